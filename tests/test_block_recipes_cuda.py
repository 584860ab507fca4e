"""te_fuser's modules under each block-scaled recipe on a GPU, against the same modules on the CPU.

The CUDA quantizers write the CPU kernels' bytes (test_block_quantize_cuda.py) and NVFP4's stochastic rounding
draws its seeds from torch's CPU generator on both devices, so outputs and gradients differ only by the GEMMs'
summation order and accumulator (docs/block_scaling.md bounds each engine; here the whole step is held to a
relative error far below what a wrong scale, block or layout gives). Also: the forward GEMM runs on the engine
block_gemm_engine names, and steps leave the device's memory where they found it."""

import copy

import pytest
import torch

import te_fuser
from te_fuser import recipe
from te_fuser._extension import has_cuda_kernels
from te_fuser.kernels import gemm as gemm_kernels

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and has_cuda_kernels()),
                                reason="CUDA and te_fuser's CUDA kernels are not available")

CUDA = torch.device("cuda")
RECIPES = {"mxfp8": recipe.MXFP8BlockScaling, "float8_block": recipe.Float8BlockScaling,
           "nvfp4": recipe.NVFP4BlockScaling}
BLOCK = {"mxfp8": 32, "float8_block": 128, "nvfp4": 16}
# A step's relative error, GPU against CPU: bf16 roundings of the results that the two GEMM orders flip
# (about 2^-8 of an element each) dominate; a misplaced scale or block is an error of order one.
STEP_TOLERANCE = 2e-2


def relative_error(got, want):
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def step(module, x, dy, fp8_recipe, seed):
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(seed)  # NVFP4's stochastic rounding seeds: the same draws on both devices
    with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
        y = module(x)
    y.backward(dy)
    return [y, x.grad] + [p.grad for p in module.parameters()]


def make(kind):
    if kind == "Linear":
        return te_fuser.Linear(512, 384, params_dtype=torch.bfloat16, device="cpu")
    return te_fuser.LayerNormMLP(256, 512, params_dtype=torch.bfloat16, device="cpu")


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
@pytest.mark.parametrize("tokens", [256, 200])  # 200: ragged against every block of 32 and more
def test_module_matches_the_cpu(name, kind, tokens):
    torch.manual_seed(0)
    cpu_module = make(kind)
    gpu_module = copy.deepcopy(cpu_module).to(CUDA)
    features = 512 if kind == "Linear" else 256
    x = torch.randn(tokens, features, dtype=torch.bfloat16)
    dy = torch.randn(tokens, 384 if kind == "Linear" else 256, dtype=torch.bfloat16)
    want = step(cpu_module, x, dy, RECIPES[name](), seed=1)
    got = step(gpu_module, x.to(CUDA), dy.to(CUDA), RECIPES[name](), seed=1)
    assert all(g.device.type == "cuda" for g in got)
    labels = ["output", "input grad"] + [n for n, _ in cpu_module.named_parameters()]
    errors = {label: relative_error(g, w) for label, g, w in zip(labels, got, want)}
    assert max(errors.values()) <= STEP_TOLERANCE, errors


@pytest.mark.parametrize("name", RECIPES)
def test_forward_gemm_runs_on_the_named_engine(name):
    layer = te_fuser.Linear(512, 384, params_dtype=torch.bfloat16, device=CUDA)
    x = torch.randn(256, 512, dtype=torch.bfloat16, device=CUDA)
    with torch.no_grad(), te_fuser.fp8_autocast(fp8_recipe=RECIPES[name]()):
        layer(x)
    codes = torch.empty(256, 512, dtype=torch.float8_e4m3fn, device=CUDA)
    weight = torch.empty(384, 512, dtype=torch.float8_e4m3fn, device=CUDA)
    expected = gemm_kernels.block_gemm_engine(codes, weight, BLOCK[name], torch.bfloat16)
    assert gemm_kernels.last_block_gemm_engine() == expected
    major = torch.cuda.get_device_capability()[0]
    if name == "float8_block" and major == 9:
        assert expected == "cublaslt_blockwise_1x128"
    if name == "mxfp8" and major < 10:
        assert expected == "device_one_pass_bf16"
    if name == "nvfp4":
        assert expected == "device_one_pass_f32"


@pytest.mark.parametrize("name", RECIPES)
def test_steps_leave_device_memory_flat(name):
    torch.manual_seed(0)
    layer = te_fuser.TransformerLayer(256, 512, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                      params_dtype=torch.bfloat16, device=CUDA)
    x = torch.randn(128, 2, 256, dtype=torch.bfloat16, device=CUDA)
    dy = torch.randn_like(x)
    levels = []
    for seed in range(4):
        outputs = step(layer, x, dy, RECIPES[name](), seed)
        del outputs
        torch.cuda.synchronize()
        levels.append(torch.cuda.memory_allocated())
    # the first step allocates the parameters' gradients; every later step ends where it began
    assert levels[1] == levels[2] == levels[3], levels
