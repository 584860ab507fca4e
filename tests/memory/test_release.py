"""release_storage: frees a storage shared by views, refuses parameters, guards later use."""

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import te_fuser
from te_fuser.memory import MemoryTracker, release_storage
from te_fuser.memory.release import guard_mechanism, has_storage_functions

from _release_probe import USES

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
LACKS_STORAGE_FUNCTIONS = f"torch {torch.__version__} lacks the storage functions release_storage needs"
# Where they are missing release_storage raises (test_refuses_where_torch_lacks_the_storage_functions).
needs_storage_functions = pytest.mark.skipif(not has_storage_functions(), reason=LACKS_STORAGE_FUNCTIONS)


PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_release_probe.py")


def _child_env():
    """The child imports te_fuser and torch exactly as this process did."""
    paths = [os.path.dirname(os.path.dirname(te_fuser.__file__)), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))


@needs_storage_functions
@pytest.mark.parametrize("device", DEVICES)
def test_frees_the_storage_behind_every_view(device):
    with MemoryTracker(device) as tracker:
        padded = torch.randn(1000 + 24, device=device)
        view = padded[:1000].view(10, 100)
        freed = release_storage(padded)
    assert freed == 1024 * 4
    assert tracker.retained_bytes == 0 and tracker.peak_bytes == 1024 * 4
    # The size query still answers, with the size before the release; the bytes are gone.
    assert view.untyped_storage().nbytes() == 1024 * 4 and padded.untyped_storage().nbytes() == 1024 * 4
    assert view.shape == (10, 100)
    assert release_storage(view) == 0  # already released
    with MemoryTracker(device) as tracker:
        view[3]  # a view of released memory is metadata only; reading it raises (below)
    assert tracker.peak_bytes == 0


@needs_storage_functions
@pytest.mark.parametrize("device", DEVICES)
def test_every_use_raises_naming_release_storage(device):
    """Each use runs in its own child process: a crash fails this test, and names the use."""
    if device == "cpu":  # one interpreter; each use in a process forked after the release
        runs = [subprocess.run([sys.executable, PROBE, device], capture_output=True, text=True, timeout=300,
                               env=_child_env())]
    else:  # CUDA cannot run in a forked child: one interpreter per use
        runs = [subprocess.run([sys.executable, PROBE, device, use], capture_output=True, text=True, timeout=300,
                               env=_child_env()) for use in USES]
    outcomes = {}
    for done in runs:
        assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-3000:])
        for line in done.stdout.splitlines():
            use, outcome, message = line.split("\t", 2)
            outcomes[use] = (outcome, message)
    assert set(outcomes) == set(USES), runs[0].stderr[-3000:]
    # te_fuser's own ops reach the data pointer through the stable C ABI, which reports only that the
    # call failed: their Python wrappers then touch each tensor's data pointer, which names it.
    wrong = {use: result for use, result in outcomes.items()
             if result[0] != "RAISED RuntimeError" or "release_storage" not in result[1]}
    assert not wrong, "uses of a released view that did not raise RuntimeError naming release_storage: " + \
        "; ".join(f"{use}: {outcome} {message}" for use, (outcome, message) in wrong.items())


@needs_storage_functions
def test_growing_a_released_tensor_raises():
    """The one use whose error does not name release_storage: torch refuses to resize the storage first."""
    padded = torch.randn(64)
    release_storage(padded)
    with pytest.raises(RuntimeError, match="not resizable"):
        padded.resize_(128)


def test_the_guard_mechanism_of_this_torch_build():
    """CUDA builds use torch's own storage switch (no binary); CPU builds the classic module built for them.
    A torch without the storage functions (2.11) has none: release_storage raises there."""
    mechanism, why_not = guard_mechanism()
    if not has_storage_functions():
        assert not hasattr(torch._C, "_construct_storage_from_data_pointer") or \
            not hasattr(torch._C.StorageBase, "_swap_data_ptr_")
        assert (mechanism, why_not) == (None, LACKS_STORAGE_FUNCTIONS)
        return
    assert why_not is None
    if torch.version.cuda is not None:
        assert mechanism == "torch._C._set_storage_data_ptr_access_error_msg"
    else:
        assert mechanism == "te_fuser._storage_poison"


@needs_storage_functions  # else release_storage refuses for that reason first
def test_refuses_before_freeing_where_no_guard_exists(monkeypatch):
    """A CPU build of torch other than the one te_fuser._storage_poison was built against."""
    monkeypatch.delattr(torch._C, "_set_storage_data_ptr_access_error_msg", raising=False)
    monkeypatch.setattr(torch.version, "git_version", "another-torch")
    tensor = torch.arange(8.0)
    with pytest.raises(RuntimeError, match="release_storage is unavailable: this CPU build of torch .* rebuild te_fuser"):
        release_storage(tensor)
    assert tensor.untyped_storage().nbytes() == 32 and tensor.sum().item() == 28.0  # untouched


