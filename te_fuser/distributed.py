"""TransformerEngine's `transformer_engine.pytorch.distributed` names, on te_fuser's state.

- CudaRNGStatesTracker: named RNG states (TE's / Megatron's model-parallel
  tracker). The states are those of the "device generator": the CUDA
  generator of the current device when CUDA is available, else torch's
  default CPU generator, so it works with a CPU-only torch.
- checkpoint: activation checkpointing with TE's signature; the recompute
  sees the forward's RNG states (default generator and tracker, so dropout
  masks match) and the forward's FP8 scales (te_fuser.checkpoint's replay).
- activation_recompute_forward and its two flags, get_all_rng_states,
  prepare_te_modules_for_fsdp.
- fp8_autocast: TE's module imports it from its fp8 module, and TE's tests
  import it from here; the same object as te_fuser.fp8_autocast.
"""

import contextlib
import warnings
from typing import Callable, Dict, List, Optional

import torch
import torch.utils.checkpoint

from .quantization import FP8GlobalState, _replay, _snapshot, fp8_autocast  # noqa: F401 (TE's import path)

__all__ = ["CudaRNGStatesTracker", "activation_recompute_forward", "checkpoint", "get_all_rng_states",
           "in_fp8_activation_recompute_phase", "is_fp8_activation_recompute_enabled", "prepare_te_modules_for_fsdp",
           "set_all_rng_states", "use_reentrant_activation_recompute"]


# -- the device generator ---------------------------------------------------------------------
def _device_generator() -> torch.Generator:
    if torch.cuda.is_available():
        # current_device() initializes CUDA, which fills default_generators: it must run first.
        index = torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


def _get_rng_state() -> torch.Tensor:
    return _device_generator().get_state()


def _set_rng_state(state: torch.Tensor) -> None:
    _device_generator().set_state(state)


# -- RNG states tracker -----------------------------------------------------------------------
_ALL_ACTIVE_RNG_STATES: Dict[str, torch.Tensor] = {}


def get_all_rng_states() -> Dict[str, torch.Tensor]:
    """The states dict of the tracker that last added a state (TE's global registry)."""
    return _ALL_ACTIVE_RNG_STATES


def set_all_rng_states(states: Dict[str, torch.Tensor]) -> None:
    global _ALL_ACTIVE_RNG_STATES
    _ALL_ACTIVE_RNG_STATES = states


class CudaRNGStatesTracker:
    """Named RNG states: `add(name, seed)` creates one, `fork(name)` runs a block on it.

    Inside `fork`, the device generator (see the module doc) runs from the named
    state; on exit the advanced state is stored back under the name and the
    generator returns to where it was, so code outside the fork sees no change.
    """

    def __init__(self):
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_ = set()

    def reset(self) -> None:
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> Dict[str, torch.Tensor]:
        """A new dict of the current states (the state tensors are never modified in place)."""
        return dict(self.states_)

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise RuntimeError(f"cuda rng state {name} already exists")
        generator = _device_generator()
        previous = generator.get_state()
        generator.manual_seed(int(seed))
        self.states_[name] = generator.get_state()
        generator.set_state(previous)
        set_all_rng_states(self.states_)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"cuda rng state {name} is not added")
        previous = _get_rng_state()
        _set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_rng_state()
            _set_rng_state(previous)


# -- activation recompute flags ------------------------------------------------------------------
_RECOMPUTE = {"enabled": False, "phase": False, "reentrant": True}
_FIRST_MODULE_STACK: List[bool] = []


