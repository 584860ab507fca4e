"""FP8 across module boundaries: Linear / LayerNormLinear(fp8_output=True, fp8_grad=True), a Linear
reading an FP8 input as it is, and fp8_mha (the QKV projection's FP8 output into DotProductAttention,
its FP8 output into the output projection).

References: torch's float8 casts of the high-precision values with the same scale (bytes), float64
math on the dequantized operands, the float64 MultiheadAttention of layer_reference; the ctx
discipline with its bug-on control.
"""

import pytest
import torch

import te_fuser
from te_fuser import Float8Tensor, recipe
from te_fuser.tensor import float8_tensor

import layer_reference as ref
from fp8_reference import reference_current_scale, reference_quantize
from _module_memory import reachable_after_backward, without_clearing

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = [recipe.DelayedScaling(amax_history_len=4), recipe.Float8CurrentScaling()]
RECIPE_IDS = ["delayed", "current"]


def _x(generator, rows=32, features=48, dtype=torch.float32):
    x = torch.randn(rows, features, generator=generator) * 2
    x[0, :3] = torch.tensor([0.0, 1e-6, -30.0])  # zero, tiny, large: edge values of the scale
    return x.to(dtype).requires_grad_()


def _layer(kind, dtype=torch.float32):
    if kind == "Linear":
        return te_fuser.Linear(48, 32, device="cpu", params_dtype=dtype)
    module = te_fuser.LayerNormLinear(48, 32, device="cpu", params_dtype=dtype)
    with torch.no_grad():
        module.layer_norm_weight.normal_(1.0, 0.2)
    return module


def _linear_op(module):
    return module._ops[0] if isinstance(module, te_fuser.Linear) else module._linear_op


def _io_state(module, kind):
    return _linear_op(module)._fp8_io_states[kind]


def _expected_scale(fp8_recipe, state, values, fp8_dtype):
    """The scale the quantizer must use: the delayed state's (read before the cast), or fp8_max / amax."""
    if isinstance(fp8_recipe, recipe.DelayedScaling):
        return state.scale.clone()
    return reference_current_scale(values.abs().max(), torch.finfo(fp8_dtype).max, 0.0, False)


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear"])
@pytest.mark.parametrize("fp8_recipe", RECIPES, ids=RECIPE_IDS)
def test_fp8_output_bytes_are_the_cast_of_the_high_precision_output(kind, fp8_recipe, generator):
    module = _layer(kind, torch.bfloat16)
    x = _x(generator, dtype=torch.bfloat16)
    for step in range(3):  # delayed scaling: later steps cast with the amaxes of the earlier ones
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            plain = module(x)  # the same GEMM in high precision (scales change only at the exit)
            state = _io_state(module, "output") if step else None
            scale = _expected_scale(fp8_recipe, state, plain, E4M3) if step else None
            out = module(x, fp8_output=True)
        assert isinstance(out, Float8Tensor) and out.dtype == torch.bfloat16 and out.shape == plain.shape
        assert out.fp8_dtype == E4M3 and out.requires_grad
        if step:
            assert torch.equal(out._data.view(torch.uint8), reference_quantize(plain, scale, E4M3).view(torch.uint8))
            assert torch.equal(out._scale_inv, torch.reciprocal(scale))
    if isinstance(fp8_recipe, recipe.DelayedScaling):
        # The output slot recorded the output's amax into its own history (and no other slot did).
        assert _io_state(module, "output").amax_history[-1, 0] == plain.float().abs().max()
        assert _io_state(module, "output").scale.item() != 1.0
    # The values against float64 math: within half an E4M3 step of the float64 result.
    expect = plain.double()
    err = (out.dequantize(torch.float64) - expect).abs()
    assert (err <= expect.abs() * 2.0**-4 + out._scale_inv.double() * 2.0**-9).all()


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear"])
@pytest.mark.parametrize("fp8_recipe", RECIPES, ids=RECIPE_IDS)
def test_fp8_grad_is_the_cast_of_the_plain_input_gradient(kind, fp8_recipe, generator):
    module = _layer(kind)
    x = _x(generator)
    dy = torch.randn(32, 32, generator=generator)
    for step in range(3):  # from the second step on, the delayed scale holds earlier backwards' amaxes
        x8, xp = (x.detach().clone().requires_grad_() for _ in range(2))
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            out8 = module(x8, fp8_grad=True)
            outp = module(xp)
        state = _io_state(module, "grad_input")
        scale = state.scale.clone() if isinstance(fp8_recipe, recipe.DelayedScaling) else None
        outp.backward(dy)
        out8.backward(dy)
    assert type(xp.grad) is torch.Tensor and isinstance(x8.grad, Float8Tensor)
    assert x8.grad.fp8_dtype == E5M2 and x8.grad.dtype == torch.float32  # HYBRID: E5M2 gradients
    if scale is None:
        scale = reference_current_scale(xp.grad.abs().max(), torch.finfo(E5M2).max, 0.0, False)
    else:
        assert scale.item() != 1.0
    assert torch.equal(x8.grad._data.view(torch.uint8), reference_quantize(xp.grad, scale, E5M2).view(torch.uint8))
    # Within E5M2's precision of the plain path's gradient.
    err = (x8.grad.dequantize(torch.float64) - xp.grad.double()).abs()
    assert (err <= xp.grad.double().abs() * 2.0**-3 + x8.grad._scale_inv.double() * 2.0**-16).all()


