"""te_fuser.LayerNormLinear: TransformerEngine's LayerNormLinear on the op fuser
(LayerNorm/RMSNorm + BasicLinear + Bias, one autograd node)."""

from typing import Callable, Optional, Union

import torch

from ..ops import _tensor_parallel as tp
from ..ops.basic.bias import Bias
from ..ops.basic.extra_output import MakeExtraOutput
from ..ops.basic.linear import BasicLinear
from ..ops.basic.norm import LayerNorm as LayerNormOp, RMSNorm as RMSNormOp
from ._linear_base import FusedModule, LinearWeights, check_unsupported, returned_bias, rng_fork
from .base import check_weight_recipes, warn_on_recipe_change
from .linear import check_forward_input

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def make_norm_op(normalization: str, size: int, eps: float, zero_centered_gamma: bool):
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    op_type = LayerNormOp if normalization == "LayerNorm" else RMSNormOp
    return op_type(size, eps, zero_centered_gamma=zero_centered_gamma, create_params=False)


def create_norm_params(module: torch.nn.Module, norm_op, device, dtype, sequence_parallel: bool) -> None:
    """layer_norm_weight and layer_norm_bias (None for RMSNorm) on the module, TE's names.
    Under sequence parallelism each rank's gradient is partial: tagged for the framework's all-reduce."""
    weight = torch.nn.Parameter(torch.empty(norm_op.size, device=device, dtype=dtype))
    module.register_parameter("layer_norm_weight", weight)
    bias = None
    if norm_op.with_bias:
        bias = torch.nn.Parameter(torch.empty(norm_op.size, device=device, dtype=dtype))
    module.register_parameter("layer_norm_bias", bias)
    for param in (weight, bias):
        if param is not None:
            param.sequence_parallel = sequence_parallel


def norm_kwargs(module: torch.nn.Module, norm_op) -> dict:
    kwargs = {"weight": module.layer_norm_weight}
    if norm_op.with_bias:
        kwargs["bias"] = module.layer_norm_bias
    return kwargs


