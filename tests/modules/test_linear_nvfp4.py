"""te_fuser.Linear (and an ops.Sequential of BasicLinear + Bias) under NVFP4BlockScaling, forward and
backward, against float64 math on operands quantized by the independent reference (nvfp4_reference.py):
x, W, dy rowwise; W (16x16 blocks), dy and x columnwise for the gradients, the wgrad's two operands
Hadamard-transformed, dy stochastically rounded with the seeds the layer drew (recorded by a spy on the
kernel), the roles' flags checked against the recipe's QParams.

The one allowed difference is te_fuser's float32 summation (ops/block_gemm.py): each 16-block's sum of
E2M1 products is exact, the block sums are scaled and added in float32, bounded by
(K / 16 + 4) * 2^-24 * sum |a||b| (plus the output rounding of 16-bit outputs). A wrong code, scale,
seed or transform moves a result by about an FP4 step of one term, far beyond that bound. Each gradient
is also within NVFP4's error of the unquantized float64 product (a transform on one wgrad operand only
would not be).

Sizes that are not multiples of 16 (TE refuses them) run as the zero-padded tensors: the reference pads,
so each GEMM's K runs over the padded length.
"""

import pytest
import torch

import nvfp4_reference as ref
import te_fuser
from _module_checks import ctx_walk_check, retained_bytes_check
from test_linear_block_scaling import layernorm_modules_check
from te_fuser.kernels import nvfp4 as nvfp4_kernels
from te_fuser.recipe import NVFP4BlockScaling

IN, OUT = 128, 64
SHAPE = (2, 48, IN)  # 96 tokens
SIZES = {  # (leading dims, in_features, out_features)
    "aligned": ((2, 48), IN, OUT),
    "ragged": ((3, 11), 41, 17),  # 33 tokens
}

RECIPES = {
    "default": NVFP4BlockScaling,  # 2D weights, the transform on the wgrad operands, stochastic gradients
    "plain": lambda: NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True,
                                       disable_2d_quantization=True),
    "rht_only": lambda: NVFP4BlockScaling(disable_stochastic_rounding=True, disable_2d_quantization=True),
}


def record_quantizations(monkeypatch):
    """The kernel's calls, in order, as (input, block_2d, rht, stochastic, seed)."""
    calls = []
    kernel = nvfp4_kernels.nvfp4_quantize

    def spy(x, rowwise=True, columnwise=True, block_2d=False, rht=False, stochastic=False, seed=0, amaxes=None):
        calls.append((x.detach().clone(), block_2d, rht, stochastic, seed))
        return kernel(x, rowwise, columnwise, block_2d, rht, stochastic, seed, amaxes=amaxes)

    monkeypatch.setattr(nvfp4_kernels, "nvfp4_quantize", spy)
    return calls


def assert_within(got, want, magnitude, steps, dtype, what):
    bound = steps * 2.0**-24 * magnitude + (0 if dtype == torch.float32 else 2.0**-8 * want.abs())
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), f"{what}: max excess {(err - bound).max().item():.3g}"


def assert_near_unquantized(got, exact, what):
    rel = ((got.double() - exact).norm() / exact.norm()).item()
    assert rel < 0.2, f"{what}: relative error {rel:.3f} against the unquantized product"


