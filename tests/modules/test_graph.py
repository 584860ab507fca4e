"""te_fuser.make_graphed_callables on the CPU: TE 2.6's signature, and graphed modules stepping exactly
like the same modules run eagerly under fp8_autocast (outputs, input and parameter gradients, the
delayed-scaling state), Megatron's pipeline _order with FP8 weight caching, nothing left on an autograd
ctx after backward, and bad arguments. The CUDA capture is checked in tests/test_graph_cuda.py."""

import copy
import inspect

import pytest
import torch

import te_fuser
from te_fuser import recipe
from te_fuser.graph import _delayed_states

from _module_memory import reachable_after_backward, retained_step_bytes, without_clearing

HIDDEN, FFN, HEADS, SEQ, BATCH = 32, 64, 2, 16, 2
EMPTY = inspect.Parameter.empty

# transformer_engine/pytorch/graph.py at TE v2.6: make_graphed_callables's parameters and defaults.
TE_2_6_PARAMETERS = [
    ("modules", EMPTY), ("sample_args", EMPTY), ("num_warmup_iters", 3), ("allow_unused_input", False),
    ("sample_kwargs", None), ("fp8_enabled", False), ("fp8_calibrating", False), ("fp8_recipe", None),
    ("fp8_group", None), ("fp8_weight_caching", False), ("_order", None), ("_num_layers_per_chunk", None),
    ("pool", None), ("retain_graph_in_backward", False), ("_reuse_graph_input_output_buffers", False),
]

RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": lambda: recipe.Float8CurrentScaling(),
}


def test_signature_is_te_2_6():
    params = inspect.signature(te_fuser.make_graphed_callables).parameters
    assert [(name, p.default) for name, p in params.items()] == TE_2_6_PARAMETERS


def _linear():
    return te_fuser.Linear(HIDDEN, HIDDEN, device="cpu")


def _layernorm_mlp():
    return te_fuser.LayerNormMLP(HIDDEN, FFN, activation="swiglu", normalization="RMSNorm", device="cpu")


def _transformer_layer(dropout=0.0):
    return te_fuser.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=dropout, attention_dropout=0.0, device="cpu")


MODULES = {"Linear": _linear, "LayerNormMLP": _layernorm_mlp, "TransformerLayer": _transformer_layer}


def _input(generator, scale=1.0):
    return (torch.randn(SEQ, BATCH, HIDDEN, generator=generator) * scale).requires_grad_()


def _eager_step(module, x, dy, fp8_recipe, **kwargs):
    with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
        y = module(x, **kwargs)
    y.backward(dy)
    return y


def _assert_same_fp8_state(graphed, eager):
    states, ref_states = _delayed_states([graphed]), _delayed_states([eager])
    assert len(states) == len(ref_states)
    for state, ref_state in zip(states, ref_states):
        for name in ("amax_history", "scale", "scale_inv"):
            assert torch.equal(getattr(state, name), getattr(ref_state, name)), name


def _assert_same_step(y, ref_y, x, ref_x, module, ref_module):
    assert torch.equal(y, ref_y)
    assert torch.equal(x.grad, ref_x.grad)
    for (name, p), ref_p in zip(module.named_parameters(), ref_module.parameters()):
        assert torch.equal(p.grad, ref_p.grad), name


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", list(MODULES))
@pytest.mark.parametrize("stepped_before", [False, True], ids=["fresh", "stepped"])
def test_graphed_steps_like_eager(kind, recipe_name, stepped_before, generator):
    """Several steps with growing inputs (the delayed scales change every step): the same bits as the
    eager module, FP8 state included. A module stepped before graphing starts from its own state (the
    warmup's updates undone), a fresh one from the initial state."""
    fp8_recipe = RECIPES[recipe_name]()
    torch.manual_seed(0)
    module = MODULES[kind]()
    if stepped_before:
        _eager_step(module, _input(generator, 4.0), torch.randn(SEQ, BATCH, HIDDEN, generator=generator), fp8_recipe)
        module.zero_grad(set_to_none=True)
    eager = copy.deepcopy(module)
    graphed = te_fuser.make_graphed_callables(module, (_input(generator),), fp8_enabled=True, fp8_recipe=fp8_recipe)
    assert graphed is module
    assert all(p.grad is None for p in module.parameters())  # the warmup's gradients went nowhere
    if recipe_name == "delayed" and stepped_before:
        _assert_same_fp8_state(module, eager)
    for state in _delayed_states([module]) if not stepped_before else ():  # made by the warmup, then reset
        assert not state.amax_history.any() and (state.scale == 1).all() and (state.scale_inv == 1).all()
    for step in range(3):
        x = _input(generator, 2.0 ** step)
        dy = torch.randn(SEQ, BATCH, HIDDEN, generator=generator) * 2.0 ** -step
        ref_x = x.detach().clone().requires_grad_()
        y = graphed(x)
        y.backward(dy)
        ref_y = _eager_step(eager, ref_x, dy, fp8_recipe)
        _assert_same_step(y, ref_y, x, ref_x, module, eager)
        if recipe_name == "delayed":
            _assert_same_fp8_state(module, eager)


