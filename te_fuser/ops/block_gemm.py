"""The GEMMs of the block-scaled recipes on the CPU (MXFP8BlockScaling, Float8BlockScaling,
NVFP4BlockScaling).

Every GEMM is `a @ b.T` over a reduction dimension K cut into blocks of `block` (32 for MXFP8, 128
for Float8 block scaling, 16 for NVFP4), each operand row-major with one scale per (row, K block):

    out[i, j] = sum over K blocks kb, in order kb = 0, 1, ...:
                    P_kb[i, j] * float32(sa[i, kb] * sb[j, kb])
    P_kb      = the block's FP8 values multiplied exactly and summed in float32 by te_fuser's FP8 GEMM
                (te_fuser.kernels.gemm: in k order on the portable and AVX2 tiers, by pairs of k on
                the bf16 dot-product tiers)

each product and each addition rounded to float32, the bias added in float32 and the result rounded
once to the output dtype. This is split accumulation, as TE requires for these recipes: each block is
summed apart and scaled before it joins the total.

K need not be a multiple of the block (TE's quantizers want multiples; te_fuser's take any size): the
last block is then partial, its scale from the amax of the elements present (what zero padding gives)
and its sum shorter. NVFP4 operands are padded with zeros to a multiple of 16 instead (their packed
rows hold 16-value blocks), which sums the same.

NVFP4 on the CPU (block_gemm; te_fuser.kernels.gemm.nvfp4_gemm) takes the E4M3 block scales as a block's
scales and the two tensors' global decode factors once at the end, as Blackwell's NVFP4 MMA does:

    out[i, j] = float32(total[i, j] * alpha) + bias[j],  alpha = float32(float32(amax_a / 2688) * float32(amax_b / 2688))

where each block's term P_kb * (sa * sb) is exact (E2M1 products sum to a multiple of 1/4 of at most 576;
E4M3 scales have 4 significant bits), so only the additions into total round. On a GPU, NVFP4's operands go
through the engines above with each block's scale its dequantization factor float32(float32(e4m3 scale *
amax) * float32(1 / 2688)) (NVFP4Tensor._codes_and_factors), which rounds differently by those factors.

    forward  y  = x  @ W.T   a = x rowwise,              b = W rowwise
    dgrad    dx = dy @ W     a = dy rowwise,             b = W columnwise (as W.T's rows)
    wgrad    dW = dy.T @ x   a = dy columnwise (dy.T),   b = x columnwise (x.T)
"""

from typing import Optional, Tuple

import torch

from ..kernels import fp8 as fp8_kernels
from ..kernels import gemm as gemm_kernels
from . import block_gemm_cuda
from ..tensor._block_scaled_tensor import fp8_data
from ..tensor.float8_blockwise_tensor import Float8BlockwiseQTensor
from ..tensor.mxfp8_tensor import MXFP8Tensor
from ..tensor.nvfp4_tensor import NVFP4Tensor

MXFP8_BLOCK, FP8_BLOCK, NVFP4_BLOCK = 32, 128, 16


def block_of(t) -> int:
    return MXFP8_BLOCK if isinstance(t, MXFP8Tensor) else NVFP4_BLOCK if isinstance(t, NVFP4Tensor) else FP8_BLOCK


def e8m0_values(codes: torch.Tensor) -> torch.Tensor:
    """2^(code - 127) as float32 (2^-127 is a float32 subnormal); NaN for 255. Built from the bits: code << 23
    is 2^(code - 127) for the codes 1..254, 0x00400000 is 2^-127."""
    bits = torch.where(codes == 0, 0x00400000, codes.to(torch.int32) << 23)
    return torch.where(codes == 255, 0x7FC00000, bits).view(torch.float32)


def _transposed(codes: torch.Tensor) -> torch.Tensor:
    """The (rows, cols) bytes as a contiguous (cols, rows) tensor: by te_fuser's FP8 transpose on the CPU
    (torch's byte transpose runs several times slower there)."""
    if codes.device.type != "cpu":
        return codes.t().contiguous()
    return fp8_kernels.transpose(codes.view(torch.float8_e4m3fn)).view(codes.dtype)


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