class _QuantizeSpy:
    """Records the amax buffer of every delayed-scaling cast (which scaling slot quantized)."""

    def __init__(self, monkeypatch):
        self.amaxes = []
        original = float8_tensor.Float8Quantizer.quantize

        def spy(quantizer, x):
            self.amaxes.append(quantizer.amax.data_ptr())
            return original(quantizer, x)

        monkeypatch.setattr(float8_tensor.Float8Quantizer, "quantize", spy)


@pytest.mark.parametrize("fp8_output", [True, False], ids=["fp8_chain", "control_plain_chain"])
def test_a_linear_reads_the_previous_fp8_output_without_requantizing(fp8_output, monkeypatch, generator):
    first = te_fuser.Linear(48, 32, device="cpu")
    second = te_fuser.Linear(32, 16, device="cpu")
    x = _x(generator)
    fp8_recipe = recipe.DelayedScaling(amax_history_len=4)
    for _ in range(2):  # the second step has non-trivial scales
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            y = first(x, fp8_output=fp8_output)
            z = second(y)
        z.sum().backward()
    spy = _QuantizeSpy(monkeypatch)
    x.grad = None
    with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
        y = first(x, fp8_output=fp8_output)
        z = second(y)
    second_input_slot = second._ops[0]._fp8_states[0].amax[0:1].data_ptr()
    # The control (plain chain) shows the spy sees the second layer quantize its input.
    assert (second_input_slot in spy.amaxes) != fp8_output
    if fp8_output:
        assert isinstance(y, Float8Tensor)
        # z against float64 math on the bytes the second GEMM was given: y's and the weight's.
        w8 = second._ops[0]._forward_quantizers[1](second.weight.detach())
        expect = y.dequantize(torch.float64) @ w8.dequantize(torch.float64).t() + second.bias.double()
        torch.testing.assert_close(z.double(), expect, rtol=1e-5, atol=1e-5)
    z.backward(torch.ones_like(z))
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert first.weight.grad is not None and second.weight.grad is not None
    if fp8_output:  # the caller's output kept its bytes and was given no transpose buffer
        assert y._data is not None and y._transpose is None


def test_fp8_output_outside_autocast_is_plain_as_in_te(generator):
    module = _layer("Linear")
    x = _x(generator)
    out = module(x, fp8_output=True, fp8_grad=True)
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out, module(x), rtol=0, atol=0)


@pytest.mark.parametrize("fp8_recipe", RECIPES, ids=RECIPE_IDS)
def test_nothing_left_on_ctx_after_backward_on_the_fp8_output_paths(fp8_recipe, monkeypatch, generator):
    first, second = _layer("LayerNormLinear"), te_fuser.Linear(32, 16, device="cpu")
    model = torch.nn.ModuleList([first, second])
    x = _x(generator)

    def forward():
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            return second(first(x, fp8_output=True, fp8_grad=True), fp8_grad=True)

    forward().sum().backward()  # the FP8 states exist from here on
    before, after, out = reachable_after_backward(model, forward)
    assert before and after == [], after
    assert isinstance(x.grad, Float8Tensor)
    with monkeypatch.context() as patch:  # the bug-on control: the fuser keeps its state on the node
        without_clearing(patch)
        _, after_leaky, _ = reachable_after_backward(model, forward)
    assert after_leaky, "the graph walk missed the tensors left on ctx"