def test_warmup_dropout_draws_are_undone(generator):
    """The warmup draws dropout masks; afterwards the generator is where it was, so the first graphed
    step draws the eager step's mask."""
    torch.manual_seed(0)
    module = _transformer_layer(dropout=0.5)
    eager = copy.deepcopy(module)
    x = _input(generator)
    torch.manual_seed(7)
    graphed = te_fuser.make_graphed_callables(module, (x,))
    y = graphed(x)
    torch.manual_seed(7)
    assert torch.equal(y, eager(x))


def test_calibrating_runs_like_eager_calibration(generator):
    """fp8_calibrating=True: the graphed call runs in high precision, as the eager module in that autocast."""
    torch.manual_seed(0)
    module = _linear()
    eager = copy.deepcopy(module)
    fp8_recipe = recipe.DelayedScaling(amax_history_len=4)
    graphed = te_fuser.make_graphed_callables(module, (_input(generator),), fp8_calibrating=True, fp8_recipe=fp8_recipe)
    x = _input(generator)
    y = graphed(x)
    with te_fuser.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=fp8_recipe):
        ref_y = eager(x)
    assert torch.equal(y, ref_y) and torch.equal(y, torch.nn.functional.linear(x, module.weight, module.bias))
    _assert_same_fp8_state(module, eager)


