"""Memory-limit markers only bite when the plugin is loaded: refuse to run them silently unchecked."""

import pytest
import torch

import te_fuser.testing.pytest_plugin as memory_plugin

MARKERS = ("limit_peak_memory", "limit_retained_memory")


@pytest.fixture(autouse=True)
def _memory_plugin_loaded(request):
    if any(request.node.get_closest_marker(name) for name in MARKERS):
        if not request.config.pluginmanager.is_registered(memory_plugin):
            pytest.fail(f"this test's memory limits need the plugin: run pytest with -p {memory_plugin.__name__}", pytrace=False)


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """These tests run many tiny ops; on a loaded machine the thread pool's hand-offs dominate."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
