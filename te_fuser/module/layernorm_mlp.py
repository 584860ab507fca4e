"""te_fuser.LayerNormMLP: TransformerEngine's LayerNormMLP on the op fuser
(norm, fc1, bias, activation, fc2, bias: one autograd node)."""

from typing import Callable, Optional, Union

import torch

from ..ops import _tensor_parallel as tp
from ..ops.basic import activation as act_ops
from ..ops.basic.bias import Bias
from ..ops.basic.extra_output import MakeExtraOutput
from ..ops.basic.linear import BasicLinear
from ._linear_base import FusedModule, LinearWeights, check_unsupported, positive_int, returned_bias, rng_fork
from .base import check_weight_recipes, warn_on_recipe_change
from .layernorm_linear import create_norm_params, make_norm_op, norm_kwargs
from .linear import check_forward_input

# TE's activation name -> (te_fuser op, fc1 rows per ffn feature): the gated ones need both halves.
ACTIVATIONS = {
    "gelu": (act_ops.GELU, 1), "qgelu": (act_ops.QGELU, 1), "relu": (act_ops.ReLU, 1), "srelu": (act_ops.SReLU, 1),
    "silu": (act_ops.SiLU, 1), "geglu": (act_ops.GEGLU, 2), "qgeglu": (act_ops.QGEGLU, 2),
    "reglu": (act_ops.ReGLU, 2), "sreglu": (act_ops.SReGLU, 2), "swiglu": (act_ops.SwiGLU, 2),
}
TE_ONLY_ACTIVATIONS = ("glu", "clamped_swiglu")  # later TE releases'


