"""The sequence-parallel all-gathers of the block-scaled recipes in their low-precision bytes.

As TransformerEngine does (distributed.py: _all_gather_mxfp8, _all_gather_fp8_blockwise), each rank
quantizes its own shard and the data and scales of each usage are all-gathered (as bytes, rows first:
the row layout the tensors define for FSDP2, tensor/_block_scaled_rows.py). The gathered tensor is
bitwise the quantization of the gathered high-precision tensor wherever no block straddles two ranks:
  * rowwise usage (MXFP8's 1x32 blocks, Float8 block scaling's 1x128 tiles): each block lies in one
    row, so any shard size;
  * columnwise usage (32x1 blocks, 128x1 tiles): a block spans rows, so a shard's row count must be a
    multiple of the block; otherwise the caller gathers in high precision and quantizes after (TE falls
    back so too, for sizes its is_quantizable refuses). TE gathers Float8's columnwise tiles in their
    compact (untransposed) layout and transposes after the gather; te_fuser sends the transposed data
    with its rows first and moves them back after: the same bytes.
NVFP4 (1x16 blocks rowwise, 16x1 columnwise, whose Hadamard transform also runs over 16 rows) takes its
per-tensor scale from the whole tensor's amax: as TE does (with_amax_reduction), each rank quantizes its
shard under the group's maximum of the shards' amaxes (rowwise and transformed columnwise), which is the
gathered tensor's own, so the gathered bytes are again its quantization.
Not gathered in low precision (high precision, quantized after the gather):
  * NVFP4 with stochastic rounding (TE's gradient quantizer): each element's random bits come from its
    place in the tensor quantized, which a shard does not know, so a gathered tensor would not be the
    whole tensor's quantization;
  * NVFP4 in 16x16 blocks and Float8 block scaling in 128x128 blocks (a CustomRecipe's input or
    gradient quantizer): TE refuses them (only 1-D blocks are gathered); their blocks span rows in both
    usages.
"""

import torch

from ..tensor import _block_scaled_rows as row_cuts
from ..tensor.float8_blockwise_tensor import BLOCK_LEN, Float8BlockQuantizer
from ..tensor.mxfp8_tensor import MXFP8_BLOCK_SCALING_SIZE, MXFP8Quantizer
from ..tensor.nvfp4_tensor import NVFP4_BLOCK_SCALING_SIZE, NVFP4Quantizer
from . import _tensor_parallel as tp


def _row_block(quantizer):
    """The rows a columnwise block of quantizer's tensors spans, or None for a format gathered in high
    precision."""
    if isinstance(quantizer, MXFP8Quantizer):
        return MXFP8_BLOCK_SCALING_SIZE
    if isinstance(quantizer, Float8BlockQuantizer) and quantizer.block_scaling_dim == 1:
        return BLOCK_LEN
    if isinstance(quantizer, NVFP4Quantizer) and not (quantizer.with_2d_quantization or quantizer.stochastic_rounding):
        return NVFP4_BLOCK_SCALING_SIZE
    return None


def gathers_low_precision(quantizer, shard: torch.Tensor, columnwise: bool) -> bool:
    """Whether `shard` (gathered along dim 0) is gathered in quantizer's bytes, the columnwise usage too
    when `columnwise`: a format listed in the module docstring, and for the columnwise usage a shard
    whose rows (the leading dims flattened) fill whole blocks."""
    block = _row_block(quantizer)
    if block is None:
        return False
    rows = shard.numel() // shard.shape[-1] if shard.dim() else 1
    return not columnwise or rows % block == 0


def quantize_rows(x: torch.Tensor, quantizer, *, rowwise: bool, columnwise: bool, group=None):
    """x as a 2-D (rows, last dim) block-scaled tensor of the usages asked for: the matrix whose rows the
    all-gather over `group` concatenates (NVFP4: quantized under the group's amaxes)."""
    q = quantizer.with_usage(rowwise=rowwise, columnwise=columnwise)
    if isinstance(q, NVFP4Quantizer) and tp.world_size(group) > 1:
        q = q.copy()  # with_usage may hand back the module's own quantizer
        q.with_amax_reduction, q.amax_reduction_group = True, group
    return q(x.reshape(-1, x.shape[-1]))


def all_gather_rows(t, group):
    """The group's 2-D block-scaled tensors t (each rank's shard, of the same usages) concatenated along
    dim 0, gathered in their data and scale bytes."""
    size = tp.world_size(group)
    if size == 1:
        return t
    inputs, names = row_cuts.row_parts(t)
    outputs = [tp.all_gather_dim0(part, group) for part in inputs]
    return row_cuts.fsdp_post_all_gather(t, outputs, (names, size), t.dtype)[0]
