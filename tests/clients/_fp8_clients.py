"""What the accelerate and Lightning tests share: the Llama-style model under a fixed seed, its float32
reference losses, the training loop, and the checks -- FP8 engaged in te_fuser's layers, nothing left
on the autograd graph after backward, no bytes left allocated by a training step."""

import contextlib
import functools
import sys
from pathlib import Path

import torch

import te_fuser
from te_fuser.quantization import DelayedScalingState
from te_fuser.recipe import DelayedScaling
from te_fuser.tensor import Float8CurrentScalingQuantizer

from _llama import LlamaConfig, LlamaForCausalLM, batches

sys.path.append(str(Path(__file__).resolve().parents[1] / "memory"))  # home of the graph walk
from _fuser_ctx_walk import allowed_storages, reachable_tensors, retained_cpu_bytes  # noqa: E402

SEED, STEPS, LR = 1234, 4, 0.1
CONFIG = LlamaConfig()
DATA = batches(CONFIG, STEPS)
# Every nn.Linear of the model becomes a te_fuser.Linear: q, k, v, o and gate, up, down per layer, lm_head.
NUM_LINEARS = 7 * CONFIG.num_hidden_layers + 1
# Relative loss differences to the float32 run, FP8 HYBRID (E4M3 forward, E5M2 gradients), with float32
# or bf16 weights, under accelerate's bf16 autocast or not; seen: < 3e-3 at step 0, < 5e-3 at later steps
# (whose weights have had FP8 updates).
STEP0_TOL, STEPS_TOL = 1e-2, 2e-2


def build_model() -> LlamaForCausalLM:
    """The same weights every time, whatever ran before."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(SEED)
        return LlamaForCausalLM(CONFIG)


def train(model, optimizer, backward=lambda loss: loss.backward(), on_last_backward=None) -> list:
    """One SGD step per batch of DATA; each step's loss. on_last_backward(loss) runs after the last
    backward while the loss, and with it the whole graph, is still alive."""
    losses = []
    model.train()
    for step, (input_ids, labels) in enumerate(DATA):
        loss = model(input_ids, labels)
        backward(loss)
        if on_last_backward is not None and step == len(DATA) - 1:
            on_last_backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def sgd(model) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR)


@functools.lru_cache(maxsize=None)
def reference_losses() -> tuple:
    """The plain float32 model's losses: the high-precision run."""
    model = build_model()
    return tuple(train(model, sgd(model)))


def assert_losses_near_reference(losses) -> None:
    reference = reference_losses()
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, reference)]
    assert rel[0] < STEP0_TOL and max(rel) < STEPS_TOL, (losses, reference)
    assert rel[0] > 1e-6, (losses, reference)  # FP8 changed the numbers: it ran
    assert losses[-1] < losses[0]  # it trains


def te_fuser_linears(model) -> list:
    return [m for m in model.modules() if isinstance(m, te_fuser.Linear)]


def assert_fp8_ran(model, recipe) -> None:
    """Every linear ran its last forward in FP8 with the recipe's scaling: delayed scaling's amax
    histories recorded and its scales updated, current scaling's per-tensor quantizers."""
    linears = te_fuser_linears(model)
    assert len(linears) == NUM_LINEARS, [type(m).__name__ for m in model.modules()]
    for linear in linears:
        op = linear._ops[0]
        assert op._fp8_enabled and op._fp8_recipe == recipe
        if isinstance(recipe, DelayedScaling):
            for state in op._fp8_states:
                assert isinstance(state, DelayedScalingState)
                assert {t.dtype for t in (state.amax_history, state.amax, state.scale, state.scale_inv)} == \
                    {torch.float32}
                assert bool((state.amax_history.amax(0) > 0).all()) and bool((state.scale != 1).all())
        else:
            assert all(isinstance(q, Float8CurrentScalingQuantizer)
                       for q in op._forward_quantizers + op._backward_quantizers)


def graph_walk(model):
    """(found, on_last_backward): found receives (path, shape, dtype) of each tensor still reachable from
    the graph after backward, apart from the model's parameters and te_fuser's FP8 state."""
    found = []

    def walk(loss):
        found.extend((path, tuple(t.shape), str(t.dtype))
                     for path, t in reachable_tensors(loss, allowed_storages(model)))

    return found, walk


@contextlib.contextmanager
def fuser_release_off():
    """The bug-on control: te_fuser's fuser keeps its saved tensors on the ctx after backward."""
    from te_fuser.ops import fuser

    fuser._CLEAR_CTX_AFTER_BACKWARD = False
    try:
        yield
    finally:
        fuser._CLEAR_CTX_AFTER_BACKWARD = True


def retained_per_step(model, optimizer, backward=lambda loss: loss.backward(), keep=None, steps=2) -> list:
    """The CPU bytes each further training step leaves allocated (te_fuser's MemoryTracker): all 0 when
    memory is flat across steps. keep: a list each step's loss is appended to, the logged-loss bug
    (seed 002), for the control."""
    input_ids, labels = DATA[0]

    def step():
        loss = model(input_ids, labels)
        backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if keep is not None:
            keep.append(loss)

    return [retained_cpu_bytes(step)[1] for _ in range(steps)]
