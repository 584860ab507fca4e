"""make_graphed_callables: TransformerEngine's CUDA-graph capture of modules, FP8 included (TE's
transformer_engine/pytorch/graph.py, API level 2.6: the same signature, return values and checks).

What a graphed call does, on either device: what the module does when called under its own
outermost `fp8_autocast(fp8_enabled, fp8_calibrating, fp8_recipe, fp8_group)`. Under delayed scaling
that includes TE's updates: at that autocast's exit the forward's amaxes, at the end of the call's
backward the backward's, all-reduced over fp8_group when the recipe reduces them, the scales and
histories updated (on CUDA each update is captured with the pass it ends). The recipe is fixed when the
callables are made; an fp8_autocast around a call changes nothing for it.

Before anything is captured, every forward pass runs num_warmup_iters times, forward and backward
(torch.autograd.grad: no parameter's .grad changes), under that autocast. Afterwards the modules'
FP8 scaling state and the RNG states are put back as they were (TE does the same), so the first
graphed step starts where an eager step would have.

On CUDA the forward (FP8 state update included) and the backward of each pass are captured with
torch.cuda.graph into one memory pool (`pool`, or a new one), in the order they will run: the passes'
forwards, then their backwards in reverse (or as `_order` says). A call copies its inputs into the
sample tensors (the graph's input buffers) and replays; its outputs and input gradients are the graph's
own buffers, which the next replay overwrites (as with TE and torch). The autograd node of a call keeps
no tensor. Parameter gradients are accumulated as usual (copied when .grad is None, so that .grad never
aliases a graph buffer). Under fp8_weight_caching a second forward is captured per callable, with the
cached FP8 weights: `is_first_microbatch=True` replays the one that quantizes them, False the other.
Within one callable, a forward's backward must run before its next forward (with `_order`, each
microbatch has graphs of its own).

On the CPU there are no CUDA graphs: make_graphed_callables runs the warmup and restores the state the
same way, and returns callables with the same interface and checks that run the modules eagerly under
that autocast, with fresh outputs each call. TE scripts that graph their layers run unchanged.

Not supported: _reuse_graph_input_output_buffers=True (NotImplementedError). Dropout under te_fuser's
RNG tracker (get_rng_state_tracker) cannot be captured: its fork sets generator states.
"""

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .distributed import get_all_rng_states
from .quantization import (_AUTOCAST_RECIPES, DelayedScalingState, FP8GlobalState, fp8_autocast,
                           get_default_fp8_recipe)
from .recipe import DelayedScaling

__all__ = ["graph_pool_handle", "is_graph_capturing", "make_graphed_callables", "restore_fp8_tensors",
           "save_fp8_tensors", "set_capture_end", "set_capture_start"]


def set_capture_start() -> None:
    """Mark that make_graphed_callables is running (FP8GlobalStateManager.fp8_graph_capturing reads it)."""
    FP8GlobalState.graph_capturing = True


def set_capture_end() -> None:
    FP8GlobalState.graph_capturing = False


def is_graph_capturing() -> bool:
    return FP8GlobalState.graph_capturing


def graph_pool_handle():
    """A token for a new CUDA graph memory pool (torch.cuda.graph_pool_handle), to pass as `pool`."""
    return torch.cuda.graph_pool_handle()


# -- FP8 scaling state: saved before the warmup, restored after ----------------------------------
def _state_holders(modules):
    """Every object of the modules that may hold scaling states: submodules and the fuser ops they keep
    outside the module tree."""
    for module in modules:
        for sub in module.modules():
            yield sub
            yield from sub.__dict__.get("_ops", ())


def _delayed_states(modules) -> List[DelayedScalingState]:
    found, seen = [], set()

    def visit(value):
        if isinstance(value, DelayedScalingState):
            if id(value) not in seen:
                seen.add(id(value))
                found.append(value)
        elif isinstance(value, (tuple, list)):
            for item in value:
                visit(item)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)

    for holder in _state_holders(modules):
        for value in vars(holder).values():
            visit(value)
    return found


