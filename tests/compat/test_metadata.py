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


def _client_checks():
    """What accelerate 1.15 and Lightning 2.6 conclude about TE, each from a fresh check, where installed."""
    found = {}
    try:
        from accelerate.utils.imports import is_transformer_engine_available
    except ImportError:
        pass
    else:
        found["accelerate"] = bool(is_transformer_engine_available())
    try:
        from lightning_utilities.core.imports import RequirementCache
    except ImportError:
        pass
    else:  # the requirement lightning.fabric's TransformerEnginePrecision checks
        found["lightning"] = bool(RequirementCache("transformer_engine>=0.11.0"))
    return found


@pytest.fixture
def no_alias():
    drop_transformer_engine_modules()
    compat.uninstall_transformer_engine()
    yield
    compat.uninstall_transformer_engine()


def test_reported_while_installed_only(no_alias):
    assert _reported_version() is None
    assert not any(_client_checks().values())
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
    assert all(_client_checks().values())
    compat.uninstall_transformer_engine()
    assert _reported_version() is None
    assert not any(_client_checks().values())


def test_clients_see_it():
    """The client checks above run where accelerate / Lightning are installed (CI installs both)."""
    pytest.importorskip("accelerate")
    pytest.importorskip("lightning_utilities")
    assert set(_client_checks()) == {"accelerate", "lightning"}


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