class activation_recompute_forward(contextlib.ContextDecorator):
    """Marks a checkpointed forward (recompute_phase=False) or its recompute (True).

    It sets the flags read by is_fp8_activation_recompute_enabled() (True under
    FP8 only) and in_fp8_activation_recompute_phase(), and carries the
    is-first-FP8-module flag of the forward over to its recompute, as TE does.
    te_fuser's modules read neither flag: under checkpoint() the recompute's FP8
    state comes from checkpoint's replay of the forward's scales. Code that
    recomputes through this context alone (Megatron's CheckpointWithoutOutput)
    gets no replay, which matters only for delayed scaling (Megatron allows that
    path with stateless recipes only).
    """

    def __init__(self, activation_recompute: bool = False, recompute_phase: bool = False):
        self.activation_recompute = bool(activation_recompute)
        self.recompute_phase = bool(recompute_phase)

    def __enter__(self):
        _RECOMPUTE["enabled"] = self.activation_recompute and FP8GlobalState.is_enabled()
        _RECOMPUTE["phase"] = self.recompute_phase
        if self.activation_recompute and not self.recompute_phase:
            _FIRST_MODULE_STACK.append(FP8GlobalState.is_first_module)
        elif self.activation_recompute and _FIRST_MODULE_STACK:
            FP8GlobalState.is_first_module = _FIRST_MODULE_STACK.pop(0)
        return self

    def __exit__(self, *exc_info):
        _RECOMPUTE["enabled"] = False
        _RECOMPUTE["phase"] = False
        return False


def is_fp8_activation_recompute_enabled() -> bool:
    return _RECOMPUTE["enabled"]


def in_fp8_activation_recompute_phase() -> bool:
    return _RECOMPUTE["phase"]


def use_reentrant_activation_recompute() -> bool:
    """Whether the last checkpoint() call used the reentrant implementation."""
    return _RECOMPUTE["reentrant"]


# -- RNG states of a checkpointed region ------------------------------------------------------------
class _RngFrame:
    """The RNG states a checkpointed forward started from: CPU, device generator, tracker."""

    def __init__(self, get_rng_state_tracker: Optional[Callable]):
        self.get_tracker = get_rng_state_tracker
        self.states = None

    def _current(self):
        tracker = self.get_tracker().get_states() if self.get_tracker is not None else None
        return torch.get_rng_state(), _get_rng_state(), tracker

    def _set(self, states) -> None:
        cpu, device, tracker = states
        torch.set_rng_state(cpu)
        _set_rng_state(device)
        if self.get_tracker is not None:
            self.get_tracker().set_states(tracker)

    @contextlib.contextmanager
    def capture(self):
        self.states = self._current()
        yield

    @contextlib.contextmanager
    def restore(self):
        """Run the block from the captured states, then return to the current ones."""
        current = self._current()
        self._set(self.states)
        try:
            yield
        finally:
            self._set(current)


@contextlib.contextmanager
def _contexts(*managers):
    with contextlib.ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield


# -- reentrant checkpoint -------------------------------------------------------------------------
def _split_for_rank(tensor: torch.Tensor, group) -> torch.Tensor:
    world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    if tensor.numel() % world:
        raise ValueError(f"distribute_saved_activations: the first argument has {tensor.numel()} elements, "
                         f"not divisible by the tensor-parallel group size {world}")
    return tensor.detach().reshape(-1).chunk(world)[rank].clone()


_FINGERPRINT_PARTS = 64


def _check_replicated(tensor: torch.Tensor, group) -> None:
    """ValueError unless every rank of the group holds the same first argument: the float64 sums of 64 equal
    parts of it and its size, compared bit for bit (a sequence-parallel shard, different on each rank, would be
    split and gathered back as a mix of the ranks' values)."""
    flat = tensor.detach().reshape(-1)
    sums = torch.zeros(_FINGERPRINT_PARTS + 1, dtype=torch.float64, device=flat.device)
    for i, part in enumerate(flat.chunk(_FINGERPRINT_PARTS)):
        sums[i] = part.double().sum()
    sums[-1] = flat.numel()
    world = torch.distributed.get_world_size(group)
    gathered = [torch.empty_like(sums) for _ in range(world)]
    torch.distributed.all_gather(gathered, sums, group=group)
    mine = sums.view(torch.int64)
    differing = [r for r, theirs in enumerate(gathered) if not torch.equal(theirs.view(torch.int64), mine)]
    if differing:
        raise ValueError(f"distribute_saved_activations: the first argument differs between the ranks of the "
                         f"tensor-parallel group (this rank's differs from ranks {differing}): it must be "
                         "replicated across the group. A sequence-parallel input is a different shard on each "
                         "rank: checkpoint it with distribute_saved_activations=False")


