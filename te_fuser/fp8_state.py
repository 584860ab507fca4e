"""fp8_autocast / autocast, and the per-module recipe state they drive.

Inside the context, te_fuser modules take their quantizers from a recipe
state. Delayed-scaling states record amaxes while tensors are cast; when the
outermost context exits, the recorded amaxes are all-reduced (MAX) over the
amax reduction group, when one is given, and the scales are updated.
Backward runs after the context has exited, so backward amaxes are folded in
at the exit of the next context, as in TransformerEngine.
"""

import contextlib
import weakref
from dataclasses import dataclass
from typing import List

import torch
import torch.utils.checkpoint

from .kernels import fp8 as fp8_kernels
from .quantizer import Float8CurrentScalingQuantizer, Float8Quantizer
from .recipe import DelayedScaling, Float8CurrentScaling


@dataclass
class _Context:
    enabled: bool
    calibrating: bool
    recipe: object
    group: object
    replay: bool = False  # an activation-checkpoint recompute: no amax recording, no update


class FP8GlobalState:
    """What the innermost fp8_autocast says, and the states waiting for an update."""

    _stack: List[_Context] = []
    _pending: List["DelayedScalingState"] = []
    # Set when the outermost context is entered; TE's is_first_fp8_module() reads and clears it.
    is_first_module: bool = False
    _live_states: "weakref.WeakSet[DelayedScalingState]" = weakref.WeakSet()

    @classmethod
    def is_enabled(cls) -> bool:
        return bool(cls._stack) and cls._stack[-1].enabled

    @classmethod
    def is_calibrating(cls) -> bool:
        return bool(cls._stack) and cls._stack[-1].calibrating

    @classmethod
    def get_recipe(cls):
        return cls._stack[-1].recipe if cls._stack else None

    @classmethod
    def get_group(cls):
        return cls._stack[-1].group if cls._stack else None

    @classmethod
    def mark_pending(cls, state: "DelayedScalingState") -> None:
        if cls._stack and cls._stack[-1].replay:
            return
        if not any(s is state for s in cls._pending):
            cls._pending.append(state)

    @classmethod
    def update_pending(cls, forward=None) -> None:
        """Update the states waiting for it (only the forward or backward ones when `forward` is given)."""
        pending = [s for s in cls._pending if forward is None or s.forward == forward]
        chosen = {id(s) for s in pending}
        cls._pending = [s for s in cls._pending if id(s) not in chosen]
        for state in pending:
            state.update()


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe=None, fp8_group=None):
    """Run te_fuser modules in FP8 (TransformerEngine's name and arguments).

    calibrating=True runs in high precision while still recording amaxes.
    """
    recipe = fp8_recipe if fp8_recipe is not None else DelayedScaling()
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        raise TypeError(f"fp8_recipe must be DelayedScaling or Float8CurrentScaling, got {type(recipe).__name__}")
    if not FP8GlobalState._stack:
        FP8GlobalState.is_first_module = True
    FP8GlobalState._stack.append(_Context(bool(enabled), bool(calibrating), recipe, fp8_group))
    try:
        yield
    finally:
        FP8GlobalState._stack.pop()
        if not FP8GlobalState._stack:
            FP8GlobalState.update_pending()


def checkpoint(function, *args, **kwargs):
    """Activation checkpointing (non-reentrant) that recomputes in the same FP8 state as the forward.

    The recompute runs during backward, after fp8_autocast has exited and updated
    the delayed scales. To give the same values as the forward, the recompute
    re-enters the forward's autocast settings with the forward's scales and
    records no amax, so it neither changes nor double-counts the scaling state.
    """
    kwargs.pop("use_reentrant", None)

    def context_fn():
        return contextlib.nullcontext(), _replay(_snapshot())

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def _snapshot():
    top = FP8GlobalState._stack[-1] if FP8GlobalState._stack else _Context(False, False, None, None)
    scales = {state: (state.scale.clone(), state.scale_inv.clone())
              for state in list(FP8GlobalState._live_states) if state.forward}
    return top, scales