class LayerNormLinear(FusedModule):
    """y = norm(x) A^T + b with TransformerEngine's constructor and parameter names
    (layer_norm_weight, layer_norm_bias, weight, bias or parameters_split names).

    Runs as one fuser [norm, BasicLinear, Bias]: under delayed scaling the norm kernel writes
    its output directly in FP8 with the linear's input scale. With return_layernorm_output the
    norm output is also returned -- (out, ln_out), or (out, bias, ln_out) with return_bias, as
    TE -- in high precision (the linear then quantizes it); its gradient is added to the
    norm's. With sequence parallelism the returned norm output is this rank's shard, or the
    all-gathered sequence with return_layernorm_output_gathered (whose gradient is
    reduce-scattered back; TE drops the gradient of a gathered output).
    parallel_mode "row" is refused, as in TE. Not supported (NotImplementedError naming the
    option): ub_*, symmetric_ar_type. fp8_output / fp8_grad and delay_wgrad_compute as te_fuser.Linear.
    """

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1,
                 get_rng_state_tracker: Optional[Callable] = None, init_method: Optional[Callable] = None,
                 bias: bool = True, normalization: str = "LayerNorm", return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode: Optional[str] = None,
                 return_layernorm_output: bool = False, return_layernorm_output_gathered: bool = False,
                 parameters_split: Optional[Union[dict, list, tuple]] = None, zero_centered_gamma: bool = False,
                 device: Union[torch.device, str, None] = None, ub_overlap_ag: bool = False,
                 ub_overlap_rs: bool = False, ub_overlap_rs_dgrad: bool = False, ub_bulk_wgrad: bool = False,
                 ub_bulk_dgrad: bool = False, ub_name: Optional[str] = None, delay_wgrad_compute: bool = False,
                 symmetric_ar_type: Optional[str] = None, name: Optional[str] = None,
                 rng_tracker_name: Optional[str] = None):
        super().__init__()
        check_unsupported("LayerNormLinear", ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs,
                          ub_overlap_rs_dgrad=ub_overlap_rs_dgrad, ub_bulk_dgrad=ub_bulk_dgrad,
                          ub_bulk_wgrad=ub_bulk_wgrad, ub_name=ub_name is not None,
                          symmetric_ar_type=symmetric_ar_type is not None)
        if parallel_mode == "row":
            raise NotImplementedError("te_fuser.LayerNormLinear does not support parallel_mode='row' "
                                      "(a normalization cannot be split along its features; TE refuses it too)")
        if parallel_mode not in (None, "column"):
            raise ValueError(f"parallel_mode must be None or 'column', got {parallel_mode!r}")
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        if self.in_features <= 0 or self.out_features <= 0:
            raise ValueError(f"in_features and out_features must be positive, got {in_features}, {out_features}")
        self.eps = float(eps)
        if not self.eps >= 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        self.normalization = normalization
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.use_bias = bool(bias)
        self.return_bias = bool(return_bias)
        self.return_layernorm_output = bool(return_layernorm_output)
        self.return_layernorm_output_gathered = bool(return_layernorm_output_gathered) and self.return_layernorm_output
        self.parallel_mode = parallel_mode
        self.tp_group = tp_group
        self.tp_size = tp.world_size(tp_group) if tp_group is not None else int(tp_size)
        self.sequence_parallel = bool(sequence_parallel) and self.tp_size > 1
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.get_rng_state_tracker = get_rng_state_tracker
        self.rng_tracker_name = rng_tracker_name
        self.init_method = init_method
        self.name = name
        self.ub_name = None
        self.params_dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        if parameters_split is not None and self.fuse_wgrad_accumulation:
            raise NotImplementedError(
                "te_fuser.LayerNormLinear does not support fuse_wgrad_accumulation with parameters_split")

        norm_op = make_norm_op(normalization, self.in_features, self.eps, self.zero_centered_gamma)
        column_sp = self.sequence_parallel and parallel_mode == "column"
        linear_op = BasicLinear(self.in_features, self.out_features, tensor_parallel_mode=parallel_mode,
                                tensor_parallel_group=tp_group, tensor_parallel_size=self.tp_size,
                                sequence_parallel=column_sp,
                                accumulate_into_main_grad=self.fuse_wgrad_accumulation, create_weight=False)
        self.local_out_features = linear_op.local_out_features
        self._weights = LinearWeights(linear_op, self.use_bias, parameters_split)
        self._split = self._weights.split
        ops = [norm_op]
        self._gathered_extra = self.return_layernorm_output_gathered and column_sp
        if self.return_layernorm_output:
            ops.append(MakeExtraOutput(tp_group if self._gathered_extra else None))
        ops.append(linear_op)
        self._bias_in_fuser = self.use_bias and not self.return_bias
        if self._bias_in_fuser:
            ops.append(Bias(self.local_out_features, create_bias=False))
        self._set_ops(ops)
        object.__setattr__(self, "_norm_op", norm_op)
        object.__setattr__(self, "_linear_op", linear_op)
        self._linear_weights = (self._weights,)
        self._set_delay_wgrad_compute(delay_wgrad_compute)

        self._build_parameters(device)

    def _create_parameters(self, device) -> None:
        create_norm_params(self, self._norm_op, device, self.params_dtype, self.sequence_parallel)
        self._weights.create(self, device, self.params_dtype)

    def reset_parameters(self, defer_init: bool = False) -> None:
        """Initialize the parameters (materializing them first when they are on the meta device)."""
        if defer_init:
            return
        self._materialize_parameters()
        self._norm_op.init_params(self.layer_norm_weight, self.layer_norm_bias)
        with rng_fork(self.get_rng_state_tracker, self.rng_tracker_name):
            self._weights.initialize(self, self.init_method)

    def set_tensor_parallel_group(self, tp_group) -> None:
        self.tp_group = tp_group
        self._linear_op.tensor_parallel_group = tp_group
        for op in self._ops:
            if isinstance(op, MakeExtraOutput) and self._gathered_extra:
                op.sequence_parallel_group = tp_group

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None,
                fp8_output: bool = False, fp8_grad: bool = False):
        weight = self._weights.full_weight(self)
        check_forward_input("LayerNormLinear", inp, weight)
        bias = self._weights.full_bias(self)
        kwargs = [norm_kwargs(self, self._norm_op)]
        if self.return_layernorm_output:
            kwargs.append({})
        kwargs.append({"weight": weight, "is_first_microbatch": is_first_microbatch,
                       "input_gathered": self._gathered_extra})
        if self._bias_in_fuser:
            kwargs.append({"bias": bias})
        warn_on_recipe_change(self)
        check_weight_recipes(self)
        result = self._fuser(inp, kwargs, fp8_output=fp8_output, fp8_grad=fp8_grad)
        out, ln_out = result if self.return_layernorm_output else (result, None)
        if self.return_bias:
            bias = returned_bias(bias, inp)
            return (out, bias, ln_out) if self.return_layernorm_output else (out, bias)
        return (out, ln_out) if self.return_layernorm_output else out
