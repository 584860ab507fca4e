"""FP8 weights (quantized_model_init / fp8_model_init): what the modules hold, that the GEMMs use the
weight's bytes as they are (no 16-bit copy), the master-weight cast, checkpoints, and ctx discipline.

References: torch's own float8 casts (bytes), a module with ordinary weights set to the dequantized
FP8 values (outputs and gradients, bitwise)."""

import copy
import io

import pytest
import torch

import te_fuser
from te_fuser import recipe
from te_fuser.tensor.float8_tensor import Float8Tensor
from te_fuser.tensor.utils import cast_master_weights_to_fp8

from _module_checks import ctx_walk_check, retained_bytes_check

IN, OUT, TOKENS = 64, 48, 96  # TOKENS differs from every weight dimension
E4M3 = torch.float8_e4m3fn
BF16 = torch.bfloat16
RECIPES = [recipe.DelayedScaling(), recipe.Float8CurrentScaling()]
RECIPE_IDS = ["delayed", "current"]

MAKERS = {
    "Linear": lambda: te_fuser.Linear(IN, OUT, params_dtype=BF16, device="cpu"),
    "LayerNormLinear": lambda: te_fuser.LayerNormLinear(IN, OUT, params_dtype=BF16, device="cpu"),
    "LayerNormMLP": lambda: te_fuser.LayerNormMLP(IN, 2 * IN, params_dtype=BF16, device="cpu"),
    "GroupedLinear": lambda: te_fuser.GroupedLinear(2, IN, OUT, params_dtype=BF16, device="cpu"),
    "ops.BasicLinear": lambda: te_fuser.ops.Sequential(te_fuser.ops.BasicLinear(IN, OUT, device="cpu", dtype=BF16)),
}
FP8_WEIGHTS = {"Linear": 1, "LayerNormLinear": 1, "LayerNormMLP": 2, "GroupedLinear": 2, "ops.BasicLinear": 1}


def build(kind, fp8_recipe=None, seed=0, preserve=False):
    torch.manual_seed(seed)
    if fp8_recipe is None:
        return MAKERS[kind]()
    with te_fuser.quantized_model_init(recipe=fp8_recipe, preserve_high_precision_init_val=preserve):
        return MAKERS[kind]()


def run(kind, module, x):
    return module(x, [32, TOKENS - 32]) if kind == "GroupedLinear" else module(x)


def fp8_params(module):
    return [(n, p) for n, p in module.named_parameters() if isinstance(p, Float8Tensor)]


def torch_cast(values: torch.Tensor, scale: float) -> torch.Tensor:
    """values * scale cast by torch to E4M3 (float32 product, round to nearest even), as bytes."""
    return (values.float() * torch.tensor(scale, dtype=torch.float32)).to(E4M3).view(torch.uint8)


def inputs(generator, dtype=BF16):
    x = torch.randn(TOKENS, IN, generator=generator)
    x[0, :4] = torch.tensor([30.0, -30.0, 1e-3, 0.0])  # edge values: large, tiny, zero
    return x.to(dtype)


