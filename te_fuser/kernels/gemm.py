"""The CPU FP8 GEMMs: validated entry points and fake kernels of torch.ops.te_fuser.fp8_gemm and
torch.ops.te_fuser.block_scaled_gemm.

    out = (a @ b.T) * (a_scale_inv * b_scale_inv) + bias, rounded once to out_dtype

with a (M, K) and b (N, K) row-major FP8 (E4M3/E5M2, any mix): the FP8 values are decoded exactly
to bfloat16, multiplied on the CPU's best engine (AMX, AVX512-BF16, AVX2 or plain C; see
te_fuser.kernels.cpu) with float32 accumulation, and the scale and bias are applied in float32.
These are torch._scaled_mm's semantics; only the float32 summation order differs between engines
(see csrc/gemm/fp8_gemm.h for the bound).

block_scaled_gemm is the block-scaled recipes' GEMM: the same engine summing each K block of `block`
values apart (the last block may be shorter), each block's sum scaled by its two float32 scales and
added to a float32 total in block order (csrc/gemm/block_scaled_gemm.h). On a GPU te_fuser.ops.block_gemm
runs cuBLASLt or an emulation instead: block_gemm_engine says which engine a call takes, last_block_gemm_engine
which one the last call took (the names are te_fuser.ops.block_gemm_cuda's).

nvfp4_gemm is NVFP4's GEMM on the CPU, from packed E2M1 data and E4M3 scale codes: each 16-value block's exact
sum times its two E4M3 scales (exact too), added to a float32 total in block order, times alpha (the two
tensors' global decode factors) once at the end, as Blackwell's NVFP4 MMA does.
"""

from typing import Optional

import torch

from .validate import (FP8_DTYPES, call_checked, check_contiguous, check_dtype, check_float_dtype,
                       check_scalar_f32)

_ops = torch.ops.te_fuser
MAX_BLOCK = 256  # TF_GEMM_KC: a block is summed within one of the engine's k blocks


def _check_operand(t, name):
    check_dtype(t, name, FP8_DTYPES)
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU for te_fuser's fp8_gemm, got {t.device}")
    check_contiguous(t, name)


def fp8_gemm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
             out_dtype: torch.dtype = torch.float32, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(a * a_scale_inv) @ (b * b_scale_inv).T (+ bias) for row-major FP8 a (M, K) and b (N, K), on the CPU.
    The Python checks run only when the binding refuses the arguments (see fp8.quantize)."""
    return call_checked(lambda: _check_fp8_gemm_args(a, a_scale_inv, b, b_scale_inv, out_dtype, bias),
                        _ops.fp8_gemm, a, a_scale_inv, b, b_scale_inv, out_dtype, bias)


def _check_fp8_gemm_args(a, a_scale_inv, b, b_scale_inv, out_dtype, bias):
    _check_operands_out_and_bias(a, b, out_dtype, bias)
    check_scalar_f32(a_scale_inv, "a_scale_inv", a, "a")
    check_scalar_f32(b_scale_inv, "b_scale_inv", b, "b")


def _check_scales(a, a_scales, b, b_scales, blocks, dtypes, layout):
    """Each operand's scales: one of dtypes, shape (its rows, blocks) (layout(operand) says what they are), on a's
    device."""
    for scales, name, rows, operand in ((a_scales, "a_scales", a.shape[0], "a"), (b_scales, "b_scales", b.shape[0], "b")):
        check_dtype(scales, name, dtypes)
        if scales.shape != (rows, blocks):
            raise ValueError(f"{name} must have shape ({rows}, {blocks}): {layout(operand)}, got {tuple(scales.shape)}")
        if scales.device != a.device:
            raise ValueError(f"{name} is on {scales.device} but a is on {a.device}; they must be on the same device")


def _check_out_and_bias(a, b, out_dtype, bias):
    check_float_dtype(out_dtype, "out_dtype")
    if bias is not None:
        check_dtype(bias, "bias")
        if bias.shape != (b.shape[0],):
            raise ValueError(f"bias must have shape ({b.shape[0]},) (one value per row of b), got {tuple(bias.shape)}")
        if bias.device != a.device:
            raise ValueError(f"bias is on {bias.device} but a is on {a.device}; they must be on the same device")
        check_contiguous(bias, "bias")


def _check_operands_out_and_bias(a, b, out_dtype, bias):
    _check_operand(a, "a")
    _check_operand(b, "b")
    if b.shape[1] != a.shape[1]:
        raise ValueError(f"b must have a.shape[1] = {a.shape[1]} columns (b is (N, K)), got shape {tuple(b.shape)}")
    _check_out_and_bias(a, b, out_dtype, bias)


def block_scaled_gemm(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                      block: int, out_dtype: torch.dtype = torch.float32,
                      bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a @ b.T for row-major FP8 a (M, K) and b (N, K) with scales a_scales (M, ceil(K / block)) and
    b_scales (N, ceil(K / block)), one per row and K block (any strides): float32 values, or uint8 E8M0
    codes (2^(code - 127), MXFP8's; CPU only), plus bias, in out_dtype:
    total = sum over K blocks kb in order of (a_kb @ b_kb.T) * (a_scales[:, kb] * b_scales[:, kb]),
    each block's sum from fp8_gemm's engine, every step in float32, then one rounding to out_dtype."""
    return call_checked(lambda: _check_block_scaled_gemm_args(a, a_scales, b, b_scales, block, out_dtype, bias),
                        _ops.block_scaled_gemm, a, a_scales, b, b_scales, block, out_dtype, bias)


