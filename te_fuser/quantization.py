"""FP8 global state: autocast / fp8_autocast, quantized_model_init, and the recipe states they drive.

Inside autocast, te_fuser modules take their quantizers from a recipe state. Delayed-scaling states
record amaxes while tensors are cast, then the recorded amaxes are all-reduced (MAX) over the amax
reduction group, when one is given, and the scales are updated, at TransformerEngine 2.6's times: the
forward (input and weight) states when the outermost context exits, the backward (gradient) states at
the end of the backward of the context's first module, the last backward of its graph to run. With
several forwards before their backwards (pipeline schedules) each backward then updates, as in TE.
That first module claims the update in its forward (claim_backward_update): an op-fuser chain run
eagerly with a graph to differentiate. Where no module claims it (no graph, or under torch.compile,
whose backward runs no Python), the exit updates the backward states too, as before the backward
that records into them: the next backward casts with the same scales either way.

FP8GlobalStateManager answers TE's global-state API from this state, CUDA-graph methods included:
add_fp8_tensors_to_global_buffer marks a module's delayed-scaling states for the next update (what a
graph replay, which runs no module code, needs), and the skip-weight-update flag is kept in a
one-element tensor, as TE keeps it (te_fuser's kernels do not read it: te_fuser.make_graphed_callables
captures a first-microbatch and a cached-weight forward instead).

FP8 availability: te_fuser runs FP8 on the CPU always (quantization kernels in C, GEMMs emulated
exactly by dequantizing); on CUDA its GEMMs use torch._scaled_mm, which needs compute capability 8.9
or newer.
"""

import contextlib
import dataclasses
import weakref
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.utils.checkpoint

from .kernels import fp8 as fp8_kernels
from .tensor.float8_blockwise_tensor import Float8BlockQuantizer
from .te_dtype import DType, te_dtype
from .tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer
from .tensor.mxfp8_tensor import MXFP8Quantizer
from .tensor.nvfp4_tensor import NVFP4Quantizer
from .tensor.quantized_tensor import Quantizer
from .recipe import (CustomRecipe, DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                     NVFP4BlockScaling, Recipe)


def runs_while_tracing(fn):
    """Mark a function that makes persistent state on first use: FP8 recipe states and their quantizers, the
    fuser's plan and groups.

    Under torch.compile dynamo does not trace it: it runs it as plain Python when it meets it, once per
    compilation (torch.compiler.assume_constant_result), and the graph reads what it made. Made inside the
    graph, scaling tensors would be graph values, which the backward could not record amaxes into, and
    Python objects would be new at each call, so each call would compile again. It must return None, and
    depend only on its arguments and on what it makes (dynamo guards the arguments, not what the function
    reads). Outside torch.compile it is a plain call."""
    return torch.compiler.assume_constant_result(fn)


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
    _live_current_states: "weakref.WeakSet[CurrentScalingState]" = weakref.WeakSet()
    graph_capturing: bool = False  # inside te_fuser.make_graphed_callables (graph.set_capture_start)
    # The outermost context's backward states, for the module that claims their update (made at its entry).
    backward_update: Optional["BackwardUpdate"] = None
    # is_first_microbatch for linear ops called without one: set by make_graphed_callables while a graphed
    # container (one whose forward takes no is_first_microbatch) runs under fp8_weight_caching.
    first_microbatch: Optional[bool] = None
    # Set while te_fuser's reentrant activation checkpoint runs its forward without grad for a backward to come.
    backward_expected: bool = False

    @classmethod
    def forward_has_backward(cls) -> bool:
        """Whether a forward running now will be differentiated, so that the backward states it uses are
        marked for update: grad mode, or a reentrant checkpoint's forward (whose backward is a replay, which
        marks nothing). An evaluation forward (no_grad, inference_mode) leaves them alone, as in TE, whose
        backward states update only at the end of a backward."""
        return torch.is_grad_enabled() or cls.backward_expected

    @classmethod
    @contextlib.contextmanager
    def expecting_backward(cls, expected: bool):
        """backward_expected while the body runs (a reentrant checkpoint's forward)."""
        saved, cls.backward_expected = cls.backward_expected, bool(expected)
        try:
            yield
        finally:
            cls.backward_expected = saved

    @classmethod
    def microbatch_flag(cls, is_first_microbatch: Optional[bool]) -> Optional[bool]:
        """A linear op's is_first_microbatch: the one it was given, else a graphed container pass's."""
        return cls.first_microbatch if is_first_microbatch is None else is_first_microbatch

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
        for state in cls.take_pending(forward):
            state.update()

    @classmethod
    def take_pending(cls, forward=None) -> List["DelayedScalingState"]:
        """Remove and return the states waiting for an update (the forward or backward ones when given)."""
        pending = [s for s in cls._pending if forward is None or s.forward == forward]
        chosen = {id(s) for s in pending}
        cls._pending = [s for s in cls._pending if id(s) not in chosen]
        return pending

    @classmethod
    def claim_backward_update(cls) -> Optional["BackwardUpdate"]:
        """For the first module of an outermost fp8_autocast (TE's is_first_fp8_module, which this clears):
        the object whose run(), at the end of that module's backward, updates the context's backward
        states. None for any later module, outside autocast, in an activation-checkpoint recompute, and
        under torch.compile (the exit updates them then)."""
        holder = cls.backward_update
        if (holder is None or holder.claimed or not cls.is_first_module or not cls._stack or cls._stack[-1].replay
                or torch.compiler.is_compiling()):
            return None
        cls.is_first_module = False
        holder.claimed = True
        return holder

    @classmethod
    def exit_outermost(cls) -> None:
        """The outermost context's exit: update the forward states, and the backward ones unless a module
        claimed them for its backward."""
        holder, cls.backward_update = cls.backward_update, None
        if holder is not None and holder.claimed:
            holder.states = cls.take_pending(forward=False)
            cls.update_pending(forward=True)
        else:
            cls.update_pending()


