"""assert_no_leak: run a training step repeatedly and fail when torch memory keeps growing."""

import collections
import dataclasses
import gc
import weakref

import torch

from .audit import audit_autograd
from .sizes import format_bytes, parse_size
from .tracker import MemoryTracker

_MAX_GROUPS = 10


@dataclasses.dataclass(frozen=True)
class LeakReport:
    """Bytes alive after each measured iteration (allocated since the first one started)."""

    samples: tuple
    growth_per_iteration: float
    tolerance: int
    survivors: str

    @property
    def leaked(self):
        return self.growth_per_iteration > self.tolerance

    def __str__(self):
        alive = ", ".join(format_bytes(s) for s in self.samples)
        verdict = "grew" if self.leaked else "stayed within tolerance:"
        text = (
            f"torch memory {verdict} {format_bytes(int(self.growth_per_iteration))} per iteration over "
            f"{len(self.samples)} iterations (tolerance {format_bytes(self.tolerance)} per iteration)\n"
            f"  alive after each iteration: {alive}"
        )
        return f"{text}\n{self.survivors}" if self.survivors else text


def _tensor_snapshot():
    return {id(obj): weakref.ref(obj) for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)}


def _new_tensors(snapshot):
    found = []
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):  # type(): no __getattr__ of lazy modules
            old = snapshot.get(id(obj))
            if old is None or old() is not obj:
                found.append(obj)
    return found


def _describe(tensor):
    try:
        nbytes = format_bytes(tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError, TypeError):
        nbytes = "no storage"
    shape = "x".join(str(s) for s in tensor.shape) or "scalar"
    grad_fn = type(tensor.grad_fn).__name__ if tensor.grad_fn is not None else None
    return f"{type(tensor).__name__} [{shape}] {tensor.dtype} {tensor.device} storage {nbytes}, grad_fn={grad_fn}"


def _survivor_report(snapshot):
    """Tensors created during the measured iterations that are still alive, and their graphs."""
    survivors = _new_tensors(snapshot)
    if not survivors:
        return ""
    groups = collections.Counter(_describe(t) for t in survivors).most_common(_MAX_GROUPS)
    lines = ["  tensors created during the measured iterations and still alive (gc-visible):"]
    lines += [f"    {count} x {description}" for description, count in groups]
    with_graph = [t for t in survivors if t.grad_fn is not None]
    if with_graph:
        audit = audit_autograd(with_graph)
        nodes = ", ".join(f"{count} x {name}" for name, count in list(audit.node_counts.items())[:_MAX_GROUPS])
        lines.append(f"  autograd nodes reachable from {len(with_graph)} of them: {nodes}")
        if audit.findings:
            lines += ["  " + line for line in str(audit).splitlines()]
    return "\n".join(lines)


def assert_no_leak(step_fn, iterations=5, *, warmup=2, tolerance=0, device=None, gc_collect=True):
    """Call ``step_fn()`` ``warmup`` times, then ``iterations`` times while measuring; raise on growth.

    After every measured iteration the torch bytes allocated since measuring began and
    still alive are sampled (MemoryTracker, on ``device``); growth per iteration is the
    difference between the last and first samples divided by ``iterations - 1``. When it
    exceeds ``tolerance`` (bytes per iteration: an int or a string like "64 KiB"),
    AssertionError is raised with the samples, the gc-visible tensors created during the
    measured iterations that are still alive (grouped), the autograd nodes reachable from
    them and the tensors held on custom Function ctxs. Returns the LeakReport otherwise.
    """
    if iterations < 2:
        raise ValueError(f"iterations must be at least 2 to measure growth, got {iterations}")
    tolerance = parse_size(tolerance)
    for _ in range(warmup):
        step_fn()
    gc.collect()
    snapshot = _tensor_snapshot()
    with MemoryTracker(device, gc_collect=gc_collect) as tracker:
        for _ in range(iterations):
            step_fn()
            if gc_collect:
                gc.collect()
            tracker.sample()
    samples = tuple(sum(sample.values()) for sample in tracker.samples)
    growth = (samples[-1] - samples[0]) / (iterations - 1)
    if growth <= tolerance:
        return LeakReport(samples, growth, tolerance, "")
    report = LeakReport(samples, growth, tolerance, _survivor_report(snapshot))
    raise AssertionError(f"memory leak in {getattr(step_fn, '__name__', 'step_fn')}: {report}")
