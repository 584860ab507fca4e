"""Seed 000 / 001 (TransformerEngine op fuser, FP8 attention): quantized tensor objects kept
on ``ctx.tensor_objects`` survive backward until the graph dies (the next iteration), so a
training loop holds one extra step of fp8 copies at its peak. The fix clears the attribute
right after restore_from_saved. Shown with a generic quantized-tensor-like object and with
te_fuser.Float8Tensor and its saved-tensor helpers; the op-fuser and attention versions live
next to those modules.
"""

import pytest
import torch
from memory_patterns import Float8TensorLike, QuantizedLinearFunction, TeFuserQuantizedLinearFunction

from te_fuser.memory import MemoryTracker, audit_autograd

TOKENS, IN, OUT = 512, 512, 512
KIB = 1024
# fp8 copies of x and w with their transposes, plus two float32 scales
QUANTIZED_BYTES = 2 * TOKENS * IN + 2 * IN * OUT + 2 * 4


FUNCTIONS = [QuantizedLinearFunction, TeFuserQuantizedLinearFunction]


def _training_loop(function, clear, steps=3):
    """Like a real loop: ``loss`` of step k is only dropped when step k+1 assigns it."""
    torch.manual_seed(0)
    w = torch.randn(IN, OUT, requires_grad=True)
    x = torch.randn(TOKENS, IN)
    loss = None
    with MemoryTracker("cpu") as tracker:
        for _ in range(steps):
            w.grad = None
            tracker.sample()  # what the step's forward starts with
            loss = function.apply(x, w, clear).square().mean()
            loss.backward()
    return tracker, loss, w


def test_quantized_object_bytes_match_the_pattern():
    q = Float8TensorLike.quantize(torch.randn(TOKENS, IN))
    assert q.nbytes() == 2 * TOKENS * IN + 4


@pytest.mark.parametrize("function", FUNCTIONS)
def test_tensor_objects_kept_on_ctx_are_caught(function):
    buggy, loss, _ = _training_loop(function, clear=False)
    fixed, _, _ = _training_loop(function, clear=True)
    # every later step's forward starts with the previous step's fp8 copies still allocated
    starts = [b["cpu"] - f["cpu"] for b, f in zip(buggy.samples, fixed.samples)]
    assert starts == [0, QUANTIZED_BYTES, QUANTIZED_BYTES]
    # and after the loop the graph of the last step still holds them
    assert buggy.retained_bytes - fixed.retained_bytes == QUANTIZED_BYTES
    report = audit_autograd(loss)
    assert report.total_bytes == QUANTIZED_BYTES
    assert {f.attribute for f in report.findings} == {"tensor_objects"}


@pytest.mark.limit_retained_memory(f"{(IN * OUT * 4 + 64) // KIB + 1} KiB", device="cpu")
@pytest.mark.parametrize("function", FUNCTIONS)
def test_clearing_tensor_objects_after_restore_frees_them(function):
    fixed, loss, w = _training_loop(function, clear=True)
    assert audit_autograd(loss).clean
    # what stays: w.grad and the loss scalar
    assert fixed.retained_bytes == w.grad.numel() * 4 + 4