class BackwardUpdate:
    """The backward states an outermost fp8_autocast marked, updated by run() at the end of the backward of
    the module that claimed them (FP8GlobalState.claim_backward_update). The claiming module's autograd
    context holds it until its backward, then drops it."""

    __slots__ = ("claimed", "states")

    def __init__(self):
        self.claimed = False
        self.states: List["DelayedScalingState"] = []

    def run(self) -> None:
        states, self.states = self.states, []
        for state in states:
            state.update()


_BLOCK_SCALED_RECIPES = (MXFP8BlockScaling, Float8BlockScaling, NVFP4BlockScaling)
_AUTOCAST_RECIPES = (DelayedScaling, Float8CurrentScaling) + _BLOCK_SCALED_RECIPES


# One recipe object per distinct recipe, for torch.compile (canonical_recipe): what makes recipe states runs as
# Python while dynamo traces (runs_while_tracing), and dynamo guards the recipe it is given by identity, so an
# equal recipe made anew each step would compile the graph again each step. A recipe made inside a compiled
# region exists, while dynamo traces it, only as a record of its fields: an equal one made outside the graph
# stands in for it.
# Callables (amax_compute_algo, scaling_factor_compute_algo) cannot be handed to such a function: a recipe
# with them stays as it is, and make_recipe_state refuses it if it was made in the compiled region.
_CANONICAL_RECIPES: dict = {}


@runs_while_tracing
def _make_recipe(key: tuple) -> None:
    _CANONICAL_RECIPES.setdefault(key, _from_key(key))


def _from_key(key: tuple):
    cls, fields = key
    return cls(**{name: _from_key(value) if _is_key(value) else value for name, value in fields})


def _is_key(value) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], type) and \
        dataclasses.is_dataclass(value[0])


def _as_key(obj) -> tuple:
    """(type, its constructor's fields) of a dataclass, nested dataclasses (Float8BlockScaling's QParams and
    MMParams) as keys too: dynamo hands only constants to a runs_while_tracing function, and it takes no frozen
    dataclass for one. Fields the constructor does not take (NVFP4BlockScaling's QParams) are left out."""
    fields = []
    for field in dataclasses.fields(obj):
        if field.init:
            value = getattr(obj, field.name)
            fields.append((field.name, _as_key(value) if dataclasses.is_dataclass(value) else value))
    return type(obj), tuple(fields)


def _recipe_key(recipe):
    """(type, fields) of a recipe, or None when it has callables or unhashable fields."""
    key = _as_key(recipe)
    if any(callable(value) for _, value in key[1]):
        return None
    try:
        hash(key)
    except TypeError:
        return None
    return key


def canonical_recipe(recipe):
    """The recipe object the state-making code receives for `recipe`: one per distinct recipe (recipes are
    frozen, equal stays equal), so that dynamo, which guards those functions' arguments by identity, compiles
    once for equal recipes made anew. fp8_autocast keeps the user's own object (TE's get_fp8_recipe())."""
    key = _recipe_key(recipe)
    if key is None:  # callables or unhashable fields: not interned (the table would keep a qfactory alive)
        return recipe
    if torch.compiler.is_compiling():
        _make_recipe(key)
        return _CANONICAL_RECIPES[key]
    return _EAGER_CANONICAL_RECIPES.setdefault(recipe, recipe)


