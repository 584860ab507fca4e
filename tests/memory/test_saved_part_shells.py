"""A part of a quantized tensor saved for backward: its shell reaches no tensor bytes, and the ctx keeps
nothing beyond what save_for_backward holds. For every kind in _quantized_kinds.KINDS and every view op
that keeps a part quantized (slice, select, split, chunk, unbind, narrow, as_strided, views of parts).

A part is linked to the tensor it was cut from twice: te_fuser's own link (_whole: its writes requantize
the whole) and, for an autograd view, torch's view base. A shell left with either keeps the whole's bytes
(its transpose too) alive as long as the ctx lives: seed 000's bug (tensors kept on ctx) in te_fuser's own
clothes. Three measurements:
  * no shell reaches any storage, by a generic walk of every attribute it carries, its view base
    included (tests/_reachable.py);
  * a forward under a saved-tensor hook that copies what is saved (as activation offloading does) leaves
    allocated exactly its output and those copies, once the caller has dropped the whole: nothing else
    is kept by the ctx (te_fuser's MemoryTracker);
  * a training step keeps only the output and the input's grad, and no tensor stays on the graph.
The measurements are shown to catch a Function that keeps the whole on ctx, or the restored part.

Found by these tests (fixed): prepare_for_saving emptied a part in place, and the empty shell was still an
autograd view of the whole: 44 of the 48 shell walks (all but the detached parts) and the 12 offloading
measurements of view parts failed, and so did the fp8_mha path when the attention saved the caller's parts.
Planted in te_fuser/float8_tensor.py and seen failing (then reverted):
- the shell keeps te_fuser's link to its whole: `self._whole = None` dropped from the line of
  prepare_for_saving that empties the shell. The detached parts' cases (a part that is no autograd view
  keeps that link only) fail the shell walk and the offloading measurement (the whole's bytes stay
  allocated after the caller dropped the whole).
- the fix undone (`or self._base is not None` dropped): the failures above.
"""

import pytest
import torch

import te_fuser
from te_fuser.attention import function as attention_function
from te_fuser.examples.gpt import GPT, GPTConfig
from te_fuser.memory import audit_autograd
from te_fuser.tensor import QuantizedTensor

from _fuser_ctx_walk import allowed_storages, reachable_from, reachable_tensors, retained_cpu_bytes
from _quantized_kinds import KINDS, random_values
from _reachable import describe

ROWS, COLS = 16, 32
PARTS = {
    "slice": lambda t: t[2:7],
    "select": lambda t: t[3],
    "split": lambda t: t.split(4)[1],
    "split_with_sizes": lambda t: t.split([3, 13])[1],
    "chunk": lambda t: t.chunk(4)[2],
    "unbind": lambda t: t.unbind()[5],
    "narrow": lambda t: t.narrow(0, 4, 8),
    "columns": lambda t: t[:, 8:24],
    "as_strided": lambda t: t.as_strided((4, 16), (COLS, 1), 2 * COLS),
    "view_of_slice": lambda t: t[2:6].view(-1),
    "slice_of_slice": lambda t: t[2:12][3:5],
    "detached_slice": lambda t: t[2:7].detach(),
}


def _whole(kind, generator):
    return kind.make(random_values((ROWS, COLS), generator))


@pytest.mark.parametrize("part", list(PARTS))
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_the_shell_of_a_saved_part_reaches_no_bytes(kind, part, generator):
    whole = _whole(kind, generator)
    with torch.no_grad():
        piece = PARTS[part](whole)
    assert isinstance(piece, QuantizedTensor), f"{part} must keep the part quantized"
    values = piece.dequantize()
    assert reachable_from(piece), "the walk sees a live part's bytes"

    tensors, shells = te_fuser.prepare_for_saving(piece)
    found = reachable_from(shells, "shells")
    assert not found, "a saved part's shell reaches tensor bytes:\n" + describe(found)
    (restored,) = te_fuser.restore_from_saved(shells, tensors)
    assert torch.equal(restored.dequantize(), values)

    # Bug-on control: a link kept under any name, in any container, is seen.
    tensors, shells = te_fuser.prepare_for_saving(piece)
    shells[0].__dict__["kept_for_later"] = {"source": [whole]}
    assert reachable_from(shells, "shells")


class PartTimesInput(torch.autograd.Function):
    """y = x * part, the part cut in forward from a quantized tensor (a block of rows of an FP8 table, a
    chunk of a fused weight) and saved the te_fuser way: its buffers through save_for_backward, its
    shell on ctx.tensor_objects, dropped in backward."""

    @staticmethod
    def forward(ctx, x, whole, cut):
        part = cut(whole)
        y = x * part.dequantize(x.dtype)
        tensors, ctx.tensor_objects = te_fuser.prepare_for_saving(part)
        ctx.save_for_backward(*tensors)
        return y

    @staticmethod
    def backward(ctx, dy):
        (part,) = te_fuser.restore_from_saved(ctx.tensor_objects, ctx.saved_tensors)
        ctx.tensor_objects = None
        return dy * part.dequantize(dy.dtype), None, None


class KeepsTheWhole(PartTimesInput):
    """Bug-on control: the whole kept on ctx (seed 000's pattern)."""

    @staticmethod
    def forward(ctx, x, whole, cut):
        ctx.whole = whole
        return PartTimesInput.forward(ctx, x, whole, cut)


