"""TransformerEngine's `pytorch.tensor.utils`: FP8 weight parameters, made (inside
`quantized_model_init`) and written from float32 master weights (`cast_master_weights_to_fp8`)."""

import copy
import types
from typing import List, Optional, Sequence

import torch

from ._block_scaled_master_cast import cast_block_scaled
from ._block_scaled_tensor import BlockScaledTensor
from .float8_blockwise_tensor import Float8BlockQuantizer
from .float8_tensor import Float8Tensor
from .mxfp8_tensor import MXFP8Quantizer
from .nvfp4_tensor import NVFP4Quantizer
from .quantized_tensor import QuantizedTensor
from ..kernels import fp8 as fp8_kernels

__all__ = ["cast_master_weights_to_fp8", "replace_raw_data"]

# Attributes tensor parallelism and optimizers read off a weight; a new FP8 parameter keeps them.
_PARAM_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel",
                     "allreduce", "shared")


def cast_master_weights_to_fp8(model_weights: Sequence[torch.Tensor], master_weights: Sequence[Optional[torch.Tensor]],
                               start_offsets: Optional[Sequence[int]] = None, group=None) -> None:
    """Write each master weight into its model weight (TE's helper and signature).

    master_weights[i] is all of model_weights[i], or, with start_offsets, the shard of the flattened
    weight that starts at start_offsets[i] (TE's distributed optimizer: each data-parallel rank steps
    one shard of the masters). None: this rank holds nothing of that weight.

    An FP8 model weight is requantized with its quantizer's recipe. The shards' amaxes are reduced
    (max) over `group`, so every rank casts with the scale the whole master gives:
    - delayed scaling casts with the weight slot's current scale and records the amax in the slot
      (the next fp8_autocast exit updates the scale from it);
    - current scaling takes a new scale from the amax.
    Each rank writes its shard's bytes and the common scale_inv; the caller then all-gathers the
    model weights' bytes (the distributed optimizer's parameter all-gather), as with TE. A
    high-precision model weight gets its shard copied in.

    A block-scaled model weight (quantized_model_init under a block recipe) is requantized from a whole
    master in its format; shards go into Float8BlockScaling's 128x128-block weights only, each block's amax
    reduced over `group` (TE 2.6's support; te_fuser.tensor._block_scaled_master_cast).

    group=None reduces nothing: each process's masters are whole (or it is alone). Every rank of
    `group` must call this with the same model weights in the same order.
    """
    count = len(model_weights)
    if len(master_weights) != count:
        raise ValueError(f"model_weights has {count} tensors but master_weights {len(master_weights)}")
    if start_offsets is not None and len(start_offsets) != count:
        raise ValueError(f"start_offsets has {len(start_offsets)} entries, expected one per model weight ({count})")
    offsets = [0] * count if start_offsets is None else [int(o) for o in start_offsets]
    shards = [_flat_shard(i, model, master, offsets[i], start_offsets is not None)
              for i, (model, master) in enumerate(zip(model_weights, master_weights))]
    fp8 = [i for i, model in enumerate(model_weights) if isinstance(model, Float8Tensor)]
    with torch.no_grad():
        amaxes = _reduced_amaxes([model_weights[i] for i in fp8], [shards[i] for i in fp8], group)
        for i, amax in zip(fp8, amaxes):
            _cast_shard(model_weights[i], shards[i], offsets[i], amax)
        for i, model in enumerate(model_weights):
            if isinstance(model, BlockScaledTensor):
                cast_block_scaled(model, shards[i], offsets[i], start_offsets is not None, group)
        for i, (model, shard) in enumerate(zip(model_weights, shards)):
            if shard is not None and not isinstance(model, QuantizedTensor):
                model.view(-1)[offsets[i]: offsets[i] + shard.numel()].copy_(shard)


def replace_raw_data(tensor: Float8Tensor, new_raw_data: torch.Tensor) -> None:
    """Move a Float8Tensor's bytes into new_raw_data (TE's helper: e.g. into a slice of one flat buffer
    that holds every FP8 weight); the tensor keeps everything else. new_raw_data: uint8, of the
    tensor's shape."""
    if not isinstance(tensor, Float8Tensor):
        raise TypeError(f"tensor must be a Float8Tensor, got {type(tensor).__name__}")
    old = tensor._live()._data
    if new_raw_data.dtype != torch.uint8 or new_raw_data.shape != old.shape:
        raise ValueError(f"new_raw_data must be a uint8 tensor of shape {tuple(old.shape)}, got "
                         f"{new_raw_data.dtype} {tuple(new_raw_data.shape)}")
    new_raw_data.detach().copy_(old)
    tensor._data = new_raw_data


def _flat_shard(i: int, model: torch.Tensor, master: Optional[torch.Tensor], offset: int,
                sharded: bool) -> Optional[torch.Tensor]:
    """master_weights[i] flattened, on its model weight's device, after checking where it lands."""
    if isinstance(model, QuantizedTensor):
        model._live()
        if model._quantizer is None:
            raise ValueError(f"model_weights[{i}] is a {type(model).__name__} without a quantizer: build the model "
                             "under te_fuser.quantized_model_init")
    if master is None:
        return None
    if not sharded and master.numel() != model.numel():
        raise ValueError(f"master_weights[{i}] has {master.numel()} elements, its model weight {model.numel()} "
                         "(pass start_offsets for shards of the flattened weight)")
    if offset < 0 or offset + master.numel() > model.numel():
        raise ValueError(f"master_weights[{i}] ({master.numel()} elements at start_offsets[{i}]={offset}) does "
                         f"not fit in its model weight of {model.numel()} elements")
    return master.detach().reshape(-1).to(model.device).contiguous()