_EAGER_CANONICAL_RECIPES: dict = {}


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe=None, fp8_group=None):
    """Run te_fuser modules in FP8 (TransformerEngine's name and arguments).

    calibrating=True runs in high precision while still recording amaxes.

    Under torch.compile(fullgraph=True) it may be inside the compiled function (the exit's scale update is
    then part of the graph) or around the compiled module. A compiled backward runs no Python, so a compiled
    module's backward states are updated at the next outermost exit, not at the end of its backward: in a
    plain loop the next backward casts with the same scales as eagerly. When the forwards of several
    microbatches run before their backwards, eager updates after each backward (TE's order); around a
    compiled module the backwards record into the live state and the next exit folds in their maximum;
    inside the compiled function the graph's exit writes the backward state in the forward, and a backward
    records its amax over what that exit left, so only the last backward's amax counts. Keep the context
    around the compiled module for such schedules.
    """
    recipe = fp8_recipe if fp8_recipe is not None else DelayedScaling()
    if not isinstance(recipe, _AUTOCAST_RECIPES + (CustomRecipe,)):
        raise TypeError(f"fp8_recipe must be DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, "
                        f"Float8BlockScaling, NVFP4BlockScaling or CustomRecipe, got {type(recipe).__name__}")
    if torch.compiler.is_compiling():  # a recipe made in the graph is a record of its fields while tracing
        recipe = canonical_recipe(recipe)
    if not FP8GlobalState._stack:
        FP8GlobalState.is_first_module = True
        FP8GlobalState.backward_update = BackwardUpdate()
    FP8GlobalState._stack.append(_Context(bool(enabled), bool(calibrating), recipe, fp8_group))
    try:
        yield
    finally:
        FP8GlobalState._stack.pop()
        if not FP8GlobalState._stack:
            FP8GlobalState.exit_outermost()


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
    """Build te_fuser modules with quantized weights (TE's context; `recipe` defaults to DelayedScaling()).

    Modules built inside (Linear, LayerNormLinear, LayerNormMLP, GroupedLinear, ops.BasicLinear, and the
    linears of MultiheadAttention / TransformerLayer) hold their linear weights as quantized parameters
    (te_fuser.tensor.utils makes them), quantized from the initialized high-precision values with the
    weight's forward quantizer of the recipe. The quantizer stays attached (`param._quantizer`), so
    copy_, in-place ops, optimizer steps and `cast_master_weights_to_fp8` write through it. Norm
    weights and biases stay high precision, as in TE.

    - DelayedScaling / Float8CurrentScaling: Float8Tensor, one byte per element plus a float32
      scale_inv (delayed: the weight slot's scale, 1 until the first update, as in TE; current: the
      tensor's own amax).
    - MXFP8BlockScaling: MXFP8Tensor with both usages (1x32 and 32x1 blocks: the dgrad's columnwise
      copy cannot be made from the rowwise bytes).
    - Float8BlockScaling: Float8BlockwiseQTensor in 128x128 blocks (w_block_scaling_dim=2), rowwise
      usage only: a 2-D block's columnwise data is its rowwise bytes transposed, made in backward.
    - NVFP4BlockScaling: NVFP4Tensor in 16x16 blocks (its weight QParams' 2D quantization), rowwise only
      for the same reason. With 1-D weight blocks either format keeps both usages.

    Inside autocast with the same recipe the GEMMs read the weight's bytes directly (no 16-bit copy,
    no requantization); outside it the forward uses the dequantized values (a transient
    high-precision copy, as any op on a quantized tensor). Under a recipe of another class (a
    CustomRecipe included) the module's forward raises RuntimeError "Recipe mismatch for '<weight>'",
    as TE's does (te_fuser.module.base.check_weight_recipes). Gradients are high precision, in the
    nominal dtype. Loading a state_dict copies the weights byte for byte with their scales.

    FSDP2 (fully_shard) shards quantized weights along dim 0 and all-gathers their bytes and scales
    (fsdp_pre_all_gather / fsdp_post_all_gather); Float8 ranks must agree on each weight's scale, as
    they do when the weights were quantized before sharding. torch.compile(fullgraph=True) trains FP8
    weights bitwise like eager (tests/test_compile_fp8.py). Not supported: parameters_split with
    quantized weights (NotImplementedError).

    preserve_high_precision_init_val=True keeps each weight's initial high-precision values on the
    CPU: `param.get_high_precision_init_val()` returns them (reset_parameters() replaces them with its
    new values), `param.clear_high_precision_init_val()` frees them (e.g. once fp32 master weights were
    made from them).
    """
    if recipe is not None and not isinstance(recipe, _AUTOCAST_RECIPES):
        raise TypeError(f"recipe must be DelayedScaling or Float8CurrentScaling or a block-scaled recipe "
                        f"(MXFP8BlockScaling, Float8BlockScaling, NVFP4BlockScaling), got {type(recipe).__name__}")
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


class _TERecipeStateNames:
    """TE's names of what a recipe state is for: `mode` ("forward" / "backward") and `dtype` (TE's DType
    of the format); te_fuser's own are `forward` and `fp8_dtype`."""

    forward: bool
    fp8_dtype: torch.dtype

    @property
    def mode(self) -> str:
        return "forward" if self.forward else "backward"

    @property
    def dtype(self) -> DType:
        return te_dtype(self.fp8_dtype)


_DELAYED_BUFFERS = ("amax_history", "scale", "scale_inv")


def _default_sf_compute(amax: torch.Tensor, scale: torch.Tensor, fp8_max: float, margin: int) -> torch.Tensor:
    """TE's default scaling factor, with te_fuser's kernel formula (csrc/fp8/fp8_scaling.h): fp8_max / amax
    (FLT_MAX when that overflows) / 2^margin; the old scale where amax is 0 or not finite."""
    # (A scalar / tensor in torch multiplies by the reciprocal: divide a full tensor instead.)
    new = torch.full_like(amax, fp8_max).div(amax).clamp(max=torch.finfo(torch.float32).max)
    new = new / 2.0 ** margin
    return torch.where((amax > 0) & torch.isfinite(amax), new, scale)


