"""release_storage: frees a storage shared by views, refuses parameters, guards later use."""

import subprocess
import sys
import textwrap

import pytest
import torch

from te_fuser.memory import MemoryTracker, release_storage

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
def test_frees_the_storage_behind_every_view(device):
    with MemoryTracker(device) as tracker:
        padded = torch.randn(1000 + 24, device=device)
        view = padded[:1000].view(10, 100)
        freed = release_storage(padded)
    assert freed == 1024 * 4
    assert tracker.retained_bytes == 0 and tracker.peak_bytes == 1024 * 4
    assert view.untyped_storage().nbytes() == 0 and padded.untyped_storage().nbytes() == 0
    assert view.shape == (10, 100)  # metadata stays; the bytes are gone
    assert release_storage(view) == 0  # already released


@pytest.mark.parametrize("device", DEVICES)
def test_later_use_raises(device):
    padded = torch.randn(130, device=device)
    view = padded[:120].view(12, 10)
    release_storage(padded)
    uses = {
        "index": lambda: view[3],
        "transpose-copy": lambda: view.t().contiguous(),
        "matmul": lambda: view @ view.t(),
        "write": lambda: view.mul_(2),
        "fill": lambda: padded.fill_(0),
        "tolist": lambda: view.tolist(),
        "item": lambda: view[1, 2].item(),
        "cast": lambda: view.to(torch.float16),
        "sum": lambda: view.sum(),
        "add": lambda: view + 1,
        "clone": lambda: view.clone(),
    }
    for name, use in uses.items():
        with pytest.raises(RuntimeError):
            use()
            pytest.fail(f"{name} on a released view did not raise")


def test_reads_that_torch_does_not_check_raise_too():
    """Elementwise read kernels do not check the storage's size: the poisoned storage makes them raise."""
    probe = textwrap.dedent(
        """
        import torch
        from te_fuser.memory import release_storage
        padded = torch.full((4096,), 7.0)
        view = padded[:4000]
        release_storage(padded)
        try:
            print("READ", view.sum().item(), flush=True)
        except RuntimeError as err:
            print("RAISED", err, flush=True)
        """
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert "READ" not in done.stdout
    assert "RAISED" in done.stdout and "release_storage" in done.stdout, (done.returncode, done.stdout,
                                                                         done.stderr[-2000:])


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
    assert release_storage(torch.ones(4), parameters=[layer.weight]) == 16


def test_allow_parameter_releases_it():
    weight = torch.nn.Parameter(torch.ones(64))
    assert release_storage(weight, allow_parameter=True) == 256
    assert weight.untyped_storage().nbytes() == 0


def test_argument_checks():
    with pytest.raises(TypeError, match="expects a torch.Tensor"):
        release_storage([1, 2])
    with pytest.raises(ValueError, match="streams only apply to CUDA tensors"):
        release_storage(torch.ones(3), streams=[object()])


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
    assert view.untyped_storage().nbytes() == 0
    fresh = torch.empty(1 << 20, device="cuda")  # same size: would take the block if it were free
    assert fresh.data_ptr() != address
    side.synchronize()
    assert total.item() == (1 << 20) - 256
