"""FP8 quantizer kernels: validated Python entry points and fake (meta) kernels.

The kernels themselves are torch.ops.te_fuser.fp8_* (C on CPU, CUDA C on GPU).
The fake kernels describe their outputs so torch.compile can trace them.
"""

import math

import torch

from .validate import (
    call_checked,
    check_contiguous,
    check_dtype,
    check_float_dtype,
    check_fp8_dtype,
    check_one_device_in_fake,
    check_same_device,
    check_scalar_f32,
    check_tensor,
    FP8_DTYPES,
)

_ops = torch.ops.te_fuser

AMAX_ALGOS = {"max": 0, "most_recent": 1}


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2)."""
    check_fp8_dtype(fp8_dtype)
    return torch.finfo(fp8_dtype).max


def _check_quantize_args(x, scale, amax, fp8_dtype):
    check_dtype(x, "x")
    check_contiguous(x, "x")
    check_scalar_f32(scale, "scale", x, "x")
    check_scalar_f32(amax, "amax", x, "x")
    check_fp8_dtype(fp8_dtype)


def quantize(x: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """FP8 bytes of fp8(x * scale) in one pass; amax <- max(amax, max|x|) in place.

    This wrapper and cast_transpose, dequantize, the scale updates and gemm.fp8_gemm check their
    tensors in Python only when the binding refuses them (validate.call_checked):
    tests/test_fp8_errors.py holds every case they name to a refusal of the binding."""
    return call_checked(lambda: _check_quantize_args(x, scale, amax, fp8_dtype), _ops.fp8_quantize,
                        x, scale, amax, fp8_dtype)


def _check_cast_transpose_args(x, scale, amax, fp8_dtype):
    _check_quantize_args(x, scale, amax, fp8_dtype)
    if x.dim() < 2:
        raise ValueError(f"x must have at least 2 dimensions for cast_transpose, got shape {tuple(x.shape)}")


def cast_transpose(x: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, fp8_dtype: torch.dtype):
    """Like quantize, and also the transpose of x viewed as (numel / x.shape[-1], x.shape[-1])."""
    return call_checked(lambda: _check_cast_transpose_args(x, scale, amax, fp8_dtype), _ops.fp8_cast_transpose,
                        x, scale, amax, fp8_dtype)


def compute_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 tensor of one element (NaN if x holds a NaN, 0 if x is empty)."""
    check_dtype(x, "x")
    check_contiguous(x, "x")
    return _ops.fp8_amax(x)


def _check_dequantize_args(data, scale_inv, dtype):
    check_dtype(data, "data", FP8_DTYPES)
    check_contiguous(data, "data")
    check_scalar_f32(scale_inv, "scale_inv", data, "data")
    check_float_dtype(dtype, "dtype")


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """dtype(fp8 value * scale_inv), rounded to nearest even."""
    return call_checked(lambda: _check_dequantize_args(data, scale_inv, dtype), _ops.fp8_dequantize,
                        data, scale_inv, dtype)


def transpose(data: torch.Tensor) -> torch.Tensor:
    """FP8 data viewed as (product of the leading dims, last dim), transposed: a contiguous
    (last dim, rows) tensor of the same bytes. CPU only (te_fuser's kernel; torch's byte transpose
    runs about four times slower there)."""
    check_dtype(data, "data", FP8_DTYPES)
    check_contiguous(data, "data")
    if data.dim() < 1:
        raise ValueError("data must have at least 1 dimension, got a 0-d tensor")
    if data.device.type != "cpu":
        raise ValueError(f"data must be on the CPU, got {data.device}")
    return _ops.fp8_transpose(data)


def _check_scaling_update_tensors(amax_history, scale, scale_inv):
    check_tensor(amax_history, "amax_history")
    if amax_history.dim() != 2:
        raise ValueError(f"amax_history must be 2-D (history_len, n), got shape {tuple(amax_history.shape)}")
    for name, t in (("amax_history", amax_history), ("scale", scale), ("scale_inv", scale_inv)):
        check_dtype(t, name, (torch.float32,))
        check_contiguous(t, name)
        check_same_device(t, name, amax_history, "amax_history")
    n = amax_history.shape[1]
    for name, t in (("scale", scale), ("scale_inv", scale_inv)):
        if t.numel() != n:
            raise ValueError(f"{name} must have amax_history.shape[1] = {n} elements, got {t.numel()}")


