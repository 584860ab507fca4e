"""te_fuser.get_cpu_offload_context (TE 2.6's CPU offload) on the CPU.

The moving logic runs here with a copier that moves tensors into new CPU buffers and records each move,
so the tests see every saved activation go out in forward and come back in backward exactly once, at the
layer commits TE's window map names, with outputs and gradients equal to a run without offload. The
lifetime tests walk the handler and measure the bytes a step leaves allocated, each with a bug-on
control: a handler that keeps its host copies.
"""

import copy
import warnings

import pytest
import torch

import te_fuser
from te_fuser import compat, cpu_offload, recipe
from te_fuser.cpu_offload import (AsyncDoubleBufferGroupOffloadHandler, CpuOffloadHookWithOffloadHandler,
                                  get_cpu_offload_context, group_prefetch_offload_commit)
from te_fuser.memory import MemoryTracker
from te_fuser.tensor.float8_blockwise_tensor import Float8BlockQuantizer
from te_fuser.tensor.mxfp8_tensor import MXFP8Quantizer

from _quantized_kinds import KINDS, random_values
from _reachable import describe, reachable_storages

HIDDEN, FFN, HEADS, SEQ, BATCH = 64, 128, 4, 16, 2
RECIPES = {"no_fp8": None, "delayed": recipe.DelayedScaling(), "current": recipe.Float8CurrentScaling()}
MODULES = {
    "linear": lambda: te_fuser.Linear(HIDDEN, HIDDEN, device="cpu"),
    "layernorm_mlp": lambda: te_fuser.LayerNormMLP(HIDDEN, FFN, device="cpu"),
    "transformer_layer": lambda: te_fuser.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0,
                                                           attention_dropout=0.0, device="cpu"),
}


class RecordingCopier:
    """Moves tensors into new CPU buffers (the "host"), recording each move: (direction, host buffer id,
    the handler's current group, the phase the test set)."""

    def __init__(self):
        self.moves, self.phase, self.handler = [], None, None
        self.sources = []  # storage addresses of the tensors moved out

    @staticmethod
    def takes(tensor):
        del tensor
        return True

    def _record(self, direction, hosts):
        self.moves += [(direction, id(h), self.handler.current_group, self.phase) for h in hosts]

    def to_host(self, tensors):
        hosts = [t.detach().clone() for t in tensors]
        self.sources += [t.untyped_storage().data_ptr() for t in tensors]
        self._record("out", hosts)
        return hosts, None

    def to_device(self, hosts, devices):
        del devices
        self._record("in", hosts)
        return [h.clone() for h in hosts], None

    @staticmethod
    def wait(event):
        assert event is None


class LeakyHandler(AsyncDoubleBufferGroupOffloadHandler):
    """The bug-on control: a handler that keeps the host copies it reloaded from."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kept = []

    def _reload(self, records):
        self.kept += [h for r in records for h in r.hosts if h is not None]
        super()._reload(records)


def _offload(num_layers, model_layers, handler_type=AsyncDoubleBufferGroupOffloadHandler):
    copier = RecordingCopier()
    handler = handler_type(num_layers, model_layers, copier=copier)
    copier.handler = handler
    return CpuOffloadHookWithOffloadHandler(handler), (lambda t: group_prefetch_offload_commit(t, handler)), copier


def _run(models, x, fp8_recipe, context=None, sync=None, copier=None, between=None):
    """Forward through the models (each inside the context, its output through sync), backward with a
    fixed gradient: (output, input grad, parameter grads). between() runs after the forward."""
    x = x.detach().clone().requires_grad_()
    h = x
    if copier is not None:
        copier.phase = "forward"
    for model in models:
        with te_fuser.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe), \
                (context if context is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)):
            h = model(h)
        h = sync(h) if sync is not None else h
    if between is not None:
        between()
    if copier is not None:
        copier.phase = "backward"
    h.backward(torch.linspace(-1, 1, h.numel()).reshape(h.shape))
    return h.detach(), x.grad, [p.grad for m in models for p in m.parameters()]


def _models(kind, n):
    torch.manual_seed(0)
    return [MODULES[kind]() for _ in range(n)]


def _input():
    return random_values((SEQ, BATCH, HIDDEN), torch.Generator().manual_seed(1))


@pytest.mark.parametrize("fp8", RECIPES)
@pytest.mark.parametrize("kind", MODULES)
def test_offloaded_run_matches_plain_run(kind, fp8):
    """Outputs and every gradient equal, bit for bit, with 2 of 3 layers' activations moved out and back."""
    models = _models(kind, 3)
    reference = _run(copy.deepcopy(models), _input(), RECIPES[fp8])
    context, sync, copier = _offload(2, 3)
    offloaded = _run(models, _input(), RECIPES[fp8], context, sync, copier)
    assert copier.moves, "nothing was offloaded"
    out, dx, grads = offloaded
    assert torch.equal(out, reference[0]) and torch.equal(dx, reference[1])
    assert len(grads) == len(reference[2]) and all(torch.equal(a, b) for a, b in zip(grads, reference[2]))


