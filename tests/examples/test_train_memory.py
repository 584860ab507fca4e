"""Memory stays flat on the example GPT: across 100 steps, and across 128 microbatches of one step.

The limits are plugin markers; each is shown to catch the bug it guards against
by running the buggy pattern under the same measurement.
"""

import gc

import pytest
import torch

from te_fuser.examples import train
from te_fuser.ops import fuser
from te_fuser.memory import MemoryTracker

TINY = ["--device", "cpu", "--hidden", "32", "--heads", "2", "--layers", "1", "--seq-len", "32", "--batch-size", "2",
        "--quiet", "--plot", ""]
# One step of this model peaks at about 0.8 MiB; one microbatch's graph is about 0.2 MiB.
PEAK_LIMIT = 2 * 2**20


class GraphKeepingLog(list):
    """The seed-002 bug: logging the loss tensor itself keeps its whole graph alive."""

    def append(self, loss):
        super().append(loss)

    def mean(self):
        return sum(x.item() for x in self) / len(self)


@pytest.mark.limit_peak_memory(PEAK_LIMIT, device="cpu")
@pytest.mark.limit_retained_memory("64 KiB", device="cpu")
def test_flat_across_100_steps():
    history = train.main(TINY + ["--steps", "100"])
    held = [h["current"] for h in history[1:]]  # the first step allocates the optimizer's state
    assert max(held) - min(held) <= 16 * 2**10, held
    assert all(h["retained"] <= 16 * 2**10 for h in history[1:])
    assert gc.get_freeze_count() == 0  # train's gc_frozen block gave its objects back to the collector


@pytest.mark.limit_peak_memory(PEAK_LIMIT, device="cpu")
def test_flat_across_128_microbatches():
    (record,) = train.main(TINY + ["--steps", "1", "--microbatches", "128"])
    assert record["peak"] < PEAK_LIMIT


def _peak_of_128_microbatches():
    with MemoryTracker(device="cpu") as mem:
        train.main(TINY + ["--steps", "1", "--microbatches", "128"])
    return mem.peak_bytes


def test_the_measurement_catches_graph_keeping_loss_logs(monkeypatch):
    """Seed 002 needs two faults: logged losses that keep their graph, and a Function whose
    ctx keeps tensors. With te_fuser's ctx clearing switched off, the measurement sees the
    growth; te_fuser's layers alone (clearing on) hold nothing even under the naive log."""
    monkeypatch.setattr(train, "LossLog", GraphKeepingLog)
    assert _peak_of_128_microbatches() < PEAK_LIMIT
    monkeypatch.setattr(fuser, "_CLEAR_CTX_AFTER_BACKWARD", False)
    assert _peak_of_128_microbatches() > 3 * PEAK_LIMIT


def _cycle_holding_one_mib():
    cycle = [torch.ones(2**18)]
    cycle.append(cycle)


def test_gc_frozen_still_collects_the_steps_cycles():
    """train freezes setup's objects so the trackers' collections stay cheap; garbage cycles made
    inside the block must still be collected, or steps would report them as retained."""
    was_enabled = gc.isenabled()
    gc.disable()  # no automatic collection between the statements below
    try:
        with train.gc_frozen():
            assert gc.get_freeze_count() > 0
            with MemoryTracker(device="cpu") as mem:
                _cycle_holding_one_mib()
            assert mem.retained_bytes < 64 * 2**10
            # The measurement sees the cycle when nothing collects it.
            with MemoryTracker(device="cpu", gc_collect=False) as mem:
                _cycle_holding_one_mib()
            assert mem.retained_bytes >= 2**20
            gc.collect()
    finally:
        if was_enabled:
            gc.enable()
    assert gc.get_freeze_count() == 0