def gemm_operand(t, columnwise: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of a block-scaled tensor as a GEMM operand: codes (rows, K) row-major FP8 with K
    the reduction dimension, scales (rows, ceil(K / block)): float32, or MXFP8's uint8 E8M0 codes.
    Rowwise: the tensor as a matrix (the reduction runs along its last dimension); columnwise: its
    transpose (along the leading ones). NVFP4's K is rounded up to 16 (its zero padding)."""
    cols = t.shape[-1]
    rows = t.numel() // cols
    block = block_of(t)
    if isinstance(t, NVFP4Tensor):  # columnwise: the transposed data (Hadamard-transformed under with_rht)
        return NVFP4Tensor._codes_and_factors(t, columnwise)  # (not a method call: dynamo would make it a graph op)
    if isinstance(t, MXFP8Tensor):  # the E8M0 codes themselves: the CPU GEMM decodes them in C
        if not columnwise:
            return fp8_data(t).reshape(rows, cols), t._rowwise_scale_inv[:rows, : _blocks(cols, block)]
        codes = _transposed(fp8_data(t, True).reshape(rows, cols))
        return codes, t._columnwise_scale_inv[: _blocks(rows, block), :cols].t()
    if not isinstance(t, Float8BlockwiseQTensor):
        raise TypeError(f"a block-scaled GEMM operand must be an MXFP8Tensor, an NVFP4Tensor or a "
                        f"Float8BlockwiseQTensor, got {type(t).__name__}")
    t = t.gemm_ready()  # an all-gather's COMPACT buffers, re-laid
    if columnwise:
        codes, scale, n, k = fp8_data(t, True).reshape(cols, rows), t._columnwise_scale_inv, cols, rows
    else:
        codes, scale, n, k = fp8_data(t).reshape(rows, cols), t._rowwise_scale_inv, rows, cols
    if t._is_2D_scaled:  # one scale per 128x128 block: repeated over its 128 rows
        return codes, scale[: _blocks(n, block), : _blocks(k, block)].repeat_interleave(block, dim=0)[:n]
    return codes, scale[: _blocks(k, block), :n].t()


def block_scaled_gemm_nt(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                         block: int, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a @ b.T for FP8 a (M, K), b (N, K) with per-(row, K block) scales (M or N, ceil(K / block); float32, or
    uint8 E8M0 codes), as the module docstring says; the last K block may be shorter. Operands on a GPU take
    block_gemm_cuda's engines."""
    if a.device.type != "cpu":
        a_scales, b_scales = (e8m0_values(s) if s.dtype == torch.uint8 else s for s in (a_scales, b_scales))
        return block_gemm_cuda.device_block_scaled_gemm_nt(a, a_scales, b, b_scales, block, out_dtype, bias)
    gemm_kernels.record_block_gemm_engine("cpu")
    return gemm_kernels.block_scaled_gemm(a.contiguous(), a_scales, b.contiguous(), b_scales, block, out_dtype, bias)


_NVFP4_GLOBAL = 1.0 / 2688.0  # 1 / (E4M3's 448 * E2M1's 6): a tensor's decode factor per unit of amax


def block_gemm(a, a_columnwise: bool, b, b_columnwise: bool, out_dtype: torch.dtype,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a @ b.T of two block-scaled tensors' usages, each as gemm_operand takes it (the rowwise or columnwise
    one): NVFP4 on the CPU through NVFP4's own GEMM, anything else through block_scaled_gemm_nt."""
    if isinstance(a, NVFP4Tensor) and a.device.type == "cpu":
        a_data, a_scales, a_amax = NVFP4Tensor._packed_operand(a, a_columnwise)
        b_data, b_scales, b_amax = NVFP4Tensor._packed_operand(b, b_columnwise)
        c = torch.tensor(_NVFP4_GLOBAL, dtype=torch.float32)
        alpha = (a_amax.reshape(()) * c) * (b_amax.reshape(()) * c)
        gemm_kernels.record_block_gemm_engine("cpu")
        return gemm_kernels.nvfp4_gemm(a_data, a_scales, b_data, b_scales, alpha, out_dtype, bias)
    return block_scaled_gemm_nt(*gemm_operand(a, a_columnwise), *gemm_operand(b, b_columnwise), block_of(a), out_dtype,
                                bias)
