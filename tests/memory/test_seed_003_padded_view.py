"""Seed 003 (DeepSpeed ZeRO-3 DeepCompile): all-gather returns a true-shape view of a padded
buffer; releasing with ``registry_tensor.data = empty`` leaves the shared storage alive.
The fix resizes the storage itself to 0 bytes: te_fuser.memory.release_storage.
"""

import pytest
import torch

from te_fuser.memory import MemoryTracker, release_storage
from te_fuser.memory.release import has_storage_functions

NUMEL, PADDED = 1000 * 1000, 1000 * 1000 + 576  # an uneven shard padded for the collective


class Registry:
    """Holds each gathered parameter's padded buffer until its final release."""

    def __init__(self):
        self.gathered = {}

    def all_gather(self, name, shape):
        padded = torch.randn(PADDED)
        self.gathered[name] = padded
        return padded[:NUMEL].view(shape)  # what the compiled graph receives and keeps

    def release_by_set_data(self, name):
        self.gathered.pop(name).data = torch.empty(0)

    def release_storage(self, name):
        release_storage(self.gathered.pop(name))


def _gather_use_release(release):
    registry = Registry()
    with MemoryTracker("cpu") as tracker:
        view = registry.all_gather("w", (1000, 1000))
        out = view.sum(dim=0)
        release(registry, "w")
    return tracker, view, out


def test_set_data_to_empty_does_not_free_the_shared_storage():
    tracker, view, out = _gather_use_release(Registry.release_by_set_data)
    assert tracker.retained_bytes >= PADDED * 4  # the whole padded buffer is still allocated
    assert view.untyped_storage().nbytes() == PADDED * 4


@pytest.mark.skipif(not has_storage_functions(),
                    reason=f"torch {torch.__version__} lacks the storage functions release_storage needs")
@pytest.mark.limit_retained_memory("8 KiB", device="cpu")
def test_release_storage_frees_it_although_the_view_is_alive():
    tracker, view, out = _gather_use_release(Registry.release_storage)
    assert tracker.retained_bytes == out.numel() * 4  # only the result of using the view
    assert view.untyped_storage().nbytes() == PADDED * 4  # the size it had; the bytes are gone (above)
    with pytest.raises(RuntimeError, match="released by te_fuser.memory.release_storage"):
        view[0].sum()