@pytest.mark.parametrize("fp8", RECIPES)
@pytest.mark.parametrize("kind", MODULES)
def test_weights_stay(kind, fp8):
    """No tensor over a parameter's bytes moves (the fused QKV weight, a view over the split parameters'
    storage, included); activations do."""
    models = _models(kind, 2)
    context, sync, copier = _offload(1, 2)
    _run(models, _input(), RECIPES[fp8], context, sync, copier)
    params = {p.untyped_storage().data_ptr() for m in models for p in m.parameters()}
    assert copier.sources and not params & set(copier.sources)


@pytest.mark.parametrize("fp8", ["no_fp8", "current"])
def test_each_saved_activation_moves_out_once_and_back_once(fp8):
    """Every non-parameter tensor saved by the offloaded layers goes out in forward at its layer's commit
    (after which the handler reaches its host copy only), and comes back once in backward at the commit
    of the layer TE's window map gives its group, before that group's backward. The last layer's tensors
    stay."""
    models = _models("layernorm_mlp", 4)
    saved_per_layer = []
    for model in copy.deepcopy(models):  # the independent count: what autograd saves, parameters aside
        seen = []
        with te_fuser.fp8_autocast(enabled=fp8 != "no_fp8", fp8_recipe=RECIPES[fp8]), \
                torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
            model(_input().requires_grad_())
        saved_per_layer.append(sum(not isinstance(t, torch.nn.Parameter) and not isinstance(t._base, torch.nn.Parameter)
                                   for t in seen))
    context, sync, copier = _offload(3, 4)
    held = []
    _run(models, _input(), RECIPES[fp8], context, sync, copier,
         between=lambda: held.extend(id(t) for _, t in reachable_storages(context, follow_weakrefs=True)))
    windows = copier.handler.layer_window_map
    assert windows == {0: 1, 1: 2, 2: 3}
    outs = [(buf, group, phase) for d, buf, group, phase in copier.moves if d == "out"]
    ins = [(buf, group, phase) for d, buf, group, phase in copier.moves if d == "in"]
    assert sorted(b for b, _, _ in outs) == sorted(b for b, _, _ in ins)  # each buffer out once, in once
    assert len({b for b, _, _ in outs}) == len(outs) == sum(saved_per_layer[:3])
    for layer in range(3):
        assert sum(g == layer and p == "forward" for _, g, p in outs) == saved_per_layer[layer]
        # reloaded at the backward commit of its window layer (current_group then is that layer)
        assert sum(g == windows[layer] and p == "backward" for _, g, p in ins) == saved_per_layer[layer]
    assert all(p == "forward" for _, _, p in outs) and all(p == "backward" for _, _, p in ins)
    # between forward and backward the offloaded tensors are their host copies alone: no device reference
    assert sorted(held) == sorted(b for b, _, _ in outs)


def _step(models, context, sync, dy):
    h = torch.ones(SEQ, BATCH, HIDDEN)
    for model in models:
        with context:
            h = model(h)
        h = sync(h)
    h.backward(dy)