# -- fp8_mha ---------------------------------------------------------------------------------
HIDDEN, HEADS, SEQ, BATCH = 64, 4, 32, 2

MHA_LAYOUTS = [  # (fuse_qkv_params, qkv_weight_interleaved, num_gqa_groups, qkv_format, input_layernorm)
    (True, True, 2, "sbhd", True),
    (True, False, 2, "bshd", False),
    (True, True, None, "bshd", False),
    (False, True, 1, "sbhd", True),
]


def _mha(fuse, interleaved, groups, qkv_format, input_layernorm):
    module = te_fuser.MultiheadAttention(HIDDEN, HEADS, num_gqa_groups=groups, fuse_qkv_params=fuse,
                                         qkv_weight_interleaved=interleaved, qkv_format=qkv_format,
                                         input_layernorm=input_layernorm, attention_dropout=0.0, device="cpu")
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "bias" in name or "layer_norm" in name:
                p.normal_(0.0 if "bias" in name else 1.0, 0.2)
    return module


def _mha_input(generator, qkv_format):
    shape = (SEQ, BATCH, HIDDEN) if qkv_format == "sbhd" else (BATCH, SEQ, HIDDEN)
    return torch.randn(shape, generator=generator).requires_grad_()


def _mha_run(module, x, fp8_recipe, dy, record=None):
    """Three steps (delayed scales settle); (output, x.grad) of the last."""
    hooks = []
    if record is not None:
        qkv = module.layernorm_qkv if module.input_layernorm else module.qkv
        hooks = [qkv.register_forward_hook(lambda m, args, out: record.append(("qkv", out))),
                 module.core_attention.register_forward_pre_hook(lambda m, args: record.append(("dpa", args[:3]))),
                 module.proj.register_forward_pre_hook(lambda m, args: record.append(("proj", args[:1])))]
    try:
        for _ in range(3):
            x.grad = None
            with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
                out = module(x)
            out.backward(dy)
    finally:
        for h in hooks:
            h.remove()
    return out.detach().double(), x.grad.double()


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("layout", MHA_LAYOUTS, ids=lambda l: f"fuse{int(l[0])}-inter{int(l[1])}-g{l[2]}-{l[3]}-ln{int(l[4])}")
@pytest.mark.parametrize("fp8_recipe_type", [recipe.DelayedScaling, recipe.Float8CurrentScaling], ids=RECIPE_IDS)
def test_fp8_mha_feeds_fp8_through_attention_within_fp8_tolerance(layout, fp8_recipe_type, generator):
    module = _mha(*layout)
    qkv_format = layout[3]
    x = _mha_input(generator, qkv_format)
    dy = torch.randn(x.shape, generator=generator)
    x64 = x.detach().double().requires_grad_()
    P = {n: p.requires_grad_() for n, p in ref.float64_params(module).items()}
    attn, bias, _ = ref.mha(module, x64, qkv_format, P=P)
    expect = attn + bias
    (expect_grad,) = torch.autograd.grad((expect * dy.double()).sum(), [x64])

    dpa_out, dpa_grad = _mha_run(module, x, fp8_recipe_type(fp8_dpa=True), dy)
    record = []
    mha_out, mha_grad = _mha_run(module, x, fp8_recipe_type(fp8_dpa=True, fp8_mha=True), dy, record)

    # What flowed: FP8 views of the QKV projection's bytes into the attention, FP8 into proj.
    (_, (q, k, v)), (_, (context,)) = record[-2:]
    assert all(isinstance(t, Float8Tensor) and t.fp8_dtype == E4M3 for t in (q, k, v, context))
    projected = record[-3][1]
    assert isinstance(projected, Float8Tensor) and projected.fp8_dtype == E4M3
    storage = projected._data.untyped_storage().data_ptr()
    # k and v (and q, but for an interleaved GQA layout, where it is one FP8 copy of its heads) view
    # the projection's bytes, with its scale: no 16-bit round trip.
    copied_q = layout[1] and 1 < (layout[2] or HEADS) < HEADS
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        assert torch.equal(t._scale_inv, projected._scale_inv), name
        assert (t._data.untyped_storage().data_ptr() == storage) != (name == "q" and copied_q), name
    if isinstance(module.core_attention._fp8_state, te_fuser.quantization.DelayedScalingState):
        # The attention's own q, k, v quantizers never ran: the bytes came in quantized.
        assert not module.core_attention._fp8_state.amax.any()

    # Against float64: both FP8 paths within FP8 tolerance; fp8_mha (three more E4M3 casts:
    # the QKV output, the attention output, and the E5M2 gradient into the attention) close to fp8_dpa.
    dpa_rel, mha_rel = _rel(dpa_out, expect), _rel(mha_out, expect)
    assert 1e-4 < dpa_rel < 0.08 and 1e-4 < mha_rel < 0.08, (dpa_rel, mha_rel)
    assert mha_rel < 2 * dpa_rel + 0.03, (dpa_rel, mha_rel)
    dpa_grel, mha_grel = _rel(dpa_grad, expect_grad), _rel(mha_grad, expect_grad)
    assert dpa_grel < 0.15 and mha_grel < 0.15, (dpa_grel, mha_grel)
    assert not torch.equal(mha_out, dpa_out)  # the FP8 path really ran differently


