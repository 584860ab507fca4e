"""te_fuser.Linear: TransformerEngine's Linear on the op fuser (BasicLinear + Bias)."""

from typing import Callable, Optional, Union

import torch

from ..ops import _tensor_parallel as tp
from ..ops.basic.bias import Bias
from ..ops.basic.linear import BasicLinear
from ._linear_base import FusedModule, LinearWeights, check_unsupported, returned_bias, rng_fork
from .base import check_weight_recipes, warn_on_recipe_change

_PARALLEL_MODES = (None, "column", "row")


def check_forward_input(module_name: str, inp, param: torch.Tensor) -> None:
    if not isinstance(inp, torch.Tensor):
        raise TypeError(f"inp must be a torch.Tensor, got {type(inp).__name__}")
    if inp.device != param.device:
        raise ValueError(f"inp is on {inp.device} but te_fuser.{module_name}'s parameters are on {param.device}")


class Linear(FusedModule):
    """y = x A^T + b, with TransformerEngine's constructor, FP8 under te_fuser.fp8_autocast,
    and every tensor saved for backward released when backward ends.

    Parameters keep TE's names: weight and bias, or <name>_weight / <name>_bias
    with parameters_split (views of one storage, concatenated without a copy).
    Under FP8 every GEMM dimension -- input rows (tokens), in_features and
    out_features, local to the TP rank -- must be divisible by 16, else a
    ValueError names the dimension.
    save_original_input (settable after construction, as Megatron does): the
    weight gradient uses the saved high-precision input, quantized again in
    backward under FP8, instead of an FP8 copy made in forward; like TE, it
    raises under the DelayedScaling recipe.
    delay_wgrad_compute=True (TE's): backward computes the input's gradient
    only; backward_dw() computes the weight's (see FusedModule.backward_dw).
    Not supported (NotImplementedError naming the option): userbuffer overlap
    (ub_*), symmetric_ar_type.
    forward(fp8_output=True) returns a Float8Tensor (quantized with the
    layer's output quantizer: under delayed scaling a forward scaling slot of
    its own, under current scaling the output's amax), and fp8_grad=True makes
    the input's gradient a Float8Tensor (the grad-input quantizer, a backward
    slot); outside fp8_autocast both are ignored, as in TE. A Float8Tensor
    input in the recipe's forward format feeds the FP8 GEMM as it is.
    """

    def __init__(self, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1,
                 get_rng_state_tracker: Optional[Callable] = None, rng_tracker_name: Optional[str] = None,
                 init_method: Optional[Callable] = None, bias: bool = True, return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode: Optional[str] = None,
                 parameters_split: Optional[Union[dict, list, tuple]] = None,
                 device: Union[torch.device, str, None] = None,
                 ub_overlap_ag: bool = False, ub_overlap_rs: bool = False, ub_overlap_rs_dgrad: bool = False,
                 ub_bulk_dgrad: bool = False, ub_bulk_wgrad: bool = False, ub_name: Optional[str] = None,
                 delay_wgrad_compute: bool = False, symmetric_ar_type: Optional[str] = None,
                 save_original_input: bool = False, name: Optional[str] = None):
        super().__init__()
        check_unsupported("Linear", ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs,
                          ub_overlap_rs_dgrad=ub_overlap_rs_dgrad, ub_bulk_dgrad=ub_bulk_dgrad,
                          ub_bulk_wgrad=ub_bulk_wgrad, ub_name=ub_name is not None,
                          symmetric_ar_type=symmetric_ar_type is not None)
        if parallel_mode not in _PARALLEL_MODES:
            raise ValueError(f"parallel_mode must be one of {_PARALLEL_MODES}, got {parallel_mode!r}")
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        if self.in_features <= 0 or self.out_features <= 0:
            raise ValueError(f"in_features and out_features must be positive, got {in_features}, {out_features}")
        self.use_bias = bool(bias)
        self.return_bias = bool(return_bias)
        self.parallel_mode = parallel_mode
        self.tp_group = tp_group
        self.tp_size = tp.world_size(tp_group) if tp_group is not None else int(tp_size)
        self.sequence_parallel = bool(sequence_parallel) and parallel_mode is not None
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.get_rng_state_tracker = get_rng_state_tracker
        self.rng_tracker_name = rng_tracker_name
        self.init_method = init_method
        self.name = name
        self.params_dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        if parameters_split is not None and self.fuse_wgrad_accumulation:
            raise NotImplementedError("te_fuser.Linear does not support fuse_wgrad_accumulation with parameters_split")

        linear_op = BasicLinear(self.in_features, self.out_features, tensor_parallel_mode=parallel_mode,
                                tensor_parallel_group=tp_group, tensor_parallel_size=self.tp_size,
                                sequence_parallel=self.sequence_parallel,
                                accumulate_into_main_grad=self.fuse_wgrad_accumulation, create_weight=False)
        self.local_in_features = linear_op.local_in_features
        self.local_out_features = linear_op.local_out_features
        self._weights = LinearWeights(linear_op, self.use_bias, parameters_split)
        self._split = self._weights.split
        ops = [linear_op]
        self._bias_in_fuser = self.use_bias and not self.return_bias
        if self._bias_in_fuser:
            ops.append(Bias(self.local_out_features, create_bias=False))
        self._set_ops(ops)
        self._linear_weights = (self._weights,)
        self._set_delay_wgrad_compute(delay_wgrad_compute)
        self.save_original_input = save_original_input

        self._build_parameters(device)

    @property
    def save_original_input(self) -> bool:
        return self._ops[0].save_original_input

    @save_original_input.setter
    def save_original_input(self, value: bool) -> None:
        self._ops[0].save_original_input = bool(value)

    # -- parameters ---------------------------------------------------------------------
    def _create_parameters(self, device) -> None:
        self._weights.create(self, device, self.params_dtype)

    def reset_parameters(self, defer_init: bool = False) -> None:
        """Initialize the parameters (materializing them first when they are on the meta device)."""
        if defer_init:
            return
        self._materialize_parameters()
        with rng_fork(self.get_rng_state_tracker, self.rng_tracker_name):
            self._weights.initialize(self, self.init_method)

    # -- tensor parallelism -------------------------------------------------------------
    def set_tensor_parallel_group(self, tp_group) -> None:
        self.tp_group = tp_group
        self._ops[0].tensor_parallel_group = tp_group

    # -- forward ------------------------------------------------------------------------
    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None,
                fp8_output: bool = False, fp8_grad: bool = False):
        weight = self._weights.full_weight(self)
        check_forward_input("Linear", inp, weight)
        bias = self._weights.full_bias(self)
        kwargs = [{"weight": weight, "is_first_microbatch": is_first_microbatch}]
        if self._bias_in_fuser:
            kwargs.append({"bias": bias})
        warn_on_recipe_change(self)
        check_weight_recipes(self)
        out = self._fuser(inp, kwargs, fp8_output=fp8_output, fp8_grad=fp8_grad)
        return (out, returned_bias(bias, inp)) if self.return_bias else out