def nvfp4_gemm(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor, alpha: torch.Tensor,
               out_dtype: torch.dtype = torch.float32, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a @ b.T for NVFP4 a (M, K) and b (N, K), K a multiple of 16, on the CPU: a and b uint8 (M or N, K / 2), two
    E2M1 values a byte (the low nibble first), row-major; a_scales (M, K / 16) and b_scales (N, K / 16) their E4M3
    block scales (uint8 codes or float8_e4m3fn, any strides); alpha a float32 tensor of one element; plus bias, in
    out_dtype:
        total = sum over blocks kb in order of float32(exact block sum * a_scales[:, kb] * b_scales[:, kb])
        out = out_dtype(float32(total * alpha) + bias)
    Each block's term is exact for E4M3 scales (a NaN scale gives NaN), so only the additions into total, the
    product with alpha and the bias round, whatever the CPU."""
    return call_checked(lambda: _check_nvfp4_gemm_args(a, a_scales, b, b_scales, alpha, out_dtype, bias),
                        _ops.nvfp4_gemm, a, a_scales, b, b_scales, alpha, out_dtype, bias)


def _check_nvfp4_gemm_args(a, a_scales, b, b_scales, alpha, out_dtype, bias):
    for t, name in ((a, "a"), (b, "b")):
        check_dtype(t, name, (torch.uint8,))
        if t.dim() != 2 or t.shape[1] % 8:
            raise ValueError(f"{name} must be 2-D packed E2M1 data with whole 16-value blocks a row (a multiple of "
                             f"8 bytes), got shape {tuple(t.shape)}")
        check_contiguous(t, name)
        if t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device}: nvfp4_gemm runs on the CPU")
    if b.shape[1] != a.shape[1]:
        raise ValueError(f"b must have a.shape[1] = {a.shape[1]} bytes a row (b is (N, K / 2)), got shape "
                         f"{tuple(b.shape)}")
    _check_scales(a, a_scales, b, b_scales, 2 * a.shape[1] // 16, (torch.uint8, torch.float8_e4m3fn),
                  lambda operand: "one E4M3 scale per row and 16-value block")
    check_scalar_f32(alpha, "alpha", a, "a")
    _check_out_and_bias(a, b, out_dtype, bias)


@torch.library.register_fake("te_fuser::nvfp4_gemm")
def _(a, a_scales, b, b_scales, alpha, out_dtype, bias=None):
    if any(t is not None and t.device.type != "cpu" for t in (a, a_scales, b, b_scales, alpha, bias)):
        raise RuntimeError("te_fuser::nvfp4_gemm takes CPU tensors")
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


_last_block_gemm_engine: Optional[str] = None


# Under torch.compile it runs when dynamo meets it, as plain Python (the engine is chosen while tracing):
# a write to a global inside the traced graph would be a side effect the block GEMM's graph cannot carry.
@torch.compiler.assume_constant_result
def record_block_gemm_engine(engine: str) -> None:
    global _last_block_gemm_engine
    _last_block_gemm_engine = engine


def last_block_gemm_engine() -> Optional[str]:
    """The engine of the last te_fuser.ops.block_gemm.block_scaled_gemm_nt call in this process (None before the
    first): "cpu", "cublaslt_blockwise_1x128", "cublaslt_mxfp8" or "device_emulation"."""
    return _last_block_gemm_engine


def block_gemm_engine(a: torch.Tensor, b: torch.Tensor, block: int, out_dtype: torch.dtype) -> str:
    """The engine block_scaled_gemm_nt would run for FP8 operands a (M, K), b (N, K) with K blocks of `block`
    and this output dtype, on a's device (te_fuser.ops.block_gemm_cuda's module docstring lists them)."""
    from ..ops.block_gemm_cuda import engine_for

    return engine_for(a, b, block, out_dtype)


def _check_block_scaled_gemm_args(a, a_scales, b, b_scales, block, out_dtype, bias):
    if not isinstance(block, int) or not 1 <= block <= MAX_BLOCK:
        raise ValueError(f"block must be an int in [1, {MAX_BLOCK}], got {block!r}")
    _check_operands_out_and_bias(a, b, out_dtype, bias)
    _check_scales(a, a_scales, b, b_scales, -(-a.shape[1] // block), (torch.float32, torch.uint8),
                  lambda operand: f"one scale per row of {operand} and K block of {block} (the last may be shorter)")


@torch.library.register_fake("te_fuser::block_scaled_gemm")
def _(a, a_scales, b, b_scales, block, out_dtype, bias=None):
    if any(t is not None and t.device.type != "cpu" for t in (a, a_scales, b, b_scales, bias)):
        raise RuntimeError("te_fuser::block_scaled_gemm takes CPU tensors")
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@torch.library.register_fake("te_fuser::fp8_gemm")
def _(a, a_scale_inv, b, b_scale_inv, out_dtype, bias=None):
    # Meta tensors reach this kernel outside tracing too; the binding takes CPU tensors only.
    if any(t is not None and t.device.type != "cpu" for t in (a, a_scale_inv, b, b_scale_inv, bias)):
        raise RuntimeError("te_fuser::fp8_gemm takes CPU tensors")
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)
