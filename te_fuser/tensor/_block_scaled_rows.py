"""Cutting a 2-D block-scaled tensor into row ranges and putting it back together: what FSDP2 needs to shard a
quantized weight along dim 0 and all-gather it in its low-precision bytes and scales.

Each format says, per buffer, the dimension its matrix rows run along and how many rows one index covers
(`_row_layout`: data 1, or 2 for NVFP4's packed transposed data; a scale 1 when it is repeated per row, or its
block length), and the padded shape each buffer has for a tensor of a given shape (`_buffer_shape`). A buffer
without a row layout (NVFP4's per-tensor amax) is the same for every row range.

A cut falls between row blocks (`_ROW_BLOCK`: 32 for MXFP8, 128 for Float8 block scaling, 16 for NVFP4), so
every block of a part is a block of the whole: the parts hold exactly the whole's bytes and scales, and the
whole gathered from them is bitwise the one that was cut.
"""

from typing import List, Tuple

import torch
from torch._prims_common import infer_size

from .quantized_tensor import QuantizedTensor


def padded(t: torch.Tensor, shape) -> torch.Tensor:
    """t (contiguous: the kernels read buffers so) when it has `shape`, else a zero tensor of `shape` with t in its
    leading corner (TE pads scales with zeros, as te_fuser's quantizers do)."""
    shape = tuple(shape)
    if tuple(t.shape) == shape:
        return t.contiguous()
    out = t.new_zeros(shape)
    out[tuple(slice(0, n) for n in t.shape)].copy_(t)
    return out


def check_cuts(t, sizes: List[int]) -> None:
    """Every cut between row blocks; ValueError naming the sizes otherwise."""
    block, start = t._ROW_BLOCK, 0
    for size in sizes[:-1]:
        start += size
        if start % block:
            raise ValueError(f"a {type(t).__name__} of shape {tuple(t.shape)} can be cut along dim 0 only between its "
                             f"{block}-row blocks, got pieces of {sizes} rows (FSDP2: make out_features a multiple "
                             f"of {block} x the number of ranks; else dequantize() first)")


