"""MemoryTracker: peak, current and retained torch bytes of a block of code, per device."""

import contextlib
import dataclasses
import gc

import torch

from .cpu_allocations import RECORDER
from .sizes import format_bytes


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """What one device's allocator saw during a tracked block.

    ``peak_bytes`` and ``retained_bytes`` are relative to the start of the block:
    peak = highest allocated level during the block minus the level at entry,
    retained = allocated at exit minus allocated at entry.

    CPU: counts the blocks torch allocated during the region (see cpu_allocations), so both
    are >= 0 and the ``*_absolute`` fields are None (torch has no CPU total to read).
    CUDA: read from the caching allocator's statistics; ``retained_bytes`` goes negative
    when the block freed memory allocated before it; the absolute levels are filled in.
    """

    device: str
    peak_bytes: int
    retained_bytes: int
    allocated_at_entry: int | None = None
    allocated_at_exit: int | None = None
    peak_absolute: int | None = None

    def __str__(self):
        text = f"{self.device}: peak +{format_bytes(self.peak_bytes)}, retained {format_bytes(self.retained_bytes)}"
        if self.peak_absolute is not None:
            text += f" (absolute peak {format_bytes(self.peak_absolute)})"
        return text


class _CpuProbe:
    device = "cpu"

    def __init__(self):
        self._watcher = RECORDER.start()

    def current(self):
        return RECORDER.sample(self._watcher)

    def finish(self):
        watcher = RECORDER.stop(self._watcher)
        return DeviceMemory("cpu", watcher.peak, watcher.current)


class _CudaProbe:
    """Uses memory_allocated / max_memory_allocated; nested probes share the peak counter.

    Resetting the peak for a new probe would hide the peak of the probes around it, so
    every reset and every read first folds the device's peak into all active probes.
    """

    _active = []

    def __init__(self, device):
        self.device = str(device)
        self._index = device.index
        self._fold_peak()
        torch.cuda.reset_peak_memory_stats(self._index)
        self._entry = torch.cuda.memory_allocated(self._index)
        self._peak = self._entry
        _CudaProbe._active.append(self)

    def _fold_peak(self):
        peak = torch.cuda.max_memory_allocated(self._index)
        for probe in _CudaProbe._active:
            if probe._index == self._index:
                probe._peak = max(probe._peak, peak)

    def current(self):
        self._fold_peak()
        return torch.cuda.memory_allocated(self._index) - self._entry

    def finish(self):
        self._fold_peak()
        _CudaProbe._active.remove(self)
        exit_level = torch.cuda.memory_allocated(self._index)
        return DeviceMemory(
            self.device,
            peak_bytes=self._peak - self._entry,
            retained_bytes=exit_level - self._entry,
            allocated_at_entry=self._entry,
            allocated_at_exit=exit_level,
            peak_absolute=self._peak,
        )


def resolve_devices(device):
    """torch.devices to track: None means CPU, plus the current CUDA device when there is one."""
    if device is None:
        devices = [torch.device("cpu")]
        if torch.cuda.is_available():
            devices.append(torch.device("cuda", torch.cuda.current_device()))
        return devices
    if isinstance(device, (list, tuple)):
        return [d for item in device for d in resolve_devices(item)]
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device must be None, 'cpu', 'cuda' or 'cuda:N', got {device!r}") from err
    if resolved.type == "cpu":
        return [torch.device("cpu")]
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but CUDA is not available")
        index = torch.cuda.current_device() if resolved.index is None else resolved.index
        return [torch.device("cuda", index)]
    raise ValueError(f"device must be None, 'cpu', 'cuda' or 'cuda:N', got {device!r}")


class MemoryTracker(contextlib.ContextDecorator):
    """Measures torch memory of a block: ``with MemoryTracker() as t: ...`` or ``@MemoryTracker()``.

    After the block, ``t.peak_bytes`` / ``t.retained_bytes`` sum the devices tracked (each
    device's own peak, not a simultaneous one) and
    ``t.devices["cpu"]`` (a DeviceMemory) gives each one. ``t.sample()`` inside the block
    returns the bytes currently allocated since entry and records them in ``t.samples``.
    As a decorator the results describe the most recent call.

    device: None (CPU, plus the current CUDA device when available), "cpu", "cuda",
    "cuda:N", or a list of those. gc_collect: run ``gc.collect()`` before the entry and
    exit readings, so that garbage in reference cycles is not counted as retained, nor
    garbage from before the block as freed by it. A full collection walks every Python object
    (about 0.1 s once torch's compiler stack is imported); a training loop that tracks every step
    can freeze the objects its setup left alive (gc.freeze, as te_fuser.examples.train does).

    CPU tracking runs torch's profiler (see cpu_allocations): it sees the thread that
    entered the tracker and the threads torch hands its work to, costs some speed while
    active, and cannot run beside another torch profiler. Use trackers from one thread.
    """

    def __init__(self, device=None, *, gc_collect=True):
        self._device_arg = device
        self._gc_collect = gc_collect
        self._probes = None
        self.devices = {}
        self.samples = []

    def __enter__(self):
        if self._probes is not None:
            raise RuntimeError("this MemoryTracker is already measuring a block; use a new one to nest")
        devices = resolve_devices(self._device_arg)
        if self._gc_collect:
            gc.collect()
        self.devices = {}
        self.samples = []
        self._probes = []
        try:
            for device in devices:
                self._probes.append(_CpuProbe() if device.type == "cpu" else _CudaProbe(device))
        except BaseException:
            self._finish()
            raise
        return self

    def __exit__(self, *exc):
        if self._gc_collect:
            gc.collect()
        self._finish()
        return False

    def _finish(self):
        probes, self._probes = self._probes, None
        for probe in probes:
            result = probe.finish()
            self.devices[result.device] = result

    def sample(self):
        """Bytes allocated since entry and still alive, summed over devices (also appended to samples)."""
        if self._probes is None:
            raise RuntimeError("MemoryTracker.sample() is only valid inside the tracked block")
        per_device = {probe.device: probe.current() for probe in self._probes}
        self.samples.append(per_device)
        return sum(per_device.values())

    @property
    def peak_bytes(self):
        return sum(d.peak_bytes for d in self._results())

    @property
    def retained_bytes(self):
        return sum(d.retained_bytes for d in self._results())

    def _results(self):
        if self._probes is not None:
            raise RuntimeError("MemoryTracker results are available after the block ends")
        return self.devices.values()

    def __str__(self):
        if not self.devices:
            return "MemoryTracker(no block measured yet)"
        return "; ".join(str(d) for d in self.devices.values())
