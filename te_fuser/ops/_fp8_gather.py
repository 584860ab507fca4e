"""The sequence-parallel all-gathers in FP8: one byte per element plus a shared scale.

Under sequence parallelism a column-parallel linear needs the whole sequence of its input, and a
row-parallel one, in backward, the whole sequence of its output gradient. Under FP8 each rank
quantizes its own shard with a scale every rank of the group shares, and the FP8 bytes are
gathered (viewed as uint8: NCCL and gloo have no FP8 dtypes), so the gathered tensor is the
quantized whole tensor, as TransformerEngine does:
  * current scaling: the shard's amax is all-reduced (MAX) over the group first, so the scale is
    the one the whole tensor would get and the gathered bytes are its quantize's;
  * delayed scaling: the recipe's known scale. Ranks whose amaxes are reduced over a group holding
    the TP ranks (fp8_group) share it; otherwise (no fp8_group) their scales can differ, so the
    ranks' scale_inv are gathered too (4 bytes each) and, where they differ, each shard is
    requantized to the largest scale_inv (the scale none of the shards overflows), at the cost
    of one more FP8 rounding.
"""

import torch
import torch.distributed as dist

from ..tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor
from ..kernels import fp8 as fp8_kernels
from . import _tensor_parallel as tp


def quantize_shard(x, quantizer, group) -> Float8Tensor:
    """This rank's shard x in FP8 (rowwise data only), with the scale all ranks of group use.

    x is a high-precision tensor (quantized here with `quantizer`) or a Float8Tensor (kept,
    requantized only when the ranks' scales differ).
    """
    if isinstance(x, Float8Tensor):
        return _with_common_scale(x, group)
    if isinstance(quantizer, Float8CurrentScalingQuantizer):
        x = x.contiguous()
        amax = fp8_kernels.compute_amax(x)
        if tp.world_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        scale, _ = fp8_kernels.current_scale(amax, fp8_kernels.fp8_max(quantizer.fp8_dtype),
                                             quantizer.amax_epsilon, quantizer.force_pow_2_scales)
        if quantizer.amax.device == x.device:  # its documented state: the values of the last call
            quantizer.amax.copy_(amax)
            quantizer.scale.copy_(scale)
        return Float8Quantizer(scale, amax.clone(), quantizer.fp8_dtype, columnwise=False)(x)
    if isinstance(quantizer, Float8Quantizer):
        # Records this shard's amax (reduced over fp8_group at the scale update).
        return _with_common_scale(quantizer(x), group)
    raise TypeError(f"quantizer must be a Float8Quantizer or Float8CurrentScalingQuantizer, "
                    f"got {type(quantizer).__name__}")


def _with_common_scale(xq: Float8Tensor, group) -> Float8Tensor:
    """xq, or xq requantized to the largest scale_inv of the group's ranks when they differ."""
    size = tp.world_size(group)
    if size == 1:
        return xq
    scale_invs = xq._scale_inv.new_empty(size)
    dist.all_gather(list(scale_invs.chunk(size)), xq._scale_inv.reshape(1).contiguous(), group=group)
    common = scale_invs.max().reshape(1)
    if bool((scale_invs == common).all()):
        return xq
    values = xq.dequantize(torch.float32)
    scratch_amax = torch.zeros(1, dtype=torch.float32, device=values.device)
    data = fp8_kernels.quantize(values, torch.reciprocal(common), scratch_amax, xq.fp8_dtype)
    return Float8Tensor(data, common, xq.fp8_dtype, xq.dtype)


def all_gather_fp8_dim0(xq: Float8Tensor, group) -> Float8Tensor:
    """The ranks' FP8 shards (sharing xq's scale) concatenated along dim 0, without a transpose."""
    data = tp.all_gather_dim0(xq._data, group)
    return Float8Tensor(data, xq._scale_inv, xq.fp8_dtype, xq.dtype)


def shard_for_saving(xq: Float8Tensor) -> Float8Tensor:
    """What the weight gradient keeps of a gathered input: this rank's FP8 shard, gathered again
    in backward (1/tp of the gathered tensor's bytes, at the cost of a second all-gather)."""
    return xq.rewrapped()
