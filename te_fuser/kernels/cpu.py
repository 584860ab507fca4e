"""Which instruction-set tier the CPU kernels use.

te_fuser detects the CPU's tiers once (cpuid; for AMX it also asks Linux for the tile-data
permission) and each kernel takes its best path at or below the current tier. A cap lowers the
tier, to test or compare the paths on one machine:

    te_fuser.kernels.cpu.set_isa("avx2")       # until changed; None removes the cap
    with te_fuser.kernels.cpu.isa("portable"):  # for a block
        ...
    TE_FUSER_CPU_ISA=portable python train.py   # read when te_fuser is imported

Tiers, lowest first: portable (plain C), avx2 (AVX2+FMA+F16C), avx512 (F+BW+VL),
avx512_bf16, amx (AMX-TILE+AMX-BF16).
"""

import contextlib
import os
from typing import List, Optional

import torch

from .. import _extension  # noqa: F401  (registers torch.ops.te_fuser)

TIERS = ("portable", "avx2", "avx512", "avx512_bf16", "amx")
ENV_VAR = "TE_FUSER_CPU_ISA"

_ops = torch.ops.te_fuser


def _tier_index(name: str) -> int:
    if name not in TIERS:
        raise ValueError(f"isa must be one of {TIERS} or None, got {name!r}")
    return TIERS.index(name)


def detected_isa() -> str:
    """The best tier this CPU supports, whatever the cap."""
    return TIERS[_ops.cpu_isa_detected()]


def available_isa() -> List[str]:
    """The tiers this CPU supports, lowest first (each can be selected with set_isa)."""
    return list(TIERS[: _ops.cpu_isa_detected() + 1])


def current_isa() -> str:
    """The tier the kernels use now: the detected one, lowered by the cap."""
    return _current


def _read_current() -> None:
    # Kept in Python: the GEMM wrappers ask on every call, and an op call costs microseconds.
    # The cap changes only through set_isa, which reads it again.
    global _current
    _current = TIERS[_ops.cpu_isa_current()]


def get_cap() -> Optional[str]:
    """The cap set by set_isa (None when there is none)."""
    cap = _ops.cpu_isa_cap()
    return None if cap < 0 else TIERS[cap]


def set_isa(name: Optional[str]) -> Optional[str]:
    """Caps the kernels' tier at `name` (None: no cap) and returns the previous cap.

    Raises ValueError for an unknown name or a tier this CPU does not support."""
    if name is None:
        previous = _ops.cpu_isa_set_cap(-1)
    else:
        index = _tier_index(name)
        if index > _ops.cpu_isa_detected():
            raise ValueError(f"isa {name!r} is not supported by this CPU; available: {available_isa()}")
        previous = _ops.cpu_isa_set_cap(index)
    _read_current()
    return None if previous < 0 else TIERS[previous]


@contextlib.contextmanager
def isa(name: Optional[str]):
    """set_isa(name) for the duration of a with-block, then the previous cap again."""
    previous = set_isa(name)
    try:
        yield
    finally:
        set_isa(previous)


def _apply_env() -> None:
    value = os.environ.get(ENV_VAR)
    if value:
        try:
            set_isa(value.strip().lower())
        except ValueError as err:
            raise ValueError(f"{ENV_VAR}={value!r}: {err}") from None


_read_current()
_apply_env()