def save_fp8_tensors(modules, fp8_recipe) -> Optional[List[Tuple[DelayedScalingState, Dict[str, torch.Tensor]]]]:
    """Copies of the delayed-scaling states of the modules (None for other recipes, which keep no state)."""
    if not isinstance(fp8_recipe, DelayedScaling):
        return None
    return [(state, {name: getattr(state, name).clone() for name in ("amax_history", "scale", "scale_inv")})
            for state in _delayed_states(modules)]


def restore_fp8_tensors(modules, fp8_tensors) -> None:
    """Put save_fp8_tensors' copies back, in place; a state made since (a first FP8 forward) goes back
    to its initial values (zero history, unit scales), as a fresh module's is."""
    if fp8_tensors is None:
        return
    saved = {id(state): values for state, values in fp8_tensors}
    for state in _delayed_states(modules):
        values = saved.get(id(state))
        if values is None:
            state.amax_history.zero_()
            state.scale.fill_(1.0)
            state.scale_inv.fill_(1.0)
        else:
            for name, value in values.items():
                getattr(state, name).copy_(value)


@contextlib.contextmanager
def _rng_restored(device: torch.device):
    """The device generator and the RNG tracker's states are put back on exit (the warmup's dropout
    draws must not shift the steps that follow)."""
    if device.type == "cuda":
        generator = torch.cuda.default_generators[torch.cuda.current_device() if device.index is None else device.index]
    else:
        generator = torch.default_generator
    state, tracker_states = generator.get_state(), dict(get_all_rng_states())
    try:
        yield
    finally:
        generator.set_state(state)
        current = get_all_rng_states()  # the tracker's own dict: its forks write into it
        current.clear()
        current.update(tracker_states)


