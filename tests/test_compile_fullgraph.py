"""torch.compile(fullgraph=True) over every te_fuser module, with no FP8, DelayedScaling and Float8CurrentScaling.

Each case trains a module for three steps (forward, backward, an SGD update) eagerly and compiled, from the
same weights and inputs, and after every step asserts the same bits: the output, the input and parameter
gradients, and the FP8 scaling state (amax_history, amax, scale, scale_inv of every delayed-scaling state; the
amax and scale each current-scaling quantizer keeps of its last call, backward ones included). fullgraph=True
fails on any graph break; the steps after the first run under set_stance("fail_on_recompile"), so the one graph
serves them all. The autocast context is inside the compiled function in some cases (its exit rolls the amax
history and updates the scales inside the graph) and around the compiled module in others (the update runs
eagerly on the state the graph wrote), as users write it.

aot_eager runs dynamo's graph and AOTAutograd's forward and backward graphs, which are what inductor compiles;
one case per module family also runs inductor. Parameters are float32, and bf16 in test_bf16_parameters.
"""

import contextlib

import pytest
import torch

import te_fuser
from te_fuser import ops
from te_fuser.quantization import CurrentScalingState
from te_fuser.recipe import DelayedScaling, Float8CurrentScaling

from _torch_support import compiles_fp8_modules_bitwise, compiles_te_fuser_modules

pytestmark = compiles_fp8_modules_bitwise

HIDDEN, FFN, HEADS, SEQ, BATCH = 32, 64, 2, 16, 2


def _sequential():
    return ops.Sequential(ops.LayerNorm(HIDDEN), ops.BasicLinear(HIDDEN, FFN), ops.Bias(FFN), ops.GELU(),
                          ops.BasicLinear(FFN, HIDDEN), ops.Bias(HIDDEN))


MODULES = {
    "Linear": lambda: te_fuser.Linear(HIDDEN, 16),
    "LayerNormLinear": lambda: te_fuser.LayerNormLinear(HIDDEN, 16),
    "LayerNormMLP": lambda: te_fuser.LayerNormMLP(HIDDEN, FFN),
    "LayerNormMLP-swiglu": lambda: te_fuser.LayerNormMLP(HIDDEN, FFN, activation="swiglu", normalization="RMSNorm"),
    "GroupedLinear": lambda: te_fuser.GroupedLinear(2, HIDDEN, 16),
    "LayerNorm": lambda: te_fuser.LayerNorm(HIDDEN),
    "RMSNorm": lambda: te_fuser.RMSNorm(HIDDEN),
    "DotProductAttention": lambda: te_fuser.DotProductAttention(HEADS, HIDDEN // HEADS, attention_dropout=0.0),
    "MultiheadAttention": lambda: te_fuser.MultiheadAttention(HIDDEN, HEADS, attention_dropout=0.0),
    "TransformerLayer": lambda: te_fuser.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0,
                                                          attention_dropout=0.0),
    "ops.Sequential": _sequential,
}

def _amax_of_history(history):
    return history.amax(dim=0)


def _scale_from_amax(amax, scale, fp8_max, recipe):
    return torch.where(amax > 0, fp8_max / amax / 2.0**recipe.margin, scale)


RECIPES = {
    "none": None,
    "delayed": DelayedScaling(amax_history_len=4),
    "current": Float8CurrentScaling(),
    # Attention in FP8 too (the plain recipes leave DotProductAttention in high precision, as TE does).
    "delayed-dpa": DelayedScaling(amax_history_len=4, fp8_dpa=True),
    "current-dpa": Float8CurrentScaling(fp8_dpa=True),
    "delayed-mha": DelayedScaling(amax_history_len=4, fp8_mha=True),  # FP8 between QKV, attention and proj
    "delayed-most-recent": DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent", margin=2),
    # TE's callables: the update is torch code of the recipe's, traced into the graph
    "delayed-callables": DelayedScaling(amax_history_len=4, margin=1, amax_compute_algo=_amax_of_history,
                                        scaling_factor_compute_algo=_scale_from_amax),
}

