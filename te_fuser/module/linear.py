"""te_fuser.Linear: TransformerEngine's Linear on the op fuser (BasicLinear + Bias)."""

import contextlib
from collections import OrderedDict
from typing import Callable, Optional, Union

import torch

from ..ops.basic.bias import Bias
from ..ops.basic.linear import BasicLinear
from ..ops.fuser import OperationFuser
from ..ops import _tensor_parallel as tp
from ._extra_state import get_fp8_extra_state, set_fp8_extra_state
from ._noop_cat import noop_cat

_PARALLEL_MODES = (None, "column", "row")
_DEFAULT_INIT_STD = 0.023  # TransformerEngine's default init_method: normal(0, 0.023)


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _split_sizes(parameters_split, out_features: int):
    """OrderedDict name -> size from a dict (sizes given) or a list of names (equal split)."""
    if parameters_split is None:
        return None
    if isinstance(parameters_split, dict):
        sizes = OrderedDict((str(k), int(v)) for k, v in parameters_split.items())
    else:
        names = [str(n) for n in parameters_split]
        if not names or out_features % len(names):
            raise ValueError(f"parameters_split {names} must split out_features={out_features} evenly")
        sizes = OrderedDict((n, out_features // len(names)) for n in names)
    if sum(sizes.values()) != out_features or any(v <= 0 for v in sizes.values()):
        raise ValueError(f"parameters_split sizes {dict(sizes)} must be positive and sum to out_features={out_features}")
    return sizes


class Linear(torch.nn.Module):
    """y = x A^T + b, with TransformerEngine's constructor, FP8 under te_fuser.fp8_autocast,
    and every tensor saved for backward released when backward ends.

    Parameters keep TE's names: weight and bias, or <name>_weight / <name>_bias
    with parameters_split (views of one storage, concatenated without a copy).
    Under FP8 every GEMM dimension -- input rows (tokens), in_features and
    out_features, local to the TP rank -- must be divisible by 16, else a
    ValueError names the dimension.
    Not supported (NotImplementedError naming the option): userbuffer overlap
    (ub_*), delay_wgrad_compute, symmetric_ar_type, save_original_input,
    and forward(fp8_output=True / fp8_grad=True), since te_fuser's Float8Tensor
    is not a torch.Tensor and cannot carry autograd across modules.
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
        unsupported = {"ub_overlap_ag": ub_overlap_ag, "ub_overlap_rs": ub_overlap_rs,
                       "ub_overlap_rs_dgrad": ub_overlap_rs_dgrad, "ub_bulk_dgrad": ub_bulk_dgrad,
                       "ub_bulk_wgrad": ub_bulk_wgrad, "ub_name": ub_name is not None,
                       "delay_wgrad_compute": delay_wgrad_compute,
                       "symmetric_ar_type": symmetric_ar_type is not None,
                       "save_original_input": save_original_input}
        for option, used in unsupported.items():
            if used:
                raise NotImplementedError(f"te_fuser.Linear does not support {option} (only its default)")
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
        self._split = _split_sizes(parameters_split, self.out_features)
        if self._split is not None and self.fuse_wgrad_accumulation:
            raise NotImplementedError("te_fuser.Linear does not support fuse_wgrad_accumulation with parameters_split")

        linear_op = BasicLinear(self.in_features, self.out_features, tensor_parallel_mode=parallel_mode,
                                tensor_parallel_group=tp_group, tensor_parallel_size=self.tp_size,
                                sequence_parallel=self.sequence_parallel,
                                accumulate_into_main_grad=self.fuse_wgrad_accumulation, create_weight=False)
        self.local_in_features = linear_op.local_in_features
        self.local_out_features = linear_op.local_out_features
        ops = [linear_op]
        self._bias_in_fuser = self.use_bias and not self.return_bias
        if self._bias_in_fuser:
            ops.append(Bias(self.local_out_features, create_bias=False))
        # Held outside the module tree: the ops keep FP8 state only; the parameters live here.
        object.__setattr__(self, "_ops", tuple(ops))
        object.__setattr__(self, "_fuser", OperationFuser(ops))

        device = torch.device(device) if device is not None else _default_device()
        self._create_parameters(device)
        if device.type != "meta":
            self.reset_parameters()

    # -- parameters ---------------------------------------------------------------------
    def _split_names(self, kind: str):
        if self._split is None:
            return [kind]
        return [f"{name}_{kind}" for name in self._split]

    def _local_split_sizes(self):
        if self._split is None:
            return [self.local_out_features]
        per_rank = self.tp_size if self.parallel_mode == "column" else 1
        sizes = []
        for name, size in self._split.items():
            if size % per_rank:
                raise ValueError(f"parameters_split['{name}'] = {size} must be divisible by the TP size {per_rank}")
            sizes.append(size // per_rank)
        return sizes

    def _create_parameters(self, device: torch.device) -> None:
        sizes = self._local_split_sizes()
        full_weight = torch.empty(self.local_out_features, self.local_in_features, device=device,
                                  dtype=self.params_dtype)
        for pname, piece in zip(self._split_names("weight"), full_weight.split(sizes)):
            param = torch.nn.Parameter(piece)
            self._ops[0].mark_weight(param)
            self.register_parameter(pname, param)
        if self.use_bias:
            full_bias = torch.empty(self.local_out_features, device=device, dtype=self.params_dtype)
            for pname, piece in zip(self._split_names("bias"), full_bias.split(sizes)):
                param = torch.nn.Parameter(piece)
                param.tensor_model_parallel = False
                if self.parallel_mode == "column":
                    tp.mark_parallel_param(param, 0)
                # A row-parallel bias under sequence parallelism gets a partial gradient
                # on each rank; like TE, mark it for the framework's all-reduce.
                param.sequence_parallel = self.sequence_parallel and self.parallel_mode == "row"
                self.register_parameter(pname, param)
        elif self._split is None:
            self.register_parameter("bias", None)

    def reset_parameters(self, defer_init: bool = False) -> None:
        """Initialize the parameters (materializing them first when they are on the meta device)."""
        if defer_init:
            return
        if self._weight_list()[0].device.type == "meta":
            self._create_parameters(_default_device())
        fork = contextlib.nullcontext()
        if self.get_rng_state_tracker is not None:
            tracker = self.get_rng_state_tracker()
            fork = tracker.fork(self.rng_tracker_name) if self.rng_tracker_name else tracker.fork()
        with torch.no_grad(), fork:
            for w in self._weight_list():
                if self.init_method is not None:
                    self.init_method(w)
                else:
                    torch.nn.init.normal_(w, mean=0.0, std=_DEFAULT_INIT_STD)
            if self.use_bias:
                for b in self._bias_list():
                    b.zero_()

    def _weight_list(self):
        return [self._parameters[n] for n in self._split_names("weight")]

    def _bias_list(self):
        return [self._parameters[n] for n in self._split_names("bias")] if self.use_bias else []

    def _full_weight(self) -> torch.Tensor:
        return noop_cat(self._weight_list())

    def _full_bias(self) -> Optional[torch.Tensor]:
        return noop_cat(self._bias_list()) if self.use_bias else None

    def __getattr__(self, name: str):
        # With parameters_split, weight/bias are the concatenation of the split parameters.
        if name in ("weight", "bias") and self.__dict__.get("_split") is not None:
            return self._full_weight() if name == "weight" else self._full_bias()
        return super().__getattr__(name)

    # -- tensor parallelism -------------------------------------------------------------
    def set_tensor_parallel_group(self, tp_group) -> None:
        self.tp_group = tp_group
        self._ops[0].tensor_parallel_group = tp_group

    # -- FP8 state in the state_dict ----------------------------------------------------
    def get_extra_state(self):
        return get_fp8_extra_state(self._ops)

    def set_extra_state(self, state) -> None:
        set_fp8_extra_state(self._ops, state, self._weight_list()[0].device)

    # -- forward ------------------------------------------------------------------------
    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None,
                fp8_output: bool = False, fp8_grad: bool = False):
        if fp8_output or fp8_grad:
            raise NotImplementedError(
                "te_fuser.Linear does not support fp8_output/fp8_grad: its Float8Tensor is not a torch.Tensor "
                "and cannot carry autograd between modules"
            )
        if not isinstance(inp, torch.Tensor):
            raise TypeError(f"inp must be a torch.Tensor, got {type(inp).__name__}")
        weight = self._full_weight()
        if inp.device != weight.device:
            raise ValueError(f"inp is on {inp.device} but te_fuser.Linear's parameters are on {weight.device}")
        bias = self._full_bias()
        kwargs = [{"weight": weight, "is_first_microbatch": is_first_microbatch}]
        if self._bias_in_fuser:
            kwargs.append({"bias": bias})
        out = self._fuser(inp, kwargs)
        return (out, bias) if self.return_bias else out