@pytest.mark.parametrize("fp8_recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("kind", list(MAKERS))
def test_weights_are_fp8_parameters_quantized_from_the_initial_values(kind, fp8_recipe):
    module = build(kind, fp8_recipe, preserve=True)
    plain = build(kind)  # the same seed without FP8 weights: the initial values
    weights = fp8_params(module)
    assert len(weights) == FP8_WEIGHTS[kind]
    plain_params = dict(plain.named_parameters())
    for name, p in module.named_parameters():
        if isinstance(p, Float8Tensor):
            continue
        assert type(p) is torch.nn.Parameter and p.dtype == BF16, name  # norms and biases stay 16-bit
    for name, p in weights:
        assert isinstance(p, torch.nn.Parameter) and p.requires_grad and p.dtype == BF16, name
        assert p.fp8_data.dtype == E4M3 and p._data.element_size() == 1 and p._scale_inv.numel() == 1
        assert p._transpose is None, "the parameter keeps one layout only"
        assert p._quantizer is not None and not p._quantizer.columnwise_usage
        init = p.get_high_precision_init_val()
        assert init.device.type == "cpu" and init.dtype == BF16
        assert torch.equal(init, plain_params[name].detach()), name
        if isinstance(fp8_recipe, recipe.DelayedScaling):
            scale = 1.0  # the weight slot's scale before any update, as in TE
        else:
            scale = (torch.tensor(448.0) / init.float().abs().max()).item()
        assert torch.equal(p._data.view(torch.uint8), torch_cast(init, scale)), name
        assert torch.equal(p._scale_inv, torch.reciprocal(torch.tensor([scale], dtype=torch.float32)))
        p.clear_high_precision_init_val()
        assert p.get_high_precision_init_val() is None


def test_without_preserve_no_initial_values_are_kept():
    module = build("Linear", recipe.DelayedScaling())
    assert not hasattr(module.weight, "get_high_precision_init_val")
    assert not te_fuser.FP8GlobalStateManager.with_fp8_parameters()


def _reference_module(kind, module):
    """An ordinary module holding the FP8 module's dequantized weights."""
    ref = build(kind)
    with torch.no_grad():
        for (name, p), (ref_name, q) in zip(module.named_parameters(), ref.named_parameters()):
            assert name == ref_name
            q.copy_(p.dequantize() if isinstance(p, Float8Tensor) else p)
    return ref


@pytest.mark.parametrize("fp8_recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("kind", list(MAKERS))
def test_outputs_and_gradients_equal_those_of_the_dequantized_weights(kind, fp8_recipe, generator):
    """Under fp8_autocast the reference casts its weights to the same FP8 bytes (delayed: the fresh
    slot scale 1; current: the same amax), so everything is bitwise equal; outside it both compute in
    bf16 with the same values."""
    module = build(kind, fp8_recipe)
    ref = _reference_module(kind, module)
    x = inputs(generator)
    for fp8 in (True, False):
        results = []
        for m in (module, ref):
            xi = x.clone().requires_grad_()
            with te_fuser.fp8_autocast(enabled=fp8, fp8_recipe=fp8_recipe):
                out = run(kind, m, xi)
            dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(BF16)
            out.backward(dy)
            results.append([out, xi.grad] + [p.grad for p in m.parameters()])
            m.zero_grad(set_to_none=True)
        for i, (got, want) in enumerate(zip(*results)):
            assert got.dtype == want.dtype and type(got) is torch.Tensor, (fp8, i)
            assert torch.equal(got, want), (fp8, i, (got.float() - want.float()).abs().max())


@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP", "GroupedLinear"])
def test_no_16bit_copy_of_an_fp8_weight_in_forward_or_backward(kind, generator, monkeypatch):
    """The GEMMs read the parameter's bytes: nothing dequantizes it, the saved weight is the
    parameter's own storage (no FP8 copy either), and no 16-bit tensor of its shape is saved."""
    module = build(kind, recipe.DelayedScaling())
    weights = [p for _, p in fp8_params(module)]
    shapes = {tuple(p.shape) for p in weights} | {tuple(p.shape[::-1]) for p in weights}
    dequantized = []
    real = Float8Tensor.dequantize
    monkeypatch.setattr(Float8Tensor, "dequantize",
                        lambda self, dtype=None: dequantized.append(tuple(self.shape)) or real(self, dtype))
    saved = []

    def pack(t):
        saved.append(t)
        return t

    x = inputs(generator).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with te_fuser.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
            out = run(kind, module, x)
    out.float().sum().backward()
    assert not [s for s in dequantized if s in shapes], dequantized
    weight_ptrs = {p._data.untyped_storage().data_ptr() for p in weights}
    saved_ptrs = {t.untyped_storage().data_ptr() for t in saved if t.numel()}
    assert weight_ptrs <= saved_ptrs, "dgrad keeps the parameter's own bytes"
    copies = [(tuple(t.shape), t.dtype) for t in saved
              if tuple(t.shape) in shapes and t.untyped_storage().data_ptr() not in weight_ptrs]
    assert not copies, f"copies of an FP8 weight saved for backward: {copies}"
    assert all(p.grad is not None and p.grad.dtype == BF16 for p in weights)


def test_an_update_between_forward_and_backward_is_caught():
    module = build("Linear", recipe.DelayedScaling())
    x = torch.randn(TOKENS, IN, dtype=BF16, requires_grad=True)
    with te_fuser.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
        out = module(x)
    cast_master_weights_to_fp8([module.weight], [module.weight.dequantize().float()])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.float().sum().backward()


@pytest.mark.parametrize("fp8_recipe", RECIPES, ids=RECIPE_IDS)
def test_cast_master_weights_to_fp8(fp8_recipe, generator):
    module = build("Linear", fp8_recipe)
    w = module.weight
    master = torch.randn(OUT, IN, generator=generator) * 0.5
    master[0, 0] = 3.0  # the amax
    op = module._ops[0]
    if isinstance(fp8_recipe, recipe.DelayedScaling):
        state = op._fp8_states[0]
        amax_before = state.amax[1].item()
        cast_master_weights_to_fp8([w, module.bias], [master, torch.ones(OUT)])
        assert torch.equal(w._data.view(torch.uint8), torch_cast(master, 1.0))
        assert state.amax[1].item() == max(amax_before, 3.0)  # recorded for the next update
        # A forward under fp8_autocast marks the state; its exit updates the weight slot's scale.
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            module(torch.randn(TOKENS, IN, dtype=BF16))
        scale = state.scale[1].item()
        assert scale == pytest.approx(448.0 / 3.0)
        cast_master_weights_to_fp8([w], [master])
        assert torch.equal(w._data.view(torch.uint8), torch_cast(master, scale))
    else:
        cast_master_weights_to_fp8([w, module.bias], [master, torch.ones(OUT)])
        scale = (torch.tensor(448.0) / torch.tensor(3.0)).item()
        assert torch.equal(w._data.view(torch.uint8), torch_cast(master, scale))
    assert torch.equal(w._scale_inv, torch.reciprocal(torch.tensor([scale])))
    assert torch.equal(module.bias.detach(), torch.ones(OUT, dtype=BF16))
    cast_master_weights_to_fp8([w], [None])  # None: left alone
    assert torch.equal(w._data.view(torch.uint8), torch_cast(master, scale))


def test_cast_master_weights_to_fp8_rejects_bad_arguments():
    module = build("Linear", recipe.DelayedScaling())
    w = module.weight
    master = torch.zeros(OUT, IN)
    with pytest.raises(ValueError, match="model_weights has 1 tensors but master_weights 2"):
        cast_master_weights_to_fp8([w], [master, master])
    with pytest.raises(ValueError, match=r"master_weights\[0\] has 10 elements"):
        cast_master_weights_to_fp8([w], [torch.zeros(10)])
    with pytest.raises(ValueError, match=r"start_offsets\[0\]=5\) does not fit"):  # shards: test_cast_master_weights_sharded.py
        cast_master_weights_to_fp8([w], [master], start_offsets=[5])
    bare = Float8Tensor(w._data.clone(), w._scale_inv.clone(), E4M3, BF16)
    with pytest.raises(ValueError, match="without a quantizer"):
        cast_master_weights_to_fp8([bare], [master])
    assert te_fuser.cast_master_weights_to_fp8 is cast_master_weights_to_fp8


def _train_a_little(kind, module, fp8_recipe, generator):
    """Two steps with float32 masters, so the FP8 weights and delayed scales move off their start."""
    masters = [p.dequantize().float() if isinstance(p, Float8Tensor) else p.detach().float() for p in module.parameters()]
    for _ in range(2):
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            out = run(kind, module, inputs(generator))
        out.float().square().mean().backward()
        with torch.no_grad():
            for p, m in zip(module.parameters(), masters):
                m.sub_(0.5 * p.grad.float())
        module.zero_grad(set_to_none=True)
        cast_master_weights_to_fp8(list(module.parameters()), masters)


@pytest.mark.parametrize("fp8_recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP", "GroupedLinear"])
def test_checkpoint_round_trip_keeps_bytes_scales_and_outputs(kind, fp8_recipe, generator):
    module = build(kind, fp8_recipe, seed=0)
    _train_a_little(kind, module, fp8_recipe, generator)
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    fresh = build(kind, fp8_recipe, seed=1)  # other initial values and (delayed) scales
    fresh.load_state_dict(state)
    for (name, p), (_, q) in zip(fp8_params(module), fp8_params(fresh)):
        assert isinstance(q, torch.nn.Parameter) and q._quantizer is not None, name
        assert torch.equal(p._data.view(torch.uint8), q._data.view(torch.uint8)), name
        assert torch.equal(p._scale_inv, q._scale_inv), name
    for p, q in zip(module.parameters(), fresh.parameters()):
        if not isinstance(p, Float8Tensor):
            assert torch.equal(p, q)
    extra = [k for k in state if k.endswith("_extra_state")]
    assert extra, "the FP8 recipe state travels as _extra_state"
    x = inputs(generator)
    outs = []
    for m in (module, fresh):
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            outs.append(run(kind, m, x))
    assert torch.equal(outs[0], outs[1])
    # And the next master cast lands on the same bytes (the delayed scales were restored too).
    masters = [torch.randn(p.shape, generator=generator) for _, p in fp8_params(module)]
    for m in (module, fresh):
        cast_master_weights_to_fp8([p for _, p in fp8_params(m)], masters)
    for (_, p), (_, q) in zip(fp8_params(module), fp8_params(fresh)):
        assert torch.equal(p._data.view(torch.uint8), q._data.view(torch.uint8))


@pytest.mark.parametrize("fp8_recipe", RECIPES, ids=RECIPE_IDS)
def test_pickled_and_deepcopied_modules_keep_fp8_parameters(fp8_recipe, generator):
    """A whole module through pickle (torch.save of a model) and deepcopy: its FP8 weights stay Parameters with
    their quantizer, so the copy's optimizer step requantizes as the original's does."""
    module = build("LayerNormMLP", fp8_recipe)
    x = inputs(generator)
    copies = [torch.load(_saved(module), weights_only=False), copy.deepcopy(module)]
    for copied in [module] + copies:
        for name, p in fp8_params(copied):
            assert isinstance(p, torch.nn.Parameter) and p._quantizer is not None, name
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            run("LayerNormMLP", copied, x).float().square().sum().backward()
        torch.optim.SGD(copied.parameters(), lr=0.5).step()
    for copied in copies:
        for (name, p), (_, q) in zip(fp8_params(module), fp8_params(copied)):
            assert torch.equal(p._data, q._data) and torch.equal(p._scale_inv, q._scale_inv), name


def _saved(module) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize("fp8_recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_nothing_on_ctx_after_backward_with_fp8_weights(kind, fp8_recipe, monkeypatch):
    module = build(kind, fp8_recipe)
    ctx_walk_check(module, lambda: torch.randn(TOKENS, IN, dtype=BF16, requires_grad=True), fp8_recipe, monkeypatch)


@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_a_step_keeps_only_output_and_grads_with_fp8_weights(kind, monkeypatch):
    module = build(kind, recipe.DelayedScaling())
    retained_bytes_check(module, lambda: torch.randn(TOKENS, IN, dtype=BF16, requires_grad=True),
                         recipe.DelayedScaling(), monkeypatch, min_leak=TOKENS * IN)


def test_parameters_split_is_refused_with_fp8_weights():
    with te_fuser.quantized_model_init():
        with pytest.raises(NotImplementedError, match="parameters_split with FP8 weights"):
            te_fuser.Linear(IN, OUT, parameters_split=["a", "b"], device="cpu")