# (module, recipe, autocast inside the compiled function?, backend)
CASES = [(name, "none", True, "aot_eager") for name in MODULES]
CASES += [(name, "delayed", True, "aot_eager") for name in MODULES if name != "DotProductAttention"]
CASES += [(name, "current", False, "aot_eager") for name in MODULES if name != "DotProductAttention"]
CASES += [
    ("DotProductAttention", "delayed-dpa", True, "aot_eager"),
    ("DotProductAttention", "current-dpa", False, "aot_eager"),
    ("MultiheadAttention", "current-dpa", True, "aot_eager"),
    ("TransformerLayer", "delayed-mha", False, "aot_eager"),
    ("Linear", "delayed", False, "aot_eager"),
    ("Linear", "current", True, "aot_eager"),
    ("ops.Sequential", "delayed", False, "aot_eager"),
    ("Linear", "delayed-most-recent", True, "aot_eager"),
    ("Linear", "delayed-callables", True, "aot_eager"),
    # one per family under inductor
    ("LayerNormMLP-swiglu", "current", True, "inductor"),
    ("GroupedLinear", "delayed", False, "inductor"),
    ("RMSNorm", "delayed", True, "inductor"),
    ("DotProductAttention", "delayed-dpa", True, "inductor"),
    ("TransformerLayer", "delayed", True, "inductor"),
    ("ops.Sequential", "current", False, "inductor"),
]


def _inputs(name, generator, step):
    """This step's inputs: random, scaled differently each step (the amaxes change, so delayed scaling casts with
    the history of earlier steps), with a zero row and one value beyond E4M3's range (saturation)."""
    scale = (1.0, 4.0, 0.25)[step]
    if name == "DotProductAttention":
        shapes, kwargs = [(SEQ, BATCH, HEADS, HIDDEN // HEADS)] * 3, {}
    elif name == "GroupedLinear":
        shapes, kwargs = [(2 * SEQ, HIDDEN)], {"m_splits": [SEQ, SEQ]}
    else:
        shapes, kwargs = [(SEQ, BATCH, HIDDEN)], {}
    xs = []
    for shape in shapes:
        x = torch.randn(shape, generator=generator) * scale
        x[0] = 0.0
        x.view(-1)[-1] = 500.0
        xs.append(x)
    return xs, kwargs


def _ops(module):
    for sub in module.modules():
        yield from getattr(sub, "_ops", None) or (sub,)


def scaling_state(module) -> dict:
    """name -> a copy of every tensor of the module's FP8 recipe states (the block-scaled recipes keep none)."""
    states = {}
    for i, op in enumerate(_ops(module)):
        named = {f"states[{j}]": s for j, s in enumerate(getattr(op, "_fp8_states", None) or ())}
        named.update({f"io[{k}]": s for k, s in (getattr(op, "_fp8_io_states", None) or {}).items()})
        named.update({attr: getattr(op, attr) for attr in ("_fp8_state", "_fp8_output_state")
                      if getattr(op, attr, None) is not None})
        for key, state in named.items():
            prefix = f"{i}:{type(op).__name__}.{key}"
            for field in ("amax_history", "amax", "scale", "scale_inv"):
                if hasattr(state, field):
                    states[f"{prefix}.{field}"] = getattr(state, field).clone()
            if isinstance(state, CurrentScalingState):  # each quantizer's last amax and scale
                for q, quantizer in enumerate(state.quantizers()):
                    states[f"{prefix}.q{q}.amax"] = quantizer.amax.clone()
                    states[f"{prefix}.q{q}.scale"] = quantizer.scale.clone()
    return states


def _train_step(step_fn, module, xs, kwargs, recipe, autocast_inside, grad_seed):
    xs = [x.clone().requires_grad_() for x in xs]
    if autocast_inside:
        out = step_fn(*xs, **kwargs)
    else:
        with te_fuser.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            out = step_fn(*xs, **kwargs)
    # The scaling state after the forward's autocast exit: eager updates the backward states at the end of
    # backward (TE's time), a compiled module at the next exit (its backward runs no Python), so here, and
    # only here, both have folded in the same backward amaxes.
    state = scaling_state(module)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out.dtype))
    result = (out.detach(), [x.grad for x in xs], {n: p.grad for n, p in module.named_parameters()}, state)
    with torch.no_grad():
        for p in module.parameters():
            p.sub_(1e-3 * p.grad)
            p.grad = None
    return result


