"""tools/te_suite/cuda_shim.py's torch.autocast: TE's tests autocast on "cuda", which the shim makes CPU
autocast, so te_fuser's modules compute in its dtype as TE's do on a GPU.

Reference: the same Linear in float64 on the bfloat16-rounded input and weight."""

import importlib.util
from pathlib import Path

import torch

import te_fuser

ROOT = Path(__file__).resolve().parents[2]


def _shim():
    spec = importlib.util.spec_from_file_location("cuda_shim", ROOT / "tools" / "te_suite" / "cuda_shim.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines the shim; installs nothing until pytest_configure
    return module


def test_cuda_autocast_is_cpu_autocast(generator):
    autocast = _shim()._CpuAutocast
    assert issubclass(autocast, torch.autocast)
    layer = te_fuser.Linear(32, 16, bias=False)
    x = torch.randn(8, 32, generator=generator, requires_grad=True)
    with autocast("cuda", dtype=torch.bfloat16):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        y = layer(x)
    assert not torch.is_autocast_enabled("cpu")
    assert y.dtype == torch.bfloat16
    expected = x.detach().bfloat16().double() @ layer.weight.detach().bfloat16().double().t()
    torch.testing.assert_close(y.double(), expected, rtol=2**-8, atol=1e-6)
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32