def _amax_and_scale_update(amax_history: torch.Tensor, scale: torch.Tensor, fp8_max: float, recipe) -> None:
    """TE's unfused delayed-scaling update, in place, on a history in TE's layout: amax from the recipe's
    amax_compute_algo (a callable of the history, "max" or "most_recent"), the scale from its
    scaling_factor_compute_algo (or _default_sf_compute), then the history rolled up one row and row 0
    reset, whether or not an amax was recorded (TE's semantics)."""
    if callable(recipe.amax_compute_algo):
        amax = recipe.amax_compute_algo(amax_history.clone())
    elif recipe.amax_compute_algo == "max":
        amax = amax_history.amax(dim=0)
    else:
        amax = amax_history[0].clone()
    if recipe.scaling_factor_compute_algo is not None:
        new = recipe.scaling_factor_compute_algo(amax, scale.clone(), fp8_max, recipe)
    else:
        new = _default_sf_compute(amax, scale, fp8_max, recipe.margin)
    new = torch.as_tensor(new, dtype=torch.float32, device=scale.device)
    if new.shape != scale.shape:
        raise ValueError(f"scaling_factor_compute_algo returned shape {tuple(new.shape)}, "
                         f"expected {tuple(scale.shape)}")
    amax_history.copy_(torch.roll(amax_history, -1, 0))
    amax_history[0].zero_()
    scale.copy_(new)


class DelayedScalingState(_TERecipeStateNames):
    """Scaling state of `num_quantizers` tensors that share a delayed-scaling recipe, in TransformerEngine's
    layout: a module's `fp8_meta["scaling_fwd"]` / `["scaling_bwd"]` are these objects, their tensors the
    ones te_fuser casts with and updates.

    Buffers, float32 whatever torch's default dtype: amax_history (history_len, n), row 0 the amaxes
    recorded since the last update (`amax`, a view of that row), rows 1.. the completed ones, oldest
    first; scale (n); scale_inv (n). `forward=True` uses the recipe's forward format, else its backward
    format; `mode` and `dtype` say so as TE's recipe states do.
    """

    def __init__(self, recipe: DelayedScaling, num_quantizers: int, forward: bool = True, device=None):
        self.recipe = recipe
        self.forward = forward
        self.fp8_dtype = recipe.fp8_format.fwd_dtype if forward else recipe.fp8_format.bwd_dtype
        device = torch.device(device) if device is not None else torch.device("cpu")
        f32 = dict(dtype=torch.float32, device=device)
        self.amax_history = torch.zeros(recipe.amax_history_len, num_quantizers, **f32)
        self.scale = torch.ones(num_quantizers, **f32)
        self.scale_inv = torch.ones(num_quantizers, **f32)
        self.group = None
        # quantizers(): views of the buffers above, made with them (under torch.compile, before tracing)
        self._quantizers = [self._make_quantizer(i) for i in range(num_quantizers)]
        FP8GlobalState._live_states.add(self)

    @property
    def amax(self) -> torch.Tensor:
        """The amaxes being recorded: row 0 of amax_history."""
        return self.amax_history[0]

    def quantizers(self, group=None) -> List[Float8Quantizer]:
        """One quantizer per tensor, writing into this state's buffers; marks the state for update (a backward
        state only for a forward that will be differentiated: FP8GlobalState.forward_has_backward).

        The same quantizer objects every call (made once per set of buffers, as TE's modules keep
        theirs): making them cost about 14 us per op and forward. Their scale and amax are views,
        so they see every update; ops set their usages each forward (configure_quantizers)."""
        if self.group is not group:
            self.group = group
        if self.forward or FP8GlobalState.forward_has_backward():
            FP8GlobalState.mark_pending(self)
        return list(self._quantizers)

    def quantizer(self, i: int) -> Float8Quantizer:
        """Tensor i's quantizer, without marking the state for update."""
        return self._quantizers[i]

    def _make_quantizer(self, i: int) -> Float8Quantizer:
        """A rowwise quantizer of views of tensor i's scale and amax slots."""
        quantizer = Float8Quantizer(self.scale[i:i + 1], self.amax[i:i + 1], self.fp8_dtype, columnwise=False)
        quantizer._slot = (self.scale, self.amax_history, i)
        return quantizer

    def update(self) -> None:
        """All-reduce the recorded amaxes over the group (if any), update the scales and roll the history."""
        if self.group is not None and self.recipe.reduce_amax and torch.distributed.is_initialized():
            torch.distributed.all_reduce(self.amax, op=torch.distributed.ReduceOp.MAX, group=self.group)
        if callable(self.recipe.amax_compute_algo) or self.recipe.scaling_factor_compute_algo is not None:
            self._update_with_callables()
            return
        fp8_kernels.delayed_scaling_update(self.amax_history, self.scale, self.scale_inv,
                                           fp8_kernels.fp8_max(self.fp8_dtype), self.recipe.margin,
                                           self.recipe.amax_compute_algo)

    def _update_with_callables(self) -> None:
        """The update with the recipe's amax_compute_algo / scaling_factor_compute_algo callables."""
        _amax_and_scale_update(self.amax_history, self.scale, fp8_kernels.fp8_max(self.fp8_dtype), self.recipe)
        self.scale_inv.copy_(torch.reciprocal(self.scale))

    def to(self, device) -> "DelayedScalingState":
        for name in _DELAYED_BUFFERS:
            setattr(self, name, getattr(self, name).to(device))
        # The old quantizers viewed the old buffers.
        self._quantizers = [self._make_quantizer(i) for i in range(self.amax.numel())]
        return self

    def state_dict(self) -> dict:
        return {name: getattr(self, name).detach().cpu().clone() for name in _DELAYED_BUFFERS}

    def load_state_dict(self, state: dict) -> None:
        """Load state_dict()'s tensors; a state saved before te_fuser kept TE's layout (its `amax` apart,
        the completed amaxes newest first) is converted, keeping every future scale the same."""
        if "amax" in state and "amax_history" in state:
            old = state["amax_history"]
            state = {**state, "amax_history": torch.cat([state["amax"].reshape(1, -1).to(old), old[:-1].flip(0)])}
        for name in _DELAYED_BUFFERS:
            if name not in state:
                raise KeyError(f"FP8 recipe state is missing '{name}'")
            mine, theirs = getattr(self, name), state[name]
            if tuple(theirs.shape) != tuple(mine.shape):
                raise ValueError(f"FP8 recipe state '{name}' has shape {tuple(theirs.shape)}, "
                                 f"this module expects {tuple(mine.shape)}")
            mine.copy_(theirs)


