"""Memory-lifetime toolkit: measure torch memory, find what keeps it alive, release it early."""

from .audit import AutogradAudit, CtxFinding, HeldTensor, audit_autograd
from .leak import LeakReport, assert_no_leak
from .loss_log import LossLog, detach_for_logging
from .release import release_storage
from .saved import SavedTensor, SavedTensors, saved_for_backward
from .sizes import format_bytes, parse_size
from .tracker import DeviceMemory, MemoryTracker

__all__ = [
    "AutogradAudit",
    "CtxFinding",
    "DeviceMemory",
    "HeldTensor",
    "LeakReport",
    "LossLog",
    "MemoryTracker",
    "SavedTensor",
    "SavedTensors",
    "assert_no_leak",
    "audit_autograd",
    "detach_for_logging",
    "format_bytes",
    "parse_size",
    "release_storage",
    "saved_for_backward",
]