class LayerNormMLP(FusedModule):
    """y = fc2(act(fc1(norm(x)))) with TransformerEngine's constructor and parameter names
    (layer_norm_weight, layer_norm_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias).

    Activations, TE's: "gelu" (tanh approximation), "qgelu", "relu", "srelu", "silu", and the gated
    "geglu", "qgeglu", "reglu", "sreglu", "swiglu" (fc1 then has 2 * ffn_hidden_size rows: the
    activation of the first half times the second, as TE). One fuser runs the whole MLP: fc1's bias and the
    activation are one kernel that writes FP8 for fc2 under delayed scaling, and the norm writes
    FP8 for fc1. set_parallel_mode=True makes fc1 column- and fc2 row-parallel over tp_group,
    with sequence_parallel as in TE (the input and output are sequence shards). Without
    set_parallel_mode the MLP is not split (TE would still shrink ffn_hidden_size by tp_size).
    return_layernorm_output / return_bias: TE's return order (out, [bias,] ln_out).
    seq_length and micro_batch_size (TE's JIT warm-up hints) are accepted and unused.
    delay_wgrad_compute=True: backward computes no weight gradient; backward_dw() computes
    fc1's and fc2's (the bias gradients come out of backward, as TE's under FP8).
    Not supported (NotImplementedError naming the option): ub_*,
    symmetric_ar_type, checkpoint (selective recompute), activation_params.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 return_bias: bool = False, get_rng_state_tracker: Optional[Callable] = None, tp_group=None,
                 tp_size: int = 1, init_method: Optional[Callable] = None, bias: bool = True,
                 normalization: str = "LayerNorm", activation: str = "gelu", activation_params: Optional[dict] = None,
                 output_layer_init_method: Optional[Callable] = None, fuse_wgrad_accumulation: bool = False,
                 params_dtype: Optional[torch.dtype] = None, return_layernorm_output: bool = False,
                 return_layernorm_output_gathered: bool = False, seq_length: Optional[int] = None,
                 micro_batch_size: Optional[int] = None, set_parallel_mode: bool = False,
                 zero_centered_gamma: bool = False, device: Union[torch.device, str, None] = None,
                 ub_overlap_ag: bool = False, name: Optional[str] = None, ub_overlap_rs: bool = False,
                 ub_overlap_rs_dgrad: bool = False, ub_bulk_dgrad: bool = False, ub_bulk_wgrad: bool = False,
                 delay_wgrad_compute: bool = False, symmetric_ar_type: Optional[str] = None,
                 checkpoint: bool = False):
        super().__init__()
        check_unsupported("LayerNormMLP", ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs,
                          ub_overlap_rs_dgrad=ub_overlap_rs_dgrad, ub_bulk_dgrad=ub_bulk_dgrad,
                          ub_bulk_wgrad=ub_bulk_wgrad,
                          symmetric_ar_type=symmetric_ar_type is not None, checkpoint=checkpoint,
                          activation_params=activation_params is not None)
        if activation not in ACTIVATIONS:
            known = "one of TE's activations te_fuser lacks" if activation in TE_ONLY_ACTIVATIONS else "unknown"
            raise NotImplementedError(f"te_fuser.LayerNormMLP: activation {activation!r} is {known}; "
                                      f"supported: {', '.join(ACTIVATIONS)}")
        self.hidden_size = positive_int(hidden_size, "hidden_size")
        self.ffn_hidden_size = positive_int(ffn_hidden_size, "ffn_hidden_size")
        self.eps = float(eps)
        if not self.eps >= 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        self.normalization = normalization
        self.activation = activation
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.use_bias = bool(bias)
        self.return_bias = bool(return_bias)
        self.return_layernorm_output = bool(return_layernorm_output)
        self.return_layernorm_output_gathered = bool(return_layernorm_output_gathered) and self.return_layernorm_output
        self.set_parallel_mode = bool(set_parallel_mode)
        self.tp_group = tp_group
        self.tp_size = tp.world_size(tp_group) if tp_group is not None else int(tp_size)
        self.sequence_parallel = bool(sequence_parallel) and self.tp_size > 1 and self.set_parallel_mode
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.get_rng_state_tracker = get_rng_state_tracker
        self.init_method = init_method
        self.output_layer_init_method = output_layer_init_method
        self.seq_length, self.micro_batch_size = seq_length, micro_batch_size
        self.name = name
        self.params_dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()

        act_type, rows = ACTIVATIONS[activation]
        parallel = self.set_parallel_mode and self.tp_size > 1
        tp_kwargs = dict(tensor_parallel_group=tp_group, tensor_parallel_size=self.tp_size,
                         sequence_parallel=self.sequence_parallel,
                         accumulate_into_main_grad=self.fuse_wgrad_accumulation, create_weight=False)
        norm_op = make_norm_op(normalization, self.hidden_size, self.eps, self.zero_centered_gamma)
        # For a gated activation each rank's fc1 rows are its shard of both halves (TE's layout).
        fc1 = BasicLinear(self.hidden_size, rows * self.ffn_hidden_size,
                          tensor_parallel_mode="column" if parallel else None, **tp_kwargs)
        fc2 = BasicLinear(self.ffn_hidden_size, self.hidden_size,
                          tensor_parallel_mode="row" if parallel else None, **tp_kwargs)
        self.size_per_partition = fc2.local_in_features
        self._fc1 = LinearWeights(fc1, self.use_bias, None, prefix="fc1_")
        self._fc2 = LinearWeights(fc2, self.use_bias, None, prefix="fc2_")

        self._gathered_extra = self.return_layernorm_output_gathered and self.sequence_parallel
        ops = [norm_op]
        if self.return_layernorm_output:
            ops.append(MakeExtraOutput(tp_group if self._gathered_extra else None))
        ops.append(fc1)
        if self.use_bias:
            ops.append(Bias(fc1.local_out_features, create_bias=False))
        ops += [act_type(), fc2]
        self._fc2_bias_in_fuser = self.use_bias and not self.return_bias
        if self._fc2_bias_in_fuser:
            ops.append(Bias(self.hidden_size, create_bias=False))
        self._set_ops(ops)
        object.__setattr__(self, "_norm_op", norm_op)
        self._linear_weights = (self._fc1, self._fc2)
        self._set_delay_wgrad_compute(delay_wgrad_compute)

        self._build_parameters(device)

    def _create_parameters(self, device) -> None:
        create_norm_params(self, self._norm_op, device, self.params_dtype, self.sequence_parallel)
        self._fc1.create(self, device, self.params_dtype)
        self._fc2.create(self, device, self.params_dtype)

    def reset_parameters(self, defer_init: bool = False) -> None:
        """Initialize the parameters (materializing them first when they are on the meta device)."""
        if defer_init:
            return
        self._materialize_parameters()
        self._norm_op.init_params(self.layer_norm_weight, self.layer_norm_bias)
        with rng_fork(self.get_rng_state_tracker, None):
            self._fc1.initialize(self, self.init_method)
        with rng_fork(self.get_rng_state_tracker, None):
            self._fc2.initialize(self, self.output_layer_init_method)

    def set_tensor_parallel_group(self, tp_group) -> None:
        self.tp_group = tp_group
        for op in self._ops:
            if isinstance(op, BasicLinear):
                op.tensor_parallel_group = tp_group
            elif isinstance(op, MakeExtraOutput) and self._gathered_extra:
                op.sequence_parallel_group = tp_group

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        check_forward_input("LayerNormMLP", inp, self.fc1_weight)
        kwargs = [norm_kwargs(self, self._norm_op)]
        if self.return_layernorm_output:
            kwargs.append({})
        kwargs.append({"weight": self.fc1_weight, "is_first_microbatch": is_first_microbatch,
                       "input_gathered": self._gathered_extra})
        if self.use_bias:
            kwargs.append({"bias": self.fc1_bias})
        kwargs += [{}, {"weight": self.fc2_weight, "is_first_microbatch": is_first_microbatch}]
        if self._fc2_bias_in_fuser:
            kwargs.append({"bias": self.fc2_bias})
        warn_on_recipe_change(self)
        check_weight_recipes(self)
        result = self._fuser(inp, kwargs)
        out, ln_out = result if self.return_layernorm_output else (result, None)
        if self.return_bias:
            bias = returned_bias(self.fc2_bias, inp)
            return (out, bias, ln_out) if self.return_layernorm_output else (out, bias)
        return (out, ln_out) if self.return_layernorm_output else out