class CurrentScalingState(_TERecipeStateNames):
    """Current scaling needs no history: one quantizer per tensor, each casting with that tensor's own amax.

    The quantizers are made once, with the state (as DelayedScalingState's): under torch.compile they
    are made before tracing, so the amax and scale each keeps of its last call are tensors the graph
    writes as inputs, also in the backward."""

    def __init__(self, recipe: Float8CurrentScaling, num_quantizers: int, forward: bool = True, device=None):
        self.recipe = recipe
        self.forward = forward
        self.fp8_dtype = recipe.fp8_format.fwd_dtype if forward else recipe.fp8_format.bwd_dtype
        self.num_quantizers = num_quantizers
        self.device = device
        self._quantizers = [self._make_quantizer(i) for i in range(num_quantizers)]
        FP8GlobalState._live_current_states.add(self)

    def quantizers(self, group=None) -> List[Float8CurrentScalingQuantizer]:
        del group  # each tensor's own amax: nothing to reduce
        return list(self._quantizers)

    def quantizer(self, i: int) -> Float8CurrentScalingQuantizer:
        """Tensor i's quantizer."""
        return self._quantizers[i]

    def _make_quantizer(self, i: int) -> Float8CurrentScalingQuantizer:
        del i  # all are alike: each casts with its tensor's own amax
        return Float8CurrentScalingQuantizer(self.fp8_dtype, device=self.device, columnwise=False,
                                             force_pow_2_scales=self.recipe.force_pow_2_scales,
                                             amax_epsilon=self.recipe.amax_epsilon)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        del state


class BlockScalingState:
    """The block-scaled recipes keep no state: fresh quantizers per tensor, by role.

    Forward slots alternate input, weight (a linear op's layout); backward slots are gradients. Under
    Float8BlockScaling each role takes its QParams and block dimension from the recipe (TE's
    Float8BlockScalingRecipeState), under NVFP4BlockScaling its fp4 QParams (TE's NVFP4BlockScalingRecipeState)."""

    def __init__(self, recipe, num_quantizers: int, forward: bool = True, device=None):
        self.recipe = recipe
        self.forward = forward
        self.fp8_dtype = recipe.fp8_format.fwd_dtype if forward else recipe.fp8_format.bwd_dtype
        self.num_quantizers = num_quantizers
        del device  # the quantizers hold no tensors

    def quantizers(self, group=None) -> list:
        del group  # each block's own amax: nothing to reduce
        return [self.quantizer(i) for i in range(self.num_quantizers)]

    def quantizer(self, i: int):
        if isinstance(self.recipe, MXFP8BlockScaling):
            return MXFP8Quantizer(self.fp8_dtype)
        recipe = self.recipe
        role = ("weight" if i % 2 else "input") if self.forward else "grad"
        if isinstance(recipe, NVFP4BlockScaling):
            qparams = {"input": recipe.fp4_quant_fwd_inp, "weight": recipe.fp4_quant_fwd_weight,
                       "grad": recipe.fp4_quant_bwd_grad}[role]
            return NVFP4Quantizer(with_rht=qparams.random_hadamard_transform,
                                  with_2d_quantization=qparams.fp4_2d_quantization,
                                  stochastic_rounding=qparams.stochastic_rounding)
        qparams, dim = {"input": (recipe.fp8_quant_fwd_inp, recipe.x_block_scaling_dim),
                        "weight": (recipe.fp8_quant_fwd_weight, recipe.w_block_scaling_dim),
                        "grad": (recipe.fp8_quant_bwd_grad, recipe.grad_block_scaling_dim)}[role]
        return Float8BlockQuantizer(self.fp8_dtype, rowwise=True, columnwise=True, amax_epsilon=qparams.amax_epsilon,
                                    force_pow_2_scales=qparams.power_2_scale, block_scaling_dim=dim)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        del state


