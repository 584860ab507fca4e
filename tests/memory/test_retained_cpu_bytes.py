"""The tests' own measurement of retained CPU bytes, checked against blocks of known size.

Two earlier CI failures came from this helper, not from te_fuser: freeing a block that an earlier
profiler session saw allocated read as negative bytes and hid the leak a control test injects.
"""

import gc

import torch
from torch.profiler import ProfilerActivity, profile

from _fuser_ctx_walk import retained_cpu_bytes


def _profiled(fn):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        return fn()


def test_counts_what_the_call_leaves_alive_and_nothing_it_freed(generator):
    n = int(torch.randint(1, 4096, (1,), generator=generator))
    kept, _ = retained_cpu_bytes(lambda: (torch.empty(n), torch.ones(3 * n).sum()))
    assert kept[0].numel() == n
    _, held = retained_cpu_bytes(lambda: [torch.empty(n), torch.empty(2 * n, dtype=torch.float64)])
    assert held == n * 4 + 2 * n * 8
    _, held = retained_cpu_bytes(lambda: torch.empty(n).add_(1).sum().item())
    assert held == 0


def test_freeing_a_block_an_earlier_profiler_saw_allocated_is_not_negative(generator):
    n = int(torch.randint(1 << 14, 1 << 16, (1,), generator=generator))
    old = {"block": _profiled(lambda: torch.empty(n))}

    def step():
        del old["block"]
        return torch.empty(8)

    # The naive sum of the events' sizes reads the old block's free: the bug the helper had.
    old["block"] = _profiled(lambda: torch.empty(n))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        kept = step()
    assert kept.numel() == 8
    assert sum(e.self_cpu_memory_usage for e in prof.events()) == 32 - 4 * n

    old["block"] = _profiled(lambda: torch.empty(n))
    _, held = retained_cpu_bytes(step)
    assert held == 32


def test_garbage_of_an_earlier_measurement_is_collected_before_the_call():
    def cyclic():
        box = {"t": torch.empty(1 << 14)}
        box["self"] = box  # freed only by the cyclic collector
        return None

    gc.disable()
    try:
        retained_cpu_bytes(cyclic)
    finally:
        gc.enable()
    _, held = retained_cpu_bytes(lambda: torch.empty(4))
    assert held == 16
