"""A quantized weight (quantized_model_init) under the fp8_autocast of another recipe class: the module refuses
it before anything runs, as TE's modules do (RuntimeError "Recipe mismatch for '<weight>'", the prefix TE's
test_recipe.py matches), for every pair of the five recipes. Under its own recipe it runs as the same module
with 16-bit weights of the same initial values does (which quantizes them to the same bytes: bitwise); outside
fp8_autocast it runs on the weight's dequantized values, unchecked, as in TE.

The weights' recipe comes from the quantizer that made them: a Float8Tensor from a delayed-scaling quantizer is
DelayedScaling's, from a current-scaling one Float8CurrentScaling's."""

import pytest
import torch

import te_fuser
from te_fuser import recipe
from te_fuser.ops.fuser import OperationFuser
from te_fuser.tensor import Float8CurrentScalingQuantizer, QuantizedTensor

HIDDEN, FFN, TOKENS = 128, 128, 128  # multiples of Float8BlockScaling's 128
BF16 = torch.bfloat16
RECIPES = {"delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling,
           "mxfp8": recipe.MXFP8BlockScaling, "block": recipe.Float8BlockScaling, "nvfp4": recipe.NVFP4BlockScaling}
MISMATCHED = [(w, a) for w in RECIPES for a in RECIPES if w != a]


class Grouped(torch.nn.Module):
    """A GroupedLinear of 3 experts over fixed splits of the rows: 32, none, the rest."""

    def __init__(self):
        super().__init__()
        self.experts = te_fuser.GroupedLinear(3, HIDDEN, FFN, params_dtype=BF16)

    def forward(self, x):
        return self.experts(x, [32, 0, x.shape[0] - 32])


MAKERS = {
    "Linear": lambda: te_fuser.Linear(HIDDEN, FFN, params_dtype=BF16),
    "LayerNormLinear": lambda: te_fuser.LayerNormLinear(HIDDEN, FFN, params_dtype=BF16),
    "LayerNormMLP": lambda: te_fuser.LayerNormMLP(HIDDEN, FFN, params_dtype=BF16),
    "GroupedLinear": Grouped,
}
FIRST_WEIGHT = {"Linear": "weight", "LayerNormLinear": "weight", "LayerNormMLP": "fc1_weight",
                "GroupedLinear": "weight0"}  # the first weight the forward checks, by its parameter name


def build(kind, recipe_name=None):
    torch.manual_seed(0)
    if recipe_name is None:
        return MAKERS[kind]()
    with te_fuser.quantized_model_init(recipe=RECIPES[recipe_name]()):
        return MAKERS[kind]()


def inputs(generator):
    x = torch.randn(TOKENS, HIDDEN, generator=generator)
    x[0, :4] = torch.tensor([30.0, -30.0, 1e-3, 0.0])  # edge values: large, tiny, zero
    return x.to(BF16)


def run_step(module, x, fp8_recipe):
    """One forward (under fp8_recipe, or without FP8 when None) and backward: [out, dx, grads]. Seeded: NVFP4's
    stochastic rounding of the gradients draws from torch's generator."""
    torch.manual_seed(5)
    xi = x.clone().requires_grad_()
    with te_fuser.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
        out = module(xi)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype))
    return [out, xi.grad] + [p.grad for p in module.parameters()]


@pytest.fixture
def fuser_calls(monkeypatch):
    """The fuser runs of the test (any op computing anything runs through one)."""
    calls = []
    real = OperationFuser.__call__
    monkeypatch.setattr(OperationFuser, "__call__", lambda self, *a, **k: calls.append(self) or real(self, *a, **k))
    return calls