@contextlib.contextmanager
def _side_stream(device: torch.device):
    """On CUDA, a stream of its own (as torch's and TE's warmups): lazy initializations happen off the
    stream the captures will order themselves after."""
    if device.type != "cuda":
        yield
        return
    stream, current = torch.cuda.Stream(device), torch.cuda.current_stream(device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        yield
    current.wait_stream(stream)


# -- the plan: which module runs on which sample arguments, in what order -------------------------
@dataclass(eq=False)
class _Pass:
    """One forward pass to graph: a module, its sample arguments, and (fp8_weight_caching) the
    is_first_microbatch it is captured with."""

    module: torch.nn.Module
    args: tuple
    kwargs: dict
    first_microbatch: Optional[bool] = None

    def __post_init__(self):
        # is_first_microbatch is no input: call_kwargs sets it
        self.kwargs_keys = [k for k in self.kwargs if k != "is_first_microbatch"]
        flat_args, _ = tree_flatten(self.args)
        if not all(isinstance(a, torch.Tensor) for a in flat_args):
            raise TypeError("sample_args must hold only tensors (TE's rule), got "
                            f"{[type(a).__name__ for a in flat_args if not isinstance(a, torch.Tensor)]}")
        self.flat_sample = tuple(flat_args) + tuple(tree_flatten([self.kwargs[k] for k in self.kwargs_keys])[0])
        self.inputs = tuple(a for a in self.flat_sample if isinstance(a, torch.Tensor))
        self.params = tuple(self.module.parameters())
        # A container (torch.nn.Sequential of te_fuser modules) takes no is_first_microbatch: its linear ops
        # read the pass's from FP8GlobalState.first_microbatch instead (TE sets a global flag for them too).
        parameters = inspect.signature(self.module.forward).parameters.values()
        self.takes_first_microbatch = any(q.name == "is_first_microbatch" or q.kind is q.VAR_KEYWORD
                                          for q in parameters)

    def call_kwargs(self, kwargs: dict) -> dict:
        """The keyword arguments the module runs with: is_first_microbatch is the pass's (weight caching),
        else the sample's (a graph replays what was captured), else absent."""
        kwargs = dict(kwargs)
        if self.first_microbatch is not None:
            kwargs["is_first_microbatch"] = self.first_microbatch
        elif "is_first_microbatch" in self.kwargs:
            kwargs["is_first_microbatch"] = self.kwargs["is_first_microbatch"]
        else:
            kwargs.pop("is_first_microbatch", None)
        return kwargs

    def flatten_call(self, args, kwargs, weight_caching: bool) -> Tuple[torch.Tensor, ...]:
        """The call's input tensors, checked against the sample: TE's interface, with clear errors."""
        if weight_caching and not isinstance(kwargs.get("is_first_microbatch"), bool):
            raise TypeError("a callable graphed with fp8_weight_caching=True needs the boolean keyword "
                            "argument is_first_microbatch")
        if self.first_microbatch is not None and kwargs["is_first_microbatch"] != self.first_microbatch:
            raise ValueError(f"this forward pass was graphed with is_first_microbatch={self.first_microbatch} "
                             f"(its microbatch in _order), got {kwargs['is_first_microbatch']}")
        for key in self.kwargs_keys:
            if key not in kwargs:
                raise TypeError(f"the graphed callable was made with keyword argument {key!r} in sample_kwargs, "
                                "but the call does not pass it")
        flat = tuple(tree_flatten(args)[0]) + tuple(tree_flatten([kwargs[k] for k in self.kwargs_keys])[0])
        if len(flat) != len(self.flat_sample):
            raise TypeError(f"the graphed callable takes {len(self.flat_sample)} argument leaves (as its sample "
                            f"arguments), got {len(flat)}")
        for i, (got, sample) in enumerate(zip(flat, self.flat_sample)):
            if isinstance(sample, torch.Tensor):
                if not isinstance(got, torch.Tensor) or got.shape != sample.shape or got.dtype != sample.dtype:
                    what = (f"{tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor)
                            else type(got).__name__)
                    raise ValueError(f"argument {i} of the graphed callable must be a tensor of shape "
                                     f"{tuple(sample.shape)} and dtype {sample.dtype} (its sample's), got {what}")
                if got.requires_grad and not sample.requires_grad and torch.is_grad_enabled():
                    raise ValueError(f"argument {i} of the graphed callable requires grad but its sample did not: "
                                     "no backward was graphed for it (pass a sample that requires grad)")
            elif got != sample:
                raise ValueError(f"argument {i} of the graphed callable is not a tensor: it is fixed at its sample "
                                 f"value {sample!r}, got {got!r}")
        return tuple(a for a in flat if isinstance(a, torch.Tensor))


def _as_tuple(value, name: str) -> tuple:
    if isinstance(value, (tuple, list)):
        return tuple(value)
    raise TypeError(f"{name} must be a tuple, got {type(value).__name__}")


def _chunk_layout(order, num_layers_per_chunk, num_callables: int, num_samples: int):
    """(number of microbatches, layers per chunk, first callable of each chunk) of an _order."""
    if not isinstance(order, (list, tuple)) or not order or not all(isinstance(c, int) and c != 0 for c in order):
        raise ValueError(f"_order must be a non-empty list of non-zero chunk numbers (1-based; negative: "
                         f"backward), got {order!r}")
    chunks = max(order)
    microbatches = len(order) // (2 * chunks)
    for chunk in range(1, chunks + 1):
        if order.count(chunk) != microbatches or order.count(-chunk) != microbatches:
            raise ValueError(f"_order must have {microbatches} forward and backward passes of each of its "
                             f"{chunks} chunks, got {order!r}")
    if len(order) != 2 * chunks * microbatches:
        raise ValueError(f"_order has {len(order)} entries, not 2 x {chunks} chunks x {microbatches} microbatches")
    if num_layers_per_chunk is None:
        if num_samples % (chunks * microbatches):
            raise ValueError(f"sample_args has {num_samples} entries, not a multiple of {chunks} chunks x "
                             f"{microbatches} microbatches of _order")
        layers = [num_samples // (chunks * microbatches)] * chunks
    elif isinstance(num_layers_per_chunk, int):
        layers = [num_layers_per_chunk] * chunks
    elif isinstance(num_layers_per_chunk, (list, tuple)) and len(num_layers_per_chunk) == chunks:
        layers = [int(n) for n in num_layers_per_chunk]
    else:
        raise ValueError(f"_num_layers_per_chunk must be an int or a list of {chunks} ints (one per chunk of "
                         f"_order), got {num_layers_per_chunk!r}")
    if sum(layers) != num_callables:
        raise ValueError(f"modules has {num_callables} entries, but _order's chunks have {sum(layers)} layers")
    if num_samples != sum(layers) * microbatches:
        raise ValueError(f"sample_args has {num_samples} entries, _order needs {sum(layers) * microbatches} "
                         f"({sum(layers)} layers x {microbatches} microbatches)")
    firsts = [sum(layers[:c]) for c in range(chunks)]
    return microbatches, layers, firsts


def _plan(modules, sample_args, sample_kwargs, order, num_layers_per_chunk, weight_caching):
    """(passes, events, returned indices): the passes to graph, the capture order as (pass index,
    forward?) pairs, and per returned callable the pass(es) it replays."""
    if order is None:
        if len(sample_args) != len(modules):
            raise ValueError(f"sample_args must have one entry per module ({len(modules)}), got {len(sample_args)}")
        variants = (True, False) if weight_caching else (None,)
        passes = [_Pass(m, _as_tuple(a, "each entry of sample_args"), dict(k), first)
                  for first in variants for m, a, k in zip(modules, sample_args, sample_kwargs)]
        n = len(passes)
        events = [(i, True) for i in range(n)] + [(i, False) for i in reversed(range(n))]
        returned = [[i + v * len(modules) for v in range(len(variants))] for i in range(len(modules))]
        return passes, events, returned
    microbatches, layers, firsts = _chunk_layout(order, num_layers_per_chunk, len(modules), len(sample_args))
    passes = [None] * len(sample_args)
    for chunk, count in enumerate(layers):
        for mb in range(microbatches):
            for layer in range(count):
                idx = firsts[chunk] * microbatches + mb * count + layer
                passes[idx] = _Pass(modules[firsts[chunk] + layer],
                                    _as_tuple(sample_args[idx], "each entry of sample_args"),
                                    dict(sample_kwargs[idx]), (mb == 0) if weight_caching else None)
    events, fwd, bwd = [], [0] * len(layers), [0] * len(layers)
    for c in order:
        chunk = abs(c) - 1
        base = firsts[chunk] * microbatches + (fwd if c > 0 else bwd)[chunk] * layers[chunk]
        ids = [base + layer for layer in range(layers[chunk])]
        events += [(i, c > 0) for i in (ids if c > 0 else reversed(ids))]
        (fwd if c > 0 else bwd)[chunk] += 1
    return passes, events, [[i] for i in range(len(passes))]


# -- warmup -------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _outermost_autocast(autocast_args: dict):
    """The graphs' fp8_autocast as the outermost one, whatever encloses the call: its exit updates what
    the call recorded, as a replayed forward graph does, and the enclosing contexts see no change."""
    saved = (FP8GlobalState._stack, FP8GlobalState._pending, FP8GlobalState.is_first_module,
             FP8GlobalState.backward_update)
    FP8GlobalState._stack, FP8GlobalState._pending = [], []
    try:
        with fp8_autocast(**autocast_args):
            yield
    finally:
        (FP8GlobalState._stack, FP8GlobalState._pending, FP8GlobalState.is_first_module,
         FP8GlobalState.backward_update) = saved


@contextlib.contextmanager
def _first_microbatch(first: Optional[bool]):
    """is_first_microbatch for the linear ops of a module that does not take the argument."""
    saved, FP8GlobalState.first_microbatch = FP8GlobalState.first_microbatch, first
    try:
        yield
    finally:
        FP8GlobalState.first_microbatch = saved


def _run_forward(p: _Pass, autocast_args: dict, function=None, args=None, kwargs=None):
    """p's module (or `function`, its original forward) under the graphs' fp8_autocast."""
    function = p.module if function is None else function
    kwargs = p.call_kwargs(p.kwargs if kwargs is None else kwargs)
    first = None if p.takes_first_microbatch else kwargs.pop("is_first_microbatch", None)
    with _outermost_autocast(autocast_args), _first_microbatch(first):
        return function(*(p.args if args is None else args), **kwargs)


def _grad_targets(p: _Pass):
    return tuple(t for t in p.inputs + p.params if t.requires_grad)


def _warmup(passes, events, iters: int, autocast_args: dict, training: bool, allow_unused: bool) -> None:
    for i, forward in events:
        if not forward:
            continue
        p = passes[i]
        for _ in range(iters):
            outputs = [o for o in tree_flatten(_run_forward(p, autocast_args))[0]
                       if isinstance(o, torch.Tensor) and o.requires_grad]
            if training and outputs:
                torch.autograd.grad(outputs, _grad_targets(p), grad_outputs=[torch.ones_like(o) for o in outputs],
                                    allow_unused=allow_unused)
            del outputs
        for sub in p.module.modules():  # TE resets it for Megatron's layers after warmup
            if hasattr(sub, "is_first_microbatch"):
                sub.is_first_microbatch = True


# -- CUDA capture and replay -------------------------------------------------------------------
@dataclass
class _Captured:
    forward_graph: Any
    backward_graph: Any = None
    outputs: tuple = ()
    output_spec: Any = None
    grad_outputs: tuple = ()
    grad_inputs: tuple = ()


def _weight_caches(module) -> list:
    """The FP8 weights the module's linear ops cached (is_first_microbatch): a cached-weight graph reads them."""
    return [c for h in _state_holders([module]) for c in tree_flatten(h.__dict__.get("_fp8_weight_cache"))[0]
            if isinstance(c, torch.Tensor)]


def _capture(passes, events, autocast_args, training, allow_unused, retain_graph, pool):
    mempool = pool if pool is not None else torch.cuda.graph_pool_handle()
    captured: List[Optional[_Captured]] = [None] * len(passes)
    keep_alive = []
    torch.cuda.synchronize()
    for i, forward in events:
        p = passes[i]
        if forward:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                out = _run_forward(p, autocast_args)
            flat, spec = tree_flatten(out)
            captured[i] = _Captured(graph, outputs=tuple(flat), output_spec=spec)
            keep_alive += _weight_caches(p.module)
            continue
        c = captured[i]
        c.grad_outputs = tuple(torch.empty_like(o) if o.requires_grad else None for o in c.outputs)
        targets = p.inputs + p.params
        if training:
            c.backward_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(c.backward_graph, pool=mempool):
                grads = torch.autograd.grad([o for o in c.outputs if o.requires_grad],
                                            [t for t in targets if t.requires_grad],
                                            grad_outputs=[g for g in c.grad_outputs if g is not None],
                                            allow_unused=allow_unused, retain_graph=retain_graph)
            grads = iter(grads)
            c.grad_inputs = tuple(next(grads) if t.requires_grad else None for t in targets)
        else:
            c.grad_inputs = (None,) * len(targets)
    torch.cuda.synchronize()
    return captured, keep_alive


def _replay_function(p: _Pass, c: _Captured, keep_alive: list):
    """The autograd Function of one captured pass: copies in, replays, returns the graph's buffers."""
    num_inputs = len(p.inputs)

    class Replay(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            for static, given in zip(p.inputs, inputs[:num_inputs]):
                if static.data_ptr() != given.data_ptr():
                    static.copy_(given)
            c.forward_graph.replay()
            # Leaf inputs get their .grad from autograd: the backward copies theirs out of the graph's buffer.
            ctx.leaf = tuple(t.is_leaf for t in inputs[:num_inputs])
            return tuple(o.detach() for o in c.outputs)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, *grads):
            if c.backward_graph is None:
                raise RuntimeError("this callable was graphed with its modules in eval mode: no backward graph")
            for static, grad in zip(c.grad_outputs, grads):
                if static is not None and grad is not None and static.data_ptr() != grad.data_ptr():
                    static.copy_(grad)
                elif static is not None and grad is None:
                    static.zero_()
            c.backward_graph.replay()
            out = []
            for j, g in enumerate(c.grad_inputs):
                if g is None:
                    out.append(None)
                elif j < num_inputs:
                    out.append(g.clone() if ctx.leaf[j] else g.detach())
                else:  # a parameter: AccumulateGrad would keep the buffer itself as .grad when it has none
                    out.append(g.clone() if p.params[j - num_inputs].grad is None else g.detach())
            ctx.leaf = None
            return tuple(out)

    Replay.keep_alive = keep_alive  # the cached FP8 weights the graphs read
    return Replay


# -- the callables --------------------------------------------------------------------------------
def _graphed_forward(module, variants: List[_Pass], run, weight_caching: bool, original_forward):
    """The forward that replaces module.forward (or is returned, with _order): runs the pass matching the
    call (its is_first_microbatch) while the module's training mode is the graphed one."""
    training = module.training

    def forward(*args, **kwargs):
        if module.training != training:
            return original_forward(*args, **kwargs)
        p = variants[0]
        if len(variants) > 1 and isinstance(kwargs.get("is_first_microbatch"), bool):
            p = next(v for v in variants if v.first_microbatch == kwargs["is_first_microbatch"])
        inputs = p.flatten_call(args, kwargs, weight_caching)
        return run(p, args, kwargs, inputs, original_forward)

    return forward


def make_graphed_callables(
    modules,
    sample_args,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    sample_kwargs=None,
    fp8_enabled: bool = False,
    fp8_calibrating: bool = False,
    fp8_recipe=None,
    fp8_group=None,
    fp8_weight_caching: bool = False,
    _order: Optional[List[int]] = None,
    _num_layers_per_chunk: Optional[List[int]] = None,
    pool: Optional[Tuple[int, ...]] = None,
    retain_graph_in_backward: bool = False,
    _reuse_graph_input_output_buffers: bool = False,
) -> Union[Callable, Tuple[Callable, ...]]:
    """Graph `modules` (one nn.Module, or a tuple) for replay: TE's make_graphed_callables (see the module
    docstring for what a call does, on CUDA and on the CPU).

    modules: the module(s) to graph, all in training mode or all in eval mode, without hooks.
    sample_args: per module (per forward pass with _order) a tuple of tensors, the arguments it is
        called with; on CUDA they become the graphs' input buffers. sample_kwargs: dicts of keyword
        arguments (tensors are inputs; other values are fixed).
    num_warmup_iters: eager forward+backward runs per pass before capture (at least 1: the first FP8
        forward creates state and caches that must not be captured).
    allow_unused_input: let an input or parameter get no gradient (else torch.autograd.grad raises).
    fp8_enabled, fp8_calibrating, fp8_recipe (default DelayedScaling()), fp8_group: the fp8_autocast
        each call runs under. fp8_weight_caching: calls pass is_first_microbatch=True/False; False
        reuses the FP8 weights of the last True.
    _order, _num_layers_per_chunk: Megatron's pipeline schedule (1-based chunk numbers, negative for
        backward); sample_args then has one entry per (chunk, microbatch, layer), and one forward
        function per entry is returned instead of the modules.
    pool: a graph_pool_handle() the graphs allocate from (CUDA). retain_graph_in_backward: capture the
        backward with retain_graph=True.

    Returns the module(s), their forward replaced (or, with _order, the forward functions).
    """
    if _reuse_graph_input_output_buffers:
        raise NotImplementedError("te_fuser's make_graphed_callables does not implement "
                                  "_reuse_graph_input_output_buffers=True")
    single = not isinstance(modules, tuple)
    modules = (modules,) if single else modules
    for m in modules:
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"modules must be torch.nn.Module objects (TE graphs only modules), got {type(m).__name__}")
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks:
            raise ValueError(f"modules must have no hooks when graphed ({type(m).__name__} has); register them after")
        if any(b.requires_grad for b in m.buffers()):
            raise ValueError(f"modules may train only parameters: a buffer of {type(m).__name__} requires grad")
    if sample_kwargs is None:
        sample_kwargs = {} if single else tuple({} for _ in sample_args)
    if single:
        sample_args, sample_kwargs = (sample_args,), (sample_kwargs,)
    sample_args = _as_tuple(sample_args, "sample_args")
    sample_kwargs = _as_tuple(sample_kwargs, "sample_kwargs")
    if len(sample_kwargs) != len(sample_args) or not all(isinstance(k, dict) for k in sample_kwargs):
        raise ValueError(f"sample_kwargs must be one dict per entry of sample_args ({len(sample_args)})")
    if fp8_recipe is not None and not isinstance(fp8_recipe, _AUTOCAST_RECIPES):
        raise TypeError(f"fp8_recipe must be DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling or "
                        f"Float8BlockScaling, got {type(fp8_recipe).__name__}")
    if not isinstance(num_warmup_iters, int) or isinstance(num_warmup_iters, bool) or num_warmup_iters < 1:
        raise ValueError(f"num_warmup_iters must be an int >= 1, got {num_warmup_iters!r}")
    for name, flag in (("fp8_enabled", fp8_enabled), ("fp8_calibrating", fp8_calibrating),
                       ("fp8_weight_caching", fp8_weight_caching), ("allow_unused_input", allow_unused_input),
                       ("retain_graph_in_backward", retain_graph_in_backward)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    training = all(m.training for m in modules)
    if not training and any(m.training for m in modules):
        raise ValueError("modules must be all in training mode or all in eval mode")
    if torch.is_autocast_enabled() and torch.is_autocast_cache_enabled():
        raise RuntimeError("make_graphed_callables does not work with torch.autocast's weight cache: "
                           "pass cache_enabled=False")
    recipe = get_default_fp8_recipe() if fp8_recipe is None else fp8_recipe
    autocast_args = dict(enabled=fp8_enabled, calibrating=fp8_calibrating, fp8_recipe=recipe, fp8_group=fp8_group)
    passes, events, returned = _plan(modules, sample_args, sample_kwargs, _order, _num_layers_per_chunk,
                                     fp8_weight_caching)
    devices = {t.device for p in passes for t in p.inputs + p.params}
    if len(devices) != 1:
        raise ValueError("sample_args and the modules' parameters must be on one device, got "
                         f"{sorted(map(str, devices))}")
    device = devices.pop()

    saved_state = save_fp8_tensors(modules, recipe)
    set_capture_start()
    try:
        with _rng_restored(device):
            with _side_stream(device):
                _warmup(passes, events, num_warmup_iters, autocast_args, training, allow_unused_input)
            if device.type == "cuda":
                captured, keep_alive = _capture(passes, events, autocast_args, training, allow_unused_input,
                                                retain_graph_in_backward, pool)
    finally:
        set_capture_end()
        restore_fp8_tensors(modules, saved_state)

    if device.type == "cuda":
        replays = {id(p): (_replay_function(p, c, keep_alive), c) for p, c in zip(passes, captured)}

        def run(p, args, kwargs, inputs, original):
            del args, kwargs, original  # the graph replays the captured call
            function, c = replays[id(p)]
            return tree_unflatten(list(function.apply(*inputs, *p.params)), c.output_spec)
    else:
        def run(p, args, kwargs, inputs, original):
            del inputs
            return _run_forward(p, autocast_args, original, args, kwargs)

    result = []
    for indices in returned:
        variants = [passes[i] for i in indices]
        module = variants[0].module
        original = module.__dict__.get("forward", type(module).forward.__get__(module))
        forward = _graphed_forward(module, variants, run, fp8_weight_caching, original)
        if _order is None:
            module.forward = forward
            result.append(module)
        else:
            result.append(forward)
    return result[0] if single else tuple(result)
