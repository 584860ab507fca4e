"""Block-scaled FP8 kernels (MXFP8 and Float8 block scaling): validated entry points, TE's scale shapes,
and fake kernels for torch.compile.

The kernels are torch.ops.te_fuser.{mxfp8_quantize, fp8_block_quantize, block_dequantize} (C on CPU;
docs/block_scaling.md gives their semantics and layouts). A tensor is viewed as a matrix of
prod(shape[:-1]) rows by shape[-1] columns.
"""

import math
from typing import Optional, Tuple

import torch

from .validate import call_checked, check_contiguous, check_dtype, check_float_dtype, check_fp8_dtype, FP8_DTYPES

_ops = torch.ops.te_fuser

MXFP8_BLOCK = 32
BLOCK_LEN = 128


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def _matrix(shape) -> Tuple[int, int]:
    """(rows, cols) of a tensor of `shape` as a matrix; a 0-d tensor is 1 x 1 (TE's M = K = 1)."""
    return (math.prod(shape[:-1]), shape[-1]) if len(shape) else (1, 1)


def mxfp8_scale_shape(shape, columnwise: bool) -> Tuple[int, int]:
    """TE's MXFP8 scale shape (uint8 E8M0 codes), padded to [128, 4] rowwise and [4, 128] columnwise."""
    rows, cols = _matrix(shape)
    if columnwise:
        return _round_up(-(-rows // MXFP8_BLOCK), 4), _round_up(cols, 128)
    return _round_up(rows, 128), _round_up(-(-cols // MXFP8_BLOCK), 4)


def fp8_block_scale_shape(shape, block_dim: int, columnwise: bool) -> Tuple[int, int]:
    """TE's Float8 block scale_inv shape (float32): Float8BlockQuantizer.get_scale_shape."""
    rows, cols = _matrix(shape)
    row_blocks, col_blocks = -(-rows // BLOCK_LEN), -(-cols // BLOCK_LEN)
    if block_dim == 2:
        return (col_blocks, _round_up(row_blocks, 4)) if columnwise else (row_blocks, _round_up(col_blocks, 4))
    return (row_blocks, _round_up(cols, 4)) if columnwise else (col_blocks, _round_up(rows, 4))


def _check_input(x, fp8_dtype, rowwise, columnwise):
    check_dtype(x, "x")
    check_contiguous(x, "x")
    check_fp8_dtype(fp8_dtype)
    if x.dim() < 1:
        raise ValueError("x must have at least 1 dimension, got a 0-d tensor")
    if not (rowwise or columnwise):
        raise ValueError("at least one of rowwise and columnwise must be True")


def _used(out, rowwise, columnwise):
    data, scale, col_data, col_scale = out
    return (data if rowwise else None, scale if rowwise else None,
            col_data if columnwise else None, col_scale if columnwise else None)


def mxfp8_quantize(x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool = True, columnwise: bool = False):
    """(data, scale, columnwise data, columnwise scale); the pair of an unused usage is None.

    Data: FP8 of x's shape (both usages, not transposed); scales: uint8 E8M0 codes, mxfp8_scale_shape."""
    out = call_checked(lambda: _check_input(x, fp8_dtype, rowwise, columnwise), _ops.mxfp8_quantize,
                       x, fp8_dtype, bool(rowwise), bool(columnwise))
    return _used(out, rowwise, columnwise)


def _check_block_args(x, fp8_dtype, block_dim, epsilon, rowwise, columnwise):
    _check_input(x, fp8_dtype, rowwise, columnwise)
    if block_dim not in (1, 2):
        raise ValueError(f"block_dim must be 1 or 2, got {block_dim!r}")
    if not 0.0 <= epsilon < math.inf:
        raise ValueError(f"amax_epsilon must be finite and >= 0, got {epsilon}")


def fp8_block_quantize(x: torch.Tensor, fp8_dtype: torch.dtype, block_dim: int, amax_epsilon: float = 0.0,
                       force_pow_2_scales: bool = False, rowwise: bool = True, columnwise: bool = False):
    """(data, scale_inv, transposed data, its scale_inv); the pair of an unused usage is None.

    Data: FP8 of x's shape; transposed data: (shape[-1], *shape[:-1]); scale_inv: float32 in
    fp8_block_scale_shape's layouts."""
    if not 0.0 <= amax_epsilon < math.inf:
        raise ValueError(f"amax_epsilon must be finite and >= 0, got {amax_epsilon}")
    out = call_checked(lambda: _check_block_args(x, fp8_dtype, block_dim, amax_epsilon, rowwise, columnwise),
                       _ops.fp8_block_quantize, x, fp8_dtype, int(block_dim), float(amax_epsilon),
                       bool(force_pow_2_scales), bool(rowwise), bool(columnwise))
    return _used(out, rowwise, columnwise)


def _check_dequantize_args(data, scale, block_rows, block_cols, dtype):
    check_dtype(data, "data", FP8_DTYPES)
    check_contiguous(data, "data")
    check_dtype(scale, "scale", (torch.uint8, torch.float32))
    check_contiguous(scale, "scale")
    check_float_dtype(dtype, "dtype")
    if data.dim() != 2 or scale.dim() != 2:
        raise ValueError(f"data and scale must be 2-D, got shapes {tuple(data.shape)} and {tuple(scale.shape)}")
    if block_rows < 1 or block_cols < 1:
        raise ValueError(f"block_rows and block_cols must be >= 1, got {block_rows} and {block_cols}")
    if data.device != scale.device:
        raise ValueError(f"data is on {data.device} but scale is on {scale.device}")
    raise ValueError(f"scale of shape {tuple(scale.shape)} does not cover the {block_rows}x{block_cols} blocks "
                     f"of data of shape {tuple(data.shape)}")


def block_dequantize(data: torch.Tensor, scale: torch.Tensor, block_rows: int, block_cols: int,
                     scale_transposed: bool = False, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """dtype(float32(value * block scale)) of 2-D FP8 data; scale is uint8 E8M0 codes or float32 values,
    indexed [r // block_rows][c // block_cols], or [c // block_cols][r // block_rows] when transposed."""
    return call_checked(lambda: _check_dequantize_args(data, scale, block_rows, block_cols, dtype),
                        _ops.block_dequantize, data, scale, int(block_rows), int(block_cols),
                        bool(scale_transposed), dtype)


def _fake_pair(x, used, data_shape, scale_shape, fp8_dtype, scale_dtype):
    if not used:
        return x.new_empty((0,), dtype=torch.uint8), x.new_empty((0,), dtype=torch.uint8)
    return x.new_empty(data_shape, dtype=fp8_dtype), x.new_empty(scale_shape, dtype=scale_dtype)


@torch.library.register_fake("te_fuser::mxfp8_quantize")
def _(x, fp8_dtype, rowwise, columnwise):
    row = _fake_pair(x, rowwise, x.shape, mxfp8_scale_shape(x.shape, False), fp8_dtype, torch.uint8)
    col = _fake_pair(x, columnwise, x.shape, mxfp8_scale_shape(x.shape, True), fp8_dtype, torch.uint8)
    return (*row, *col)


@torch.library.register_fake("te_fuser::fp8_block_quantize")
def _(x, fp8_dtype, block_dim, epsilon, force_pow_2_scales, rowwise, columnwise):
    t_shape = (x.shape[-1], *x.shape[:-1])
    row = _fake_pair(x, rowwise, x.shape, fp8_block_scale_shape(x.shape, block_dim, False), fp8_dtype, torch.float32)
    col = _fake_pair(x, columnwise, t_shape, fp8_block_scale_shape(x.shape, block_dim, True), fp8_dtype,
                     torch.float32)
    return (*row, *col)


@torch.library.register_fake("te_fuser::block_dequantize")
def _(data, scale, block_rows, block_cols, scale_transposed, out_dtype):
    return data.new_empty(data.shape, dtype=out_dtype)
