"""What te_fuser's linear-family modules share: TE's options, the weight/bias parameters of one
BasicLinear (with parameters_split), their initialization and the FP8 `_extra_state`."""

import contextlib
import copy
from collections import OrderedDict
from typing import Optional

import torch

from .. import amp
from ..quantization import FP8GlobalState, canonical_recipe, current_init
from ..tensor.utils import initialize_weight, quantize_weights
from ..ops import _tensor_parallel as tp
from ..ops._delayed_wgrad import WgradQueue
from ..ops.basic.linear import BasicLinear
from ..ops.fuser import OperationFuser
from ._extra_state import get_fp8_extra_state, set_fp8_extra_state
from ._fp8_meta import fp8_meta_view
from ._noop_cat import adjacent_in_one_storage, noop_cat
from .base import TransformerEngineBaseModule

_DEFAULT_INIT_STD = 0.023  # TransformerEngine's default init_method: normal(0, 0.023)


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def check_unsupported(module_name: str, **options) -> None:
    """NotImplementedError naming the first option set away from its default."""
    for option, used in options.items():
        if used:
            raise NotImplementedError(f"te_fuser.{module_name} does not support {option} (only its default)")


def split_sizes(parameters_split, out_features: int):
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


def positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def returned_bias(bias: Optional[torch.Tensor], inp: torch.Tensor) -> Optional[torch.Tensor]:
    """A bias returned to the caller (return_bias), in the autocast dtype under torch.autocast, as TE
    returns it: the caller adds it to the module's output, which is in that dtype."""
    return amp.cast(bias, amp.autocast_dtype(inp.device.type))


def rng_fork(get_rng_state_tracker, rng_tracker_name):
    """The RNG context TE initializes weights under: the tracker's fork, or nothing."""
    if get_rng_state_tracker is None:
        return contextlib.nullcontext()
    tracker = get_rng_state_tracker()
    return tracker.fork(rng_tracker_name) if rng_tracker_name else tracker.fork()


