import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    """Runs a test on the CPU and, where CUDA is present, on the GPU."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    return torch.device(request.param)


@pytest.fixture
def generator():
    """A freshly seeded generator per test: random, yet reproducible from the printed seed."""
    seed = torch.seed() % (2**31)
    print(f"random seed: {seed}")
    return torch.Generator().manual_seed(seed)
