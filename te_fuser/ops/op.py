"""Operation base classes of the fuser (in the spirit of TransformerEngine's pytorch/ops).

A BasicOperation is one step of a chain (linear, bias, activation, ...): it
owns its parameters and FP8 quantizers and implements op_forward/op_backward
on a per-op OperationContext. A FusedOperation is stateless: it runs several
adjacent basic ops in one step (one kernel where possible) using the basic
ops' own parameters, quantizers and contexts.
"""

from typing import List, Optional, Sequence, Tuple

import torch

from ..quantization import (FP8GlobalStateManager, canonical_recipe, is_block_scaled, make_recipe_state,
                            runs_while_tracing)
from ._gemm_kind import require_per_tensor


class OperationContext:
    """What one basic op carries from its forward to its backward.

    Tensors go through save_for_backward() (the fuser hands them to autograd's
    save_for_backward; Float8Tensors are split into buffers + shells) and come
    back as `saved_tensors` in backward. Anything else is set as an attribute.
    clear() drops every attribute once backward is done with them.

    The fuser sets input_requires_grad and params_require_grad (one flag per
    op_params() entry, all False under torch.no_grad) before op_forward, and
    autocast_dtype: torch.autocast's dtype, which the op computes in and casts
    its parameters to (te_fuser.amp), or None outside autocast.
    """

    autocast_dtype = None

    def __init__(self):
        self.to_save: Tuple = ()
        self.saved_tensors: Optional[Tuple] = None

    def save_for_backward(self, *objs) -> None:
        self.to_save = objs

    def clear(self) -> None:
        self.__dict__.clear()


class FusibleOperation(torch.nn.Module):
    """What the fuser runs, a basic op or a fusion of several: both give `basic_ops` and
    fuser_forward / fuser_backward (TE's common base class of the two)."""