@contextlib.contextmanager
def _replay(snapshot):
    top, scales = snapshot
    # States missing from the snapshot were created during the checkpointed forward
    # itself, so they cast with their initial scale there.
    forward_scales = dict(scales)
    for state in list(FP8GlobalState._live_states):
        if state.forward and state not in forward_scales:
            forward_scales[state] = (torch.ones_like(state.scale), torch.ones_like(state.scale_inv))
    current = {state: (state.scale.clone(), state.scale_inv.clone(), state.amax.clone()) for state in forward_scales}
    for state, (scale, scale_inv) in forward_scales.items():
        state.scale.copy_(scale)
        state.scale_inv.copy_(scale_inv)
    FP8GlobalState._stack.append(_Context(top.enabled, top.calibrating, top.recipe, top.group, replay=True))
    try:
        yield
    finally:
        FP8GlobalState._stack.pop()
        for state, (scale, scale_inv, amax) in current.items():
            state.scale.copy_(scale)
            state.scale_inv.copy_(scale_inv)
            state.amax.copy_(amax)


def autocast(enabled: bool = True, recipe=None, amax_reduction_group=None):
    """The newer TransformerEngine name for fp8_autocast."""
    return fp8_autocast(enabled=enabled, fp8_recipe=recipe, fp8_group=amax_reduction_group)


class DelayedScalingState:
    """Scaling state of `num_quantizers` tensors that share a delayed-scaling recipe.

    Buffers: amax_history (history_len, n), amax (n), scale (n), scale_inv (n).
    `forward=True` uses the recipe's forward format, else its backward format.
    """

    def __init__(self, recipe: DelayedScaling, num_quantizers: int, forward: bool = True, device=None):
        self.recipe = recipe
        self.forward = forward
        self.fp8_dtype = recipe.fp8_format.fwd_dtype if forward else recipe.fp8_format.bwd_dtype
        device = torch.device(device) if device is not None else torch.device("cpu")
        # float32 whatever torch's default dtype is (Lightning sets it to bf16), as in TE.
        self.amax_history = torch.zeros(recipe.amax_history_len, num_quantizers, device=device, dtype=torch.float32)
        self.amax = torch.zeros(num_quantizers, device=device, dtype=torch.float32)
        self.scale = torch.ones(num_quantizers, device=device, dtype=torch.float32)
        self.scale_inv = torch.ones(num_quantizers, device=device, dtype=torch.float32)
        self.group = None
        self._quantizers = None  # quantizers(), made on first use, views of the buffers above
        FP8GlobalState._live_states.add(self)

    def quantizers(self, group=None) -> List[Float8Quantizer]:
        """One quantizer per tensor, writing into this state's buffers; marks the state for update.

        The same quantizer objects every call (made once per set of buffers, as TE's modules keep
        theirs): making them cost about 14 us per op and forward. Their scale and amax are views,
        so they see every update; ops set their usages each forward (configure_quantizers)."""
        self.group = group
        FP8GlobalState.mark_pending(self)
        if self._quantizers is None:
            self._quantizers = [self.quantizer(i) for i in range(self.amax.numel())]
        return list(self._quantizers)

    def quantizer(self, i: int) -> Float8Quantizer:
        """Tensor i's quantizer (views of its scale and amax slots), without marking the state for update."""
        return Float8Quantizer(self.scale[i:i + 1], self.amax[i:i + 1], self.fp8_dtype)

    def update(self) -> None:
        """All-reduce amaxes over the group (if any), roll the history and update the scales."""
        if self.group is not None and self.recipe.reduce_amax and torch.distributed.is_initialized():
            torch.distributed.all_reduce(self.amax, op=torch.distributed.ReduceOp.MAX, group=self.group)
        if callable(self.recipe.amax_compute_algo) or self.recipe.scaling_factor_compute_algo is not None:
            self._update_with_callables()
            return
        fp8_kernels.delayed_scaling_update(self.amax_history, self.amax, self.scale, self.scale_inv,
                                           fp8_kernels.fp8_max(self.fp8_dtype), self.recipe.margin,
                                           self.recipe.amax_compute_algo)

    def te_amax_history(self) -> torch.Tensor:
        """The history in TE's layout: row 0 the amax being recorded, rows 1.. the last
        amax_history_len - 1 closed steps, oldest first (the same window the update reduces)."""
        return torch.cat([self.amax[None], self.amax_history[:-1].flip(0)])

    def _update_with_callables(self) -> None:
        """The update with the recipe's amax_compute_algo / scaling_factor_compute_algo callables (TE's semantics)."""
        recipe = self.recipe
        te_history = self.te_amax_history()
        if callable(recipe.amax_compute_algo):
            amax = recipe.amax_compute_algo(te_history.clone())
        elif recipe.amax_compute_algo == "max":
            amax = te_history.amax(dim=0)
        else:
            amax = te_history[0].clone()
        fp8_max = fp8_kernels.fp8_max(self.fp8_dtype)
        if recipe.scaling_factor_compute_algo is not None:
            scale = recipe.scaling_factor_compute_algo(amax, self.scale.clone(), fp8_max, recipe)
        else:  # the kernel's formula (csrc/fp8/fp8_scaling.h)
            # (A scalar / tensor in torch multiplies by the reciprocal: divide a full tensor instead.)
            new = torch.full_like(amax, fp8_max).div(amax).clamp(max=torch.finfo(torch.float32).max)
            new = new / 2.0 ** recipe.margin
            scale = torch.where((amax > 0) & torch.isfinite(amax), new, self.scale)
        scale = torch.as_tensor(scale, dtype=torch.float32, device=self.scale.device)
        if scale.shape != self.scale.shape:
            raise ValueError(f"scaling_factor_compute_algo returned shape {tuple(scale.shape)}, "
                             f"expected {tuple(self.scale.shape)}")
        self.amax_history.copy_(torch.cat([self.amax[None], self.amax_history[:-1]]))
        self.scale.copy_(scale)
        self.scale_inv.copy_(torch.reciprocal(self.scale))
        self.amax.zero_()

    def to(self, device) -> "DelayedScalingState":
        for name in ("amax_history", "amax", "scale", "scale_inv"):
            setattr(self, name, getattr(self, name).to(device))
        self._quantizers = None  # they viewed the old buffers
        return self

    def state_dict(self) -> dict:
        return {name: getattr(self, name).detach().cpu().clone()
                for name in ("amax_history", "amax", "scale", "scale_inv")}

    def load_state_dict(self, state: dict) -> None:
        for name in ("amax_history", "amax", "scale", "scale_inv"):
            if name not in state:
                raise KeyError(f"FP8 recipe state is missing '{name}'")
            mine, theirs = getattr(self, name), state[name]
            if tuple(theirs.shape) != tuple(mine.shape):
                raise ValueError(f"FP8 recipe state '{name}' has shape {tuple(theirs.shape)}, "
                                 f"this module expects {tuple(mine.shape)}")
            mine.copy_(theirs)


