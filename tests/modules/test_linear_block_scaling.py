"""te_fuser.Linear under MXFP8BlockScaling and Float8BlockScaling, forward and backward, against a
float64 reference of the quantized math: each operand quantized by the independent references of
block_scaling_reference.py (x, W, dy rowwise; W, dy, x columnwise for the gradients), multiplied
and summed in float64. The one allowed difference is te_fuser's float32 summation
(ops/block_gemm.py): within a block, then block by block, each step rounded, bounded by
(block + ceil(K / block) + 4) * 2^-24 * sum |a||b| (plus the output rounding of 16-bit outputs). A wrong
code or scale moves a result by about an FP8 step of one term, far beyond that bound.

Sizes that are not multiples of the block (TE's quantizers refuse them) run too: the last block is
partial, its scale from the elements present, as the references' zero padding gives.
"""

import warnings

import pytest
import torch

import block_scaling_reference as ref
import te_fuser
from _module_checks import ctx_walk_check, retained_bytes_check
from te_fuser.recipe import Float8BlockScaling, Format, MXFP8BlockScaling, QParams

IN, OUT = 256, 128
SHAPE = (2, 64, IN)  # 128 tokens
SIZES = {  # (leading dims, in_features, out_features)
    "aligned": ((2, 64), IN, OUT),
    "ragged": ((3, 11), 200, 33),  # 33 tokens; every dimension a partial last block of 32 and of 128
}


def _hybrid_mxfp8():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return MXFP8BlockScaling(fp8_format=Format.HYBRID)


RECIPES = {
    "mxfp8": MXFP8BlockScaling,
    "mxfp8_hybrid": _hybrid_mxfp8,
    "block": Float8BlockScaling,
    "block_fp32_scales": lambda: Float8BlockScaling(fp8_quant_fwd_inp=QParams(False, 1e-3),
                                                    fp8_quant_fwd_weight=QParams(False),
                                                    fp8_quant_bwd_grad=QParams(False, 1e-6)),
    "block_2d_input_hybrid": lambda: Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1,
                                                        fp8_format=Format.HYBRID),
}


def quantized(recipe, role, t, columnwise):
    """float64 values of t (2-D) as the recipe quantizes it for `role` (input, weight or grad)."""
    fp8_dtype = recipe.fp8_format.bwd_dtype if role == "grad" else recipe.fp8_format.fwd_dtype
    t = t.detach()
    if isinstance(recipe, MXFP8BlockScaling):
        return ref.mxfp8_values(t, fp8_dtype, columnwise)
    qparams, dim = {"input": (recipe.fp8_quant_fwd_inp, recipe.x_block_scaling_dim),
                    "weight": (recipe.fp8_quant_fwd_weight, recipe.w_block_scaling_dim),
                    "grad": (recipe.fp8_quant_bwd_grad, recipe.grad_block_scaling_dim)}[role]
    return ref.float8_block_values(t, fp8_dtype, dim, qparams.amax_epsilon, qparams.power_2_scale, columnwise)


def assert_within(got, want, magnitude, steps, dtype, what):
    """|got - want| <= steps * 2^-24 * magnitude (+ half an ulp of the output dtype)."""
    bound = steps * 2.0**-24 * magnitude + (0 if dtype == torch.float32 else 2.0**-8 * want.abs())
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), f"{what}: max excess {(err - bound).max().item():.3g}"