class FusedModule(TransformerEngineBaseModule):
    """A module whose ops (held outside the module tree: they keep FP8 state only, the
    parameters live on the module) run through one OperationFuser."""

    _fp8_state_is_a_view = True  # fp8_meta and quantizers: views of the ops' state

    def _set_ops(self, ops) -> None:
        object.__setattr__(self, "_ops", tuple(ops))
        object.__setattr__(self, "_fuser", OperationFuser(ops))

    def __getattr__(self, name: str):
        if name == "fp8_meta":  # TE's dict of the FP8 state, a view made on each access (_fp8_meta.py)
            return fp8_meta_view(type(self).__name__, self.__dict__["_ops"])
        # With parameters_split, weight/bias are the concatenation of the split parameters.
        if name in ("weight", "bias") and self.__dict__.get("_split") is not None:
            weights = self.__dict__["_weights"]
            return weights.full_weight(self) if name == "weight" else weights.full_bias(self)
        return super().__getattr__(name)

    def _param_device(self) -> torch.device:
        return next(iter(self.parameters())).device

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        """TE's: inside an enabled fp8_autocast, make the FP8 state of the active recipe now rather than in
        the next forward, so that `quantizers` / `fp8_meta` hold it (e.g. to set a scale before exporting).
        num_gemms is TE's slot count: te_fuser sizes the state from the module's own GEMMs."""
        if isinstance(num_gemms, bool) or not isinstance(num_gemms, int) or num_gemms < 1:
            raise ValueError(f"num_gemms must be a positive int, got {num_gemms!r}")
        if not FP8GlobalState.is_enabled():
            return
        recipe = canonical_recipe(FP8GlobalState.get_recipe())
        for op in self._ops:
            if op.num_forward_quantizers + op.num_backward_quantizers > 0:
                op.setup_fp8(True, recipe, FP8GlobalState.get_group(), self._param_device())

    # -- split parameters stay views of one storage (LinearWeights.share_storage) ---------
    def _apply(self, fn, recurse=True):
        result = super()._apply(fn, recurse)
        self._share_split_storage()
        return result

    def __deepcopy__(self, memo):
        cls = type(self)
        copied = cls.__new__(cls)
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__dict__, memo))  # what deepcopy does for a Module
        copied._share_split_storage()
        return copied

    def _share_split_storage(self) -> None:
        for weights in getattr(self, "_linear_weights", ()):
            weights.share_storage(self)

    # -- parameters: subclasses define _create_parameters(device) and reset_parameters() -----
    def _build_parameters(self, device) -> None:
        """Create the parameters on device (default_device() when None); initialize them unless the
        device is "meta" (deferred init: reset_parameters() materializes them later)."""
        device = torch.device(device) if device is not None else default_device()
        self._create_parameters(device)
        if device.type != "meta":
            self.reset_parameters()

    def _materialize_parameters(self) -> None:
        """Meta parameters become real ones on default_device(), for reset_parameters() to initialize."""
        if self._param_device().type == "meta":
            self._create_parameters(default_device())

    # -- FP8 state in the state_dict ----------------------------------------------------
    def get_extra_state(self):
        return get_fp8_extra_state(self._ops)

    def set_extra_state(self, state) -> None:
        set_fp8_extra_state(self._ops, state, self._param_device())

    # -- delay_wgrad_compute (TE's): weight gradients left for backward_dw() --------------
    delay_wgrad_compute = False

    def _wgrad_params(self):
        """[(linear op, the parameters its weight gradient goes to)]; the ops' LinearWeights by default."""
        return [(weights.op, weights.weights(self)) for weights in self._linear_weights]

    def _set_delay_wgrad_compute(self, enabled: bool) -> None:
        self.delay_wgrad_compute = bool(enabled)
        for op in self._ops:
            if hasattr(op, "wgrad_queue"):  # the linear ops
                op.wgrad_queue = WgradQueue() if enabled else None

    def backward_dw(self) -> None:
        """With delay_wgrad_compute (TE's), the weight gradients the oldest backward not yet handled
        queued: computed now and accumulated, into main_grad with fuse_wgrad_accumulation, else into
        .grad (added to one already there, as autograd would); their queued inputs are freed. Each
        backward queues one entry, each call runs one; a call with none queued raises, as in TE.
        Without delay_wgrad_compute the backward computed them: nothing to do."""
        if not self.delay_wgrad_compute:
            return
        targets = [(op.wgrad_queue, params) for op, params in self._wgrad_params()]
        if not any(len(queue) for queue, _ in targets):
            raise RuntimeError(f"te_fuser.{type(self).__name__}.backward_dw(): no weight gradient is queued "
                               "(each backward queues one, each backward_dw() computes one)")
        for queue, params in targets:
            if len(queue):
                accumulate_grads(params, queue.run_oldest())


def accumulate_grads(params, grads) -> None:
    """Add each gradient to its parameter's .grad (set it when None); a single gradient for several
    parameters (parameters_split) is split among them along dim 0. None: nothing (main_grad has it)."""
    if not isinstance(grads, (list, tuple)):
        grads = [grads] if grads is None or len(params) == 1 else grads.split([p.shape[0] for p in params])
    with torch.no_grad():
        for param, grad in zip(params, grads):
            if grad is None:
                continue
            if param.grad is None:
                param.grad = grad
            else:
                param.grad += grad


def _param(module: torch.nn.Module, name: str):
    """module.<name>, read from its parameters first: getattr would pass through two Python
    __getattr__ methods (FusedModule's and Module's) on every forward."""
    param = module._parameters.get(name)
    return param if param is not None else getattr(module, name)