class CurrentScalingState:
    """Current scaling needs no history: fresh quantizers per tensor."""

    def __init__(self, recipe: Float8CurrentScaling, num_quantizers: int, forward: bool = True, device=None):
        self.recipe = recipe
        self.forward = forward
        self.fp8_dtype = recipe.fp8_format.fwd_dtype if forward else recipe.fp8_format.bwd_dtype
        self.num_quantizers = num_quantizers
        self.device = device

    def quantizers(self, group=None) -> List[Float8CurrentScalingQuantizer]:
        del group  # each tensor's own amax: nothing to reduce
        return [self.quantizer(i) for i in range(self.num_quantizers)]

    def quantizer(self, i: int) -> Float8CurrentScalingQuantizer:
        del i  # every tensor gets a fresh one
        return Float8CurrentScalingQuantizer(self.fp8_dtype, device=self.device,
                                             force_pow_2_scales=self.recipe.force_pow_2_scales,
                                             amax_epsilon=self.recipe.amax_epsilon)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        del state


def make_recipe_state(recipe, num_quantizers: int, forward: bool = True, device=None):
    """The state type that goes with a recipe."""
    if isinstance(recipe, DelayedScaling):
        return DelayedScalingState(recipe, num_quantizers, forward, device)
    if isinstance(recipe, Float8CurrentScaling):
        return CurrentScalingState(recipe, num_quantizers, forward, device)
    raise TypeError(f"unknown FP8 recipe {type(recipe).__name__}")
