"""Exact accounting of torch's CPU allocations, read from the profiler's memory events.

Why the profiler: torch keeps no running total of CPU bytes (there is no CPU twin of
``torch.cuda.memory_allocated``), and ``gc`` cannot see buffers held only by C++ autograd
nodes. With ``profile_memory=True`` torch's CPU allocator reports every allocation and
every free (address, size, in order) to the profiler, from the calling thread and the
threads torch hands work to (intra-op pool, autograd engine). Summing those events gives
the exact bytes allocated by torch, the true peak in between and no noise from Python's
own objects. glibc's ``mallinfo2`` was the alternative: cheaper, but it cannot see a peak
between two reads, it counts every malloc in the process (Python, the profiler itself),
and it is glibc-only.

Blind spot: a free on a thread torch did not hand the profiler to (a thread of your own, or
ProcessGroupGloo's workers, which drop a finished collective's work, and the buffers it owns,
just after the caller's wait returns) is not reported. Such a block reads as alive until its
address is allocated again, when the stale entry is dropped. To measure a multi-rank CPU step
exactly, keep the collectives' works referenced until the step ends and free them on the
measuring thread (tests/clients/test_seed_001.py shows how).

What is counted: a block is counted from its allocation inside a tracked region until it
is freed. A block that existed before the region started is never counted, and neither is
its release (torch does not report the size of blocks it saw allocated while no profiler
ran). So ``current`` is "bytes allocated since the start that are still alive": freeing old
memory cannot hide a new leak.

Nesting: there is one profiler session for all active watchers. Whenever a watcher starts,
samples or stops, the session is stopped, its events are fed in order to every active
watcher, and a new session starts if any watcher is still active; a watcher therefore sees
the frees of blocks allocated in an earlier session.

Quiet: kineto prints a "profiler_start"/"profiler_stop" line to stderr for every session.
Unless KINETO_LOG_LEVEL is already set, the first session sets it to 6 (above kineto's
highest level), which kineto reads when it first starts; set it yourself to keep its logs.
"""

import os
import threading

import torch
from torch._C import _autograd as _ag
from torch._C import _profiler as _prof

_ACTIVITIES = {_prof.ProfilerActivity.CPU}


def _memory_config():
    return _prof.ProfilerConfig(
        _prof.ProfilerState.KINETO,
        False,  # report_input_shapes
        True,  # profile_memory
        False,  # with_stack
        False,  # with_flops
        False,  # with_modules
        _prof._ExperimentalConfig(),
    )


class AllocationWatcher:
    """Running count of the CPU bytes allocated since this watcher started and still alive."""

    def __init__(self):
        self._live = {}  # address -> size of the blocks allocated while watching
        self.current = 0
        self.peak = 0
        self.lost = False  # another profiler ended a session this watcher depended on

    def _feed(self, address, size):
        if size > 0:
            # An address seen allocated twice lost its free to a gap between sessions.
            self.current += size - self._live.get(address, 0)
            self._live[address] = size
            if self.current > self.peak:
                self.peak = self.current
        else:
            self.current -= self._live.pop(address, 0)


def _allocation_events(result):
    """(address, signed size) of the CPU allocation events of a profiler result, in order."""
    found = []
    stack = list(result.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _prof._EventType.Allocation:
            fields = event.extra_fields
            if fields.device.type == "cpu" and fields.alloc_size != 0:
                found.append((event.start_time_ns, event.id, fields.ptr, fields.alloc_size))
    found.sort()
    return [(address, size) for _, _, address, size in found]


class _Recorder:
    def __init__(self):
        self._lock = threading.Lock()
        self._watchers = []
        self._running = False

    def _flush(self):
        if not self._running:
            return
        self._running = False
        if not torch.autograd._profiler_enabled():
            # A torch profiler started inside the region took the session over and ended it:
            # its allocation events are gone, so every active watcher's count is incomplete.
            for watcher in self._watchers:
                watcher.lost = True
            return
        result = _ag._disable_profiler()
        for address, size in _allocation_events(result):
            for watcher in self._watchers:
                watcher._feed(address, size)

    def _resume(self):
        if self._watchers and not self._running:
            if torch.autograd._profiler_enabled():
                raise RuntimeError(
                    "te_fuser.memory measures CPU memory through torch's profiler "
                    "(profile_memory=True), but another torch profiler is already running; "
                    "stop it, or track a CUDA device only"
                )
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
            config = _memory_config()
            _ag._prepare_profiler(config, _ACTIVITIES)
            _ag._enable_profiler(config, _ACTIVITIES)
            self._running = True

    def start(self):
        watcher = AllocationWatcher()
        with self._lock:
            self._flush()
            self._watchers.append(watcher)
            try:
                self._resume()
            except BaseException:
                self._watchers.remove(watcher)
                raise
        return watcher

    def sample(self, watcher):
        with self._lock:
            self._flush()
            self._resume()
        _check_not_lost(watcher)
        return watcher.current

    def stop(self, watcher):
        with self._lock:
            self._flush()
            self._watchers.remove(watcher)
            self._resume()
        _check_not_lost(watcher)
        return watcher


def _check_not_lost(watcher):
    if watcher.lost:
        raise RuntimeError(
            "a torch profiler ran inside a te_fuser.memory CPU measurement and ended the profiler "
            "session it counts allocations with: the measurement is incomplete. Profile outside the "
            "measured region, or track a CUDA device only"
        )


RECORDER = _Recorder()