def blocks(n):
    return -(-n // 16)


@pytest.mark.parametrize("sizes", sorted(SIZES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_linear_matches_the_quantized_math_in_float64(name, dtype, sizes, generator, monkeypatch):
    recipe = RECIPES[name]()
    lead, IN, OUT = SIZES[sizes]
    layer = te_fuser.Linear(IN, OUT, bias=True, params_dtype=dtype)
    with torch.no_grad():
        layer.bias.normal_(generator=generator)
    x = (torch.randn(*lead, IN, generator=generator) * torch.logspace(-2, 2, IN)).to(dtype).requires_grad_()
    calls = record_quantizations(monkeypatch)
    with te_fuser.fp8_autocast(fp8_recipe=recipe):
        y = layer(x)
    dy = torch.randn(y.shape, generator=generator).to(dtype)
    y.backward(dy)

    (x_in, *x_flags), (w_in, *w_flags), (g_in, *g_flags) = calls
    x2, w, g = x.detach().reshape(-1, IN), layer.weight.detach(), dy.reshape(-1, OUT)
    assert torch.equal(x_in.reshape(-1, IN), x2) and torch.equal(w_in, w) and torch.equal(g_in.reshape(-1, OUT), g)
    inp, weight, grad = recipe.fp4_quant_fwd_inp, recipe.fp4_quant_fwd_weight, recipe.fp4_quant_bwd_grad
    assert x_flags[:3] == [False, inp.random_hadamard_transform, False]
    assert w_flags[:3] == [weight.fp4_2d_quantization, False, False]
    assert g_flags[:3] == [False, grad.random_hadamard_transform, grad.stochastic_rounding]
    seed = g_flags[3] if grad.stochastic_rounding else None
    rht, two_d = inp.random_hadamard_transform, weight.fp4_2d_quantization

    xq, wq = ref.values(x2), ref.values(w, block_2d=two_d)
    b = layer.bias.detach().double()
    y_ref = xq @ wq.t() + b
    assert_within(y.reshape(-1, OUT), y_ref, xq.abs() @ wq.abs().t() + b.abs(), blocks(IN) + 4, dtype, "y")
    assert_near_unquantized(y.reshape(-1, OUT), x2.double() @ w.double().t() + b, "y")

    gq, wq_t = ref.values(g, seed=seed), ref.values(w, columnwise=True, block_2d=two_d)  # wq_t: (IN, OUT)
    dx_ref = gq @ wq_t.t()
    assert_within(x.grad.reshape(-1, IN), dx_ref, gq.abs() @ wq_t.abs().t(), blocks(OUT) + 4, dtype, "dx")
    assert_near_unquantized(x.grad.reshape(-1, IN), g.double() @ w.double(), "dx")

    gq_t = ref.values(g, columnwise=True, rht=rht, seed=seed)  # (OUT, tokens), transformed under rht
    xq_t = ref.values(x2, columnwise=True, rht=rht)  # (IN, tokens)
    dw_ref = gq_t @ xq_t.t()
    tokens = g.shape[0]
    assert_within(layer.weight.grad, dw_ref, gq_t.abs() @ xq_t.abs().t(), blocks(tokens) + 4, dtype, "dW")
    assert_near_unquantized(layer.weight.grad, g.double().t() @ x2.double(), "dW")


def test_ops_sequential_matches_the_module(generator):
    """ops.Sequential(BasicLinear, Bias) under the recipe gives the module's output and grads bit for bit
    (same weights, same seed for the stochastic rounding)."""
    layer = te_fuser.Linear(IN, OUT, bias=True)
    seq = te_fuser.ops.Sequential(te_fuser.ops.BasicLinear(IN, OUT), te_fuser.ops.Bias(OUT))
    with torch.no_grad():
        seq[0].weight.copy_(layer.weight)
        seq[1].bias.copy_(layer.bias)
    x = torch.randn(SHAPE, generator=generator)
    results = []
    for model in (layer, seq):
        xi = x.clone().requires_grad_()
        torch.manual_seed(7)
        with te_fuser.fp8_autocast(fp8_recipe=NVFP4BlockScaling()):
            y = model(xi)
        y.backward(torch.ones_like(y))
        results.append((y, xi.grad, next(model.parameters()).grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_save_original_input_gives_the_same_bits(generator):
    """save_original_input=True keeps x in high precision and quantizes its columnwise data (transformed)
    in backward: the same operands, so the same output and grads."""
    plain = te_fuser.Linear(IN, OUT)
    original = te_fuser.Linear(IN, OUT, save_original_input=True)
    original.load_state_dict(plain.state_dict())
    x = torch.randn(SHAPE, generator=generator)
    results = []
    for model in (plain, original):
        xi = x.clone().requires_grad_()
        torch.manual_seed(11)
        with te_fuser.fp8_autocast(fp8_recipe=NVFP4BlockScaling()):
            y = model(xi)
        y.backward(torch.ones_like(y))
        results.append((y, xi.grad, model.weight.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_layernorm_modules_at_ragged_sizes(name, generator):
    """As test_linear_block_scaling's: LayerNormLinear and LayerNormMLP against their parts at 33 tokens."""
    lead, k, _ = SIZES["ragged"]
    layernorm_modules_check(RECIPES[name](), torch.randn(*lead, k, generator=generator), 0.25)


def test_refusals_name_what_they_refuse():
    with pytest.raises(ValueError, match="Inf or NaN"):
        with te_fuser.fp8_autocast(fp8_recipe=NVFP4BlockScaling()):
            te_fuser.Linear(32, 32)(torch.full((16, 32), float("nan")))


# -- the lifetime discipline -------------------------------------------------------------------------
MODULES = {
    "Linear": lambda: te_fuser.Linear(IN, OUT, bias=True),
    "LayerNormLinear": lambda: te_fuser.LayerNormLinear(IN, OUT, bias=True),
}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_nothing_reachable_after_backward(module, monkeypatch):
    """The ctx walk finds nothing after backward, and finds the saved NVFP4 buffers with the fuser's
    clearing switched off (bug-on control)."""
    torch.manual_seed(0)
    ctx_walk_check(MODULES[module](), lambda: torch.randn(128, IN, requires_grad=True), NVFP4BlockScaling(),
                   monkeypatch)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_retained_bytes(module, monkeypatch):
    """A step keeps only its output and grads; with clearing off it keeps at least the FP4 bytes of x's and
    W's columnwise copies (bug-on control)."""
    torch.manual_seed(0)
    retained_bytes_check(MODULES[module](), lambda: torch.randn(128, IN, requires_grad=True), NVFP4BlockScaling(),
                         monkeypatch, min_leak=(128 * IN + OUT * IN) // 2)
