"""Quantized weights (quantized_model_init) under the block-scaled recipes: MXFP8Tensor, Float8BlockwiseQTensor
(128x128 blocks) and NVFP4Tensor (16x16 blocks) parameters. What the modules hold, that the block-scaled GEMMs
read the parameter's own bytes (no requantization, no 16-bit copy), optimizer steps, checkpoints, copies and
the ctx discipline.

References: the recipe's weight quantizer on the same initial values (its bit-exactness against float64
references is tests/test_block_scaling_reference.py's and test_nvfp4_quantize.py's); the same module built
with high-precision weights and run under the same recipe (it quantizes those values to the same bytes each
step: outputs and gradients bitwise); optimizer steps of plain parameters holding the dequantized values."""

import copy
import io
import pickle

import pytest
import torch

import te_fuser
from te_fuser import recipe
from te_fuser.quantization import BlockScalingState
from te_fuser.tensor import Float8BlockwiseQTensor, MXFP8Tensor, NVFP4Tensor, QuantizedTensor
from te_fuser.tensor._block_scaled_tensor import BlockScaledTensor

from _module_checks import ctx_walk_check, retained_bytes_check

HIDDEN, FFN, TOKENS = 128, 256, 128  # multiples of Float8BlockScaling's 128
BF16 = torch.bfloat16
RECIPES = {"mxfp8": recipe.MXFP8BlockScaling, "block": recipe.Float8BlockScaling, "nvfp4": recipe.NVFP4BlockScaling}
TENSOR_CLASS = {"mxfp8": MXFP8Tensor, "block": Float8BlockwiseQTensor, "nvfp4": NVFP4Tensor}
COLUMNWISE_KEPT = {"mxfp8": True, "block": False, "nvfp4": False}  # 2-D blocks: rowwise only

class Grouped(torch.nn.Module):
    """A GroupedLinear of 3 experts over fixed splits of the rows: 32, none, the rest (a ragged last block)."""

    def __init__(self):
        super().__init__()
        self.experts = te_fuser.GroupedLinear(3, HIDDEN, FFN, params_dtype=BF16, device="cpu")

    def forward(self, x):
        return self.experts(x, [32, 0, x.shape[0] - 32])


MAKERS = {
    "Linear": lambda: te_fuser.Linear(HIDDEN, FFN, params_dtype=BF16, device="cpu"),
    "GroupedLinear": Grouped,
    "LayerNormLinear": lambda: te_fuser.LayerNormLinear(HIDDEN, FFN, params_dtype=BF16, device="cpu"),
    "LayerNormMLP": lambda: te_fuser.LayerNormMLP(HIDDEN, FFN, params_dtype=BF16, device="cpu"),
    "ops.BasicLinear": lambda: te_fuser.ops.Sequential(te_fuser.ops.BasicLinear(HIDDEN, FFN, device="cpu", dtype=BF16)),
    # parameters_split (the default unfused QKV) is refused with quantized weights: fused QKV. No dropout:
    # the runs compared draw from torch's generator in different states.
    "MultiheadAttention": lambda: te_fuser.MultiheadAttention(HIDDEN, 2, params_dtype=BF16, device="cpu",
                                                              fuse_qkv_params=True, attention_dropout=0.0),
    "TransformerLayer": lambda: te_fuser.TransformerLayer(HIDDEN, FFN, 2, params_dtype=BF16, device="cpu",
                                                          fuse_qkv_params=True, attention_dropout=0.0,
                                                          hidden_dropout=0.0),
}
QUANTIZED_WEIGHTS = {"Linear": 1, "GroupedLinear": 3, "LayerNormLinear": 1, "LayerNormMLP": 2, "ops.BasicLinear": 1,
                     "MultiheadAttention": 2, "TransformerLayer": 4}
ATTENTION = ("MultiheadAttention", "TransformerLayer")


def build(kind, recipe_name=None, seed=0, preserve=False):
    torch.manual_seed(seed)
    if recipe_name is None:
        module = MAKERS[kind]()
    else:
        with te_fuser.quantized_model_init(recipe=RECIPES[recipe_name](), preserve_high_precision_init_val=preserve):
            module = MAKERS[kind]()
    with torch.no_grad():  # biases and norm weights off their constant init: every gradient shows
        gen = torch.Generator().manual_seed(seed + 1)
        for p in module.parameters():
            if p.dim() == 1:
                p.add_((torch.randn(p.shape, generator=gen) * 0.1).to(p.dtype))
    return module