@pytest.mark.parametrize("missing, warning", [
    pytest.param("_set_storage_data_ptr_access_error_msg", "this CPU build of torch", marks=needs_storage_functions,
                 id="no-guard"),
    pytest.param("_construct_storage_from_data_pointer", LACKS_STORAGE_FUNCTIONS, id="no-storage-functions"),
])
def test_warns_at_import_where_no_guard_exists(missing, warning):
    probe = textwrap.dedent(
        f"""
        import warnings
        import torch
        if hasattr(torch._C, {missing!r}):
            delattr(torch._C, {missing!r})
        torch.version.git_version = "another-torch"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import te_fuser
        print([str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)])
        """
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=_child_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"release_storage will raise: {warning}" in done.stdout, done.stdout


@pytest.mark.parametrize("strip", ["_construct_storage_from_data_pointer", "_swap_data_ptr_"])
def test_refuses_where_torch_lacks_the_storage_functions(monkeypatch, strip):
    """torch 2.11: release_storage raises before freeing anything; refusing a parameter still comes first."""
    if strip == "_swap_data_ptr_":  # a method of a C type: stand in a StorageBase without it
        monkeypatch.setattr(torch._C, "StorageBase", type("StorageBase", (), {}))
    else:
        monkeypatch.delattr(torch._C, strip, raising=False)
    assert not has_storage_functions()
    assert guard_mechanism() == (None, LACKS_STORAGE_FUNCTIONS)
    tensor = torch.arange(8.0)
    with pytest.raises(RuntimeError, match="release_storage is unavailable: " + re.escape(LACKS_STORAGE_FUNCTIONS)):
        release_storage(tensor)
    assert tensor.untyped_storage().nbytes() == 32 and tensor.sum().item() == 28.0  # untouched
    with pytest.raises(ValueError, match="refuses to free an nn.Parameter"):
        release_storage(torch.nn.Parameter(torch.ones(4)))


def test_refuses_parameters_and_their_views():
    layer = torch.nn.Linear(8, 8)
    before = layer.weight.detach().clone()
    with pytest.raises(ValueError, match="refuses to free an nn.Parameter"):
        release_storage(layer.weight)
    with pytest.raises(ValueError, match="refuses to free an nn.Parameter"):
        release_storage(layer.weight[2:])
    # .data shares the storage without being a view: found through the model, or through gc
    with pytest.raises(ValueError, match="shared with an nn.Parameter of shape \\(8, 8\\)"):
        release_storage(layer.weight.data, parameters=layer)
    with pytest.raises(ValueError, match="shared with an nn.Parameter of shape \\(8,\\)"):
        release_storage(layer.bias.detach())
    torch.testing.assert_close(layer.weight.detach(), before)


@needs_storage_functions
def test_releases_what_no_parameter_shares():
    layer = torch.nn.Linear(8, 8)
    assert release_storage(torch.ones(4), parameters=[layer.weight]) == 16


def test_fp8_parameters_are_refused():
    """A quantized weight owns no storage of its own: its FP8 bytes, transpose and scale are what must be refused."""
    with te_fuser.quantized_model_init(enabled=True):
        layer = te_fuser.Linear(32, 32)
    before = layer.weight.dequantize().clone()
    for held in (layer.weight, layer.weight._data, layer.weight._scale_inv):
        with pytest.raises(ValueError, match="refuses to free"):
            release_storage(held)
    with pytest.raises(ValueError, match="shared with an nn.Parameter"):
        release_storage(layer.weight._data, parameters=layer)
    assert torch.equal(layer.weight.dequantize(), before)


@needs_storage_functions
def test_releases_a_float8_tensor():
    """Handed a Float8Tensor (an FP8 all-gather), release_storage frees its data, transpose and scale."""
    quantizer = te_fuser.Float8CurrentScalingQuantizer(torch.float8_e4m3fn, columnwise=True)
    x = torch.randn(64, 32)
    quantizer(x)  # its own state, allocated once
    with MemoryTracker("cpu") as tracker:
        gathered = quantizer(x)
        freed = release_storage(gathered)
    assert freed == 64 * 32 * 2 + 4  # data, transpose and scale
    assert tracker.retained_bytes == 0 and tracker.peak_bytes >= freed
    with pytest.raises(RuntimeError, match="release_storage"):
        gathered.dequantize()


def test_parameters_argument_takes_any_iterable():
    layer = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match="shared with an nn.Parameter"):
        release_storage(layer.weight.data, parameters=(p for p in layer.parameters()))
    with pytest.raises(TypeError, match="parameters must be"):
        release_storage(torch.ones(3), parameters=3)
    with pytest.raises(TypeError, match="parameters must hold"):
        release_storage(torch.ones(3), parameters=["weight"])


@needs_storage_functions
def test_allow_parameter_releases_it():
    weight = torch.nn.Parameter(torch.ones(64))
    assert release_storage(weight, allow_parameter=True) == 256
    with pytest.raises(RuntimeError, match="release_storage"):
        weight.sum()


def test_argument_checks():
    with pytest.raises(TypeError, match="expects a torch.Tensor"):
        release_storage([1, 2])
    with pytest.raises(ValueError, match="streams only apply to CUDA tensors"):
        release_storage(torch.ones(3), streams=[object()])


@needs_storage_functions
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_block_not_reused_before_a_side_stream_finishes():
    side = torch.cuda.Stream()
    padded = torch.ones(1 << 20, device="cuda")
    view = padded[: (1 << 20) - 256]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # keep the side stream busy
        total = view.sum()
    address = padded.untyped_storage().data_ptr()
    release_storage(padded, streams=[side])
    with pytest.raises(RuntimeError, match="release_storage"):
        view.untyped_storage().data_ptr()
    fresh = torch.empty(1 << 20, device="cuda")  # same size: would take the block if it were free
    assert fresh.data_ptr() != address
    side.synchronize()
    assert total.item() == (1 << 20) - 256
