"""A stand-in `transformer_engine` package written into a temporary folder by the tests.

Its `common.recipe` mirrors what TE's pickles reference (facts from TE's
transformer_engine/common/recipe/__init__.py): a `_FormatHelper(max_fwd,
max_bwd)` named tuple, a `Format` enum of them, and a `DelayedScaling`
dataclass with TE's fields. Pickling a state dict that holds its objects gives
the bytes TE's get_extra_state writes; unpickling te_fuser's bytes with it
present is what TE's set_extra_state does.
"""

import importlib
import sys
import textwrap

RECIPE_SOURCE = textwrap.dedent('''
    from dataclasses import dataclass
    from enum import Enum
    from typing import Callable, NamedTuple, Optional, Union


    class _FormatHelper(NamedTuple):
        max_fwd: float
        max_bwd: float


    class Format(Enum):
        E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
        E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
        HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)


    class Recipe:
        pass


    @dataclass
    class DelayedScaling(Recipe):
        margin: int = 0
        fp8_format: Format = Format.HYBRID
        amax_history_len: int = 1024
        amax_compute_algo: Union[str, Callable] = "max"
        scaling_factor_compute_algo: Optional[Callable] = None
        reduce_amax: bool = True
        fp8_dpa: bool = False
        fp8_mha: bool = False
''')

FAKE_VERSION = "9.9.9+fake"


def write_fake_te(root) -> None:
    """Create root/transformer_engine/{__init__,common/__init__,common/recipe}.py."""
    pkg = root / "transformer_engine"
    (pkg / "common").mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"__version__ = {FAKE_VERSION!r}\n")
    (pkg / "common" / "__init__.py").write_text("")
    (pkg / "common" / "recipe.py").write_text(RECIPE_SOURCE)


def drop_transformer_engine_modules() -> None:
    """Forget every imported `transformer_engine...` module and `transformer_engine_torch`."""
    for name in [n for n in sys.modules
                 if n in ("transformer_engine", "transformer_engine_torch") or n.startswith("transformer_engine.")]:
        del sys.modules[name]
    importlib.invalidate_caches()