def _assert_same_bits(eager, compiled, step):
    (out_a, dx_a, dp_a, state_a), (out_b, dx_b, dp_b, state_b) = eager, compiled
    assert all(bool(t.isfinite().all()) for t in [out_a, *dx_a, *dp_a.values()]), "the eager steps diverged"
    assert torch.equal(out_a, out_b), f"step {step}: outputs differ"
    for i, (a, b) in enumerate(zip(dx_a, dx_b)):
        assert torch.equal(a, b), f"step {step}: gradient of input {i} differs"
    assert dp_a.keys() == dp_b.keys()
    for name in dp_a:
        assert torch.equal(dp_a[name], dp_b[name]), f"step {step}: gradient of {name} differs"
    assert state_a.keys() == state_b.keys()
    for name in state_a:
        assert torch.equal(state_a[name], state_b[name]), f"step {step}: {name} differs"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each case compiles from scratch: cache entries of earlier cases (the same forward code) neither serve it
    nor count toward dynamo's recompile limit."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _check_training_steps(name, recipe_name, autocast_inside, backend, generator, dtype=torch.float32):
    recipe = RECIPES[recipe_name]
    modules = []
    for _ in range(2):
        torch.manual_seed(0)
        modules.append(MODULES[name]().to(dtype))
    eager_module, compiled_module = modules

    def stepper(module):
        if not autocast_inside:
            return module

        def step(*args, **kwargs):
            with te_fuser.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
                return module(*args, **kwargs)
        return step

    compiled = torch.compile(stepper(compiled_module), fullgraph=True, backend=backend)
    for step in range(3):
        xs, kwargs = _inputs(name, generator, step)
        xs = [x.to(dtype) for x in xs]
        grad_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        eager_result = _train_step(stepper(eager_module), eager_module, xs, kwargs, recipe, autocast_inside,
                                   grad_seed)
        # One graph for all steps: a recompilation after the first step fails.
        with torch.compiler.set_stance("fail_on_recompile") if step else contextlib.nullcontext():
            compiled_result = _train_step(compiled, compiled_module, xs, kwargs, recipe, autocast_inside, grad_seed)
        _assert_same_bits(eager_result, compiled_result, step)
    if recipe is not None and "delayed" in recipe_name and name not in ("LayerNorm", "RMSNorm"):
        state = scaling_state(compiled_module)
        assert any(k.endswith("amax_history") and bool(v[1].gt(0).any()) for k, v in state.items()), \
            "the amax history did not roll: the steps did not exercise the scale update"


@compiles_te_fuser_modules
@pytest.mark.parametrize("name, recipe_name, autocast_inside, backend", CASES,
                         ids=[f"{n}-{r}-{'inside' if i else 'outside'}-{b}" for n, r, i, b in CASES])
def test_compiled_training_steps_match_eager_bitwise(name, recipe_name, autocast_inside, backend, generator):
    _check_training_steps(name, recipe_name, autocast_inside, backend, generator)


@compiles_te_fuser_modules
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_bf16_parameters(backend, generator, monkeypatch):
    """bf16 parameters and inputs. Inductor computes a chain of fused 16-bit pointwise ops in float32 and rounds
    once (TransformerLayer's bias + residual adds then differ from step 1 on); with emulate_precision_casts it
    rounds after each op, as eager does."""
    monkeypatch.setattr(torch._inductor.config, "emulate_precision_casts", True)
    _check_training_steps("TransformerLayer", "delayed", True, backend, generator, torch.bfloat16)


@compiles_te_fuser_modules
def test_interleaved_microbatches_under_an_outside_autocast(generator):
    """Two microbatches' forwards, then their backwards in reverse order (a pipeline schedule's order), each
    forward under its own autocast around the module. Eager updates the gradient's scaling state at the end of
    each backward (TE's time): one roll per backward, in backward order. A compiled module's backward runs no
    Python: both backwards record into the live state, which holds their maximum until the next autocast exit
    folds it in. Every backward's amax counts either way (checked against the gradients' own amaxes), and the
    forward states, updated at each exit, give both the same outputs."""
    recipe = RECIPES["delayed"]
    modules = []
    for _ in range(2):
        torch.manual_seed(0)
        modules.append(MODULES["Linear"]())
    eager_module, compiled_module = modules
    compiled = torch.compile(compiled_module, fullgraph=True, backend="aot_eager")
    for step in range(2):
        xs = [torch.randn(SEQ, BATCH, HIDDEN, generator=generator) * scale for scale in (1.0, 10.0)]
        dys = [torch.randn(SEQ, BATCH, 16, generator=generator) * scale for scale in (1.0, 50.0)]
        amaxes = [float(dy.abs().max()) for dy in dys]  # the Linear's gradient at its output is dy
        results = []
        for forward in (eager_module, compiled):
            outs = []
            for x in xs:
                with te_fuser.fp8_autocast(fp8_recipe=recipe):
                    outs.append(forward(x.clone().requires_grad_()))
            for out, dy in reversed(list(zip(outs, dys))):
                out.backward(dy)
            results.append(outs)
        for a, b in zip(*results):
            assert torch.equal(a, b), f"step {step}: outputs differ"
        eager_bwd, compiled_bwd = (m.fp8_meta["scaling_bwd"].amax_history[:, 0] for m in modules)
        assert eager_bwd[-2:].tolist() == [amaxes[1], amaxes[0]] and eager_bwd[0].item() == 0.0
        assert compiled_bwd[0].item() == max(amaxes)
        if step:  # the first step's two backwards, folded in at the second step's first exit
            assert compiled_bwd[-1].item() == max(previous)
        previous = amaxes


