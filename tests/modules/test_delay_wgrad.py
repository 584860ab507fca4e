"""delay_wgrad_compute=True and backward_dw() (TE's): backward computes the input's gradient only and
queues the weight-gradient GEMMs; backward_dw() computes them. The reference is the same module without
delay_wgrad_compute: the same GEMMs, so every result must be bitwise equal, over several microbatches
that accumulate. The queued inputs live on the linear op until backward_dw(), never on an autograd ctx."""

import gc

import pytest
import torch
import torch.distributed as dist

import te_fuser
from te_fuser import recipe
from te_fuser.ops._delayed_wgrad import WgradQueue

from _fuser_ctx_walk import retained_cpu_bytes
from _module_checks import autocast, ctx_walk_check, spawn
from _torch_support import compiles_te_fuser_modules

HIDDEN, OUT, FFN, TOKENS, MICROBATCHES = 64, 48, 96, 32, 3
RECIPES = {"no_fp8": None, "delayed": recipe.DelayedScaling(), "current": recipe.Float8CurrentScaling()}


class _Grouped(torch.nn.Module):
    """A GroupedLinear called with fixed m_splits, so every module here is called as module(x)."""

    def __init__(self, **kwargs):
        super().__init__()
        self.inner = te_fuser.GroupedLinear(2, HIDDEN, OUT, device="cpu", **kwargs)

    def forward(self, x):
        half = x.shape[0] // 2
        return self.inner(x, [half, x.shape[0] - half])

    def backward_dw(self):
        self.inner.backward_dw()


MODULES = {
    "Linear": lambda **kw: te_fuser.Linear(HIDDEN, OUT, device="cpu", **kw),
    "LayerNormLinear": lambda **kw: te_fuser.LayerNormLinear(HIDDEN, OUT, device="cpu", **kw),
    "LayerNormMLP": lambda **kw: te_fuser.LayerNormMLP(HIDDEN, FFN, device="cpu", **kw),
    "GroupedLinear": _Grouped,
}


def _pair(name, **kwargs):
    """(reference, delayed): the same module and weights, without and with delay_wgrad_compute."""
    ref = MODULES[name](**kwargs)
    delayed = MODULES[name](delay_wgrad_compute=True, **kwargs)
    delayed.load_state_dict(ref.state_dict())
    return ref, delayed


def _linear_weights(module):
    """The parameters whose gradient is a weight-gradient GEMM's (not the norm's, not the biases)."""
    return [p for n, p in module.named_parameters() if "weight" in n and "layer_norm" not in n]


def _grads(module, main_grad: bool):
    """{name: gradient} of every parameter (main_grad for the linear weights when main_grad is set)."""
    linear = {id(p) for p in _linear_weights(module)}
    return {n: (p.main_grad if main_grad and id(p) in linear else p.grad) for n, p in module.named_parameters()}


def _copies(grads):
    return {n: None if g is None else g.clone() for n, g in grads.items()}