class CustomRecipeRole(str):
    """A tensor role handed to a CustomRecipe's factory: TE 2.9's string ("linear_input", ...), carrying
    later TE's QuantizerRole fields (module_type, tensor_type, name) for factories written for those."""

    module_type: str
    tensor_type: str
    name: str

    def __new__(cls, tensor_type: str):
        role = super().__new__(cls, f"linear_{tensor_type}")
        role.module_type, role.tensor_type, role.name = "linear", tensor_type, ""
        return role

    def __reduce__(self):  # __new__ takes the tensor type, not the string
        return CustomRecipeRole, (self.tensor_type,)


class CustomRecipeState:
    """The quantizers a CustomRecipe's factory returns, one per slot, asked for once, when the state is
    made (TE's CustomRecipeState; te_fuser's ops make their states when the recipe changes).

    tensor_types names the slots ("output", "grad_input", ...); by default te_fuser's linear layout:
    forward slots alternate input, weight; backward slots are grad_output."""

    def __init__(self, recipe: CustomRecipe, *, mode: str, num_quantizers: int = 1, device=None,
                 tensor_types: Optional[List[str]] = None):
        if mode not in ("forward", "backward"):
            raise ValueError(f"mode must be 'forward' or 'backward', got {mode!r}")
        if tensor_types is None:
            tensor_types = [("input", "weight")[i % 2] if mode == "forward" else "grad_output"
                            for i in range(num_quantizers)]
        if len(tensor_types) != num_quantizers:
            raise ValueError(f"tensor_types names {len(tensor_types)} slots, num_quantizers is {num_quantizers}")
        self.recipe = recipe
        self.mode = mode
        self.forward = mode == "forward"
        self.num_quantizers = num_quantizers
        self.device = device
        self.roles = [CustomRecipeRole(tensor_type) for tensor_type in tensor_types]
        self._slots = [self._ask(role) for role in self.roles]

    def _ask(self, role: CustomRecipeRole) -> Quantizer:
        quantizer = self.recipe.qfactory(role)
        if not isinstance(quantizer, Quantizer):
            raise TypeError(f"CustomRecipe's qfactory returned {type(quantizer).__name__} for role {role!r}; "
                            "it must return a te_fuser quantizer (e.g. Float8CurrentScalingQuantizer)")
        return quantizer

    def make_quantizers(self) -> list:
        """TE's method: the slots' quantizers."""
        return list(self._slots)

    def quantizers(self, group=None) -> list:
        del group  # the factory's quantizers reduce amaxes themselves, if at all
        return list(self._slots)

    def quantizer(self, i: int):
        return self._slots[i]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        del state


def recipe_state_tensors() -> List[torch.Tensor]:
    """The tensors of every live FP8 scaling state: delayed scaling's amax history, scale and scale_inv, and
    each current-scaling quantizer's amax and scale. They persist from step to step (a graph that references
    them holds no memory of its own: te_fuser.memory.audit_autograd's `persistent`)."""
    tensors = [getattr(state, name) for state in list(FP8GlobalState._live_states) for name in _DELAYED_BUFFERS]
    for state in list(FP8GlobalState._live_current_states):
        tensors += [t for quantizer in state._quantizers for t in (quantizer.amax, quantizer.scale)]
    return tensors


def make_recipe_state(recipe, num_quantizers: int, forward: bool = True, device=None, tensor_types=None):
    """The state type that goes with a recipe. tensor_types: what the slots hold ("output", "grad_input",
    ...), which only a CustomRecipe's factory is told."""
    if isinstance(recipe, Recipe) and dataclasses.is_dataclass(recipe) and any(
            field.name not in vars(recipe) for field in dataclasses.fields(recipe)):
        raise TypeError(f"fp8_recipe: this {type(recipe).__name__} was made inside a torch.compile'd function "
                        "with callable fields (amax_compute_algo / scaling_factor_compute_algo); make it outside "
                        "the compiled function")
    if isinstance(recipe, DelayedScaling):
        return DelayedScalingState(recipe, num_quantizers, forward, device)
    if isinstance(recipe, Float8CurrentScaling):
        return CurrentScalingState(recipe, num_quantizers, forward, device)
    if isinstance(recipe, _BLOCK_SCALED_RECIPES):
        return BlockScalingState(recipe, num_quantizers, forward, device)
    if isinstance(recipe, CustomRecipe):
        return CustomRecipeState(recipe, mode="forward" if forward else "backward", num_quantizers=num_quantizers,
                                 device=device, tensor_types=tensor_types)
    raise TypeError(f"unknown FP8 recipe {type(recipe).__name__}")


def is_block_scaled(recipe) -> bool:
    """Whether a recipe scales blocks rather than whole tensors (MXFP8, Float8 block scaling, NVFP4)."""
    return isinstance(recipe, _BLOCK_SCALED_RECIPES)