class LinearWeights:
    """The weight and bias parameters of one BasicLinear on a module, with TE's names:
    weight and bias, or <name>_weight / <name>_bias with parameters_split (views of one
    storage, concatenated without a copy). Parameters are always read with getattr, so
    FSDP's flat parameters (plain attributes, absent from _parameters) work."""

    def __init__(self, linear_op: BasicLinear, use_bias: bool, parameters_split, prefix: str = ""):
        self.op = linear_op
        self.use_bias = use_bias
        self.prefix = prefix
        self.split = split_sizes(parameters_split, linear_op.out_features)
        self._weight_names, self._bias_names = self.names("weight"), self.names("bias")
        self.fp8_init = current_init()  # quantized_model_init at construction
        if self.fp8_init.enabled and self.split is not None:
            raise NotImplementedError("te_fuser does not support parameters_split with FP8 weights "
                                      "(quantized_model_init): the split weights would be concatenated in 16 bits")

    def names(self, kind: str):
        if self.split is None:
            return (self.prefix + kind,)
        return tuple(f"{self.prefix}{name}_{kind}" for name in self.split)

    def _local_split_sizes(self):
        op = self.op
        if self.split is None:
            return [op.local_out_features]
        per_rank = op.tensor_parallel_size if op.tensor_parallel_mode == "column" else 1
        sizes = []
        for name, size in self.split.items():
            if size % per_rank:
                raise ValueError(f"parameters_split['{name}'] = {size} must be divisible by the TP size {per_rank}")
            sizes.append(size // per_rank)
        return sizes

    def create(self, module: torch.nn.Module, device, dtype) -> None:
        op = self.op
        sizes = self._local_split_sizes()
        full_weight = torch.empty(op.local_out_features, op.local_in_features, device=device, dtype=dtype)
        for pname, piece in zip(self._weight_names, full_weight.split(sizes)):
            param = torch.nn.Parameter(piece)
            op.mark_weight(param)
            module.register_parameter(pname, param)
        if self.use_bias:
            full_bias = torch.empty(op.local_out_features, device=device, dtype=dtype)
            for pname, piece in zip(self._bias_names, full_bias.split(sizes)):
                param = torch.nn.Parameter(piece)
                param.tensor_model_parallel = False
                if op.tensor_parallel_mode == "column":
                    tp.mark_parallel_param(param, 0)
                # A row-parallel bias under sequence parallelism gets a partial gradient
                # on each rank; like TE, mark it for the framework's all-reduce.
                param.sequence_parallel = op.sequence_parallel and op.tensor_parallel_mode == "row"
                module.register_parameter(pname, param)
        elif self.split is None:
            module.register_parameter(self.prefix + "bias", None)

    def initialize(self, module, init_method) -> None:
        def init_fn(w):
            if init_method is not None:
                init_method(w)
            else:
                torch.nn.init.normal_(w, mean=0.0, std=_DEFAULT_INIT_STD)

        for w in self.weights(module):
            initialize_weight(w, init_fn)
        with torch.no_grad():
            for b in self.biases(module):
                b.zero_()
        if self.fp8_init.enabled:  # weight slot 1 of BasicLinear's forward quantizers
            quantize_weights(module, [(name, self.op, 1) for name in self._weight_names], self.fp8_init)

    def share_storage(self, module) -> None:
        """Make split parameters views of one storage again, values kept (torch gives each parameter its
        own storage when it deep-copies a module or moves it to another device or dtype; the forward would
        then concatenate them into a copy, and save that copy for backward, at every step)."""
        if self.split is None:
            return
        for params in (self.weights(module), self.biases(module)):
            # Plain tensors only: a sharded (DTensor) or quantized parameter keeps its own layout.
            if (len(params) < 2
                    or not all(isinstance(p, torch.nn.Parameter) and type(p.data) is torch.Tensor for p in params)
                    or adjacent_in_one_storage(params)):
                continue
            with torch.no_grad():
                full = torch.cat([p.detach() for p in params])
            start = 0
            for p in params:
                p.data = full[start:start + p.shape[0]]
                start += p.shape[0]

    def weights(self, module):
        return [getattr(module, n) for n in self._weight_names]

    def biases(self, module):
        return [getattr(module, n) for n in self._bias_names] if self.use_bias else []

    def full_weight(self, module) -> torch.Tensor:
        if self.split is None:  # every forward asks: the common case without building lists
            return _param(module, self._weight_names[0])
        return noop_cat(self.weights(module))

    def full_bias(self, module) -> Optional[torch.Tensor]:
        if not self.use_bias:
            return None
        if self.split is None:
            return _param(module, self._bias_names[0])
        return noop_cat(self.biases(module))
