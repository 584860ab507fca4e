
import pytest

from fake_te import drop_transformer_engine_modules, write_fake_te


@pytest.fixture
def fake_te(tmp_path, monkeypatch):
    """A fake `transformer_engine` package importable for the test's duration; returns its recipe module."""
    drop_transformer_engine_modules()
    write_fake_te(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import transformer_engine.common.recipe as recipe

    yield recipe
    drop_transformer_engine_modules()


@pytest.fixture
def alias():
    """te_fuser's `transformer_engine` alias installed for the test's duration."""
    from te_fuser import compat

    drop_transformer_engine_modules()
    compat.install_transformer_engine()
    yield
    compat.uninstall_transformer_engine()