@pytest.mark.parametrize("fp8", RECIPES)
@pytest.mark.parametrize("main_grad", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("name", MODULES)
def test_backward_dw_gives_the_backward_results(name, main_grad, fp8, generator):
    """Each microbatch: after backward the input gradient and the non-linear gradients (norm, biases) are the
    reference's and the linear weights' are untouched; after backward_dw() all are the reference's, bitwise."""
    ref, delayed = _pair(name, fuse_wgrad_accumulation=main_grad)
    if main_grad:
        for layer in (ref, delayed):
            for p in _linear_weights(layer):
                p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    linear = {n for n, p in delayed.named_parameters() if any(p is w for w in _linear_weights(delayed))}
    for _ in range(MICROBATCHES):
        x = torch.randn(TOKENS, HIDDEN, generator=generator)
        dy = torch.randn(TOKENS, OUT if name != "LayerNormMLP" else HIDDEN, generator=generator)
        results = []
        for layer in (ref, delayed):
            xi = x.clone().requires_grad_()
            before = _copies(_grads(layer, main_grad))
            with autocast(RECIPES[fp8]):
                out = layer(xi)
            out.backward(dy)
            results.append((out, xi.grad, _grads(layer, main_grad)))
        (out_ref, dx_ref, grads_ref), (out, dx, grads) = results
        assert torch.equal(out, out_ref) and torch.equal(dx, dx_ref)
        for n, g in grads.items():
            if n in linear:  # untouched until backward_dw()
                assert (g is None and before[n] is None) or torch.equal(g, before[n]), n
            else:
                assert torch.equal(g, grads_ref[n]), n
        delayed.backward_dw()
        for n, g in _grads(delayed, main_grad).items():
            assert torch.equal(g, grads_ref[n]), n
        if main_grad:
            assert all(p.grad is None for p in _linear_weights(delayed))


@pytest.mark.parametrize("fp8", RECIPES)
@pytest.mark.parametrize("name", MODULES)
def test_queue_holds_several_backwards_first_in_first_out(name, fp8, generator):
    """All the microbatches' backwards first, then as many backward_dw(): the same accumulated gradients;
    one more backward_dw() raises, as TE's does on an empty queue."""
    ref, delayed = _pair(name)
    xs = [torch.randn(TOKENS, HIDDEN, generator=generator) for _ in range(MICROBATCHES)]
    for layer in (ref, delayed):
        for x in xs:
            with autocast(RECIPES[fp8]):
                out = layer(x)
            out.backward(torch.ones_like(out))
    assert all(p.grad is None for p in _linear_weights(delayed))
    for _ in xs:
        delayed.backward_dw()
    for (n, p), q in zip(ref.named_parameters(), delayed.parameters()):
        assert torch.equal(p.grad, q.grad), n
    with pytest.raises(RuntimeError, match="backward_dw.*no weight gradient is queued"):
        delayed.backward_dw()


def test_backward_dw_without_delay_is_a_no_op_and_parameters_split_gets_its_pieces(generator):
    """Without delay_wgrad_compute there is nothing to run (TE returns). With parameters_split the one
    weight gradient is split among the split weights, as autograd splits it through their concatenation."""
    ref, delayed = _pair("Linear", parameters_split=("query", "key", "value"))
    x = torch.randn(TOKENS, HIDDEN, generator=generator)
    for layer in (ref, delayed):
        layer(x).sum().backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    assert ref.backward_dw() is None
    assert all(torch.equal(p.grad, grads[n]) for n, p in ref.named_parameters())
    delayed.backward_dw()
    for n, p in delayed.named_parameters():
        assert torch.equal(p.grad, grads[n]), n


@pytest.mark.parametrize("block_recipe", [recipe.MXFP8BlockScaling(), recipe.Float8BlockScaling(),
                                          recipe.NVFP4BlockScaling()], ids=["mxfp8", "fp8_block", "nvfp4"])
def test_block_scaled_recipes(block_recipe, generator):
    """Under the block-scaled recipes the queued GEMM reads dy's columnwise usage only; results as without
    the delay, bitwise (NVFP4's stochastic rounding of dy is seeded, so the same draws)."""
    size = 128  # Float8BlockScaling's block
    ref = te_fuser.LayerNormLinear(size, size, device="cpu")
    delayed = te_fuser.LayerNormLinear(size, size, device="cpu", delay_wgrad_compute=True)
    delayed.load_state_dict(ref.state_dict())
    for _ in range(2):
        x = torch.randn(size, size, generator=generator)
        for layer in (ref, delayed):
            with autocast(block_recipe):
                out = layer(x)
            out.backward(torch.ones_like(out))
        assert delayed.weight.grad is None or not torch.equal(delayed.weight.grad, ref.weight.grad)
        delayed.backward_dw()
        for (n, p), q in zip(ref.named_parameters(), delayed.parameters()):
            assert torch.equal(p.grad, q.grad), n


def _tensor_parallel_case(rank):
    """Column- and row-parallel with sequence parallelism, no FP8 and current scaling: the input gathered
    (FP8 bytes) and dy gathered in backward are what the queue keeps; results as without the delay."""
    group = dist.group.WORLD
    for mode in ("column", "row"):
        for fp8 in ("no_fp8", "current"):
            torch.manual_seed(0)
            ref, delayed = [te_fuser.Linear(HIDDEN, 2 * OUT, parallel_mode=mode, sequence_parallel=True,
                                            tp_group=group, device="cpu", delay_wgrad_compute=d) for d in (False, True)]
            delayed.load_state_dict(ref.state_dict())
            g = torch.Generator().manual_seed(rank)
            for _ in range(2):
                x = torch.randn(TOKENS, ref.local_in_features, generator=g)
                results = []
                for layer in (ref, delayed):
                    xi = x.clone().requires_grad_()
                    with te_fuser.fp8_autocast(enabled=fp8 != "no_fp8", fp8_recipe=RECIPES[fp8], fp8_group=group):
                        out = layer(xi)
                    out.backward(torch.ones_like(out))
                    results.append(xi.grad)
                assert torch.equal(*results), (mode, fp8)
                delayed.backward_dw()
                for (n, p), q in zip(ref.named_parameters(), delayed.parameters()):
                    assert torch.equal(p.grad, q.grad), (mode, fp8, n)


def test_tensor_parallel_on_two_ranks():
    spawn(_tensor_parallel_case)


@compiles_te_fuser_modules
def test_torch_compile(generator):
    """fullgraph=True: a clear error (the backward is traced once, it could not queue at each call);
    without it, dynamo runs the fuser's autograd Function eagerly and the delay works."""
    torch._dynamo.reset()
    ref, delayed = _pair("Linear")
    with pytest.raises(Exception, match="delay_wgrad_compute under torch.compile"):
        torch.compile(delayed, fullgraph=True)(torch.randn(TOKENS, HIDDEN)).sum().backward()
    torch._dynamo.reset()
    compiled = torch.compile(delayed)
    for _ in range(2):
        x = torch.randn(TOKENS, HIDDEN, generator=generator)
        compiled(x).sum().backward()
        delayed.backward_dw()
        ref(x).sum().backward()
        assert torch.equal(delayed.weight.grad, ref.weight.grad)
    torch._dynamo.reset()


# -- lifetimes ---------------------------------------------------------------------------
def _never_dropped(queue):
    """The bug the lifetime test must catch: the queued entry is run but stays on the queue."""
    compute, operands = queue._pending[0]
    return compute(*operands)


def _step_bytes(layer, x, fp8, with_backward_dw: bool):
    """(CPU bytes a forward + backward (+ backward_dw) leaves allocated, bytes it must: the output, the
    input's gradient and the parameters' gradients)."""
    layer.zero_grad(set_to_none=True)
    x.grad = None

    def step():
        with autocast(RECIPES[fp8]):
            out = layer(x)
        out.backward(torch.ones_like(out))
        if with_backward_dw:
            layer.backward_dw()
        return out

    gc.collect()
    out, retained = retained_cpu_bytes(step)
    grads = sum(p.numel() * p.element_size() for p in layer.parameters() if p.grad is not None)
    return retained, out.numel() * out.element_size() + x.numel() * x.element_size() + grads


def _queued_bytes(name, fp8, tokens):
    """What the queue must hold per backward: each weight-gradient GEMM's x and dy (in x out features),
    4 bytes an element, or 1 under FP8 (their transposed FP8 bytes only). Linear and GroupedLinear queue
    the caller's own input without FP8, allocated before the step and so not counted."""
    gemms = [(HIDDEN, FFN), (FFN, HIDDEN)] if name == "LayerNormMLP" else [(HIDDEN, OUT)]
    size = 1 if RECIPES[fp8] is not None else 4
    caller_input = tokens * HIDDEN * size if size == 4 and name in ("Linear", "GroupedLinear") else 0
    return sum(tokens * (k + n) * size for k, n in gemms) - caller_input


@pytest.mark.parametrize("fp8", RECIPES)
@pytest.mark.parametrize("name", MODULES)
def test_queued_inputs_are_freed_by_backward_dw(name, fp8, monkeypatch, generator):
    """After backward the queue holds exactly the wgrad GEMMs' inputs (not an FP8 tensor's row-major bytes
    too); after backward_dw() the step keeps only what a step without the delay keeps. Bug-on control: a
    queue that runs its entry without dropping it keeps those bytes, and the measurement sees it."""
    tokens = 1024  # queued bytes (>= 100 KiB) far above the allocator's small-tensor noise
    layer = MODULES[name](delay_wgrad_compute=True)
    x = torch.randn(tokens, HIDDEN, generator=generator, requires_grad=True)
    queued = _queued_bytes(name, fp8, tokens)
    _step_bytes(layer, x, fp8, with_backward_dw=True)  # warm-up: the FP8 state exists before measuring

    kept, expected = _step_bytes(layer, x, fp8, with_backward_dw=False)  # (no weight grads yet)
    layer.backward_dw()  # empties the queue again
    assert abs(kept - expected - queued) <= 1024, ("the queue holds the wgrad inputs", kept - expected, queued)
    retained, expected = _step_bytes(layer, x, fp8, with_backward_dw=True)
    assert retained <= expected + 4096, (retained, expected)

    monkeypatch.setattr(WgradQueue, "run_oldest", _never_dropped)
    leaked, expected = _step_bytes(layer, x, fp8, with_backward_dw=True)
    assert leaked >= expected + queued - 1024, ("bug-on control", leaked, expected, queued)


@pytest.mark.parametrize("fp8", RECIPES)
@pytest.mark.parametrize("name", MODULES)
def test_nothing_on_ctx_after_backward_while_the_wgrad_waits(name, fp8, monkeypatch, generator):
    """The queued inputs are not the autograd graph's: after backward the graph walk finds nothing (and,
    as its control, finds the saved tensors with the fuser's clearing off), while a wgrad is still queued."""
    layer = MODULES[name](delay_wgrad_compute=True)
    ctx_walk_check(layer, lambda: torch.randn(TOKENS, HIDDEN, generator=generator, requires_grad=True),
                   RECIPES[fp8], monkeypatch)
    layer.backward_dw()  # both of the check's backwards queued one
    layer.backward_dw()
    with pytest.raises(RuntimeError, match="no weight gradient is queued"):
        layer.backward_dw()