@compiles_te_fuser_modules
def test_recipe_made_inside_the_compiled_function(generator):
    """A recipe constructed in the compiled function (with fields that differ from the defaults): the modules'
    recipe states are made for that recipe, not for the defaults, and train as eagerly."""
    def step(module, x):
        with te_fuser.fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=3, margin=1)):
            return module(x)

    modules = []
    for _ in range(2):
        torch.manual_seed(0)
        modules.append(MODULES["Linear"]())
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for s in range(3):
        xs, _ = _inputs("Linear", generator, s)
        dy = torch.randn(SEQ, BATCH, 16, generator=generator)
        outs, states = [], []
        for fn, module in ((step, modules[0]), (compiled, modules[1])):
            out = fn(module, xs[0].clone().requires_grad_())
            states.append(scaling_state(module))  # after the exit, before backward: see _train_step
            out.backward(dy)
            outs.append(out)
        assert torch.equal(outs[0], outs[1])
        eager_state, compiled_state = states
        for name in eager_state:
            assert torch.equal(eager_state[name], compiled_state[name]), f"step {s}: {name} differs"
    assert modules[1]._ops[0]._fp8_states[0].amax_history.shape[0] == 3


@compiles_te_fuser_modules
@pytest.mark.parametrize("name", ["Linear", "GroupedLinear"])
def test_weight_caching_across_microbatches(name, generator):
    """is_first_microbatch: True quantizes and caches the FP8 weight, False reuses it (three microbatches a
    step, two steps, delayed scaling): eager's bits, the weight's amax recorded once a step as eagerly. (The
    cache is written before the fuser's autograd Function, outside the traced Function.)"""
    recipe = RECIPES["delayed"]
    modules = []
    for _ in range(2):
        torch.manual_seed(0)
        modules.append(MODULES[name]())
    compiled = torch.compile(modules[1], fullgraph=True, backend="aot_eager")
    for step in range(2):
        for microbatch, first in enumerate((True, False, False)):
            xs, kwargs = _inputs(name, generator, microbatch)
            results = []
            for module, forward in zip(modules, (modules[0], compiled)):
                x = xs[0].clone().requires_grad_()
                with te_fuser.fp8_autocast(fp8_recipe=recipe):
                    out = forward(x, is_first_microbatch=first, **kwargs)
                state = scaling_state(module)  # after the exit, before backward: see _train_step
                out.backward(torch.ones_like(out))
                results.append((out, x.grad, state))
            assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
            eager_state, compiled_state = results[0][2], results[1][2]
            for key in eager_state:
                assert torch.equal(eager_state[key], compiled_state[key]), f"step {step}.{microbatch}: {key} differs"
        for p, q in zip(modules[0].parameters(), modules[1].parameters()):
            assert torch.equal(p.grad, q.grad)


@compiles_te_fuser_modules
def test_recipe_with_callables_made_inside_the_compiled_function_is_refused():
    """Its callables cannot reach the Python that makes the recipe states while dynamo traces: a clear error,
    not states made for the defaults."""
    module = MODULES["Linear"]()

    def step(x):
        with te_fuser.fp8_autocast(fp8_recipe=DelayedScaling(amax_compute_algo=_amax_of_history)):
            return module(x)

    with pytest.raises(Exception, match="made inside a torch.compile'd function with callable fields"):
        torch.compile(step, fullgraph=True, backend="aot_eager")(torch.randn(SEQ, BATCH, HIDDEN))