def _gather_from_ranks(chunk: torch.Tensor, group, shape) -> torch.Tensor:
    world = torch.distributed.get_world_size(group)
    full = torch.empty(chunk.numel() * world, dtype=chunk.dtype, device=chunk.device)
    # all_gather_single is torch >= 2.13's name for all_gather_into_tensor.
    gather = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
    gather(full, chunk, group=group)
    return full.view(shape)


# Switched off only by the memory tests, to show that they catch a frame left on ctx.
_CLEAR_FRAME_AFTER_BACKWARD = True


class _ReentrantCheckpoint(torch.autograd.Function):
    """Runs `function` without keeping its activations; backward recomputes them and backpropagates.

    The frame (function, kwargs, RNG and FP8 snapshots, the split input's shape)
    sits on ctx until backward, which drops it.
    """

    @staticmethod
    def forward(ctx, frame, *args):
        with torch.no_grad(), frame.forward_context(), FP8GlobalState.expecting_backward(frame.backward_expected):
            outputs = frame.function(*args, **frame.kwargs)
        if frame.tp_group is not None:
            # Keep only this rank's 1-D chunk of the first argument until backward.
            _check_replicated(args[0], frame.tp_group)
            frame.input_shape = args[0].shape
            args[0].data = _split_for_rank(args[0], frame.tp_group)
        ctx.frame = frame
        ctx.non_tensors = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*[a if torch.is_tensor(a) else None for a in args])
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("te_fuser.distributed.checkpoint with use_reentrant=True does not work with "
                               "torch.autograd.grad(); use .backward() or use_reentrant=False")
        frame, non_tensors = ctx.frame, ctx.non_tensors
        if _CLEAR_FRAME_AFTER_BACKWARD:
            ctx.frame = ctx.non_tensors = None  # nothing of the forward outlives this backward
        inputs = [t if t is not None else a for t, a in zip(ctx.saved_tensors, non_tensors)]
        if frame.tp_group is not None:
            inputs[0].data = _gather_from_ranks(inputs[0].data, frame.tp_group, frame.input_shape)
        detached = [a.detach().requires_grad_(a.requires_grad) if torch.is_tensor(a) else a for a in inputs]
        with torch.enable_grad(), frame.recompute_context():
            outputs = frame.function(*detached, **frame.kwargs)
        outputs = (outputs,) if torch.is_tensor(outputs) else tuple(outputs)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if torch.is_tensor(o) and o.requires_grad]
        if not pairs:
            raise RuntimeError("none of the checkpointed function's outputs requires grad")
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None,) + tuple(a.grad if torch.is_tensor(a) else None for a in detached)