@pytest.mark.parametrize("leaky", [False, True], ids=["handler", "bug_on_control"])
def test_nothing_held_after_backward(leaky):
    """After backward the handler reaches no tensor (its records, host copies and restored tensors
    died with the graph), and a step leaves 0 bytes allocated. Bug on: a handler that keeps its host
    copies is caught by both measurements."""
    models = _models("layernorm_mlp", 3)
    context, sync, copier = _offload(2, 3, LeakyHandler if leaky else AsyncDoubleBufferGroupOffloadHandler)
    handler = copier.handler
    dy = torch.randn(SEQ, BATCH, HIDDEN)
    _step(models, context, sync, dy)  # grads exist from now on: later steps add into them in place
    handler_kept = getattr(handler, "kept", [])
    handler_kept.clear()

    h = torch.ones(SEQ, BATCH, HIDDEN)
    for model in models:
        with context:
            h = model(h)
        h = sync(h)
    between = reachable_storages(context, "context", follow_weakrefs=True)
    assert between, "the walk must see the host copies while the graph holds them"
    h.backward(dy)
    del h
    after = reachable_storages(context, "context", follow_weakrefs=True)
    with MemoryTracker(device="cpu") as tracker:
        _step(models, context, sync, dy)
    if leaky:
        assert after and tracker.retained_bytes > 0
    else:
        assert not after, "the handler still reaches:\n" + describe(after)
        assert tracker.retained_bytes == 0


def test_dropped_graph_frees_host_copies():
    """A forward whose graph is dropped without backward leaves nothing behind in the handler."""
    models = _models("linear", 3)
    context, sync, copier = _offload(2, 3)
    h = torch.ones(SEQ, BATCH, HIDDEN)
    for model in models:
        with context:
            h = model(h)
        h = sync(h)
    assert copier.moves
    del h
    assert not reachable_storages(context, "context", follow_weakrefs=True)


@pytest.mark.parametrize("make", [*[k.make for k in KINDS[:2]],
                                  lambda v: MXFP8Quantizer(torch.float8_e4m3fn)(v),
                                  lambda v: Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True,
                                                                 block_scaling_dim=1)(v)],
                         ids=[k.name for k in KINDS[:2]] + ["mxfp8", "block1d"])
def test_quantized_tensor_moves_its_buffers(make):
    """A quantized tensor saved by a torch op moves as its buffers (prepare_for_saving); the caller's
    object keeps its own, and the gradient through it is the one without offload."""
    values = random_values((32, 64), torch.Generator().manual_seed(2))
    w = torch.randn(32, 64, requires_grad=True)
    q = make(values)
    q.requires_grad_()
    expected = torch.autograd.grad((q * w).sum(), w)[0]
    buffers = [name for name, v in vars(q).items() if isinstance(v, torch.Tensor)]
    context, sync, copier = _offload(1, 1)
    copier.phase = "forward"
    with context:
        y = (q * w).sum()
    y = sync(y.reshape(1))
    assert all(getattr(q, name) is not None for name in buffers), "the caller's tensor was emptied"
    assert len(copier.moves) >= 2  # its data and scale at least, and w's is not among them
    copier.phase = "backward"
    (grad,) = torch.autograd.grad(y.sum(), w)
    assert torch.equal(grad, expected)
    assert sum(d == "in" for d, *_ in copier.moves) == sum(d == "out" for d, *_ in copier.moves)


def test_layers_past_the_run_are_read_from_the_device():
    """One layer run of 3 model layers: its copies started, but their window (layer 1) never came, so
    backward reads the device tensors and nothing comes back from the host."""
    models = _models("linear", 1)
    reference = _run(copy.deepcopy(models), _input(), None)
    context, sync, copier = _offload(2, 3)
    out, dx, grads = _run(models, _input(), None, context, sync, copier)
    assert [d for d, *_ in copier.moves] and all(d == "out" for d, *_ in copier.moves)
    assert torch.equal(out, reference[0]) and torch.equal(dx, reference[1])
    assert all(torch.equal(a, b) for a, b in zip(grads, reference[2]))


def test_a_tensor_saved_twice_moves_once():
    """x saved by two ops of a layer moves out once and back once, and both gradients are right."""
    x = torch.randn(8, 8)
    a, b = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    context, sync, copier = _offload(1, 1)
    with context:
        y = x * a + x * b
    sync(y).sum().backward()
    assert [d for d, *_ in copier.moves] == ["out", "in"]
    assert torch.equal(a.grad, x) and torch.equal(b.grad, x)