def check_fp8_support() -> Tuple[bool, str]:
    """(available, reason): always on the CPU; on CUDA when the current GPU has compute capability >= 8.9."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            return False, (f"te_fuser's CUDA FP8 GEMMs need compute capability 8.9+, this GPU has {major}.{minor} "
                           "(FP8 on the CPU is always available)")
    return True, ""


def _block_scaling_support(name: str) -> Tuple[bool, str]:
    """te_fuser's block-scaled kernels run on the CPU; on a CUDA machine the modules' tensors are on the GPU.
    A torch built without CUDA makes no CUDA tensors, whatever torch.cuda is made to answer."""
    if torch.cuda.is_available() and torch.backends.cuda.is_built():
        return False, f"te_fuser runs {name} on the CPU only (no CUDA kernels for it yet)"
    return True, ""


def check_mxfp8_support() -> Tuple[bool, str]:
    return _block_scaling_support("MXFP8 (MXFP8BlockScaling)")


def check_fp8_block_scaling_support() -> Tuple[bool, str]:
    return _block_scaling_support("FP8 block scaling (Float8BlockScaling)")


def check_nvfp4_support() -> Tuple[bool, str]:
    return _block_scaling_support("NVFP4 (NVFP4BlockScaling)")


def get_default_fp8_recipe() -> DelayedScaling:
    return DelayedScaling()


def get_align_size_for_quantization(recipe) -> int:
    """The row alignment a GEMM operand needs under `recipe` (later TE's function): 32 for MXFP8 (its
    block), 128 for NVFP4, 16 for the other FP8 recipes."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a te_fuser.recipe.Recipe, got {type(recipe).__name__}")
    if recipe.mxfp8():
        return 32
    if recipe.nvfp4():
        return 128
    return 16


def get_fp8_torch_dtype(fp8_recipe, fprop_tensor: bool = True) -> torch.dtype:
    return fp8_recipe.fp8_format.fwd_dtype if fprop_tensor else fp8_recipe.fp8_format.bwd_dtype


def get_fp8_max(fp8_recipe, fprop_tensor: bool = True) -> float:
    return fp8_recipe.fp8_format.max_fwd if fprop_tensor else fp8_recipe.fp8_format.max_bwd


class QuantizationState:
    """A live view of te_fuser's FP8 state with the field names of TE's `quantization_state`."""

    @property
    def fp8_enabled(self) -> bool:
        return FP8GlobalState.is_enabled()

    @property
    def fp8_calibration(self) -> bool:
        return FP8GlobalState.is_calibrating()

    @property
    def fp8_recipe(self) -> Optional[Recipe]:
        return FP8GlobalState.get_recipe()

    @property
    def fp8_distributed_group(self):
        return FP8GlobalState.get_group()

    @property
    def autocast_depth(self) -> int:
        return len(FP8GlobalState._stack)

    @property
    def is_first_fp8_module(self) -> bool:
        return FP8GlobalState.is_first_module

    @is_first_fp8_module.setter
    def is_first_fp8_module(self, value: bool) -> None:
        FP8GlobalState.is_first_module = bool(value)

    @property
    def fp8_parameters(self) -> bool:
        return current_init().enabled

    @property
    def high_precision_init_val(self) -> bool:
        return current_init().preserve_high_precision_init_val

    @property
    def fp8_graph_capturing(self) -> bool:
        return FP8GlobalStateManager.fp8_graph_capturing()

    skip_fp8_weight_update_tensor = None  # set_skip_fp8_weight_update_tensor's tensor