def test_fp8_weight_caching_reuses_the_first_microbatch_weights(generator):
    """is_first_microbatch=False casts with the weights quantized at the last True, as the eager module
    does; a call without it is refused, as in TE."""
    fp8_recipe = recipe.DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    module = _linear()
    eager = copy.deepcopy(module)
    graphed = te_fuser.make_graphed_callables(module, (_input(generator),), fp8_enabled=True, fp8_recipe=fp8_recipe,
                                              fp8_weight_caching=True)
    for first in (True, False, False, True, False):
        with torch.no_grad():  # an optimizer step between microbatches: only a True call sees it
            module.weight.mul_(1.5)
            eager.weight.mul_(1.5)
        x = _input(generator)
        ref_x = x.detach().clone().requires_grad_()
        dy = torch.randn(SEQ, BATCH, HIDDEN, generator=generator)
        y = graphed(x, is_first_microbatch=first)
        y.backward(dy)
        ref_y = _eager_step(eager, ref_x, dy, fp8_recipe, is_first_microbatch=first)
        _assert_same_step(y, ref_y, x, ref_x, module, eager)
        _assert_same_fp8_state(module, eager)
    with pytest.raises(TypeError, match="is_first_microbatch"):
        graphed(_input(generator))


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_pipeline_order_with_weight_caching(recipe_name, generator):
    """Megatron's interleaved schedule: two chunks of one layer each, two microbatches, forwards before
    backwards (_order = [1, 2, 1, 2, -2, -1, -2, -1]); one forward function per (chunk, microbatch),
    microbatch 0 graphed with is_first_microbatch=True. Two iterations against the eager layers."""
    fp8_recipe = RECIPES[recipe_name]()
    order = [1, 2, 1, 2, -2, -1, -2, -1]
    torch.manual_seed(0)
    layers = (_linear(), _layernorm_mlp())
    eager = copy.deepcopy(layers)
    samples = [(_input(generator),) for _ in range(4)]  # (chunk 0: mb 0, mb 1), (chunk 1: mb 0, mb 1)
    functions = te_fuser.make_graphed_callables(layers, tuple(samples), fp8_enabled=True, fp8_recipe=fp8_recipe,
                                                fp8_weight_caching=True, _order=order)
    assert len(functions) == 4 and all(callable(f) for f in functions)

    def run_schedule(call):
        """call(chunk, microbatch, x) -> y; returns the outputs and the input grads in schedule order."""
        xs = [_input(torch.Generator().manual_seed(100 + mb)) for mb in range(2)]
        dys = [torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(200 + mb)) for mb in range(2)]
        acts, outs, fwd, bwd = {}, [], [0, 0], [0, 0]
        for c in order:
            chunk = abs(c) - 1
            if c > 0:
                mb = fwd[chunk]
                x = xs[mb] if chunk == 0 else acts[(0, mb)][1].detach().requires_grad_()
                acts[(chunk, mb)] = (x, call(chunk, mb, x))
                outs.append(acts[(chunk, mb)][1])
                fwd[chunk] += 1
            else:
                mb = bwd[chunk]
                x, y = acts[(chunk, mb)]
                y.backward(dys[mb] if chunk == 1 else acts[(1, mb)][0].grad)
                bwd[chunk] += 1
        return outs, [xs[mb].grad for mb in range(2)]

    def graphed_call(chunk, mb, x):
        return functions[2 * chunk + mb](x, is_first_microbatch=mb == 0)

    def eager_call(chunk, mb, x):
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            return eager[chunk](x, is_first_microbatch=mb == 0)

    for _ in range(2):
        outs, grads = run_schedule(graphed_call)
        ref_outs, ref_grads = run_schedule(eager_call)
        assert all(torch.equal(a, b) for a, b in zip(outs, ref_outs))
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
        for layer, ref_layer in zip(layers, eager):
            for p, ref_p in zip(layer.parameters(), ref_layer.parameters()):
                assert torch.equal(p.grad, ref_p.grad)
            if recipe_name == "delayed":
                _assert_same_fp8_state(layer, ref_layer)
    with pytest.raises(ValueError, match="is_first_microbatch=True"):
        functions[0](samples[0][0], is_first_microbatch=False)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_nothing_left_on_ctx_after_backward(recipe_name, monkeypatch, generator):
    """A graphed TransformerLayer's step leaves no tensor reachable from its graph and no bytes beyond its
    output and gradients; with the fuser's ctx clearing switched off (the seed-000 bug) both checks fail."""
    torch.manual_seed(0)
    layer = _transformer_layer()
    x = _input(generator)
    graphed = te_fuser.make_graphed_callables(layer, (x,), fp8_enabled=True, fp8_recipe=RECIPES[recipe_name]())

    def forward():
        return graphed(x)

    before, after, _ = reachable_after_backward(layer, forward)
    assert before and after == []
    held, expected = retained_step_bytes(layer, forward, [x])
    assert held <= expected + 1024, (held, expected)
    without_clearing(monkeypatch)
    _, after_leaky, _ = reachable_after_backward(layer, forward)
    assert after_leaky, "the graph walk missed the tensors left on ctx"
    held_leaky, expected = retained_step_bytes(layer, forward, [x])
    assert held_leaky >= expected + SEQ * BATCH * HIDDEN, (held_leaky, expected)


def test_eval_mode_graph_and_training_mode_falls_back(generator):
    """Graphed in eval mode, the module runs its original forward once back in training mode (TE)."""
    torch.manual_seed(0)
    module = _linear().eval()
    eager = copy.deepcopy(module)
    x = _input(generator)
    graphed = te_fuser.make_graphed_callables(module, (x,))
    assert torch.equal(graphed(x), eager(x))
    module.train()
    eager.train()
    assert torch.equal(graphed(x), eager(x))


def _bad_call(kind, generator):
    x = _input(generator)
    module = _linear()
    calls = {
        "modules": lambda: te_fuser.make_graphed_callables(lambda t: t, (x,)),
        "sample_args": lambda: te_fuser.make_graphed_callables(module, x),
        "sample_args tensors": lambda: te_fuser.make_graphed_callables(module, (x, 3)),
        "sample_kwargs": lambda: te_fuser.make_graphed_callables((module,), ((x,),), sample_kwargs=({}, {})),
        "num_warmup_iters": lambda: te_fuser.make_graphed_callables(module, (x,), num_warmup_iters=0),
        "fp8_enabled": lambda: te_fuser.make_graphed_callables(module, (x,), fp8_enabled="yes"),
        "fp8_recipe": lambda: te_fuser.make_graphed_callables(module, (x,), fp8_recipe="delayed"),
        "_order": lambda: te_fuser.make_graphed_callables((module,), ((x,), (x,)), _order=[1, 1, -1]),
        "_num_layers_per_chunk": lambda: te_fuser.make_graphed_callables(
            (module,), ((x,), (x,)), _order=[1, 1, -1, -1], _num_layers_per_chunk=[1, 1]),
        "_reuse_graph_input_output_buffers": lambda: te_fuser.make_graphed_callables(
            module, (x,), _reuse_graph_input_output_buffers=True),
    }
    return calls[kind]