@pytest.mark.filterwarnings("ignore:Recipe type changed")
@pytest.mark.parametrize("weights_recipe, autocast_recipe", MISMATCHED, ids=[f"{w}-under-{a}" for w, a in MISMATCHED])
@pytest.mark.parametrize("kind", list(MAKERS))
def test_a_weight_of_another_recipe_is_refused_before_anything_runs(kind, weights_recipe, autocast_recipe,
                                                                   generator, fuser_calls):
    module = build(kind, weights_recipe)
    weight = module.get_parameter(("experts." if kind == "GroupedLinear" else "") + FIRST_WEIGHT[kind])
    quantizer = weight._quantizer
    expected, got = RECIPES[weights_recipe].__name__, RECIPES[autocast_recipe].__name__
    with te_fuser.fp8_autocast(fp8_recipe=RECIPES[autocast_recipe]()):
        with pytest.raises(RuntimeError, match=f"^Recipe mismatch for '{FIRST_WEIGHT[kind]}': ") as error:
            module(inputs(generator).requires_grad_())
    message = str(error.value)
    assert f"for {expected}," in message and f"runs {got};" in message, message
    assert not fuser_calls, "an op ran"
    assert weight._quantizer is quantizer, "the weight still carries the quantizer that made it"


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", list(MAKERS))
def test_a_weight_of_the_autocast_recipe_runs_as_16bit_weights_of_its_values_do(kind, recipe_name, generator):
    """The reference: the same module with 16-bit weights of the same initial values under the same recipe
    (delayed: the fresh weight slot's scale 1; current and the block formats: from the values alone) casts them
    to the quantized weights' bytes, so outputs and gradients are bitwise equal."""
    module, plain = build(kind, recipe_name), build(kind)
    assert any(isinstance(p, QuantizedTensor) for p in module.parameters())
    x = inputs(generator)
    got = run_step(module, x, RECIPES[recipe_name]())
    want = run_step(plain, x, RECIPES[recipe_name]())
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(a, b), (i, (a.float() - b.float()).abs().max())


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_outside_fp8_autocast_a_quantized_weight_runs_on_its_dequantized_values(kind, recipe_name, generator):
    """As TE: no recipe to check, the GEMMs read the dequantized weight (bitwise those of a 16-bit module holding
    them)."""
    module, plain = build(kind, recipe_name), build(kind)
    with torch.no_grad():
        for (name, p), (_, q) in zip(module.named_parameters(), plain.named_parameters()):
            q.copy_(p.dequantize() if isinstance(p, QuantizedTensor) else p)
    x = inputs(generator)
    for i, (a, b) in enumerate(zip(run_step(module, x, None), run_step(plain, x, None))):
        assert a.dtype == b.dtype and torch.equal(a, b), i


@pytest.mark.filterwarnings("ignore:Recipe type changed")
def test_calibration_checks_the_weights_against_its_recipe(generator, fuser_calls):
    """fp8_autocast(enabled=False, calibrating=True) checks as TE's does: its recipe is the one the amaxes are
    recorded for."""
    module = build("Linear", "current")
    with te_fuser.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=recipe.MXFP8BlockScaling()):
        with pytest.raises(RuntimeError, match="^Recipe mismatch for 'weight': .*for Float8CurrentScaling, .*"
                                               "runs MXFP8BlockScaling;"):
            module(inputs(generator))
    assert not fuser_calls
    with te_fuser.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=recipe.Float8CurrentScaling()):
        module(inputs(generator))
    assert fuser_calls


@pytest.mark.filterwarnings("ignore:Recipe type changed")
def test_a_custom_recipe_matches_no_quantized_weight(generator):
    """As in TE, no recipe class is a CustomRecipe: a quantized weight is refused under one even when its
    factory returns the weight's own kind of quantizer."""
    module = build("Linear", "current")
    custom = recipe.CustomRecipe(qfactory=lambda role: Float8CurrentScalingQuantizer(torch.float8_e4m3fn))
    with te_fuser.fp8_autocast(fp8_recipe=custom):
        with pytest.raises(RuntimeError, match="^Recipe mismatch for 'weight': .*for Float8CurrentScaling, .*"
                                               "runs CustomRecipe;"):
            module(inputs(generator))


@pytest.mark.filterwarnings("ignore:Recipe type changed")
@pytest.mark.parametrize("kind", ["MultiheadAttention", "TransformerLayer"])
def test_attention_layers_refuse_through_their_linear_modules(kind, generator, fuser_calls):
    """The first linear module of the layer (the fused QKV projection) names its weight."""
    makers = {"MultiheadAttention": lambda: te_fuser.MultiheadAttention(HIDDEN, 2, params_dtype=BF16,
                                                                         fuse_qkv_params=True, input_layernorm=True),
              "TransformerLayer": lambda: te_fuser.TransformerLayer(HIDDEN, FFN, 2, params_dtype=BF16,
                                                                     fuse_qkv_params=True)}
    with te_fuser.quantized_model_init(recipe=recipe.DelayedScaling()):
        layer = makers[kind]()
    x = torch.randn(TOKENS // 2, 2, HIDDEN, generator=generator).to(BF16)
    with te_fuser.fp8_autocast(fp8_recipe=recipe.NVFP4BlockScaling()):
        with pytest.raises(RuntimeError, match="^Recipe mismatch for 'weight': .*for DelayedScaling, .*"
                                               "runs NVFP4BlockScaling;"):
            layer(x)
    assert not fuser_calls
