"""An FP8 training step of te_fuser's modules on CUDA never waits for the host: quantizing, the FP8 GEMMs,
recording amaxes and, at the autocast's exit, the delayed-scaling update all stay on the device
(torch.cuda.set_sync_debug_mode("error") raises on any synchronizing call)."""

import pytest
import torch

import te_fuser
from te_fuser.recipe import DelayedScaling, Float8CurrentScaling

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs a CUDA device with FP8 GEMMs (compute capability 8.9+)")

MODULES = {
    "Linear": lambda: te_fuser.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda"),
    "LayerNormMLP": lambda: te_fuser.LayerNormMLP(256, 512, params_dtype=torch.bfloat16, device="cuda",
                                                  activation="swiglu", normalization="RMSNorm"),
}


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()], ids=["delayed", "current"])
@pytest.mark.parametrize("name", list(MODULES))
def test_fp8_step_does_not_synchronize(name, recipe):
    module = MODULES[name]()
    x = torch.randn(128, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    for step in range(3):  # the first step makes the scaling state; the later ones run on it
        if step:
            torch.cuda.set_sync_debug_mode("error")
        try:
            with te_fuser.fp8_autocast(fp8_recipe=recipe):
                y = module(x)
            y.backward(torch.ones_like(y))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(x.grad).all()
