"""The alias's `transformer-engine` distribution, as the clients that look for TE through package
metadata see it: importlib.metadata itself, accelerate's and Lightning's availability checks."""

import importlib.metadata

import pytest

import te_fuser.compat as compat
from fake_te import FAKE_VERSION, drop_transformer_engine_modules, write_fake_te

NAMES = ("transformer-engine", "transformer_engine", "Transformer.Engine")


def _reported_version(name="transformer-engine"):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _accelerate_check():
    """accelerate 1.15's check, fresh each call (find_spec, then importlib.metadata)."""
    imports = pytest.importorskip("accelerate.utils.imports")
    return imports.is_transformer_engine_available


def _lightning_check():
    """The requirement lightning.fabric's TransformerEnginePrecision checks, in a fresh RequirementCache (the
    plugin's module-level one remembers its first answer)."""
    imports = pytest.importorskip("lightning_utilities.core.imports")
    return lambda: bool(imports.RequirementCache("transformer_engine>=0.11.0"))


@pytest.fixture
def no_alias():
    drop_transformer_engine_modules()
    compat.uninstall_transformer_engine()
    yield
    compat.uninstall_transformer_engine()


def test_reported_while_installed_only(no_alias):
    assert _reported_version() is None
    compat.install_transformer_engine()
    compat.install_transformer_engine()  # idempotent: one distribution, not two
    for name in NAMES:
        assert _reported_version(name) == compat.TE_API_VERSION, name
    meta = importlib.metadata.metadata("transformer_engine")
    assert (meta["Name"], meta["Version"]) == ("transformer-engine", compat.TE_API_VERSION)
    listed = [d for d in importlib.metadata.distributions() if d.metadata["Name"] == "transformer-engine"]
    assert len(listed) == 1
    assert importlib.metadata.packages_distributions()["transformer_engine"] == ["transformer-engine"]
    assert importlib.metadata.distribution("transformer-engine").files is None
    assert _reported_version("transformer-engine-torch") is None  # only TE's own name
    compat.uninstall_transformer_engine()
    assert _reported_version() is None


@pytest.mark.parametrize("client_check", [_accelerate_check, _lightning_check], ids=["accelerate", "lightning"])
def test_client_checks_follow_the_alias(no_alias, client_check):
    available = client_check()
    assert not available()
    compat.install_transformer_engine()
    assert available()
    compat.uninstall_transformer_engine()
    assert not available()


def test_never_replaces_a_real_distribution(tmp_path, monkeypatch, no_alias):
    write_fake_te(tmp_path)
    dist_info = tmp_path / "transformer_engine-9.9.9.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: transformer_engine\nVersion: {FAKE_VERSION}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match="will not shadow"):
        compat.install_transformer_engine()
    assert _reported_version() == FAKE_VERSION
    compat.install_transformer_engine(force=True)
    for name in NAMES:
        assert _reported_version(name) == FAKE_VERSION, name
    compat.uninstall_transformer_engine()
    assert _reported_version() == FAKE_VERSION
    drop_transformer_engine_modules()