def blocks(n, block):
    return -(-n // block)


@pytest.mark.parametrize("sizes", sorted(SIZES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_linear_matches_the_quantized_math_in_float64(name, dtype, sizes, generator):
    recipe = RECIPES[name]()
    block = 32 if isinstance(recipe, MXFP8BlockScaling) else 128
    lead, IN, OUT = SIZES[sizes]
    layer = te_fuser.Linear(IN, OUT, bias=True, params_dtype=dtype)
    with torch.no_grad():
        layer.bias.normal_(generator=generator)
    x = (torch.randn(*lead, IN, generator=generator) * torch.logspace(-3, 3, IN)).to(dtype).requires_grad_()
    with te_fuser.fp8_autocast(fp8_recipe=recipe):
        y = layer(x)
    dy = torch.randn(y.shape, generator=generator).to(dtype)
    y.backward(dy)

    x2, w, g = x.detach().reshape(-1, IN), layer.weight.detach(), dy.reshape(-1, OUT)  # quantized in their dtypes
    xq, wq = quantized(recipe, "input", x2, False), quantized(recipe, "weight", w, False)
    b = layer.bias.detach().double()
    y_ref = xq @ wq.t() + b
    assert_within(y.reshape(-1, OUT), y_ref, xq.abs() @ wq.abs().t() + b.abs(), block + blocks(IN, block) + 4, dtype,
                  "y")

    gq, wq_col = quantized(recipe, "grad", g, False), quantized(recipe, "weight", w, True)
    dx_ref = gq @ wq_col
    assert_within(x.grad.reshape(-1, IN), dx_ref, gq.abs() @ wq_col.abs(), block + blocks(OUT, block) + 4, dtype,
                  "dx")

    gq_col, xq_col = quantized(recipe, "grad", g, True), quantized(recipe, "input", x2, True)
    dw_ref = gq_col.t() @ xq_col
    rows = g.shape[0]
    assert_within(layer.weight.grad, dw_ref, gq_col.abs().t() @ xq_col.abs(), block + blocks(rows, block) + 4,
                  dtype, "dW")
    torch.testing.assert_close(layer.bias.grad.double(), g.double().sum(0), rtol=2e-2 if dtype != torch.float32 else 1e-5,
                               atol=1e-4)


@pytest.mark.parametrize("name", ["mxfp8", "block"])
def test_gemm_order_is_the_stated_one(name, generator):
    """The forward output equals, bit for bit, the stated order computed in float32 from the exact
    quantized values: per K block a float32 sum (k ascending, te_fuser's portable FP8 GEMM), times
    float32(sa * sb), added block by block."""
    from te_fuser.kernels import cpu

    recipe = RECIPES[name]()
    block = 32 if name == "mxfp8" else 128
    layer = te_fuser.Linear(IN, OUT, bias=False, params_dtype=torch.float32)
    x = torch.randn(128, IN, generator=generator)
    with cpu.isa("portable"), te_fuser.fp8_autocast(fp8_recipe=recipe):
        y = layer(x)
    xq, wq = quantized(recipe, "input", x, False), quantized(recipe, "weight", layer.weight, False)
    want = torch.zeros(128, OUT, dtype=torch.float32)
    for kb in range(IN // block):
        cols = slice(kb * block, (kb + 1) * block)
        a, b = xq[:, cols], wq[:, cols]
        sa = a.abs().amax(1, keepdim=True)  # the block's scale up to a power of two: any common factor
        sa = torch.where(sa > 0, torch.exp2(torch.floor(torch.log2(sa))), torch.ones_like(sa))
        sb = b.abs().amax(1, keepdim=True)
        sb = torch.where(sb > 0, torch.exp2(torch.floor(torch.log2(sb))), torch.ones_like(sb))
        partial = torch.zeros(128, OUT, dtype=torch.float32)
        for k in range(block):  # exact products of the scaled-down values, summed in k order
            partial += ((a[:, k:k + 1] / sa) * (b[:, k] / sb[:, 0])[None, :]).float()
        want += partial * (sa.float() * sb.float().t())
    assert torch.equal(y, want)


def copy_params(pairs):
    with torch.no_grad():
        for dst, src in pairs:
            dst.copy_(src)


def layernorm_modules_check(recipe, x, tolerance):
    """LayerNormLinear is LayerNorm then Linear bit for bit (output and dx); LayerNormMLP's output is
    LayerNorm, fc1, te_fuser's GELU op, fc2 bit for bit, and its output and dx stay within `tolerance`
    (relative) of the unquantized module's."""
    k = x.shape[-1]
    lnl, ln, lin = te_fuser.LayerNormLinear(k, 33), te_fuser.LayerNorm(k), te_fuser.Linear(k, 33)
    mlp, mlp_ln, fc1, fc2 = te_fuser.LayerNormMLP(k, 72), te_fuser.LayerNorm(k), te_fuser.Linear(k, 72), \
        te_fuser.Linear(72, k)
    copy_params([(ln.weight, lnl.layer_norm_weight), (ln.bias, lnl.layer_norm_bias), (lin.weight, lnl.weight),
                 (lin.bias, lnl.bias), (mlp_ln.weight, mlp.layer_norm_weight), (mlp_ln.bias, mlp.layer_norm_bias),
                 (fc1.weight, mlp.fc1_weight), (fc1.bias, mlp.fc1_bias), (fc2.weight, mlp.fc2_weight),
                 (fc2.bias, mlp.fc2_bias)])

    def run(f, quantized=True):
        xi = x.clone().requires_grad_()
        torch.manual_seed(5)  # the same stochastic-rounding seeds for each run
        with te_fuser.fp8_autocast(enabled=quantized, fp8_recipe=recipe):
            y = f(xi)
        y.backward(torch.ones_like(y))
        return y, xi.grad

    for a, b in zip(run(lnl), run(lambda t: lin(ln(t)))):
        assert torch.equal(a, b)
    y, dx = run(mlp)
    gelu = te_fuser.ops.GELU()
    assert torch.equal(y, run(lambda t: fc2(gelu(fc1(mlp_ln(t)))))[0])
    for got, exact in zip((y, dx), run(mlp, quantized=False)):
        assert ((got - exact).norm() / exact.norm()).item() < tolerance


@pytest.mark.parametrize("name", ["mxfp8", "block"])
def test_layernorm_modules_at_ragged_sizes(name, generator):
    lead, k, _ = SIZES["ragged"]
    layernorm_modules_check(RECIPES[name](), torch.randn(*lead, k, generator=generator), 0.1)


def test_refusals_name_what_they_refuse():
    with pytest.raises(NotImplementedError, match="enable_2d_quantization"):
        MXFP8BlockScaling(enable_2d_quantization=True)
    with pytest.raises(NotImplementedError, match="fp8_output"):
        with te_fuser.fp8_autocast(fp8_recipe=MXFP8BlockScaling()):
            te_fuser.Linear(IN, OUT)(torch.randn(32, IN), fp8_output=True)


# -- the lifetime discipline under each block-scaled recipe -------------------------------------------
MODULES = {
    "Linear": lambda: te_fuser.Linear(IN, OUT, bias=True),
    "LayerNormLinear": lambda: te_fuser.LayerNormLinear(IN, OUT, bias=True),
}


@pytest.mark.parametrize("module", sorted(MODULES))
@pytest.mark.parametrize("name", ["mxfp8", "block"])
def test_nothing_reachable_after_backward(name, module, monkeypatch):
    """The ctx walk finds nothing after backward, and finds the saved block-scaled buffers with the
    fuser's clearing switched off (bug-on control)."""
    torch.manual_seed(0)
    ctx_walk_check(MODULES[module](), lambda: torch.randn(128, IN, requires_grad=True), RECIPES[name](), monkeypatch)


@pytest.mark.parametrize("module", sorted(MODULES))
@pytest.mark.parametrize("name", ["mxfp8", "block"])
def test_retained_bytes(name, module, monkeypatch):
    """A step keeps only its output and grads; with clearing off it keeps at least the FP8 bytes of
    x's and W's columnwise copies (bug-on control)."""
    torch.manual_seed(0)
    retained_bytes_check(MODULES[module](), lambda: torch.randn(128, IN, requires_grad=True), RECIPES[name](),
                         monkeypatch, min_leak=128 * IN + OUT * IN)
