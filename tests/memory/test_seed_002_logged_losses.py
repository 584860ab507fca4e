"""Seed 002 (Fast-LLM): losses stored for logging kept their grad_fn, and through a custom
Function's ctx every microbatch's stage tensors; memory grew per microbatch until OOM.

The buggy loop is caught by MemoryTracker (the measurement the plugin markers use); the
LossLog / detach_for_logging loops stay flat, with the limits written as plugin markers.
"""

import pytest
import torch
from memory_patterns import StageFunction

from te_fuser.memory import LossLog, MemoryTracker, audit_autograd, detach_for_logging

MICROBATCHES = 128
BATCH, WIDTH = 64, 256
STAGE_BYTES = 2 * BATCH * WIDTH * 4  # ctx.context: the stage input and its hidden activation
KIB = 1024


def _train_step(log):
    """One step over MICROBATCHES microbatches; samples the tracker after each one."""
    torch.manual_seed(0)
    w = torch.randn(WIDTH, WIDTH, requires_grad=True)
    w.grad = torch.zeros_like(w)  # gradients accumulate in place: no new allocation per step
    with MemoryTracker("cpu") as tracker:
        for _ in range(MICROBATCHES):
            loss = StageFunction.apply(torch.randn(BATCH, WIDTH), w)
            loss.backward()
            log(loss)
            del loss
            tracker.sample()
    return tracker, [sample["cpu"] for sample in tracker.samples]


def test_storing_losses_with_grad_fn_is_caught():
    losses = []
    tracker, samples = _train_step(losses.append)
    growth = samples[-1] - samples[0]
    assert growth >= (MICROBATCHES - 1) * STAGE_BYTES  # every microbatch's stage tensors survive
    assert tracker.retained_bytes >= MICROBATCHES * STAGE_BYTES
    report = audit_autograd(losses)
    assert len(report.findings) == MICROBATCHES
    assert report.total_bytes == MICROBATCHES * STAGE_BYTES


@pytest.mark.limit_retained_memory("4 KiB", device="cpu")
@pytest.mark.limit_peak_memory("2 MiB", device="cpu")
def test_loss_log_keeps_memory_flat():
    log = LossLog()
    tracker, samples = _train_step(log.append)
    assert samples[-1] - samples[0] == (MICROBATCHES - 1) * 4  # one float32 scalar per microbatch
    assert tracker.retained_bytes == MICROBATCHES * 4
    values = log.values()
    assert len(values) == MICROBATCHES and all(v > 0 for v in values)


@pytest.mark.limit_retained_memory("4 KiB", device="cpu")
def test_detach_for_logging_keeps_memory_flat():
    logged = []
    tracker, samples = _train_step(lambda loss: logged.append(detach_for_logging({"loss": loss, "parts": (loss,)})))
    # the detached loss shares the loss's 4-byte storage, and nothing else of the microbatch
    assert samples[-1] - samples[0] == (MICROBATCHES - 1) * 4
    assert audit_autograd([entry["loss"] for entry in logged]).nodes_visited == 0