def rows(t, start: int, stop: int):
    """Rows [start, stop) of a 2-D block-scaled tensor, as a new tensor: its data cut (views), its scales cut and
    padded to the part's shapes, buffers without a row layout as they are."""
    shape = (stop - start, *t.shape[1:])
    layout = t._row_layout()
    parts = {}
    for name in t._BUFFERS:
        b = getattr(t, name)
        if b is not None and name in layout:
            dim, unit = layout[name]
            b = padded(b.narrow(dim, start // unit, -(-(stop - start) // unit)), t._buffer_shape(name, shape))
        parts[name[1:]] = b
    return type(t)(shape, t.dtype, fp8_dtype=t._fp8_dtype, quantizer=t._quantizer, **parts, **t._meta())


def zeros_like_layout(t, shape):
    """A tensor of t's format, usages and quantizer, of `shape`, every buffer zero (FSDP2's padded shard)."""
    buffers = {name[1:]: None if getattr(t, name) is None else getattr(t, name).new_zeros(t._buffer_shape(name, shape))
               for name in t._BUFFERS}
    return type(t)(shape, t.dtype, fp8_dtype=t._fp8_dtype, quantizer=t._quantizer, **buffers, **t._meta())


def fsdp_pre_all_gather(t, mesh, outer_size) -> Tuple[tuple, tuple]:
    """This shard's buffers as bytes, each with its rows first and without padding, for FSDP2 to all-gather;
    buffers without a row layout (an amax) are gathered too, for fsdp_post_all_gather to check the ranks agree."""
    world = mesh.size()
    if t.dim() != 2 or t.shape[0] * world != outer_size[0] or t.shape[0] % t._ROW_BLOCK:
        raise ValueError(f"FSDP2 shards of a {type(t).__name__} must split its {tuple(outer_size)} rows evenly over "
                         f"{world} ranks in whole {t._ROW_BLOCK}-row blocks, this shard is {tuple(t.shape)}")
    inputs, names = row_parts(t)
    return tuple(inputs), (tuple(names), world)


def row_parts(t) -> Tuple[list, list]:
    """(this 2-D tensor's buffers as bytes, each with its rows first and without padding; what
    fsdp_post_all_gather needs to know of each) for an all-gather along dim 0. The parts hold t's rows
    whatever their count: a caller whose blocks span rows checks they do not straddle the cuts."""
    layout = t._row_layout()
    inputs, names = [], []
    for name in t._BUFFERS:
        b = getattr(t, name)
        if b is None:
            continue
        dim, unit = layout.get(name, (0, None))
        part = b if unit is None else b.narrow(dim, 0, -(-t.shape[0] // unit)).movedim(dim, 0)
        part = part.contiguous()
        if part.dim() and part.stride(-1) != 1:  # a moved size-1 dim: "contiguous", but not viewable as bytes
            part = part.clone(memory_format=torch.contiguous_format)
        inputs.append(part.view(torch.uint8))
        names.append((name, b.dtype, dim, unit is None))
    return inputs, names


def fsdp_post_all_gather(t, outputs, metadata, param_dtype, out=None):
    """The whole tensor from the gathered buffers: those whose rows run along dim 0 and need no padding as views
    of the all-gather outputs (FSDP2 frees and refills those), the others (padded scales, data transposed by
    rows: a 1-D-block format's columnwise usage) as copies, kept between gathers; shared buffers checked equal on
    every rank. With out= (FSDP2's later gathers, into the same storage) out's
    buffers that are not views of the outputs take the new values."""
    names, world = metadata
    shape = (t.shape[0] * world, *t.shape[1:])
    whole = {}
    for (name, dtype, dim, shared), gathered in zip(names, outputs):
        value = gathered.view(dtype)
        if shared:
            parts = value.reshape(world, -1)
            if not bool((parts == parts[:1]).all()):
                raise RuntimeError(f"the FSDP2 shards of a {type(t).__name__} hold different {name} on different "
                                   "ranks: the gathered tensor cannot represent them (te_fuser does not reduce it "
                                   "over the FSDP group when a shard is requantized)")
            whole[name] = parts[0].reshape(getattr(t, name).shape)
        else:
            whole[name] = padded(value.movedim(0, dim), t._buffer_shape(name, shape))
    if out is None:
        buffers = {name[1:]: whole.get(name) for name in t._BUFFERS}
        return type(t)(shape, param_dtype, fp8_dtype=t._fp8_dtype, quantizer=t._quantizer, **buffers,
                       **t._meta()), tuple(outputs)
    for name, value in whole.items():
        mine = getattr(out, name)
        if mine.data_ptr() != value.data_ptr() or mine.stride() != value.stride():
            mine.copy_(value)
    return None


class BlockScaledReshape(QuantizedTensor):
    """A block-scaled tensor flattened (FSDP2's flat view of a shard, kept as long as the shard), which its blocks
    cannot follow: reading dequantizes the base and reshapes, writing requantizes the base. It holds no bytes of
    its own (a dequantized copy in its place would cost the shard's size in 16 bits)."""

    def __new__(cls, base, shape):
        self = super().__new__(cls, tuple(shape), base.dtype, base.device, base.requires_grad)
        self._base_tensor = base
        return self

    def dequantize(self, dtype=None) -> torch.Tensor:
        return self._base_tensor.dequantize(dtype).reshape(self.shape)

    def quantize_(self, src: torch.Tensor) -> "BlockScaledReshape":
        if isinstance(src, QuantizedTensor):
            src = src.dequantize()
        self._base_tensor.quantize_(src.expand(self.shape).reshape(self._base_tensor.shape))
        return self

    def __tensor_flatten__(self):
        return ["_base_tensor"], None


def view(t, shape):
    """t viewed as `shape`: t itself for its own shape, a BlockScaledReshape when flattened to 1-D (FSDP2 keeps
    such a view of each shard for the shard's lifetime), None otherwise (the format's own views, or a
    dequantized copy)."""
    shape = tuple(infer_size(tuple(shape), t.numel()))
    if shape == tuple(t.shape):
        return t
    if t.dim() > 1 and len(shape) == 1:
        return BlockScaledReshape(t, shape)
    return None