def delayed_scaling_update(amax_history, scale, scale_inv, fp8_max_value: float, margin: int,
                           amax_compute_algo: str = "max") -> None:
    """Update scale/scale_inv from the amax history and roll it, in place, in TransformerEngine's layout:
    row 0 the amaxes recorded since the last update, rows 1.. the completed ones, oldest first; a tensor
    that recorded nothing (0) keeps its history and scale (see csrc/fp8/fp8_scaling.h).

    The tensors are checked in Python only when the binding refuses them (validate.call_checked), as in
    quantize; the binding takes margin as an integer and the algorithm as its number, so those two are
    checked here first."""
    if amax_compute_algo not in AMAX_ALGOS:
        raise ValueError(f"amax_compute_algo must be one of {sorted(AMAX_ALGOS)}, got {amax_compute_algo!r}")
    if not (isinstance(margin, (int, float)) and margin == int(margin) and -126 <= margin <= 126):
        raise ValueError(f"margin must be an integer in [-126, 126], got {margin!r}")
    call_checked(lambda: _check_scaling_update_tensors(amax_history, scale, scale_inv),
                 _ops.fp8_delayed_scaling_update, amax_history, scale, scale_inv, float(fp8_max_value),
                 int(margin), AMAX_ALGOS[amax_compute_algo])


def current_scale(amax: torch.Tensor, fp8_max_value: float, epsilon: float = 0.0, force_pow2: bool = False):
    """(scale, scale_inv) for current scaling: fp8_max / max(amax, epsilon), 1 for amax 0/Inf/NaN."""
    if not 0.0 < fp8_max_value < math.inf:
        raise ValueError(f"fp8_max_value must be positive and finite, got {fp8_max_value}")
    if not 0.0 <= epsilon < math.inf:
        raise ValueError(f"epsilon must be finite and >= 0, got {epsilon}")
    return call_checked(lambda: check_scalar_f32(amax, "amax", amax, "amax"), _ops.fp8_current_scale,
                        amax, float(fp8_max_value), float(epsilon), bool(force_pow2))


@torch.library.register_fake("te_fuser::fp8_quantize")
def _(x, scale, amax, fp8_dtype):
    check_one_device_in_fake(x=x, scale=scale, amax=amax)
    return torch.empty_like(x, dtype=fp8_dtype)


@torch.library.register_fake("te_fuser::fp8_cast_transpose")
def _(x, scale, amax, fp8_dtype):
    check_one_device_in_fake(x=x, scale=scale, amax=amax)
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else 0
    return torch.empty_like(x, dtype=fp8_dtype), x.new_empty((cols, rows), dtype=fp8_dtype)


@torch.library.register_fake("te_fuser::fp8_amax")
def _(x):
    return x.new_empty((1,), dtype=torch.float32)


@torch.library.register_fake("te_fuser::fp8_dequantize")
def _(data, scale_inv, out_dtype):
    check_one_device_in_fake(data=data, scale_inv=scale_inv)
    return torch.empty_like(data, dtype=out_dtype)


@torch.library.register_fake("te_fuser::fp8_transpose")
def _(data):
    return data.new_empty((data.shape[-1], math.prod(data.shape[:-1])))


@torch.library.register_fake("te_fuser::fp8_delayed_scaling_update")
def _(amax_history, scale, scale_inv, fp8_max_value, margin, amax_compute_algo):
    check_one_device_in_fake(amax_history=amax_history, scale=scale, scale_inv=scale_inv)
    return None


@torch.library.register_fake("te_fuser::fp8_current_scale")
def _(amax, fp8_max_value, epsilon, force_pow2):
    return amax.new_empty((1,)), amax.new_empty((1,))