@pytest.mark.parametrize("layers", [(1, 1), (1, 2)], ids=["offloaded", "read_from_device"])
def test_changed_in_place_after_saving_raises(layers):
    """autograd's version check survives the hooks: a saved tensor changed in place before its offload (or
    before backward, when its group stayed on the device) makes backward raise, instead of the gradient
    reading the new values."""
    x = torch.randn(8, 8)
    a = torch.randn(8, 8, requires_grad=True)
    context, sync, _ = _offload(*layers)
    with context:
        y = x * a
        x.mul_(2)
    y = sync(y)
    with pytest.raises(RuntimeError, match="inplace"):
        y.sum().backward()


def test_changed_in_place_by_a_later_layer_raises():
    """Layer 0's saved tensor written by layer 1 while its copy runs (its window is layer 1's commit)."""
    x = torch.randn(8, 8)
    a = torch.randn(8, 8, requires_grad=True)
    context, sync, _ = _offload(1, 2)
    with context:
        y = sync(x * a)
    with context:
        x.add_(1)
        y = sync(y * 2)
    with pytest.raises(RuntimeError, match="inplace"):
        y.sum().backward()


def test_parameters_stay():
    """Parameters (and views of them, such as the transposed weight a GEMM saves) never move."""
    w = torch.nn.Parameter(torch.randn(8, 8))
    context, sync, copier = _offload(1, 2)
    with context:
        y = (w * w.t()).sum(0)  # saves w and its transposed view
    sync(y).sum().backward()
    assert copier.moves == []
    assert torch.equal(w.grad, 2 * w.detach().t())


def test_cpu_context_warns_once_and_moves_nothing(monkeypatch):
    """Without CUDA the context is TE's (hooks on, CPUOffloadEnabled while entered), says once that it has
    nothing to move, and the run equals the plain one."""
    if torch.cuda.is_available():
        pytest.skip("the CPU-only message is for machines without CUDA")
    monkeypatch.setattr(cpu_offload, "_warned_nothing_to_move", False)
    with pytest.warns(UserWarning, match="nothing"):
        context, sync = get_cpu_offload_context(True, 1, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        get_cpu_offload_context(True, 1, 2)
    assert context.moves_tensors is False
    assert not cpu_offload.is_cpu_offload_enabled()
    with context:
        assert cpu_offload.is_cpu_offload_enabled() and cpu_offload.CPUOffloadEnabled
    assert not cpu_offload.is_cpu_offload_enabled()
    models = _models("linear", 2)
    reference = _run(copy.deepcopy(models), _input(), None)
    out, dx, grads = _run(models, _input(), None, context, sync)
    assert torch.equal(out, reference[0]) and torch.equal(dx, reference[1])
    assert all(torch.equal(a, b) for a, b in zip(grads, reference[2]))


def test_arguments():
    with pytest.raises(ValueError, match="offload_activations"):
        get_cpu_offload_context(True, offload_activations=False, offload_weights=False)
    with pytest.raises(ValueError, match="num_layers"):
        get_cpu_offload_context(True, num_layers=3, model_layers=2)
    with pytest.raises(ValueError, match="model_layers"):
        get_cpu_offload_context(True, num_layers=0, model_layers=-1)
    with pytest.warns(DeprecationWarning, match="weights"):
        context, sync = get_cpu_offload_context(True, offload_activations=False, offload_weights=True)
    x = torch.ones(2, requires_grad=True)
    assert sync(x) is x
    context, sync = get_cpu_offload_context(False, 1, 2)
    assert sync(x) is x
    with pytest.raises(NotImplementedError, match="double_buffering"):
        get_cpu_offload_context(True, 1, 2, double_buffering=True)


def test_te_names_through_the_alias():
    compat.install_transformer_engine()
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.pytorch.cpu_offload import is_cpu_offload_enabled, mark_activation_offload
    finally:
        compat.uninstall_transformer_engine()

    assert te.get_cpu_offload_context is get_cpu_offload_context
    assert is_cpu_offload_enabled is cpu_offload.is_cpu_offload_enabled
    t = torch.ones(2)
    mark_activation_offload(t, None)
    assert t.activation_offloading