class BasicOperation(FusibleOperation):
    """One op of a chain: parameters, FP8 quantizers, op_forward and op_backward.

    Quantizers: num_forward_quantizers / num_backward_quantizers per op, made
    from a recipe state while FP8 is on (setup_fp8), else none.
    """

    num_forward_quantizers = 0
    num_backward_quantizers = 0
    # Whether the op runs under the block-scaled recipes (MXFP8BlockScaling, Float8BlockScaling).
    supports_block_scaling = False
    num_extra_inputs = 0  # tensors the op takes besides its input (see fuser.py)
    num_extra_outputs = 0  # tensors the op returns besides its output (see fuser.py)

    def __init__(self):
        super().__init__()
        self._fp8_recipe = None
        self._fp8_states = None  # (forward state, backward state) for the current recipe
        self._fp8_enabled = False
        self._forward_quantizers: List = []
        self._backward_quantizers: List = []

    def forward(self, input_: torch.Tensor, *extra_inputs: torch.Tensor, **kwargs) -> torch.Tensor:
        """Called on its own (outside a Sequential), a basic op runs through a fuser of one op."""
        self._ensure_own_fuser()
        return self.__dict__["_own_fuser"](input_, [kwargs], extra_inputs=extra_inputs)

    @runs_while_tracing  # a fuser made in the graph would be new at each call: one compilation per call
    def _ensure_own_fuser(self) -> None:
        if "_own_fuser" not in self.__dict__:
            from .fuser import OperationFuser  # the fuser module imports this one

            self.__dict__["_own_fuser"] = OperationFuser([self])

    # -- the fuser's view: a basic op is a fusion of one ---------------------------------
    @property
    def basic_ops(self) -> Tuple["BasicOperation", ...]:
        return (self,)

    def fuser_forward(self, ctxs, input_, prev_op_grad_output_quantizer, next_op_input_quantizer, kwargs_list):
        return self.op_forward(ctxs[0], input_, prev_op_grad_output_quantizer, next_op_input_quantizer,
                               **kwargs_list[0])

    def fuser_backward(self, ctxs, grad_output):
        grad_input, param_grads = self.op_backward(ctxs[0], grad_output)
        return grad_input, [param_grads]

    # -- what subclasses implement ------------------------------------------------------
    def op_forward(self, ctx: OperationContext, input_, prev_op_grad_output_quantizer,
                   next_op_input_quantizer, **kwargs):
        raise NotImplementedError

    def op_backward(self, ctx: OperationContext, grad_output):
        """(grad_input, tuple of grads of op_params(), in order)."""
        raise NotImplementedError

    def onnx_forward(self, input_, *extra_inputs, **kwargs):
        """(output, extra outputs) under te_fuser.export.onnx_export(True): see ops/_onnx_forward.py."""
        del input_, extra_inputs, kwargs
        raise NotImplementedError(f"te_fuser's {type(self).__name__} op has no ONNX export")

    def op_params(self, **kwargs) -> Sequence[torch.Tensor]:
        """The tensors this op trains (its parameters, or those passed in kwargs)."""
        del kwargs
        if not self._parameters:  # an activation's: parameters() costs microseconds on every call
            return ()
        return tuple(self.parameters(recurse=False))

    def input_quantizer(self):
        """The quantizer this op wants its input cast with, or None (input stays high precision)."""
        return None

    def grad_output_quantizer(self):
        """The quantizer this op wants its grad_output cast with, or None."""
        return None

    def configure_quantizers(self, input_requires_grad: bool, params_require_grad: Sequence[bool]) -> None:
        """Set the quantizers' usages (e.g. columnwise data only when a gradient GEMM needs it)."""
        del input_requires_grad, params_require_grad

    def before_traced_forward(self, **kwargs) -> None:
        """Under torch.compile, called by the fuser before its autograd Function with this op's forward
        keywords: state the forward writes goes here (a write inside the traced Function is a side effect
        after which dynamo cannot hand saved FP8 buffers to the backward)."""
        del kwargs

    # -- FP8 recipe state ---------------------------------------------------------------
    @property
    def fp8_enabled(self) -> bool:
        return self._fp8_enabled

    def setup_fp8(self, enabled: bool, recipe, group, device) -> None:
        """Called by the fuser before every forward: fresh quantizers from the recipe state."""
        # Written into __dict__: these are plain Python values, and Module.__setattr__ (which looks
        # for parameters, buffers and submodules first) would cost microseconds per op and forward.
        attrs = self.__dict__
        attrs["_fp8_enabled"] = bool(enabled) and (self.num_forward_quantizers + self.num_backward_quantizers) > 0
        if not self._fp8_enabled:
            attrs["_forward_quantizers"], attrs["_backward_quantizers"] = [], []
            return
        if is_block_scaled(recipe) and not self.supports_block_scaling:
            raise NotImplementedError(f"te_fuser's {type(self).__name__} does not run under {type(recipe).__name__} "
                                      "yet (Linear does); use DelayedScaling or Float8CurrentScaling for it")
        self._ensure_fp8_states(recipe, device)
        attrs["_forward_quantizers"] = self._fp8_states[0].quantizers(group) if self.num_forward_quantizers else []
        attrs["_backward_quantizers"] = self._fp8_states[1].quantizers(group) if self.num_backward_quantizers else []
        if recipe.custom() and not self.supports_block_scaling:
            require_per_tensor(type(self).__name__, self._fp8_states)

    @runs_while_tracing
    def _ensure_fp8_states(self, recipe, device) -> None:
        if self._fp8_states is None or (self._fp8_recipe is not recipe and self._fp8_recipe != recipe):
            self._fp8_recipe = recipe
            self._fp8_states = (make_recipe_state(recipe, self.num_forward_quantizers, True, device),
                                make_recipe_state(recipe, self.num_backward_quantizers, False, device))
        for state in self._fp8_states:
            if hasattr(state, "amax") and state.amax.device != torch.device(device):
                state.to(device)  # the module moved: its scaling state follows

    def get_quantizer(self, mode: str, index: int):
        """TE's BasicOperation.get_quantizer: quantizer `index` of this op's "forward" or "backward" recipe
        state, which is made first if the op has none (for the innermost fp8_autocast's recipe, TE's default
        DelayedScaling outside any). A delayed-scaling quantizer's scale and amax are views of the state, so
        it sees every later update."""
        if mode not in ("forward", "backward"):
            raise ValueError(f"get_quantizer: mode must be 'forward' or 'backward', got {mode!r}")
        count = self.num_forward_quantizers if mode == "forward" else self.num_backward_quantizers
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
            raise IndexError(f"get_quantizer: {type(self).__name__} has {count} {mode} quantizer(s), "
                             f"got index {index!r}")
        if self._fp8_states is None:
            self._ensure_fp8_states(canonical_recipe(FP8GlobalStateManager.get_fp8_recipe()), self._state_device())
        return self._fp8_states[0 if mode == "forward" else 1].quantizer(index)

    def forward_quantizer_for_init(self, recipe, device, index: int):
        """Forward quantizer `index` of `recipe`'s state (made if needed), without marking the state for
        an update: what fp8_model_init quantizes a weight with (a rowwise copy of it, which shares its
        scaling tensors, so the forward finds the weight's quantizer in sync)."""
        self._ensure_fp8_states(recipe, device)
        return self._fp8_states[0].quantizer(index)

    def fp8_extra_state(self):
        """The recipe and its scaling state, for a module's get_extra_state (None before FP8 ran)."""
        if self._fp8_states is None:
            return None
        return {"recipe": self._fp8_recipe,
                "forward": self._fp8_states[0].state_dict(),
                "backward": self._fp8_states[1].state_dict()}

    def get_extra_state(self):
        """The FP8 recipe state travels in the state_dict as `_extra_state`, as in TransformerEngine."""
        return self.fp8_extra_state()

    def set_extra_state(self, state) -> None:
        self.load_fp8_extra_state(state, self._state_device())

    def _state_device(self) -> torch.device:
        """Where this op's recipe state goes when nothing says: its parameters' device, else the CPU."""
        param = next(self.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def load_fp8_extra_state(self, state, device) -> None:
        if not state:
            return
        self._fp8_recipe = state["recipe"]
        self._fp8_states = (make_recipe_state(self._fp8_recipe, self.num_forward_quantizers, True, device),
                            make_recipe_state(self._fp8_recipe, self.num_backward_quantizers, False, device))
        self._fp8_states[0].load_state_dict(state["forward"])
        self._fp8_states[1].load_state_dict(state["backward"])


class FusedOperation(FusibleOperation):
    """Several adjacent basic ops run as one step; holds no state of its own.

    Not registered as a submodule of anything (the basic ops are), so it adds
    no parameters or state_dict entries.
    """

    def __init__(self, basic_ops: Sequence[BasicOperation]):
        super().__init__()
        # A plain tuple, so the basic ops are not registered twice.
        object.__setattr__(self, "_basic_ops", tuple(basic_ops))

    @property
    def basic_ops(self) -> Tuple[BasicOperation, ...]:
        return self._basic_ops

    def fuser_forward(self, ctxs, input_, prev_op_grad_output_quantizer, next_op_input_quantizer, kwargs_list):
        raise NotImplementedError(f"{type(self).__name__} is a backward-only fusion")

    def fuser_backward(self, ctxs, grad_output):
        raise NotImplementedError(f"{type(self).__name__} is a forward-only fusion")