def inputs(kind, generator):
    shape = (TOKENS // 2, 2, HIDDEN) if kind in ATTENTION else (TOKENS, HIDDEN)
    x = torch.randn(shape, generator=generator)
    x.view(-1, HIDDEN)[0, :4] = torch.tensor([30.0, -30.0, 1e-3, 0.0])  # edge values: large, tiny, zero
    return x.to(BF16)


def quantized_params(module):
    return [(n, p) for n, p in module.named_parameters() if isinstance(p, QuantizedTensor)]


def weight_quantizer(recipe_name):
    """The recipe's weight quantizer (forward slot 1), both usages."""
    return BlockScalingState(RECIPES[recipe_name](), 2).quantizer(1)


def buffers(t):
    return {name: getattr(t, name) for name in t._BUFFERS if getattr(t, name) is not None}


def assert_same_buffers(got, want, where):
    mine, theirs = buffers(got), buffers(want)
    assert set(mine) <= set(theirs), (where, sorted(mine), sorted(theirs))
    for name, b in mine.items():
        assert torch.equal(b.view(torch.uint8), theirs[name].view(torch.uint8)), (where, name)


def run_step(kind, module, x, recipe_name, dy_seed=7):
    """One forward (under the recipe, or without FP8 when recipe_name is None) and backward: [out, dx, grads].
    Seeded: NVFP4's stochastic rounding of the gradients draws from torch's generator."""
    torch.manual_seed(dy_seed)
    xi = x.clone().requires_grad_()
    with te_fuser.fp8_autocast(enabled=recipe_name is not None,
                               fp8_recipe=ALL_RECIPES[recipe_name]() if recipe_name else None):
        out = module(xi)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(dy_seed)).to(out.dtype))
    results = [out, xi.grad] + [p.grad for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return results


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", list(MAKERS))
def test_weights_are_the_recipes_tensors_quantized_from_the_initial_values(kind, recipe_name):
    module = build(kind, recipe_name, preserve=True)
    plain = dict(build(kind).named_parameters())  # the same seed without quantized weights
    weights = quantized_params(module)
    assert len(weights) == QUANTIZED_WEIGHTS[kind]
    for name, p in module.named_parameters():
        if not isinstance(p, QuantizedTensor):
            assert type(p) is torch.nn.Parameter and p.dtype == BF16, name  # norms and biases stay 16-bit
    quantizer = weight_quantizer(recipe_name)
    for name, p in weights:
        assert type(p) is TENSOR_CLASS[recipe_name] and isinstance(p, torch.nn.Parameter), name
        assert p.requires_grad and p.dtype == BF16 and p.shape == plain[name].shape, name
        assert (p._columnwise_data is not None) == COLUMNWISE_KEPT[recipe_name], name
        assert p._quantizer.columnwise_usage == COLUMNWISE_KEPT[recipe_name]
        init = p.get_high_precision_init_val()
        assert init.device.type == "cpu" and torch.equal(init, plain[name].detach()), name
        want = quantizer(init)
        assert_same_buffers(p, want, name)
        if not COLUMNWISE_KEPT[recipe_name]:  # what the dgrad makes of the rowwise bytes
            assert_same_buffers(p.columnwise_from_rowwise(), want, name)
        p.clear_high_precision_init_val()
        assert p.get_high_precision_init_val() is None


def test_columnwise_from_rowwise_refuses_what_it_cannot_make():
    one_d = weight_quantizer("block")
    one_d.block_scaling_dim = 1
    with pytest.raises(ValueError, match="128x128"):
        one_d(torch.randn(128, 128)).columnwise_from_rowwise()
    with pytest.raises(ValueError, match="16x16"):
        NVFP4Tensor((8, 16), torch.float32, rowwise_data=torch.zeros(8, 8, dtype=torch.uint8),
                    rowwise_scale_inv=torch.zeros(128, 4, dtype=torch.uint8), amax_rowwise=torch.ones(1),
                    fp8_dtype=torch.uint8).columnwise_from_rowwise()


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", list(MAKERS))
def test_outputs_and_gradients_equal_the_high_precision_module_under_the_recipe(kind, recipe_name, generator):
    """Under the recipe the high-precision module quantizes its weights to the parameters' bytes: bitwise
    equal. Outside autocast both compute in bf16, the quantized one with its dequantized (rowwise) values."""
    module = build(kind, recipe_name)
    x = inputs(kind, generator)
    got, want = run_step(kind, module, x, recipe_name), run_step(kind, build(kind), x, recipe_name)
    for i, (g, w) in enumerate(zip(got, want)):
        assert type(g) is torch.Tensor and g.dtype == w.dtype, i
        assert torch.equal(g, w), (i, (g.float() - w.float()).abs().max())
    dequantized = build(kind)
    with torch.no_grad():
        for (name, p), q in zip(module.named_parameters(), dequantized.parameters()):
            q.copy_(p.dequantize() if isinstance(p, QuantizedTensor) else p)
    for i, (g, w) in enumerate(zip(run_step(kind, module, x, None), run_step(kind, dequantized, x, None))):
        assert torch.equal(g, w), (i, (g.float() - w.float()).abs().max())


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", ["Linear", "GroupedLinear", "LayerNormMLP"])
def test_the_gemms_read_the_parameters_bytes(kind, recipe_name, generator, monkeypatch):
    """Nothing quantizes or dequantizes a weight in forward or backward; what backward keeps of it is the
    parameter's own storage (no copy), and no 16-bit tensor of its shape is saved."""
    module = build(kind, recipe_name)
    weights = [p for _, p in quantized_params(module)]
    shapes = {tuple(p.shape) for p in weights} | {tuple(p.shape[::-1]) for p in weights}
    touched = []
    quantizer_type = type(weights[0]._quantizer)
    real_quantize, real_dequantize = quantizer_type.quantize, BlockScaledTensor.dequantize
    monkeypatch.setattr(quantizer_type, "quantize",
                        lambda self, x, *a, **k: touched.append(("quantize", tuple(x.shape)))
                        or real_quantize(self, x, *a, **k))
    monkeypatch.setattr(BlockScaledTensor, "dequantize",
                        lambda self, dtype=None: touched.append(("dequantize", tuple(self.shape)))
                        or real_dequantize(self, dtype))
    saved = []

    def pack(t):
        saved.append(t)
        return t

    x = torch.randn(3 * TOKENS, HIDDEN, generator=generator).to(BF16).requires_grad_()  # tokens: no weight dim
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with te_fuser.fp8_autocast(fp8_recipe=RECIPES[recipe_name]()):
            out = module(x)
    out.float().sum().backward()
    assert not [t for t in touched if t[1] in shapes], touched
    assert [t for t in touched if t[0] == "quantize"], "the control: the inputs are quantized"
    weight_ptrs = {b.untyped_storage().data_ptr() for p in weights for b in buffers(p).values()}
    saved_ptrs = {t.untyped_storage().data_ptr() for t in saved if t.numel()}
    assert saved_ptrs & weight_ptrs, "dgrad keeps the parameter's own bytes"
    copies = [(tuple(t.shape), t.dtype) for t in saved
              if tuple(t.shape) in shapes and t.untyped_storage().data_ptr() not in weight_ptrs]
    assert not copies, f"copies of a quantized weight saved for backward: {copies}"
    assert all(p.grad is not None and p.grad.dtype == BF16 and type(p.grad) is torch.Tensor for p in weights)


ALL_RECIPES = {**RECIPES, "delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling}


@pytest.mark.parametrize("update", ["mul_", "Adam_foreach", "Adam_fused"])
@pytest.mark.parametrize("recipe_name", list(ALL_RECIPES))
def test_an_update_between_forward_and_backward_is_caught(recipe_name, update, generator):
    """Autograd's version check sees a write into a quantized weight's buffers after the forward saved them.
    Planted to check it: quantized_tensor._bump_versions made a no-op: every case backpropagates through the
    overwritten weight without an error (the writes inside __torch_dispatch__ are not counted), the Float8
    recipes' too."""
    fp8_recipe = ALL_RECIPES[recipe_name]()
    torch.manual_seed(0)
    with te_fuser.quantized_model_init(recipe=fp8_recipe):
        module = MAKERS["Linear"]()
    x = inputs("Linear", generator).requires_grad_()
    weight = module.weight
    weight.grad = torch.ones(weight.shape, dtype=BF16)
    optimizer = {"Adam_foreach": lambda: torch.optim.Adam([weight], foreach=True),
                 "Adam_fused": lambda: torch.optim.Adam([weight], fused=True)}.get(update)
    with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
        out = module(x)
    if optimizer is None:
        with torch.no_grad():
            weight.mul_(0.5)
    else:
        optimizer().step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.float().sum().backward()


OPTIMIZERS = {
    "SGD": lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.5, foreach=False),
    "SGD_foreach": lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.5, foreach=True),
    "Adam": lambda params: torch.optim.Adam(params, lr=0.05, foreach=False),
    "Adam_foreach": lambda params: torch.optim.Adam(params, lr=0.05, foreach=True),
    "Adam_fused": lambda params: torch.optim.Adam(params, lr=0.05, fused=True),
}


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_optimizer_steps_update_the_quantized_weights(recipe_name, optimizer, generator):
    """Two training steps of a LayerNormMLP stepping its quantized weights directly: after each, every weight
    holds the recipe's weight quantizer applied to the step a plain parameter of its dequantized values takes
    (with the same gradient and optimizer state), in the usages it keeps."""
    module = build("LayerNormMLP", recipe_name)
    params = list(module.parameters())
    plain = [torch.nn.Parameter(p.dequantize() if isinstance(p, QuantizedTensor) else p.detach().clone())
             for p in params]
    step, plain_step = OPTIMIZERS[optimizer](params), OPTIMIZERS[optimizer](plain)
    quantizer = weight_quantizer(recipe_name)
    for _ in range(2):
        with te_fuser.fp8_autocast(fp8_recipe=RECIPES[recipe_name]()):
            out = module(inputs("LayerNormMLP", generator))
        out.float().square().mean().backward()
        before = [{n: b.clone() for n, b in buffers(p).items()} if isinstance(p, QuantizedTensor) else None
                  for p in params]
        with torch.no_grad():
            for p, q in zip(params, plain):
                q.copy_(p.dequantize() if isinstance(p, QuantizedTensor) else p)  # start where the module is
                q.grad = p.grad.clone()
        plain_step.step()
        step.step()
        module.zero_grad(set_to_none=True)
        for p, q, old in zip(params, plain, before):
            if not isinstance(p, QuantizedTensor):
                assert torch.equal(p, q)
                continue
            want = quantizer(q.detach())
            assert_same_buffers(p, want, optimizer)
            changed = [n for n, b in buffers(p).items()
                       if not torch.equal(b.view(torch.uint8), old[n].view(torch.uint8))]
            assert "_rowwise_data" in changed, (optimizer, "the step must change the weight's bytes")


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP", "TransformerLayer"])
def test_checkpoint_round_trip_keeps_bytes_and_outputs(kind, recipe_name, generator):
    fp8_recipe = RECIPES[recipe_name]()
    module = build(kind, recipe_name, seed=0)
    run_step(kind, module, inputs(kind, generator), recipe_name)  # the recipe has run: its _extra_state
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert [k for k in state if k.endswith("_extra_state")], "the recipe travels as _extra_state"
    fresh = build(kind, recipe_name, seed=1)  # other initial values
    fresh.load_state_dict(state)
    for (name, p), (_, q) in zip(quantized_params(module), quantized_params(fresh)):
        assert type(q) is type(p) and isinstance(q, torch.nn.Parameter) and q._quantizer is not None, name
        assert_same_buffers(q, p, name)
        assert_same_buffers(p, q, name)
    for p, q in zip(module.parameters(), fresh.parameters()):
        if not isinstance(p, QuantizedTensor):
            assert torch.equal(p, q)
    x = inputs(kind, generator)
    for got, want in zip(run_step(kind, fresh, x, recipe_name), run_step(kind, module, x, recipe_name)):
        assert torch.equal(got, want)
    del fp8_recipe


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_pickle_and_deepcopy_give_independent_equal_modules(recipe_name, generator):
    module = build("LayerNormMLP", recipe_name)
    x = inputs("LayerNormMLP", generator)
    want = run_step("LayerNormMLP", module, x, recipe_name)
    for copied in (pickle.loads(pickle.dumps(module)), copy.deepcopy(module)):
        for (name, p), (_, q) in zip(quantized_params(module), quantized_params(copied)):
            assert type(q) is type(p) and isinstance(q, torch.nn.Parameter) and q.requires_grad, name
            assert_same_buffers(q, p, name)
            own = {b.untyped_storage().data_ptr() for b in buffers(p).values()}
            assert not own & {b.untyped_storage().data_ptr() for b in buffers(q).values()}, name
        for got, ref in zip(run_step("LayerNormMLP", copied, x, recipe_name), want):
            assert torch.equal(got, ref)
        before = module.fc1_weight._rowwise_data.clone()
        torch.optim.SGD(copied.parameters(), lr=1.0).zero_grad()
        with torch.no_grad():
            copied.fc1_weight.mul_(-1.0)  # requantized through the copy's own quantizer
        assert torch.equal(module.fc1_weight._rowwise_data, before), "the copy shares no buffer"
        assert not torch.equal(copied.fc1_weight._rowwise_data, before)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_nothing_on_ctx_after_backward_with_quantized_weights(kind, recipe_name, monkeypatch):
    module = build(kind, recipe_name)
    ctx_walk_check(module, lambda: torch.randn(TOKENS, HIDDEN, dtype=BF16, requires_grad=True),
                   RECIPES[recipe_name](), monkeypatch)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_a_step_keeps_only_output_and_grads_with_quantized_weights(kind, recipe_name, monkeypatch):
    module = build(kind, recipe_name)
    retained_bytes_check(module, lambda: torch.randn(TOKENS, HIDDEN, dtype=BF16, requires_grad=True),
                         RECIPES[recipe_name](), monkeypatch, min_leak=TOKENS * HIDDEN // 2)


def test_parameters_split_is_refused_with_block_scaled_weights():
    with te_fuser.quantized_model_init(recipe=recipe.NVFP4BlockScaling()):
        with pytest.raises(NotImplementedError, match="parameters_split"):
            te_fuser.Linear(HIDDEN, FFN, parameters_split=["a", "b"], device="cpu")


@pytest.mark.parametrize("other", ["block", "nvfp4", "delayed"])
def test_ops_quantize_weights_of_another_recipe_from_their_values(other, generator):
    """te_fuser.ops check no recipe (as TE's ops; the modules refuse, tests/test_recipe_mismatch.py): MXFP8
    weights under another recipe's autocast are quantized from their dequantized values, as a 16-bit weight
    holding them would be (bitwise)."""
    module = build("ops.BasicLinear", "mxfp8")
    dequantized = build("ops.BasicLinear")
    with torch.no_grad():
        dequantized[0].weight.copy_(module[0].weight.dequantize())
    x = inputs("ops.BasicLinear", generator)
    for got, want in zip(run_step("ops.BasicLinear", module, x, other, 5),
                         run_step("ops.BasicLinear", dequantized, x, other, 5)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("weights_recipe, autocast_recipe", [
    (recipe.NVFP4BlockScaling(), recipe.NVFP4BlockScaling(disable_2d_quantization=True)),
    (recipe.Float8BlockScaling(fp8_quant_fwd_weight=recipe.QParams(power_2_scale=False)), recipe.Float8BlockScaling()),
], ids=["nvfp4-2d-to-1d", "block-fp32-to-pow2-scales"])
@pytest.mark.parametrize("kind", ["Linear", "GroupedLinear"])
def test_weights_of_the_recipe_with_other_options_are_quantized_from_their_values(kind, weights_recipe,
                                                                                  autocast_recipe, generator):
    """A module's weights quantized for the autocast's recipe class but other weight blocks (the recipe check
    passes): the autocast's quantizer quantizes their dequantized values, as a 16-bit weight holding them
    (bitwise)."""
    torch.manual_seed(0)
    with te_fuser.quantized_model_init(recipe=weights_recipe):
        module = MAKERS[kind]()
    dequantized = MAKERS[kind]()
    with torch.no_grad():
        for (_, w), (_, d) in zip(module.named_parameters(), dequantized.named_parameters()):
            d.copy_(w.dequantize() if isinstance(w, QuantizedTensor) else w)
    x = inputs(kind, generator)
    results = []
    for m in (module, dequantized):
        torch.manual_seed(5)
        xi = x.clone().requires_grad_()
        with te_fuser.fp8_autocast(fp8_recipe=autocast_recipe):
            out = m(xi)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype))
        results.append([out, xi.grad] + [p.grad for p in m.parameters()])
    for got, want in zip(*results):
        assert torch.equal(got, want)