BAD = {
    "modules": (TypeError, "modules must be torch.nn.Module"),
    "sample_args": (TypeError, "each entry of sample_args must be a tuple"),
    "sample_args tensors": (TypeError, "sample_args must hold only tensors"),
    "sample_kwargs": (ValueError, "sample_kwargs must be one dict per entry of sample_args"),
    "num_warmup_iters": (ValueError, "num_warmup_iters must be an int >= 1"),
    "fp8_enabled": (TypeError, "fp8_enabled must be a bool"),
    "fp8_recipe": (TypeError, "fp8_recipe must be"),
    "_order": (ValueError, "_order must have"),
    "_num_layers_per_chunk": (ValueError, "_num_layers_per_chunk must be"),
    "_reuse_graph_input_output_buffers": (NotImplementedError, "_reuse_graph_input_output_buffers"),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_arguments_name_themselves(kind, generator):
    error, message = BAD[kind]
    with pytest.raises(error, match=message):
        _bad_call(kind, generator)()


def test_bad_calls_of_a_graphed_callable_name_the_argument(generator):
    torch.manual_seed(0)
    x = _input(generator)
    graphed = te_fuser.make_graphed_callables(_linear(), (x,))
    with pytest.raises(ValueError, match=r"argument 0 .* shape \(16, 2, 32\)"):
        graphed(torch.randn(8, 2, HIDDEN))
    with pytest.raises(ValueError, match="dtype torch.float32"):
        graphed(x.double())
    with pytest.raises(TypeError, match="takes 1 argument leaves"):
        graphed(x, x)
    graphed = te_fuser.make_graphed_callables(_linear(), (x.detach(),))
    with pytest.raises(ValueError, match="argument 0 .* requires grad but its sample did not"):
        graphed(x)


def test_made_inside_fp8_autocast_and_refused_with_hooks(generator):
    """Made inside an fp8_autocast, the callables run under their own (the warmup too): the enclosing
    context keeps its state. A module with hooks is refused, as in TE."""
    fp8_recipe = recipe.DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    module = _linear()
    eager = copy.deepcopy(module)
    x = _input(generator)
    with te_fuser.fp8_autocast(enabled=False, calibrating=True):
        graphed = te_fuser.make_graphed_callables(module, (x,), fp8_enabled=True, fp8_recipe=fp8_recipe)
        assert te_fuser.FP8GlobalStateManager.get_fp8_autocast_state()[:2] == (False, True)
    y = graphed(x)
    with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
        assert torch.equal(y, eager(x))
    _assert_same_fp8_state(module, eager)
    module = _linear()
    module.register_forward_hook(lambda *args: None)
    with pytest.raises(ValueError, match="no hooks"):
        te_fuser.make_graphed_callables(module, (x,))


class _WithUnusedParameter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = _linear()
        self.unused = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.linear(x)


def test_allow_unused_input(generator):
    """A parameter the forward does not use: the warmup's autograd.grad refuses it unless
    allow_unused_input=True (as the captured backward would); then it gets no gradient."""
    x = _input(generator)
    with pytest.raises(RuntimeError, match="not have been used"):
        te_fuser.make_graphed_callables(_WithUnusedParameter(), (x,))
    module = te_fuser.make_graphed_callables(_WithUnusedParameter(), (x,), allow_unused_input=True,
                                             retain_graph_in_backward=True)
    module(x).sum().backward()
    assert module.unused.grad is None and module.linear.weight.grad is not None


def test_an_enclosing_autocast_changes_nothing(generator):
    """TE scripts call graphed layers inside their own fp8_autocast: each call still updates the scales
    at its end with the graphed recipe (as a replayed forward graph does), here twice in one context."""
    graph_recipe = recipe.DelayedScaling(amax_history_len=4, margin=1)
    torch.manual_seed(0)
    module = _linear()
    eager = copy.deepcopy(module)
    graphed = te_fuser.make_graphed_callables(module, (_input(generator),), fp8_enabled=True, fp8_recipe=graph_recipe)
    xs = [_input(generator, 3.0 ** i) for i in range(2)]
    with te_fuser.fp8_autocast(enabled=False, fp8_recipe=recipe.Float8CurrentScaling()):
        ys = [graphed(x) for x in xs]
        assert not te_fuser.FP8GlobalStateManager.is_fp8_enabled()  # the enclosing context is intact
    for x, y in zip(xs, ys):
        with te_fuser.fp8_autocast(fp8_recipe=graph_recipe):
            assert torch.equal(y, eager(x))
    _assert_same_fp8_state(module, eager)
