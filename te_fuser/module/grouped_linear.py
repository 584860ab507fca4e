"""te_fuser.GroupedLinear: TransformerEngine's GroupedLinear (MoE experts) on the op fuser."""

from typing import Callable, List, Optional, Union

import torch

from ..quantization import current_init
from ..tensor.utils import initialize_weight, quantize_weights
from ..ops import _tensor_parallel as tp
from ..ops.basic.grouped_linear import GroupedBasicLinear, validate_m_splits
from ._linear_base import _DEFAULT_INIT_STD, FusedModule, returned_bias, rng_fork
from .base import check_weight_recipes, warn_on_recipe_change

_PARALLEL_MODES = (None, "column", "row")


class GroupedLinear(FusedModule):
    """y_i = x_i A_i^T + b_i for the consecutive row groups x_i of the input given by m_splits.

    TransformerEngine's constructor and parameter names (weight0..weight{n-1},
    bias0..bias{n-1}); one autograd node (a GroupedBasicLinear op on the fuser),
    every tensor saved for backward released when backward ends. Under FP8 each
    GEMM has its own input, weight and grad-output quantizers, and every
    m_splits entry, in_features and out_features must be divisible by 16.
    As in TransformerEngine, tensor parallelism only shards the weights
    (parallel_mode "column": out_features, "row": in_features): the
    communication is the caller's (the MoE layer's), and bias needs TP size 1.
    delay_wgrad_compute=True: backward_dw() computes the weight gradients of the
    oldest backward, as te_fuser.Linear's.
    Not supported (NotImplementedError naming the option): userbuffer overlap,
    save_original_input, single_grouped_weight/bias and
    use_grouped_tensor=True.
    """

    def __init__(self, num_gemms: int, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1,
                 get_rng_state_tracker: Optional[Callable] = None, rng_tracker_name: Optional[str] = None,
                 init_method: Optional[Callable] = None, bias: bool = True, return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode: Optional[str] = None,
                 device: Union[torch.device, str, None] = None, ub_overlap_rs: bool = False,
                 ub_overlap_ag: bool = False, ub_name: Optional[str] = None, delay_wgrad_compute: bool = False,
                 save_original_input: bool = False, single_grouped_weight: bool = False,
                 single_grouped_bias: bool = False, name: Optional[str] = None,
                 use_grouped_tensor: Optional[bool] = None):
        super().__init__()
        self._fp8_init = current_init()  # quantized_model_init at construction
        unsupported = {"ub_overlap_rs": ub_overlap_rs, "ub_overlap_ag": ub_overlap_ag,
                       "ub_name": ub_name is not None,
                       "save_original_input": save_original_input, "single_grouped_weight": single_grouped_weight,
                       "single_grouped_bias": single_grouped_bias, "use_grouped_tensor": bool(use_grouped_tensor)}
        for option, used in unsupported.items():
            if used:
                raise NotImplementedError(f"te_fuser.GroupedLinear does not support {option} (only its default)")
        for arg, value in (("num_gemms", num_gemms), ("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{arg} must be a positive int, got {value!r}")
        if parallel_mode not in _PARALLEL_MODES:
            raise ValueError(f"parallel_mode must be one of {_PARALLEL_MODES}, got {parallel_mode!r}")
        self.num_gemms = num_gemms
        self.in_features = in_features
        self.out_features = out_features
        self.tp_group = tp_group
        self.tp_size = tp.world_size(tp_group) if tp_group is not None else int(tp_size)
        if self.tp_size > 1 and bias:
            raise ValueError("te_fuser.GroupedLinear: bias=True needs TP size 1 (as in TransformerEngine, the "
                             "tensor-parallel communication is outside this module)")
        self.parallel_mode = parallel_mode
        self.sequence_parallel = self.tp_size > 1 and bool(sequence_parallel)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.use_bias = bool(bias)
        self.return_bias = bool(return_bias)
        self.apply_bias = self.use_bias and not self.return_bias
        self.init_method = init_method
        self.get_rng_state_tracker = get_rng_state_tracker
        self.rng_tracker_name = rng_tracker_name
        self.params_dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        self.save_original_input = False
        self.name = name
        local_in, local_out = in_features, out_features
        for mode, size, arg in (("column", out_features, "out_features"), ("row", in_features, "in_features")):
            if parallel_mode == mode and size % self.tp_size:
                raise ValueError(f"{arg} ({size}) must be divisible by the TP size {self.tp_size}")
        if parallel_mode == "column":
            local_out //= self.tp_size
        elif parallel_mode == "row":
            local_in //= self.tp_size
        self.local_in_features, self.local_out_features = local_in, local_out

        op = GroupedBasicLinear(num_gemms, local_in, local_out, use_bias=self.apply_bias,
                                accumulate_into_main_grad=self.fuse_wgrad_accumulation)
        self._set_ops([op])
        self._set_delay_wgrad_compute(delay_wgrad_compute)

        self._build_parameters(device)

    def _create_parameters(self, device: torch.device) -> None:
        for i in range(self.num_gemms):
            weight = torch.nn.Parameter(torch.empty(self.local_out_features, self.local_in_features, device=device,
                                                    dtype=self.params_dtype))
            weight.tensor_model_parallel = False
            if self.parallel_mode is not None:
                tp.mark_parallel_param(weight, 0 if self.parallel_mode == "column" else 1)
            self.register_parameter(f"weight{i}", weight)
            if self.use_bias:
                bias = torch.nn.Parameter(torch.empty(self.local_out_features, device=device, dtype=self.params_dtype))
                self.register_parameter(f"bias{i}", bias)
            else:
                # TransformerEngine keeps an empty tensor (not a parameter) under the bias names.
                setattr(self, f"bias{i}", torch.empty(0, device=device, dtype=self.params_dtype))

    def reset_parameters(self, defer_init: bool = False) -> None:
        """Initialize the parameters (materializing them first when they are on the meta device)."""
        if defer_init:
            return
        self._materialize_parameters()
        def init_fn(w):
            if self.init_method is not None:
                self.init_method(w)
            else:
                torch.nn.init.normal_(w, mean=0.0, std=_DEFAULT_INIT_STD)

        with rng_fork(self.get_rng_state_tracker, self.rng_tracker_name):
            for w in self._weights():
                initialize_weight(w, init_fn)
        with torch.no_grad():
            for b in self._biases():
                b.zero_()
        if self._fp8_init.enabled:  # GEMM i's weight is forward quantizer 2i + 1
            op = self._ops[0]
            quantize_weights(self, [(f"weight{i}", op, 2 * i + 1) for i in range(self.num_gemms)],
                                         self._fp8_init)

    # Read with getattr, not self._parameters: under FSDP1 the parameters are attributes only.
    def _weights(self) -> List[torch.Tensor]:
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def _wgrad_params(self):
        return [(self._ops[0], self._weights())]

    def _biases(self) -> List[torch.Tensor]:
        return [getattr(self, f"bias{i}") for i in range(self.num_gemms)] if self.use_bias else []

    def set_tensor_parallel_group(self, tp_group) -> None:
        self.tp_group = tp_group

    # -- forward ------------------------------------------------------------------------
    def forward(self, inp: torch.Tensor, m_splits, is_first_microbatch: Optional[bool] = None,
                out: Optional[torch.Tensor] = None, dgrad_out: Optional[torch.Tensor] = None):
        if out is not None or dgrad_out is not None:
            raise NotImplementedError("te_fuser.GroupedLinear does not support preallocated out/dgrad_out buffers")
        if not isinstance(inp, torch.Tensor):
            raise TypeError(f"inp must be a torch.Tensor, got {type(inp).__name__}")
        if inp.dim() < 2 or inp.shape[-1] != self.local_in_features:
            raise ValueError(f"inp must be [..., in_features = {self.local_in_features}]"
                             f"{' (local to this TP rank)' if self.tp_size > 1 else ''}, got {tuple(inp.shape)}")
        weights = self._weights()
        if inp.device != weights[0].device:
            raise ValueError(f"inp is on {inp.device} but te_fuser.GroupedLinear's parameters are on "
                             f"{weights[0].device}")
        splits = validate_m_splits(m_splits, self.num_gemms, inp.numel() // inp.shape[-1])
        biases = self._biases()
        kwargs = {"weights": weights, "biases": biases if self.apply_bias else (), "m_splits": splits,
                  "is_first_microbatch": is_first_microbatch}
        warn_on_recipe_change(self)
        check_weight_recipes(self)
        y = self._fuser(inp, [kwargs])
        return (y, [returned_bias(b, inp) for b in biases]) if self.return_bias else y
