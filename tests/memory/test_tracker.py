"""MemoryTracker: exact CPU accounting through the profiler, nesting, C++-held bytes, CUDA stats."""

import pytest
import torch

from te_fuser.memory import DeviceMemory, MemoryTracker

MIB = 2**20
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_counts_exact_allocation_sizes_and_peak():
    numel = int(torch.randint(1000, 200000, ()).item())
    with MemoryTracker("cpu") as tracker:
        a = torch.empty(numel, dtype=torch.float32)
        b = torch.empty(2 * numel, dtype=torch.float64)
        del b
    assert tracker.devices["cpu"] == DeviceMemory("cpu", peak_bytes=4 * numel + 16 * numel, retained_bytes=4 * numel)
    assert tracker.peak_bytes == 20 * numel and tracker.retained_bytes == 4 * numel
    del a


def test_freeing_older_memory_does_not_hide_a_new_allocation():
    old = torch.empty(MIB)
    with MemoryTracker("cpu") as tracker:
        del old
        new = torch.empty(MIB // 4)
    assert tracker.retained_bytes == MIB  # the new block; the release of the old one is not counted
    del new


def test_nested_trackers_and_samples():
    with MemoryTracker("cpu") as outer:
        a = torch.empty(MIB)  # 4 MiB
        with MemoryTracker("cpu") as inner:
            b = torch.empty(MIB // 2)  # 2 MiB
            del a
            assert inner.sample() == 2 * MIB
        assert outer.sample() == 2 * MIB
        c = torch.empty(MIB // 4)
    assert (inner.peak_bytes, inner.retained_bytes) == (2 * MIB, 2 * MIB)
    assert (outer.peak_bytes, outer.retained_bytes) == (6 * MIB, 3 * MIB)
    assert outer.samples == [{"cpu": 2 * MIB}]
    del b, c


def test_decorator_reports_the_last_call():
    tracker = MemoryTracker("cpu")

    @tracker
    def make(n):
        return torch.empty(n)

    kept = make(1000)
    assert tracker.retained_bytes == 4000
    make(10)  # the returned tensor is still alive when the tracked call exits
    assert tracker.retained_bytes == 40 and tracker.peak_bytes == 40
    del kept


class _SavesHidden(torch.autograd.Function):
    """Keeps an intermediate only through save_for_backward: no Python object refers to it."""

    @staticmethod
    def forward(ctx, x):
        hidden = x.exp()
        ctx.save_for_backward(hidden)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (hidden,) = ctx.saved_tensors
        return grad * 2 + 0 * hidden


class _KeepsOnCtx(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.kept = x.exp()
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def test_sees_bytes_held_only_by_cpp_autograd_nodes():
    x = torch.randn(256, 1024, requires_grad=True)  # 1 MiB
    with MemoryTracker("cpu") as tracker:
        y = _SavesHidden.apply(x)
        after_forward = tracker.sample()
        y.sum().backward()
        after_backward = tracker.sample()
    assert after_forward == 2 * MIB  # y and the hidden buffer
    assert after_backward == 2 * MIB  # y and x.grad: backward freed the saved buffer inside C++
    assert tracker.peak_bytes >= 3 * MIB


def test_sees_plain_ctx_attributes_until_the_graph_dies():
    x = torch.randn(256, 1024, requires_grad=True)
    with MemoryTracker("cpu") as tracker:
        y = _KeepsOnCtx.apply(x)
        y.sum().backward()
        with_graph = tracker.sample()
        del y
        without_graph = tracker.sample()
    assert with_graph - without_graph == 2 * MIB  # y and ctx.kept die with the graph


def test_bad_devices_are_rejected():
    with pytest.raises(ValueError, match="device must be None, 'cpu', 'cuda' or 'cuda:N'"):
        MemoryTracker("tpu").__enter__()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            MemoryTracker("cuda").__enter__()


def test_results_only_after_the_block_and_no_reentry():
    tracker = MemoryTracker("cpu")
    with tracker:
        with pytest.raises(RuntimeError, match="after the block"):
            tracker.peak_bytes
        with pytest.raises(RuntimeError, match="already measuring"):
            tracker.__enter__()
    with pytest.raises(RuntimeError, match="only valid inside"):
        tracker.sample()


def test_refuses_to_share_the_profiler():
    with torch.profiler.profile():
        with pytest.raises(RuntimeError, match="another torch profiler is already running"):
            MemoryTracker("cpu").__enter__()
    with MemoryTracker("cpu") as tracker:  # still usable afterwards
        kept = torch.empty(10)
    assert tracker.retained_bytes == 40
    del kept


def test_a_profiler_started_inside_a_measurement_is_not_a_silent_zero():
    """It ends the session the tracker counts with: the tracker must say so, not report 0 bytes (a
    memory-budget test would pass whatever it allocated)."""
    with pytest.raises(RuntimeError, match="measurement is incomplete"):
        with MemoryTracker("cpu"):
            kept = torch.empty(1 << 20, dtype=torch.uint8)
            with torch.profiler.profile():
                torch.ones(4).sum()
            more = torch.empty(1 << 20, dtype=torch.uint8)
    del kept, more
    with MemoryTracker("cpu") as tracker:  # the next measurement is whole again
        kept = torch.empty(10)
    assert tracker.retained_bytes == 40


@CUDA
def test_cuda_garbage_from_before_the_block_is_not_counted_as_freed_by_it():
    class Node:
        pass

    def leave_a_cycle_holding(t):
        a, b = Node(), Node()
        a.other, b.other, a.tensor = b, a, t

    leave_a_cycle_holding(torch.empty(MIB, device="cuda"))
    with MemoryTracker("cuda") as tracker:
        kept = torch.empty(MIB // 4, device="cuda")
    assert tracker.retained_bytes == MIB
    del kept


@CUDA
def test_cuda_peak_and_retained_with_nesting():
    device = torch.device("cuda")
    with MemoryTracker("cuda") as outer:
        a = torch.empty(MIB, device=device)
        with MemoryTracker("cuda") as inner:
            b = torch.empty(MIB // 2, device=device)
            del b
        c = torch.empty(MIB // 4, device=device)
        del a
    cuda = outer.devices[str(torch.device("cuda", torch.cuda.current_device()))]
    assert cuda.peak_bytes >= 6 * MIB  # the inner reset of the peak counter did not hide a + b
    assert cuda.retained_bytes == MIB
    assert cuda.peak_absolute == cuda.allocated_at_entry + cuda.peak_bytes
    assert inner.peak_bytes >= 2 * MIB and inner.retained_bytes == 0
    del c
