import os
import zlib

import pytest
import torch

import te_fuser
from te_fuser.memory.release import guard_mechanism

from _cpu_default import build_modules_on_cpu

# The memory-limit markers and options, also when te_fuser is imported from a source tree
# without its pytest11 entry point. The entry point has the same name, so pytest loads
# the plugin once either way; --strict-markers (pyproject.toml) fails loudly without it.
pytest_plugins = ["te_fuser.testing.pytest_plugin"]

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_configure(config):
    config.addinivalue_line("markers", "te_default_device: modules built without device= keep te_fuser's "
                                       "(TE's) default device instead of the suite's CPU")


def pytest_report_header(config):
    """Which te_fuser and torch this run tests (.ci/run checks the line)."""
    mechanism, why_not = guard_mechanism()
    return [f"te_fuser: {os.path.dirname(te_fuser.__file__)}",
            f"torch: {torch.__version__} (CUDA {torch.version.cuda}), release_storage guard: {mechanism or why_not}"]


def _test_seed(nodeid):
    """A fixed seed per test, from its node id: every run draws the same inputs, so a failure replays."""
    return zlib.crc32(nodeid.encode()) & 0x7FFFFFFF


@pytest.fixture(autouse=True)
def _seed_torch_per_test(request):
    """Draws from torch's default generator depend on the test alone, not on which tests ran before."""
    seed = _test_seed(request.node.nodeid) ^ 0x5EED
    # Not torch.manual_seed: its first call imports torch._dynamo, which pytester's in-process
    # runs (test_pytest_plugin.py) would then drop from sys.modules.
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


@pytest.fixture(autouse=True)
def _modules_on_cpu_by_default(request, monkeypatch):
    """See _cpu_default.py: on a GPU machine, modules built without device= stay on the CPU here."""
    if "te_default_device" not in request.keywords:
        build_modules_on_cpu(monkeypatch.setattr)


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    """Runs a test on the CPU and, where CUDA is present, on the GPU."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    return torch.device(request.param)


@pytest.fixture
def generator(request):
    """A generator seeded from the test's node id; the seed is printed (shown with a failure)."""
    seed = _test_seed(request.node.nodeid)
    print(f"random seed: {seed} (fixed for {request.node.nodeid})")
    return torch.Generator().manual_seed(seed)
