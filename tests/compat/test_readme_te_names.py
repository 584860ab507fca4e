"""README.md's table of TransformerEngine 2.6's public names is what tools/te_suite/compat_names.py generates
now: a name te_fuser gains or loses changes the table, and this test fails until it is regenerated
(`python tools/te_suite/compat_names.py --write`)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _compat_names():
    spec = importlib.util.spec_from_file_location("compat_names", ROOT / "tools" / "te_suite" / "compat_names.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_table_matches_the_names_te_fuser_provides():
    names = _compat_names()
    assert names.readme_section((ROOT / "README.md").read_text()) == names.table(), (
        "README.md's TE-names table is stale: run python tools/te_suite/compat_names.py --write")


def test_every_listed_module_and_name_is_parsed():
    modules = _compat_names().te_names()
    assert "transformer_engine.pytorch" in modules and "Linear" in modules["transformer_engine.pytorch"]
    assert all(names == sorted(set(names)) for names in modules.values())