class _CheckpointFrame:
    """What a checkpointed call needs again at recompute time."""

    def __init__(self, function, kwargs, get_rng_state_tracker, tp_group, context_fn):
        self.function, self.kwargs, self.tp_group = function, kwargs, tp_group
        self.rng = _RngFrame(get_rng_state_tracker)
        self.user_forward, self.user_recompute = context_fn()
        self.fp8 = _snapshot()
        # torch.autocast settings of the forward, re-entered for the recompute.
        self.autocast = [(device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                         for device in ("cpu", "cuda") if device == "cpu" or torch.cuda.is_available()]
        self.input_shape = None
        self.backward_expected = False  # whether the reentrant Function will be differentiated (checkpoint sets it)

    def forward_context(self):
        return _contexts(self.rng.capture(), self.user_forward,
                         activation_recompute_forward(activation_recompute=True, recompute_phase=False))

    def recompute_context(self):
        autocasts = [torch.autocast(device, enabled=enabled, dtype=dtype) for device, enabled, dtype in self.autocast]
        return _contexts(self.rng.restore(), *autocasts, self.user_recompute, _replay(self.fp8),
                         activation_recompute_forward(activation_recompute=True, recompute_phase=True))


def _noop_context_fn():
    return contextlib.nullcontext(), contextlib.nullcontext()


def checkpoint(function: Callable, *args, distribute_saved_activations: bool = False,
               get_rng_state_tracker: Optional[Callable] = None, tp_group=None, use_reentrant: bool = True,
               **kwargs):
    """Checkpoint `function(*args, **kwargs)`: keep its inputs, recompute its activations in backward.

    The keyword arguments named in the signature belong to checkpoint; the
    others go to `function` (as do `context_fn`, `determinism_check` and
    `debug`, which go to torch.utils.checkpoint, as TE passes them).

    The recompute runs from the forward's RNG states -- torch's CPU generator,
    the device generator, and the states of `get_rng_state_tracker()` -- so
    dropout draws the same masks, and in the forward's FP8 state (the forward's
    autocast settings and scales, recording no amax).

    use_reentrant=True (TE's default) runs an autograd Function that keeps the
    inputs; with distribute_saved_activations=True and a process group
    (tp_group, else the default group) it keeps only this rank's 1-D chunk of
    the first argument and all-gathers it before the recompute; that argument
    must be the same on every rank of the group (ValueError otherwise: a
    sequence-parallel shard cannot be distributed). Without an
    initialized process group distribute_saved_activations does nothing.
    use_reentrant=False runs torch's non-reentrant checkpoint (there, as in TE,
    distribute_saved_activations has no effect).
    """
    if not callable(function):
        raise TypeError(f"function must be callable, got {type(function).__name__}")
    context_fn = kwargs.pop("context_fn", _noop_context_fn)
    determinism_check = kwargs.pop("determinism_check", "default")
    debug = kwargs.pop("debug", False)
    _RECOMPUTE["reentrant"] = bool(use_reentrant)
    group = None
    if distribute_saved_activations and torch.distributed.is_available() and torch.distributed.is_initialized():
        group = tp_group if tp_group is not None else torch.distributed.GroupMember.WORLD

    if use_reentrant:
        if determinism_check != "default" or debug:
            raise ValueError("determinism_check and debug need use_reentrant=False")
        frame = _CheckpointFrame(function, kwargs, get_rng_state_tracker, group, context_fn)
        # The Function's forward runs without grad; it is differentiated when an input requires grad.
        frame.backward_expected = torch.is_grad_enabled() and any(torch.is_tensor(a) and a.requires_grad for a in args)
        if group is not None and not (args and torch.is_tensor(args[0])):
            raise TypeError("distribute_saved_activations needs a tensor as the first argument")
        return _ReentrantCheckpoint.apply(frame, *args)

    if group is not None:
        warnings.warn("distribute_saved_activations has no effect with use_reentrant=False", stacklevel=2)

    def contexts():
        frame = _CheckpointFrame(function, kwargs, get_rng_state_tracker, None, context_fn)
        return frame.forward_context(), frame.recompute_context()

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=contexts,
                                             determinism_check=determinism_check, debug=debug, **kwargs)


# -- FSDP ----------------------------------------------------------------------------------------
def prepare_te_modules_for_fsdp(fsdp_root: torch.nn.Module) -> None:
    """Check an FSDP-wrapped model before training; te_fuser needs nothing more.

    TE calls this to hand FSDP's process group to its modules, which shard the
    FP8 weight copies and saved activations FSDP cannot see. te_fuser modules
    keep no such tensors (FP8 weights of fp8_model_init are the parameters
    themselves; activations are saved through autograd), so there is nothing to
    shard and no group is recorded. This raises TypeError unless fsdp_root is
    wrapped by FSDP1 (FullyShardedDataParallel) or FSDP2 (fully_shard).
    """
    import torch.distributed.fsdp as fsdp

    wrappers = tuple(getattr(fsdp, name) for name in ("FullyShardedDataParallel", "FSDPModule") if hasattr(fsdp, name))
    if not isinstance(fsdp_root, wrappers):
        raise TypeError("prepare_te_modules_for_fsdp: fsdp_root must be wrapped by FullyShardedDataParallel "
                        f"or fully_shard, got {type(fsdp_root).__name__}")
