"""block_scaled_gemm_nt off the CPU: cuBLASLt through torch's scaled_mm where the device has the block-scaled
GEMM of the operands' scaling, else one GEMM over all of K on scale-folded operands, else the split-accumulation
emulation in torch on the device.

The engines (te_fuser.kernels.gemm.block_gemm_engine says which one a call takes, last_block_gemm_engine which
one the last call took):

    "cpu"                       te_fuser's C kernel (te_fuser.kernels.gemm.block_scaled_gemm), CPU tensors
    "cublaslt_blockwise_1x128"  Float8 block scaling (K blocks of 128) on sm90: torch's BlockWise1x128 x
                                BlockWise1x128 (128x128 weight blocks arrive as per-row scales, which it takes
                                too), float32 scales of shape (rows, K / 128) in column-major order
    "cublaslt_mxfp8"            MXFP8 (K blocks of 32) on sm100/sm103: BlockWise1x32 with E8M0 scales in the
                                SWIZZLE_32_4_4 layout (swizzle_32_4_4)
    "device_one_pass_bf16"      MXFP8 elsewhere: each value times its E8M0 scale (a power of two) is exact in
                                bfloat16, and one bf16 GEMM with float32 accumulation sums the exact products
                                over all of K, as Blackwell's block-scaled MMA does
    "device_one_pass_f32"       the rest (NVFP4's float32 decode factors, Float8 block scaling off sm90 or its
                                wgrad): each value times its scale rounded to float32, one float32 GEMM
    "device_emulation"          the C kernel's split accumulation in torch, where the float32 GEMM would run in
                                TF32 (_tf32_matmuls), which the one-pass engine's
                                folded values do not survive and the emulation's FP8 values do

The library runs only what torch's checks and cuBLASLt accept: E4M3 operands (MXFP8: not both E5M2), M, N, K
multiples of 16, K a multiple of the block, a bfloat16 output (torch's blockwise paths write only bf16); the
bias is then added to the bf16 result in float32 and rounded again. NVFP4 (K blocks of 16) arrives as E4M3
codes and float32 decode factors, which torch's NVFP4 GEMM (packed E2M1, E4M3 scales, a global scale) cannot
take without the tensors' own scales. docs/block_scaling.md bounds each engine's distance from the C kernel.
Measured on an H200 (benchmarks/RESULTS.md, 2026-11-28): the split emulation took a 8192 x 4096 x 4096 MXFP8
Linear step 124 times as long as bf16's, its float32 block sums being written once per K block.
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..kernels import gemm as gemm_kernels

_aten = torch.ops.aten  # replaced by a recorder in the plumbing tests
ALIGNMENT = 16
EMULATION_BATCH_BYTES = 256 << 20  # the float32 block sums one batched GEMM of the emulation holds
# torch's block-scaled _scaled_mm_v2 and its ScalingType enum (torch 2.10+); without them every call emulates
_TORCH_HAS_BLOCK_SCALED_MM = hasattr(F, "ScalingType") and hasattr(torch.ops.aten, "_scaled_mm_v2")
# torch.mm(bf16, bf16, out_dtype=torch.float32): float32 accumulation and output (CUDA, torch 2.8+)
_TORCH_HAS_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")
_LIBRARY = {  # block -> (engine, the capabilities with the library GEMM)
    128: ("cublaslt_blockwise_1x128", lambda cap: cap == (9, 0)),
    32: ("cublaslt_mxfp8", lambda cap: cap[0] == 10),
}


def _capability(device: torch.device) -> Tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device))


def engine_for(a: torch.Tensor, b: torch.Tensor, block: int, out_dtype: torch.dtype) -> str:
    """The engine block_scaled_gemm_nt runs for operands a (M, K), b (N, K) (see the module docstring)."""
    if a.device.type == "cpu":
        return "cpu"
    library = _LIBRARY.get(block)
    if (library is not None and _TORCH_HAS_BLOCK_SCALED_MM and torch.version.hip is None
            and out_dtype == torch.bfloat16):
        (m, k), n = a.shape, b.shape[0]
        fits = k % block == 0 and all(d % ALIGNMENT == 0 for d in (m, n, k))
        if block == 128:
            dtypes_ok = a.dtype == b.dtype == torch.float8_e4m3fn
        else:
            dtypes_ok = not (a.dtype == b.dtype == torch.float8_e5m2)
        if fits and dtypes_ok and library[1](_capability(a.device)):
            return library[0]
    if block == 32 and _TORCH_HAS_MM_OUT_DTYPE:
        return "device_one_pass_bf16"
    return "device_emulation" if _tf32_matmuls() else "device_one_pass_f32"


def _tf32_matmuls() -> bool:
    """Whether torch runs float32 CUDA matmuls in TF32 (allow_tf32, which torch 2.14 still answers from its
    fp32_precision settings)."""
    return bool(torch.backends.cuda.matmul.allow_tf32)


def swizzle_32_4_4(scales: torch.Tensor) -> torch.Tensor:
    """A (rows, blocks) scale matrix in cuBLASLt's block-scaling layout (torch's SWIZZLE_32_4_4), flat: padded with
    zeros to (roundup(rows, 128), roundup(blocks, 4)), cut into 128 x 4 tiles stored row of tiles after row of
    tiles, and within a tile scale (r, c) at offset (r % 32) * 16 + (r // 32) * 4 + c."""
    rows, blocks = scales.shape
    tr, tc = -(-rows // 128), -(-blocks // 4)
    padded = scales.new_zeros((tr * 128, tc * 4))
    padded[:rows, :blocks] = scales
    # (tile row, r // 32, r % 32, tile col, c) -> (tile row, tile col, r % 32, r // 32, c)
    tiles = padded.view(tr, 4, 32, tc, 4).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().view(-1)


def _as_e8m0(scales: torch.Tensor) -> torch.Tensor:
    """float32 powers of two 2^-127..2^127 (e8m0_values' results), NaN for code 255, as E8M0: exact."""
    return scales.to(torch.float8_e8m0fnu)


def library_gemm_nt(engine: str, a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                    bias: Optional[torch.Tensor]) -> torch.Tensor:
    """a @ b.T through torch's _scaled_mm_v2 (cuBLASLt) in bfloat16, the bias added after in float32."""
    if engine == "cublaslt_blockwise_1x128":
        recipe, swizzle = F.ScalingType.BlockWise1x128, F.SwizzleType.NO_SWIZZLE
        sa, sb = (s.float().t().contiguous().t() for s in (a_scales, b_scales))  # (rows, K / 128), column-major
    else:
        recipe, swizzle = F.ScalingType.BlockWise1x32, F.SwizzleType.SWIZZLE_32_4_4
        sa, sb = (swizzle_32_4_4(_as_e8m0(s)) for s in (a_scales, b_scales))
    out = _aten._scaled_mm_v2(a.contiguous(), b.contiguous().t(), [sa], [recipe.value], [swizzle.value], [sb],
                              [recipe.value], [swizzle.value], None, torch.bfloat16, [], False)
    return out if bias is None else (out.float() + bias.float()).to(torch.bfloat16)


def folded(codes: torch.Tensor, scales: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """codes (rows, K) times the scales (rows, ceil(K / block)) of their K blocks, rounded once to dtype."""
    rows, k = codes.shape
    nb = -(-k // block)
    values = F.pad(codes.float(), (0, nb * block - k)).view(rows, nb, block)
    return (values * scales.float()[:, :nb, None]).view(rows, nb * block)[:, :k].to(dtype)


def one_pass_block_scaled_gemm_nt(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                                  block: int, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
                                  operand_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """a @ b.T as one GEMM over all of K on the scale-folded operands (folded), in operand_dtype (bfloat16 where
    that is exact: MXFP8's power-of-two scales), summed in float32; the bias in float32; one rounding."""
    fa, fb = folded(a, a_scales, block, operand_dtype), folded(b, b_scales, block, operand_dtype)
    if operand_dtype == torch.float32:
        total = fa @ fb.t()
    elif fa.device.type == "cuda":
        total = torch.mm(fa, fb.t(), out_dtype=torch.float32)
    else:  # the same sums elsewhere: bf16 x bf16 products are exact in float32
        total = fa.float() @ fb.float().t()
    if bias is not None:
        total = total + bias.float()
    return total if out_dtype == torch.float32 else total.to(out_dtype)


def emulated_block_scaled_gemm_nt(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                                  block: int, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
                                  blocks_per_batch: Optional[int] = None) -> torch.Tensor:
    """The C kernel's split accumulation in torch, on a's device: each K block's FP8 products (exact in float32)
    summed by a float32 batched GEMM, times float32(sa * sb), added to a float32 total in block order; the bias
    in float32; one rounding. Only the order of the sums inside a block differs from the C kernel.
    blocks_per_batch: blocks summed by one batched GEMM (default: as many as fit EMULATION_BATCH_BYTES).
    TF32 cannot change it: FP8 values and their products are exact in TF32's inputs and float32's sums."""
    m, k = a.shape
    n = b.shape[0]
    nb = -(-k // block)
    pad = nb * block - k  # a ragged last block, zero padded: its sum is the shorter sum
    av = F.pad(a.float(), (0, pad)).view(m, nb, block).transpose(0, 1)
    bv = F.pad(b.float(), (0, pad)).view(n, nb, block).permute(1, 2, 0)
    sa, sb = a_scales.float(), b_scales.float()
    total = torch.zeros((m, n), dtype=torch.float32, device=a.device)
    if blocks_per_batch is None:
        blocks_per_batch = max(1, EMULATION_BATCH_BYTES // (4 * max(1, m * n)))
    for first in range(0, nb, blocks_per_batch):
        last = min(nb, first + blocks_per_batch)
        sums = torch.bmm(av[first:last], bv[first:last])  # (blocks, M, N)
        for i, kb in enumerate(range(first, last)):
            total = total + sums[i] * (sa[:, kb, None] * sb[None, :, kb])
    if bias is not None:
        total = total + bias.float()
    return total if out_dtype == torch.float32 else total.to(out_dtype)


def device_block_scaled_gemm_nt(a, a_scales, b, b_scales, block, out_dtype, bias=None) -> torch.Tensor:
    """block_scaled_gemm_nt for operands on a device: the library or the emulation (engine_for)."""
    engine = engine_for(a, b, block, out_dtype)
    gemm_kernels.record_block_gemm_engine(engine)
    if engine == "device_emulation":
        return emulated_block_scaled_gemm_nt(a, a_scales, b, b_scales, block, out_dtype, bias)
    if engine.startswith("device_one_pass"):
        operand_dtype = torch.bfloat16 if engine == "device_one_pass_bf16" else torch.float32
        return one_pass_block_scaled_gemm_nt(a, a_scales, b, b_scales, block, out_dtype, bias, operand_dtype)
    return library_gemm_nt(engine, a, a_scales, b, b_scales, bias)
