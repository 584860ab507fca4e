"""FP8 weights: quantized_model_init / fp8_model_init (TransformerEngine's names).

Modules built inside `quantized_model_init(enabled=True)` (Linear, LayerNormLinear, LayerNormMLP,
GroupedLinear, ops.BasicLinear) hold their linear weights as Float8Tensor parameters: one byte per
element plus a float32 scale_inv, quantized from the initialized high-precision values with the
weight's forward quantizer of the recipe (DelayedScaling: the weight slot's scale, 1 until the first
update, as in TE; Float8CurrentScaling: the tensor's own amax). The quantizer stays attached
(`param._quantizer`), so copy_, in-place ops and `cast_master_weights_to_fp8` write through it.
Norm weights and biases stay high precision, as in TE.

Inside fp8_autocast the FP8 GEMMs read the weight's bytes directly (no 16-bit copy); outside it the
forward uses the dequantized values (a transient high-precision copy, as any op on a Float8Tensor).
Gradients of FP8 weights are high precision, in the nominal dtype. Loading a state_dict copies FP8
weights byte for byte with their scales (Float8Tensor.copy_ from a Float8Tensor of the same format).

FSDP2 (fully_shard) shards FP8 weights as Float8Tensors and all-gathers their bytes
(Float8Tensor.fsdp_pre_all_gather / fsdp_post_all_gather); the ranks must agree on each weight's
scale, as they do when the weights were quantized before sharding.
The master-weight cast is te_fuser.tensor.utils.cast_master_weights_to_fp8 (TE's place for it).
torch.compile (without fullgraph: the FP8 scaling-state updates break the graph) trains FP8 weights
bitwise like eager (tests/test_compile_fp8.py). Not supported: parameters_split with FP8 weights
(NotImplementedError).
"""

import contextlib
import copy
import types
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .tensor.float8_tensor import Float8Tensor
from .recipe import DelayedScaling, Float8CurrentScaling

# Attributes tensor parallelism and optimizers read off a weight; a new FP8 parameter keeps them.
_PARAM_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel",
                     "allreduce", "shared")


@dataclass
class _InitState:
    enabled: bool = False
    recipe: object = None
    preserve_high_precision_init_val: bool = False


_STATE = _InitState()


def current_init() -> _InitState:
    """What the innermost quantized_model_init says (a copy: modules keep it from their construction)."""
    return _InitState(_STATE.enabled, _STATE.recipe, _STATE.preserve_high_precision_init_val)


@contextlib.contextmanager
def quantized_model_init(enabled: bool = True, recipe=None, preserve_high_precision_init_val: bool = False):
    """Build te_fuser modules with FP8 weights (TE's context; `recipe` defaults to DelayedScaling()).

    preserve_high_precision_init_val=True keeps each weight's initial high-precision values on the
    CPU: `param.get_high_precision_init_val()` returns them, `param.clear_high_precision_init_val()`
    frees them (e.g. once fp32 master weights were made from them).
    """
    if recipe is not None and not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        raise TypeError(f"recipe must be DelayedScaling or Float8CurrentScaling, got {type(recipe).__name__}")
    global _STATE
    saved = _STATE
    _STATE = _InitState(bool(enabled), recipe if recipe is not None else DelayedScaling(),
                        bool(preserve_high_precision_init_val))
    try:
        yield
    finally:
        _STATE = saved


def fp8_model_init(enabled: bool = True, recipe=None, preserve_high_precision_init_val: bool = False):
    """TE's older name for quantized_model_init."""
    return quantized_model_init(enabled=enabled, recipe=recipe,
                                preserve_high_precision_init_val=preserve_high_precision_init_val)


def rowwise_copy(quantizer):
    """The quantizer a weight keeps: the same scaling state, without the transposed data (the GEMMs
    transpose the weight's bytes when they need to, so the parameter never holds a second copy)."""
    own = copy.copy(quantizer)
    own.set_usage(columnwise=False)
    return own


def fp8_weight_parameter(values: torch.Tensor, quantizer, init: _InitState,
                         like: Optional[torch.Tensor] = None) -> torch.nn.Parameter:
    """A Float8Tensor parameter holding `values` quantized by `quantizer` (which it keeps)."""
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


def quantize_weights(module: torch.nn.Module, named: Sequence[tuple], init: _InitState) -> None:
    """Replace module.<name> (initialized, high precision) by an FP8 parameter, for each (name, op, slot):
    the op's forward quantizer `slot` of init.recipe quantizes it."""
    for name, op, slot in named:
        weight = getattr(module, name)
        if isinstance(weight, Float8Tensor):
            continue
        quantizer = op.forward_quantizer_for_init(init.recipe, weight.device, slot)
        module.register_parameter(name, fp8_weight_parameter(weight, quantizer, init, like=weight))


def initialize_weight(weight: torch.Tensor, init_fn) -> torch.Tensor:
    """init_fn applied to a high-precision tensor of weight's shape: the weight itself, or for an FP8
    weight (re-initialized) a fresh tensor of its nominal dtype that the caller quantizes back."""
    target = weight
    if isinstance(weight, Float8Tensor):
        target = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        init_fn(target)
    if target is not weight:
        with torch.no_grad():
            weight.copy_(target)
    return weight
