"""The private aten ops the library backends call, checked once against the schemas te_fuser was written for.

These ops (torch's SDPA kernels) are private and their signatures move between torch releases. A backend
whose op is missing or whose schema differs is not chosen, with the difference as its reason; it never
crashes on a call with the wrong arguments.
"""

from typing import Dict, Optional, Tuple, Union

import torch

from ...quantization import runs_while_tracing

_checked: Dict[str, Optional[str]] = {}


Schemas = Union[str, Tuple[str, ...]]  # one schema, or each torch release's form of it that te_fuser's call fits


def schema_problem(expected: Dict[str, Schemas]) -> Optional[str]:
    """None when every aten op in expected (name -> schema string, or a tuple of accepted ones) exists with
    one of its schemas, else the reason.

    The answer for each op is computed at its first check and kept.
    """
    ops = tuple(expected.items())
    _ensure_checked(ops)  # every op first: dynamo reads _checked as it was when first read in a frame
    for name, schema in ops:
        problem = _checked[f"{name}:{schema}"]
        if problem is not None:
            return problem
    return None


@runs_while_tracing  # checked in the graph, the answer would be new at the next call: a second compilation
def _ensure_checked(ops: tuple) -> None:
    for name, schema in ops:
        key = f"{name}:{schema}"
        if key not in _checked:
            _checked[key] = _check(name, schema)


def _check(name: str, expected: Schemas) -> Optional[str]:
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return f"torch {torch.__version__} has no aten::{name}"
    found = str(packet.default._schema)
    accepted = (expected,) if isinstance(expected, str) else expected
    if found not in accepted:
        wanted = repr(accepted[0]) if len(accepted) == 1 else " or ".join(map(repr, accepted))
        return (f"aten::{name} in torch {torch.__version__} has a schema te_fuser was not written for: "
                f"found {found!r}, expected {wanted}")
    return None


def clear() -> None:
    """Forget the checks (tests that change an expected schema)."""
    _checked.clear()