def _reduced_amaxes(models: List[Float8Tensor], shards: List[Optional[torch.Tensor]], group) -> List[torch.Tensor]:
    """max|shard| of each FP8 weight, reduced over group in one all-reduce (0 where no shard is here)."""
    if not models:
        return []
    amaxes = torch.stack([fp8_kernels.compute_amax(s).reshape(()) if s is not None
                          else torch.zeros((), dtype=torch.float32, device=m.device)
                          for m, s in zip(models, shards)])
    if group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(amaxes, op=torch.distributed.ReduceOp.MAX, group=group)
    return list(amaxes.reshape(-1, 1).unbind(0))


def _cast_shard(model: Float8Tensor, shard: Optional[torch.Tensor], offset: int, amax: torch.Tensor) -> None:
    """The scale for `amax` under the weight's recipe (its quantizer's scale_for_amax: delayed scaling
    records the amax for the slot's next update), the shard's bytes and scale_inv written into model."""
    quantizer = model._quantizer
    if quantizer.fp8_dtype != model.fp8_dtype:
        raise ValueError(f"the Float8Tensor holds {model.fp8_dtype} but its quantizer casts to {quantizer.fp8_dtype}")
    scale = quantizer.scale_for_amax(amax)
    if shard is not None:
        data = fp8_kernels.quantize(shard, scale, torch.zeros_like(amax), model.fp8_dtype)
        model._data.view(-1)[offset: offset + shard.numel()].copy_(data.view(torch.uint8))
    model._scale_inv.copy_(torch.reciprocal(scale))
    if model._transpose is not None:
        # Stale until every shard's bytes are here: a whole master refreshes it, shards drop it (the
        # GEMMs transpose on demand).
        whole = shard is not None and shard.numel() == model.numel()
        if whole:
            model._refresh_transpose()
        else:
            model._transpose = None


def rowwise_copy(quantizer):
    """The quantizer a weight keeps: the same scaling state, with the usages the weight holds (weight_usages)."""
    own = copy.copy(quantizer)
    own.set_usage(columnwise=keeps_columnwise(quantizer))
    return own


def keeps_columnwise(quantizer) -> bool:
    """Whether a weight quantized by `quantizer` holds its columnwise usage too. A Float8 weight never (the
    GEMMs transpose its bytes when they need to), nor one in 2-D blocks (Float8 block scaling's 128x128,
    NVFP4's 16x16: its columnwise data is the rowwise bytes transposed, made in backward); the 1-D block
    formats (MXFP8, 1x128 tiles, NVFP4's 1x16) do: their columnwise blocks run the other way."""
    if isinstance(quantizer, Float8BlockQuantizer):
        return quantizer.block_scaling_dim != 2
    if isinstance(quantizer, NVFP4Quantizer):
        return not quantizer.with_2d_quantization
    return isinstance(quantizer, MXFP8Quantizer)


def fp8_weight_parameter(values: torch.Tensor, quantizer, init,
                         like: Optional[torch.Tensor] = None) -> torch.nn.Parameter:
    """A quantized parameter holding `values` quantized by `quantizer` (a copy of which it keeps)."""
    values = values.detach()
    quantizer = rowwise_copy(quantizer)
    fp8 = quantizer.quantize(values.contiguous())
    fp8._quantizer = quantizer
    param = torch.nn.Parameter(fp8, requires_grad=True if like is None else like.requires_grad)
    for name in _PARAM_ATTRIBUTES:
        if like is not None and hasattr(like, name):
            setattr(param, name, getattr(like, name))
    if init.preserve_high_precision_init_val:
        param._high_precision_init_val = values.to("cpu", copy=True)
        param.get_high_precision_init_val = types.MethodType(_get_high_precision_init_val, param)
        param.clear_high_precision_init_val = types.MethodType(_clear_high_precision_init_val, param)
    return param


def _get_high_precision_init_val(self) -> Optional[torch.Tensor]:
    return getattr(self, "_high_precision_init_val", None)


def _clear_high_precision_init_val(self) -> None:
    self._high_precision_init_val = None


def quantize_weights(module: torch.nn.Module, named: Sequence[tuple], init) -> None:
    """Replace module.<name> (initialized, high precision) by a quantized parameter, for each (name, op, slot):
    the op's forward quantizer `slot` of init.recipe quantizes it."""
    for name, op, slot in named:
        weight = getattr(module, name)
        if isinstance(weight, QuantizedTensor):
            continue
        quantizer = op.forward_quantizer_for_init(init.recipe, weight.device, slot)
        module.register_parameter(name, fp8_weight_parameter(weight, quantizer, init, like=weight))


def initialize_weight(weight: torch.Tensor, init_fn) -> torch.Tensor:
    """init_fn applied to a high-precision tensor of weight's shape: the weight itself, or for a quantized
    weight (re-initialized) a fresh tensor of its nominal dtype, quantized back into it."""
    target = weight
    if isinstance(weight, QuantizedTensor):
        target = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        init_fn(target)
    if target is not weight:
        with torch.no_grad():
            weight.copy_(target)
        if getattr(weight, "_high_precision_init_val", None) is not None:  # kept, not yet cleared
            weight._high_precision_init_val = target.to("cpu", copy=True)
    return weight