def test_fp8_mha_with_rotary_projects_in_high_precision_as_te(generator):
    module = _mha(True, True, None, "sbhd", False)
    x = _mha_input(generator, "sbhd")
    freqs = torch.randn(SEQ, 1, 1, HIDDEN // HEADS, generator=generator)
    record = []
    hook = module.core_attention.register_forward_pre_hook(lambda m, args: record.append(args[:3]))
    with te_fuser.fp8_autocast(fp8_recipe=recipe.DelayedScaling(fp8_dpa=True, fp8_mha=True)):
        out = module(x, rotary_pos_emb=freqs)
    hook.remove()
    assert all(type(t) is torch.Tensor for t in record[0])
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("fp8_recipe", [recipe.DelayedScaling(fp8_dpa=True, fp8_mha=True, amax_history_len=4),
                                        recipe.Float8CurrentScaling(fp8_dpa=True, fp8_mha=True)], ids=RECIPE_IDS)
def test_fp8_mha_leaves_nothing_on_ctx_after_backward(fp8_recipe, monkeypatch, generator):
    module = _mha(True, True, 2, "sbhd", True)
    x = _mha_input(generator, "sbhd")

    def forward():
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            return module(x)

    forward().sum().backward()
    before, after, _ = reachable_after_backward(module, forward)
    assert before and after == [], after
    with monkeypatch.context() as patch:
        without_clearing(patch)
        _, after_leaky, _ = reachable_after_backward(module, forward)
    assert after_leaky, "the graph walk missed the tensors left on ctx"


def test_example_gpt_block_runs_fp8_mha_end_to_end(monkeypatch, generator):
    from te_fuser.examples.gpt import GPTConfig, Parallel, TransformerBlock

    torch.manual_seed(1234)  # the block's initial weights
    cfg = GPTConfig(hidden_size=64, num_heads=4, ffn_hidden_size=128, seq_len=32)
    block = TransformerBlock(cfg, Parallel(), "cpu", torch.float32)
    x = torch.randn(32, 2, 64, generator=generator).requires_grad_()
    dy = torch.randn(x.shape, generator=generator)

    def run(fp8_recipe, record=None):
        hooks = []
        if record is not None:
            hooks = [block.qkv.register_forward_hook(lambda m, args, out: record.append(out)),
                     block.attention.register_forward_pre_hook(lambda m, args: record.append(args[:3])),
                     block.proj.register_forward_pre_hook(lambda m, args: record.append(args[0]))]
        for _ in range(3):
            x.grad = None
            with te_fuser.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
                out = block(x)
            out.backward(dy)
        for h in hooks:
            h.remove()
        return out.detach().double(), x.grad.double()

    plain_out, plain_grad = run(None)
    dpa_out, dpa_grad = run(recipe.DelayedScaling(fp8_dpa=True, amax_history_len=4))
    record = []
    mha_recipe = recipe.DelayedScaling(fp8_dpa=True, fp8_mha=True, amax_history_len=4)
    mha_out, mha_grad = run(mha_recipe, record)
    projected, (q, k, v), context = record[-3:]
    assert isinstance(projected, Float8Tensor) and isinstance(context, Float8Tensor)
    for t in (q, k, v):  # views of the projection's FP8 bytes with its scale
        assert isinstance(t, Float8Tensor) and t._scale_inv is projected._scale_inv
        assert t._data.untyped_storage().data_ptr() == projected._data.untyped_storage().data_ptr()
    # The residual stream dominates the block's output: compare the attention + MLP part.
    base = x.detach().double()
    dpa_rel, mha_rel = _rel(dpa_out - base, plain_out - base), _rel(mha_out - base, plain_out - base)
    assert 1e-4 < dpa_rel < 0.08 and 1e-4 < mha_rel < 0.08 and mha_rel < 2 * dpa_rel + 0.03, (dpa_rel, mha_rel)
    assert _rel(mha_grad - dy.double(), plain_grad - dy.double()) < 0.15

    def forward():
        with te_fuser.fp8_autocast(fp8_recipe=mha_recipe):
            return block(x)

    before, after, _ = reachable_after_backward(block, forward)
    assert before and after == [], after
    with monkeypatch.context() as patch:
        without_clearing(patch)
        _, after_leaky, _ = reachable_after_backward(block, forward)
    assert after_leaky, "the graph walk missed the tensors left on ctx"


def test_output_and_grad_input_states_round_trip_in_te_slots(generator):
    module = _layer("Linear")
    x = _x(generator)
    fp8_recipe = recipe.DelayedScaling(amax_history_len=4)
    for _ in range(3):
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            out = module(x, fp8_output=True, fp8_grad=True)
        out.backward(torch.ones_like(out))
    state = module.state_dict()
    payload = te_fuser.module._te_pickle.safe_loads(state["_extra_state"].numpy().tobytes())
    for kind, key, column in (("output", "fwd", 2), ("grad_input", "bwd", 1)):  # TE's GEMM1_OUTPUT, GRAD_INPUT1
        mine = _io_state(module, kind)
        assert payload[f"scale_{key}"][column] == mine.scale[0] != 1.0
        assert torch.equal(payload[f"amax_history_{key}"][:, column], mine.amax_history[:, 0])
    fresh = _layer("Linear")
    fresh.load_state_dict(state)
    for kind in ("output", "grad_input"):
        for name in ("amax_history", "amax", "scale", "scale_inv"):
            assert torch.equal(getattr(_io_state(fresh, kind), name), getattr(_io_state(module, kind), name)), name
    with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
        a, b = module(x, fp8_output=True), fresh(x, fp8_output=True)
    assert torch.equal(a._data.view(torch.uint8), b._data.view(torch.uint8)) and torch.equal(a._scale_inv, b._scale_inv)


def test_attention_output_state_round_trips_in_te_o_slot(generator):
    layout = (True, True, 2, "sbhd", False)
    module = _mha(*layout)
    x = _mha_input(generator, "sbhd")
    _mha_run(module, x, recipe.DelayedScaling(fp8_dpa=True, fp8_mha=True, amax_history_len=4),
             torch.ones(x.shape))
    mine = module.core_attention._fp8_output_state
    state = module.state_dict()
    payload = te_fuser.module._te_pickle.safe_loads(state["core_attention._extra_state"].numpy().tobytes())
    assert payload["scale_fwd"][3] == mine.scale[0] != 1.0  # TE's META_O
    assert torch.equal(payload["amax_history_fwd"][:, 3], mine.amax_history[:, 0])
    fresh = _mha(*layout)
    fresh.load_state_dict(state)
    for name in ("amax_history", "amax", "scale", "scale_inv"):
        assert torch.equal(getattr(fresh.core_attention._fp8_output_state, name), getattr(mine, name)), name