class KeepsWhatItRestored(PartTimesInput):
    """Bug-on control: the restored part left on ctx after backward (seed 000's bug)."""

    @staticmethod
    def backward(ctx, dy):
        ctx.tensor_objects = te_fuser.restore_from_saved(ctx.tensor_objects, ctx.saved_tensors)
        return dy * ctx.tensor_objects[0].dequantize(dy.dtype), None, None


def _nbytes(t):
    return t.untyped_storage().nbytes()


def retained_beyond_saved(forward):
    """(output, CPU bytes the forward leaves allocated beyond its output and what autograd saved).

    Every tensor saved for backward is packed as a copy (as activation offloading does), so the bytes
    the forward saved are those copies, and anything else still allocated is held some other way."""
    packed = []

    def pack(t):
        packed.append(t.detach().clone())
        return packed[-1]

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, retained = retained_cpu_bytes(forward)
    return out, retained - _nbytes(out) - sum(_nbytes(t) for t in packed)


SAVED_PARTS = ["slice", "columns", "view_of_slice", "detached_slice"]  # rows, strided columns, views of a part


def _part_forward(function, source, cut, x):
    def forward():
        with torch.no_grad():
            whole = source.clone()  # the caller's tensor, dropped once the forward returns
        return function.apply(x, whole, cut)
    return forward


def _inputs(kind, part, generator):
    source, cut = _whole(kind, generator), PARTS[part]
    x = random_values(tuple(cut(source).shape), generator).requires_grad_()
    return source, cut, x


@pytest.mark.parametrize("part", SAVED_PARTS)
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_a_saved_part_keeps_nothing_beyond_what_it_saved(kind, part, generator):
    source, cut, x = _inputs(kind, part, generator)
    y, beyond = retained_beyond_saved(_part_forward(PartTimesInput, source, cut, x))
    assert beyond == 0, f"{beyond} bytes held beyond the output and the saved tensors"
    found = reachable_tensors(y, allowed=set(), saved=False)
    assert not found, "the ctx reaches tensor bytes before backward:\n" + describe(found)


def _step(function, source, cut, x, grad):
    def step():
        y = _part_forward(function, source, cut, x)()
        y.backward(grad)
        return y
    x.grad = None
    return retained_cpu_bytes(step)


@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_a_step_through_a_saved_part_keeps_only_output_and_grad(kind, generator):
    source, cut, x = _inputs(kind, "slice", generator)
    grad = random_values(tuple(x.shape), generator)
    y, retained = _step(PartTimesInput, source, cut, x, grad)
    expected = _nbytes(y) + _nbytes(x.grad)
    assert retained == expected, f"{retained - expected} bytes beyond the output and x.grad"
    assert audit_autograd(y).clean and not reachable_tensors(y, allowed=set())
    torch.testing.assert_close(x.grad, grad * cut(source).dequantize(torch.float32), rtol=0, atol=0)


def test_the_measurements_catch_a_ctx_that_keeps_the_whole_or_the_restored_part(generator):
    """Bug-on controls of the two tests above (the kind with a transpose: the most bytes to keep)."""
    source, cut, x = _inputs(KINDS[1], "slice", generator)
    y, beyond = retained_beyond_saved(_part_forward(KeepsTheWhole, source, cut, x))
    assert beyond >= source.numel() and reachable_tensors(y, allowed=set(), saved=False)

    grad = random_values(tuple(x.shape), generator)
    y, retained = _step(KeepsWhatItRestored, source, cut, x, grad)
    assert retained >= _nbytes(y) + _nbytes(x.grad) + x.numel() and not audit_autograd(y).clean


GPT_CONFIG = GPTConfig(vocab_size=64, seq_len=64, hidden_size=64, num_heads=2, num_layers=1, ffn_hidden_size=128)


def _caller_parts_as_they_are(original):
    """What FP8 attention would save without rewrapped(): the caller's q, k, v parts themselves."""
    return lambda t, quantizer: t if isinstance(t, QuantizedTensor) else original(t, quantizer)


@pytest.mark.parametrize("saved", ["rewrapped", "parts_as_they_are"])
def test_fp8_mha_keeps_nothing_beyond_what_it_saved(saved, monkeypatch):
    """te_fuser's own path through parts: under fp8_mha the GPT block's attention gets q, k, v as views
    of the QKV projection's FP8 output (split, then view) and saves them (its own wrappers over their
    bytes, or, as if it did not rewrap them, the parts themselves)."""
    if saved == "parts_as_they_are":
        monkeypatch.setattr(attention_function, "fp8_input", _caller_parts_as_they_are(attention_function.fp8_input))
    torch.manual_seed(0)
    model = GPT(GPT_CONFIG, dtype=torch.bfloat16)
    tokens = torch.randint(0, GPT_CONFIG.vocab_size, (GPT_CONFIG.seq_len, 2))
    fp8_recipe = te_fuser.recipe.DelayedScaling(fp8_dpa=True, fp8_mha=True)

    def forward():
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            return model(tokens)

    forward().float().sum().backward()  # the first step creates the FP8 scaling state
    model.zero_grad(set_to_none=True)
    out, beyond = retained_beyond_saved(forward)
    assert beyond == 0, f"{beyond} bytes held beyond the output and the saved tensors"
    found = reachable_tensors(out, allowed_storages(model), saved=False)
    assert not found, "a ctx reaches tensor bytes before backward:\n" + describe(found)
    out.float().sum().backward()
    assert audit_autograd(out).clean