class FP8GlobalStateManager:
    """TE's FP8 global state API, answered from te_fuser's fp8_autocast state."""

    quantization_state = QuantizationState()
    _opened_by_set = None  # the context set_fp8_autocast_state opened outside any fp8_autocast

    @classmethod
    def reset(cls) -> None:
        """Forget every fp8_autocast context and pending scale update (for tests and restarts)."""
        FP8GlobalState._stack.clear()
        FP8GlobalState._pending.clear()
        FP8GlobalState.is_first_module = False
        FP8GlobalState.backward_update = None
        FP8GlobalState.graph_capturing = False
        QuantizationState.skip_fp8_weight_update_tensor = None
        cls._opened_by_set = None

    @classmethod
    def is_fp8_available(cls) -> Tuple[bool, str]:
        return check_fp8_support()

    @classmethod
    def is_mxfp8_available(cls) -> Tuple[bool, str]:
        return check_mxfp8_support()

    @classmethod
    def is_fp8_block_scaling_available(cls) -> Tuple[bool, str]:
        return check_fp8_block_scaling_support()

    @classmethod
    def is_nvfp4_available(cls) -> Tuple[bool, str]:
        return check_nvfp4_support()

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return FP8GlobalState.is_enabled()

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        return FP8GlobalState.is_calibrating()

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        """True inside quantized_model_init(enabled=True): modules built now get FP8 weights."""
        return current_init().enabled

    @classmethod
    def with_high_precision_init_val(cls) -> bool:
        return current_init().preserve_high_precision_init_val

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        """Inside te_fuser.make_graphed_callables, or while the current CUDA stream is capturing."""
        return FP8GlobalState.graph_capturing or (torch.cuda.is_available()
                                                  and torch.cuda.is_current_stream_capturing())

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        """True once per outermost fp8_autocast: the first call inside it; later calls give False."""
        first = FP8GlobalState.is_first_module
        FP8GlobalState.is_first_module = False
        return first

    @classmethod
    def get_fp8_recipe(cls):
        """The innermost fp8_autocast's recipe; TE's default DelayedScaling() outside any."""
        recipe = FP8GlobalState.get_recipe()
        return recipe if recipe is not None else get_default_fp8_recipe()

    @classmethod
    def get_fp8_group(cls):
        return FP8GlobalState.get_group()

    @staticmethod
    def get_meta_tensor_key(forward: bool = True) -> str:
        """The key of a module's fp8_meta that holds its forward ("scaling_fwd") or backward
        ("scaling_bwd") scaling state."""
        return "scaling_fwd" if forward else "scaling_bwd"

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        """All-reduce (MAX) the recorded amaxes and update the scales of the delayed-scaling states
        waiting for it, forward (input/weight) or backward (gradient) ones; te_fuser does this itself
        when the outermost fp8_autocast exits."""
        FP8GlobalState.update_pending(forward=bool(forward))

    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, fp8_meta) -> None:
        """Mark the delayed-scaling states of a module's fp8_meta ("scaling_fwd", "scaling_bwd") for the
        next update (outermost fp8_autocast exit or reduce_and_update_fp8_tensors), with the amax
        reduction group fp8_meta["fp8_group"] when the dict has one. What a graph replay calls, since it
        runs no module code; a module's own forward marks its states itself. Other recipes: nothing."""
        if not isinstance(fp8_meta, dict):
            raise TypeError(f"fp8_meta must be a module's fp8_meta dict, got {type(fp8_meta).__name__}")
        for key in (cls.get_meta_tensor_key(True), cls.get_meta_tensor_key(False)):
            state = fp8_meta.get(key)
            if isinstance(state, DelayedScalingState):
                if "fp8_group" in fp8_meta:
                    state.group = fp8_meta["fp8_group"]
                FP8GlobalState.mark_pending(state)

    @classmethod
    def set_skip_fp8_weight_update_tensor(cls, skip: bool) -> None:
        """Write `skip` into the one-element float32 flag tensor (made on the current device on first use,
        then updated in place, so a captured graph sees one address). te_fuser's kernels do not read it."""
        flag = QuantizationState.skip_fp8_weight_update_tensor
        if flag is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
            flag = QuantizationState.skip_fp8_weight_update_tensor = torch.empty(1, dtype=torch.float32,
                                                                                 device=device)
        flag.fill_(bool(skip))

    @classmethod
    def get_skip_fp8_weight_update_tensor(cls):
        """The flag tensor set_skip_fp8_weight_update_tensor writes, or None before its first call."""
        return QuantizationState.skip_fp8_weight_update_tensor

    @classmethod
    def get_fp8_autocast_state(cls) -> tuple:
        """TE's tuple: (enabled, calibrating, recipe, group, is_first_fp8_module, fp8_graph_capturing) of
        the innermost fp8_autocast; (False, False, None, None, ...) outside any."""
        return (FP8GlobalState.is_enabled(), FP8GlobalState.is_calibrating(), FP8GlobalState.get_recipe(),
                FP8GlobalState.get_group(), FP8GlobalState.is_first_module, FP8GlobalState.graph_capturing)

    @classmethod
    def set_fp8_autocast_state(cls, fp8_state: tuple) -> None:
        """Set what get_fp8_autocast_state returned: the innermost fp8_autocast takes its settings.
        Outside any, an enabled or calibrating state opens a context (TE's state is global), which
        setting a disabled state closes again; its pending updates wait for the next outermost exit."""
        if not isinstance(fp8_state, tuple) or len(fp8_state) != 6:
            raise ValueError("fp8_state must be the 6-tuple get_fp8_autocast_state returns, got "
                             f"{fp8_state!r}")
        enabled, calibrating, recipe, group, first, capturing = fp8_state
        FP8GlobalState.is_first_module, FP8GlobalState.graph_capturing = bool(first), bool(capturing)
        recipe = recipe if recipe is not None else get_default_fp8_recipe()
        stack = FP8GlobalState._stack
        opened = bool(stack) and stack[-1] is cls._opened_by_set
        if opened and not (enabled or calibrating):
            stack.pop()
            cls._opened_by_set = None
        elif stack:
            stack[-1] = _Context(bool(enabled), bool(calibrating), recipe, group, stack[-1].replay)
            if opened:
                cls._opened_by_set = stack[-1]
        elif enabled or calibrating:
            stack.append(_Context(bool(enabled), bool(calibrating), recipe, group))
            cls._opened_by_set = stack[-1]


__all__ = ["FP8GlobalState", "FP8GlobalStateManager", "QuantizationState", "autocast", "check_fp8_block_scaling_support",
           "check_fp8_support", "check_mxfp8_support", "check_nvfp4_support", "checkpoint", "fp8_autocast",
           "fp8_model_init", "get_align_size_for_quantization", "get_default_fp8_recipe", "get_fp8_max", "get_fp8_torch_dtype", "quantized_model_init"]
