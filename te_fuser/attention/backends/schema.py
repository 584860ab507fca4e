"""The private aten ops the library backends call, checked once against the schemas te_fuser was written for.

These ops (torch's SDPA kernels) are private and their signatures move between torch releases. A backend
whose op is missing or whose schema differs is not chosen, with the difference as its reason; it never
crashes on a call with the wrong arguments.
"""

from typing import Dict, Optional

import torch

_checked: Dict[str, Optional[str]] = {}


def schema_problem(expected: Dict[str, str]) -> Optional[str]:
    """None when every aten op in expected (name -> schema string) exists with that schema, else the reason.

    The answer for each op is computed at its first check and kept.
    """
    for name, schema in expected.items():
        key = f"{name}:{schema}"
        if key not in _checked:
            _checked[key] = _check(name, schema)
        if _checked[key] is not None:
            return _checked[key]
    return None


def _check(name: str, expected: str) -> Optional[str]:
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return f"torch {torch.__version__} has no aten::{name}"
    found = str(packet.default._schema)
    if found != expected:
        return (f"aten::{name} in torch {torch.__version__} has a schema te_fuser was not written for: "
                f"found {found!r}, expected {expected!r}")
    return None


def clear() -> None:
    """Forget the checks (tests that change an expected schema)."""
    _checked.clear()
