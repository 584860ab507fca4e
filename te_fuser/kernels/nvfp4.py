"""NVFP4 kernels: validated entry points, TE's data and scale shapes, and fake kernels for torch.compile.

The kernels are torch.ops.te_fuser.{nvfp4_quantize, nvfp4_dequantize} (C on CPU; docs/block_scaling.md,
"NVFP4", gives their semantics and layouts). A tensor is viewed as a matrix of prod(shape[:-1]) rows by
shape[-1] columns, of any sizes: one whose sizes are not multiples of 16 is quantized as its zero-padding
to multiples of 16, whose packed data keeps the matrix's rows (TE's quantizer takes only multiples of 16).
"""

import math
from typing import Optional, Tuple

import torch

from .validate import call_checked, check_contiguous, check_dtype, check_float_dtype, check_tensor

_ops = torch.ops.te_fuser

NVFP4_BLOCK = 16


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def _matrix(shape) -> Tuple[int, int]:
    return math.prod(shape[:-1]), shape[-1]


def nvfp4_scale_shape(shape, columnwise: bool) -> Tuple[int, int]:
    """TE's NVFP4 scale shape (uint8 E4M3 codes): (roundup(rows, 128), roundup(ceil(cols / 16), 4)) rowwise,
    (roundup(cols, 128), roundup(ceil(rows / 16), 4)) columnwise (the transposed data's rows)."""
    rows, cols = _matrix(shape)
    if columnwise:
        rows, cols = cols, rows
    return _round_up(rows, 128), _round_up(-(-cols // NVFP4_BLOCK), 4)


def padded_len(n: int) -> int:
    """How many values a packed row of n values holds: n rounded up to the block (16)."""
    return _round_up(n, NVFP4_BLOCK)


def nvfp4_data_shape(shape, columnwise: bool) -> Tuple[int, ...]:
    """Packed uint8 data (two values a byte): (*shape[:-1], padded_len(cols) / 2) rowwise,
    (cols, padded_len(rows) / 2) columnwise (TE's (.., cols / 2) and (cols, rows / 2) for multiples of 16)."""
    rows, cols = _matrix(shape)
    return (cols, padded_len(rows) // 2) if columnwise else (*shape[:-1], padded_len(cols) // 2)


def _check_quantize_args(x, rowwise, columnwise, block_2d, rht):
    check_dtype(x, "x")
    check_contiguous(x, "x")
    if x.dim() < 1:
        raise ValueError("x must have at least 1 dimension to be quantized to NVFP4")
    if not (rowwise or columnwise):
        raise ValueError("at least one of rowwise and columnwise must be True")
    if block_2d and rht:
        raise ValueError("with_2d_quantization and with_rht cannot both be set (2D blocks are the weights', the "
                         "Hadamard transform the wgrad operands')")
    finite_message = "x holds Inf or NaN, which NVFP4 cannot represent (no E2M1 code stands for them)"
    if torch.compiler.is_compiling():  # the graph checks when it runs (a traced value has no truth value)
        torch._assert_async(torch.isfinite(x).all(), finite_message)
    elif not bool(torch.isfinite(x).all()):
        raise ValueError(finite_message)


def nvfp4_quantize(x: torch.Tensor, rowwise: bool = True, columnwise: bool = True, block_2d: bool = False,
                   rht: bool = False, stochastic: bool = False, seed: int = 0,
                   amaxes: Optional[Tuple[torch.Tensor, torch.Tensor]] = None):
    """(data, scale, amax, columnwise data, columnwise scale, columnwise amax); an unused usage's are None.
    Data and scales in nvfp4_data_shape's and nvfp4_scale_shape's layouts.

    amaxes: the (rowwise, columnwise) amaxes to quantize under, float32 tensors of one element on x's device,
    instead of x's own (nvfp4_amax's): a tensor-parallel group's maximum of each rank's, so that every rank's
    shard shares the whole tensor's global scale.

    block_2d: one scale per 16x16 block (both usages); rht: the columnwise data quantizes the random
    Hadamard transform of each 16 consecutive values along the rows; stochastic: stochastic rounding
    drawing from the counter-based stream `seed` (an int in [0, 2^63), or an int64 tensor of one element holding
    it: a seed drawn in a torch.compile'd graph, a graph value until the graph runs), else round to nearest even."""
    if amaxes is not None:
        return _quantize_with_amaxes(x, rowwise, columnwise, block_2d, rht, stochastic, seed, amaxes)
    if isinstance(seed, torch.Tensor):
        if seed.dtype != torch.int64 or seed.numel() != 1:
            raise ValueError(f"seed must be an int or an int64 tensor of one element, got {seed.dtype} of "
                             f"{seed.numel()} elements")
        kernel, seed = _ops.nvfp4_quantize_seeded, seed.reshape(())
    elif not 0 <= int(seed) < 2**63:
        raise ValueError(f"seed must lie in [0, 2**63), got {seed}")
    else:
        kernel, seed = _ops.nvfp4_quantize, int(seed)
    out = call_checked(lambda: _check_quantize_args(x, rowwise, columnwise, block_2d, rht), kernel,
                       x, bool(rowwise), bool(columnwise), bool(block_2d), bool(rht), bool(stochastic), seed)
    row, col = out[:3], out[3:]
    return (*(row if rowwise else (None,) * 3), *(col if columnwise else (None,) * 3))


def _check_amaxes(x, amaxes):
    for name, a in zip(("amaxes[0]", "amaxes[1]"), amaxes):
        check_tensor(a, name)
        if a.dtype != torch.float32 or a.numel() != 1 or a.device != x.device:
            raise ValueError(f"{name} must be one float32 value on {x.device}, got dtype {a.dtype}, shape "
                             f"{tuple(a.shape)} on {a.device}")


def _quantize_with_amaxes(x, rowwise, columnwise, block_2d, rht, stochastic, seed, amaxes):
    if not isinstance(amaxes, (tuple, list)) or len(amaxes) != 2:
        raise ValueError(f"amaxes must be a pair of tensors (rowwise, columnwise), got {amaxes!r}")
    if isinstance(seed, torch.Tensor) or not 0 <= int(seed) < 2**63:
        raise ValueError(f"seed must be an int in [0, 2**63) when amaxes are given, got {seed!r}")

    def check():
        _check_quantize_args(x, rowwise, columnwise, block_2d, rht)
        _check_amaxes(x, amaxes)

    out = call_checked(check, _ops.nvfp4_quantize_with_amax, x, amaxes[0].reshape(1), amaxes[1].reshape(1),
                       bool(rowwise), bool(columnwise), bool(block_2d), bool(rht), bool(stochastic), int(seed))
    row, col = out[:3], out[3:]
    return (*(row if rowwise else (None,) * 3), *(col if columnwise else (None,) * 3))


def _check_amax_args(x):
    check_dtype(x, "x")
    check_contiguous(x, "x")
    if x.dim() < 1:
        raise ValueError("x must have at least 1 dimension")


def nvfp4_amax(x: torch.Tensor, rht: bool = False) -> torch.Tensor:
    """The amax nvfp4_quantize takes of x, a float32 tensor of one element on x's device: max |x|, or (rht) max
    |the Hadamard transform of 16 consecutive values of a column| (the columnwise usage's under the transform).
    Inf or NaN in x shows in it (NaN above Inf above every finite value)."""
    return call_checked(lambda: _check_amax_args(x), _ops.nvfp4_amax, x, bool(rht))


def _check_unpack_args(data):
    check_dtype(data, "data", (torch.uint8,))
    check_contiguous(data, "data")
    if data.dim() < 1:
        raise ValueError("data must have at least 1 dimension")


def e2m1_as_e4m3(data: torch.Tensor) -> torch.Tensor:
    """The E4M3 codes (float8_e4m3fn, (..., 2 m)) of packed E2M1 data (uint8, (..., m), the low nibble first):
    every E2M1 value is an E4M3 value, so the block GEMM runs NVFP4 operands as FP8 ones (CPU tensors)."""
    return call_checked(lambda: _check_unpack_args(data), _ops.nvfp4_unpack_e4m3, data)


def _check_dequantize_args(data, scale, amax, dtype):
    check_dtype(data, "data", (torch.uint8,))
    check_contiguous(data, "data")
    check_dtype(scale, "scale", (torch.uint8,))
    check_contiguous(scale, "scale")
    check_tensor(amax, "amax")
    check_float_dtype(dtype, "dtype")
    if data.dim() != 2 or scale.dim() != 2:
        raise ValueError(f"data and scale must be 2-D, got shapes {tuple(data.shape)} and {tuple(scale.shape)}")
    if amax.dtype != torch.float32 or amax.numel() != 1:
        raise ValueError(f"amax must be one float32 value, got dtype {amax.dtype} and shape {tuple(amax.shape)}")
    if (data.shape[1] * 2) % NVFP4_BLOCK:
        raise ValueError(f"data must hold a multiple of {NVFP4_BLOCK} values per row (two a byte), got "
                         f"{data.shape[1] * 2}")
    raise ValueError(f"scale of shape {tuple(scale.shape)} does not cover data of shape {tuple(data.shape)}")


def nvfp4_dequantize(data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """dtype(float32(e2m1 * float32(float32(scale * amax) / 2688))) of packed 2-D data (rows, cols / 2),
    (rows, cols) out."""
    return call_checked(lambda: _check_dequantize_args(data, scale, amax, dtype), _ops.nvfp4_dequantize,
                        data, scale, amax, dtype)


def _fake_usage(x, used, data_shape, scale_shape):
    if not used:
        return (x.new_empty((0,), dtype=torch.uint8), x.new_empty((0,), dtype=torch.uint8),
                x.new_empty((0,), dtype=torch.float32))
    return (x.new_empty(data_shape, dtype=torch.uint8), x.new_empty(scale_shape, dtype=torch.uint8),
            x.new_empty((1,), dtype=torch.float32))


@torch.library.register_fake("te_fuser::nvfp4_quantize")
def _fake_quantize(x, rowwise, columnwise, block_2d, rht, stochastic, seed):
    row = _fake_usage(x, rowwise, nvfp4_data_shape(x.shape, False), nvfp4_scale_shape(x.shape, False))
    col = _fake_usage(x, columnwise, nvfp4_data_shape(x.shape, True), nvfp4_scale_shape(x.shape, True))
    return (*row, *col)


@torch.library.custom_op("te_fuser::nvfp4_quantize_seeded", mutates_args=())
def _quantize_seeded(x: torch.Tensor, rowwise: bool, columnwise: bool, block_2d: bool, rht: bool, stochastic: bool,
                     seed: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                   torch.Tensor, torch.Tensor]:
    """nvfp4_quantize with the seed as a tensor: stochastic rounding in a compiled graph draws the seed each
    time the graph runs (torch.randint on the default generator, as eager quantize() draws it)."""
    seed = int(seed)
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must lie in [0, 2**63), got {seed}")
    return _ops.nvfp4_quantize(x, rowwise, columnwise, block_2d, rht, stochastic, seed)


_quantize_seeded.register_fake(_fake_quantize)


@torch.library.register_fake("te_fuser::nvfp4_quantize_with_amax")
def _(x, amax, amax_t, rowwise, columnwise, block_2d, rht, stochastic, seed):
    return _fake_quantize(x, rowwise, columnwise, block_2d, rht, stochastic, seed)


@torch.library.register_fake("te_fuser::nvfp4_unpack_e4m3")
def _(data):
    return data.new_empty((*data.shape[:-1], data.shape[-1] * 2), dtype=torch.float8_e4m3fn)


@torch.library.register_fake("te_fuser::nvfp4_amax")
def _(x, rht):
    return x.new_empty((1,), dtype=torch.float32)


@torch.library.register_fake("te_fuser::nvfp4_dequantize")
def _(data, scale, amax, out_dtype):
    return data.new_empty((data.shape[0], data.shape[1] * 2), dtype=out_dtype)
