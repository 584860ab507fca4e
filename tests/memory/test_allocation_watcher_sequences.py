"""AllocationWatcher counts every sequence of allocation events exactly, lost frees included.

A free can be lost (made on a thread the profiler does not see); the block then reads as alive until
its address is allocated again, when the stale entry is dropped (cpu_allocations' docstring). The table
feeds event sequences to a watcher and checks `current` after each event and `peak`; the last test
loses a real free on a thread of its own.

Bugs these tests fail on (each planted in AllocationWatcher._feed, seen failing, reverted):
- `self.current += size` for an allocation (the stale size not subtracted: the address counted twice):
  the four lost-free rows and the thread test (peak 2 blocks, 1 retained);
- `self._live.setdefault(address, size)` (the stale size kept, so the later free subtracts it): the same
  five (the thread test retains -256 bytes);
- `self.current += size; self._live.pop(address, None)` for a free (the event's size, not the tracked
  block's): the rows freeing an unknown address, a block from before watching or a block twice.
"""

import threading

import pytest
import torch

from te_fuser.memory import MemoryTracker
from te_fuser.memory.cpu_allocations import AllocationWatcher

A, B = 0x7F0000001000, 0x7F0000802000  # addresses
S1, S2, S3 = 1000, 300, 5000  # sizes, no one a sum of the others

# name: (events as (address, size; negative for a free), current after each event, peak)
SEQUENCES = {
    "alloc, free": ([(A, S1), (A, -S1)], [S1, 0], S1),
    "free of a block allocated before watching": ([(A, -S1)], [0], 0),
    "free of an unknown address among tracked blocks": ([(A, S2), (B, -S1), (A, -S2)], [S2, S2, 0], S2),
    "address reused after its free": ([(A, S1), (A, -S1), (A, S2), (A, -S2)], [S1, 0, S2, 0], S1),
    "double free": ([(A, S1), (A, -S1), (A, -S1)], [S1, 0, 0], S1),
    "lost free, allocated again smaller": ([(A, S1), (A, S2), (A, -S2)], [S1, S2, 0], S1),
    "lost free, allocated again larger": ([(A, S2), (A, S3), (A, -S3)], [S2, S3, 0], S3),
    "lost free amid another block": ([(A, S1), (B, S2), (A, S3), (B, -S2), (A, -S3)],
                                     [S1, S1 + S2, S2 + S3, S3, 0], S2 + S3),
    "two lost frees of one address": ([(A, S1), (A, S2), (A, S3), (A, -S3)], [S1, S2, S3, 0], S3),
}


@pytest.mark.parametrize("name", list(SEQUENCES))
def test_current_and_peak_after_each_event(name):
    events, currents, peak = SEQUENCES[name]
    watcher = AllocationWatcher()
    seen = []
    for address, size in events:
        watcher._feed(address, size)
        seen.append(watcher.current)
    assert (seen, watcher.peak) == (currents, peak)


def test_a_free_lost_on_another_thread_is_dropped_when_its_address_returns():
    """The second block is a little smaller than the first: glibc's aligned allocation then reuses the
    freed block most of the time (not always), so the test tries until it does."""
    size, smaller = 1 << 16, (1 << 16) - 256
    for _ in range(20):
        with MemoryTracker("cpu") as tracker:
            box = [torch.empty(size // 4)]
            address = box[0].data_ptr()
            freer = threading.Thread(target=box.clear)  # the last reference dies on that thread
            freer.start()
            freer.join()
            assert tracker.sample() == size, "the free on the other thread was seen: nothing to test"
            again = torch.empty(smaller // 4)
            reused = again.data_ptr() == address
            del again
        if reused:
            assert (tracker.peak_bytes, tracker.retained_bytes) == (size, 0)
            return
        assert (tracker.peak_bytes, tracker.retained_bytes) == (size + smaller, size)  # the lost block
    pytest.skip("the allocator never gave the freed address back in 20 tries")
