"""TE's NVTE_DPA_FP8_RECIPE: the attention's recipe apart from the linear layers'.

Under MXFP8 or NVFP4 linears with fp8_dpa=True, "DelayedScaling" / "Float8CurrentScaling" runs the
attention in per-tensor FP8, "F16" in high precision. Each switched run is compared bit for bit with
the attention run directly under the recipe TE's table names (the FP8 attention itself is tested against
float64 in tests/test_attention.py); the saved bytes are checked against the high-precision run.
"""

import pytest
import torch

import te_fuser
from te_fuser.attention.dot_product_attention.utils import AttentionParams, get_attention_backend
from te_fuser.memory.saved import saved_for_backward
from te_fuser.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling,
                             NVFP4BlockScaling)

from _torch_support import compiles_te_fuser_modules

HEADS, DIM, SEQ, BATCH = 4, 32, 64, 2
VARS = ("NVTE_DPA_FP8_RECIPE", "NVTE_DPA_FP8_FORMAT", "NVTE_DPA_FP8DS_AMAX_ALGO", "NVTE_DPA_FP8DS_AMAX_HISTLEN",
        "NVTE_DPA_FP8DS_REDUCE_AMAX")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in VARS:
        monkeypatch.delenv(name, raising=False)


def inputs(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(SEQ, BATCH, HEADS, DIM, generator=g).mul(1 + 3 * i).bfloat16().requires_grad_()
               for i in range(3))
    with torch.no_grad():
        q[0, 0, 0, :3] = torch.tensor([0.0, 300.0, -1e-3])  # a zero, a value near E4M3's top, a tiny one
    return q, k, v


def run(module, recipe, seed):
    """Output and q, k, v grads of one forward and backward under fp8_autocast(recipe)."""
    q, k, v = inputs(seed)
    with te_fuser.fp8_autocast(fp8_recipe=recipe):
        out = module(q, k, v)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 100)).bfloat16())
    return [out.detach(), q.grad, k.grad, v.grad]


def dpa():
    return te_fuser.DotProductAttention(HEADS, DIM, qkv_format="sbhd", attn_mask_type="causal")


# (autocast recipe, NVTE_DPA_FP8_RECIPE, the recipe the attention must run under)
SWITCHES = [
    (MXFP8BlockScaling(fp8_dpa=True), "DelayedScaling",
     DelayedScaling(fp8_format=Format.E4M3, amax_history_len=1, amax_compute_algo="most_recent", fp8_dpa=True)),
    (MXFP8BlockScaling(fp8_dpa=True), "Float8CurrentScaling", Float8CurrentScaling(fp8_format=Format.E4M3,
                                                                                   fp8_dpa=True)),
    (NVFP4BlockScaling(fp8_dpa=True), "DelayedScaling",
     DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=1, amax_compute_algo="most_recent", fp8_dpa=True)),
    (NVFP4BlockScaling(fp8_dpa=True), "Float8CurrentScaling", Float8CurrentScaling(fp8_format=Format.HYBRID,
                                                                                   fp8_dpa=True)),
    (Float8CurrentScaling(fp8_dpa=True), "DelayedScaling",
     DelayedScaling(amax_history_len=1, amax_compute_algo="most_recent", fp8_dpa=True)),
    (DelayedScaling(fp8_dpa=True), "Float8CurrentScaling", Float8CurrentScaling(fp8_dpa=True)),
    (DelayedScaling(fp8_dpa=True, amax_history_len=5), "DelayedScaling",
     DelayedScaling(fp8_dpa=True, amax_history_len=5)),
]


@pytest.mark.parametrize("recipe, switch, expected", SWITCHES,
                         ids=[f"{type(r).__name__}-{s}" for r, s, _ in SWITCHES])
def test_switched_attention_is_the_named_recipes(monkeypatch, recipe, switch, expected):
    """Three steps (delayed scaling updates its scales between them): outputs and grads equal, bit for bit,
    those of the attention run under the recipe TE's table names, and differ from high precision."""
    switched, direct = dpa(), dpa()
    for step in range(3):
        monkeypatch.setenv("NVTE_DPA_FP8_RECIPE", switch)
        got = run(switched, recipe, step)
        monkeypatch.delenv("NVTE_DPA_FP8_RECIPE")
        want = run(direct, expected, step)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert torch.equal(a, b), f"step {step}: {name} differs from the run under {expected!r}"
    assert switched._fp8_recipe == expected
    high = run(dpa(), None, 2)
    assert not torch.equal(got[0], high[0])


def test_delayed_scaling_takes_the_variables(monkeypatch):
    monkeypatch.setenv("NVTE_DPA_FP8_RECIPE", "DelayedScaling")
    monkeypatch.setenv("NVTE_DPA_FP8_FORMAT", "E4M3")
    monkeypatch.setenv("NVTE_DPA_FP8DS_AMAX_ALGO", "max")
    monkeypatch.setenv("NVTE_DPA_FP8DS_AMAX_HISTLEN", "3")
    monkeypatch.setenv("NVTE_DPA_FP8DS_REDUCE_AMAX", "0")
    module = dpa()
    q, k, v = inputs(0)
    with te_fuser.fp8_autocast(fp8_recipe=NVFP4BlockScaling(fp8_dpa=True)):
        module(q, k, v).float().sum().backward()
    assert module._fp8_recipe == DelayedScaling(fp8_format=Format.E4M3, amax_compute_algo="max", amax_history_len=3,
                                                reduce_amax=False, fp8_dpa=True)
    history = module._fp8_state.amax_history
    assert history.shape == (3, 3)
    # The newest completed amaxes are q's, k's and v's (as bf16 values).
    torch.testing.assert_close(history[-1], torch.stack([t.detach().float().abs().max() for t in (q, k, v)]))
    # NVTE_DPA_FP8_FORMAT is read under NVFP4 only: MXFP8 keeps its own fp8_format.
    with te_fuser.fp8_autocast(fp8_recipe=MXFP8BlockScaling(fp8_format=Format.E4M3, fp8_dpa=True)):
        module(q, k, v)
    assert module._fp8_recipe.fp8_format == Format.E4M3


@pytest.mark.parametrize("recipe", [DelayedScaling(fp8_dpa=True, fp8_mha=True), MXFP8BlockScaling(fp8_dpa=True),
                                    NVFP4BlockScaling(fp8_dpa=True)], ids=lambda r: type(r).__name__)
def test_f16_runs_the_attention_in_high_precision(monkeypatch, recipe):
    monkeypatch.setenv("NVTE_DPA_FP8_RECIPE", "F16")
    got = run(dpa(), recipe, 4)
    want = run(dpa(), None, 4)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_f16_turns_fp8_mha_off_in_multihead_attention(monkeypatch):
    """MultiheadAttention under DelayedScaling(fp8_mha=True) with "F16": its projections keep 16-bit outputs,
    the same model as DelayedScaling without FP8 attention."""
    torch.manual_seed(3)
    layers = [te_fuser.MultiheadAttention(128, 4, params_dtype=torch.bfloat16, attn_mask_type="causal",
                                          attention_dropout=0.0) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(SEQ, BATCH, 128, dtype=torch.bfloat16)
    seen = []
    layers[0].core_attention.register_forward_pre_hook(lambda m, args: seen.append(type(args[0])))
    monkeypatch.setenv("NVTE_DPA_FP8_RECIPE", "F16")
    with te_fuser.fp8_autocast(fp8_recipe=DelayedScaling(fp8_dpa=True, fp8_mha=True)):
        got = layers[0](x)
    monkeypatch.delenv("NVTE_DPA_FP8_RECIPE")
    with te_fuser.fp8_autocast(fp8_recipe=DelayedScaling()):
        want = layers[1](x)
    assert seen == [torch.Tensor] and type(got) is torch.Tensor
    assert torch.equal(got, want)


def attention_saved_bytes(recipe):
    module = dpa()
    q, k, v = inputs(5)

    def forward():
        with te_fuser.fp8_autocast(fp8_recipe=recipe):
            return module(q, k, v)

    _, saved = saved_for_backward(forward)
    return saved.total_bytes, {e.dtype for e in saved}


@pytest.mark.parametrize("recipe", [MXFP8BlockScaling(fp8_dpa=True), NVFP4BlockScaling(fp8_dpa=True)],
                         ids=lambda r: type(r).__name__)
def test_fp8_attention_saves_one_byte_per_value(monkeypatch, recipe):
    """q, k, v and out are saved as FP8 bytes beside the block-scaled linears; "F16", the control, saves their
    16-bit values: twice the bytes, which the same count sees."""
    values = 4 * SEQ * BATCH * HEADS * DIM
    lse = BATCH * HEADS * SEQ * 4
    monkeypatch.setenv("NVTE_DPA_FP8_RECIPE", "Float8CurrentScaling")
    fp8_bytes, dtypes = attention_saved_bytes(recipe)
    assert torch.bfloat16 not in dtypes
    assert values + lse <= fp8_bytes <= values + lse + 64  # + the per-tensor scales
    monkeypatch.setenv("NVTE_DPA_FP8_RECIPE", "F16")
    high_bytes, dtypes = attention_saved_bytes(recipe)
    assert torch.bfloat16 in dtypes and high_bytes == 2 * values + lse


def test_transformer_layer_with_nvfp4_linears_and_fp8_attention(monkeypatch):
    """A TransformerLayer trains under NVFP4 linears and FP8 attention: its loss is near the same layer's with
    high-precision attention, and nothing it saves for the attention is 16-bit."""
    torch.manual_seed(7)
    layer = te_fuser.TransformerLayer(128, 512, 4, params_dtype=torch.bfloat16, hidden_dropout=0.0,
                                      attention_dropout=0.0)
    x = torch.randn(SEQ, BATCH, 128, dtype=torch.bfloat16)
    recipe = NVFP4BlockScaling(fp8_dpa=True, disable_stochastic_rounding=True)
    losses = {}
    for switch in ("DelayedScaling", "F16"):
        monkeypatch.setenv("NVTE_DPA_FP8_RECIPE", switch)
        for _ in range(2):  # the second step runs on the first's delayed scales
            layer.zero_grad()

            def forward():
                with te_fuser.fp8_autocast(fp8_recipe=recipe):
                    return layer(x)

            out, saved = saved_for_backward(forward)
            out.float().square().mean().backward()
        losses[switch] = out.float().square().mean().item()
        attention = [e for e in saved if "FusedAttention" in e.op]
        assert attention, "the attention saved nothing"
        assert (torch.bfloat16 in {e.dtype for e in attention}) == (switch == "F16")
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())
    assert losses["DelayedScaling"] != losses["F16"]
    assert losses["DelayedScaling"] == pytest.approx(losses["F16"], rel=0.05)


def test_backend_query_follows_the_switch(monkeypatch):
    params = AttentionParams(qkv_dtype=torch.bfloat16, qkv_layout="sbhd_sbhd_sbhd", batch_size=BATCH,
                             num_heads=HEADS, num_gqa_groups=HEADS, max_seqlen_q=SEQ, max_seqlen_kv=SEQ,
                             head_dim_qk=DIM, head_dim_v=DIM, attn_mask_type="causal", fp8=True,
                             fp8_meta={"recipe": NVFP4BlockScaling(fp8_dpa=True)})
    monkeypatch.setenv("NVTE_DPA_FP8_RECIPE", "F16")
    high = get_attention_backend(params)
    monkeypatch.setenv("NVTE_DPA_FP8_RECIPE", "Float8CurrentScaling")
    fp8 = get_attention_backend(params)
    # FP8 attention runs on te_fuser's kernels only, which TE's query calls FusedAttention.
    assert fp8[:3] == (False, None, True) and not fp8[-2]
    assert high != fp8


def test_refusals_name_what_to_set(monkeypatch):
    q, k, v = inputs(0)
    for recipe, match in ((MXFP8BlockScaling(fp8_dpa=True), "MXFP8 attention"),
                          (NVFP4BlockScaling(fp8_dpa=True), "NVTE_DPA_FP8_RECIPE")):
        with pytest.raises(NotImplementedError, match=match), te_fuser.fp8_autocast(fp8_recipe=recipe):
            dpa()(q, k, v)
    bad = {"NVTE_DPA_FP8_RECIPE": "Delayed", "NVTE_DPA_FP8_FORMAT": "E3M4", "NVTE_DPA_FP8DS_AMAX_ALGO": "mean",
           "NVTE_DPA_FP8DS_AMAX_HISTLEN": "0", "NVTE_DPA_FP8DS_REDUCE_AMAX": "yes"}
    for name, value in bad.items():
        monkeypatch.setenv("NVTE_DPA_FP8_RECIPE", "DelayedScaling")
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=name), \
                te_fuser.fp8_autocast(fp8_recipe=NVFP4BlockScaling(fp8_dpa=True)):
            dpa()(q, k, v)
        monkeypatch.delenv(name)
    monkeypatch.setenv("NVTE_DPA_FP8_RECIPE", "MXFP8BlockScaling")
    with pytest.raises(NotImplementedError, match="MXFP8 attention"), \
            te_fuser.fp8_autocast(fp8_recipe=DelayedScaling(fp8_dpa=True)):
        dpa()(q, k, v)
    for cls in (MXFP8BlockScaling, NVFP4BlockScaling):
        with pytest.raises(NotImplementedError, match="fp8_mha"):
            cls(fp8_mha=True)
    with pytest.raises(ValueError, match="Float8BlockScaling"):
        Float8BlockScaling(fp8_dpa=True)  # TE refuses FP8 attention with this recipe


@pytest.mark.parametrize("recipe", [MXFP8BlockScaling(fp8_dpa=True), NVFP4BlockScaling(fp8_dpa=True)],
                         ids=lambda r: type(r).__name__)
def test_switched_delayed_scaling_state_round_trips_through_extra_state(monkeypatch, recipe):
    """The attention's delayed-scaling state under a switched recipe is saved in _extra_state: a module loaded
    from it continues with the same scales (a fresh module, the control, starts from scale 1 and differs)."""
    monkeypatch.setenv("NVTE_DPA_FP8_RECIPE", "DelayedScaling")
    trained = dpa()
    for seed in range(2):
        run(trained, recipe, seed)
    loaded, fresh = dpa(), dpa()
    loaded.load_state_dict(trained.state_dict())
    outs = [run(module, recipe, 9)[0] for module in (trained, loaded, fresh)]
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], outs[2])


@compiles_te_fuser_modules
@pytest.mark.parametrize("recipe", [DelayedScaling(fp8_dpa=True), NVFP4BlockScaling(fp8_dpa=True)],
                         ids=lambda r: type(r).__name__)
def test_switch_under_torch_compile_fullgraph(monkeypatch, recipe):
    """The switched recipe is made while dynamo traces (not inside the graph): the compiled step, autocast
    inside it, gives eager's output and grads bit for bit, under current scaling (no state between steps)."""
    monkeypatch.setenv("NVTE_DPA_FP8_RECIPE", "Float8CurrentScaling")
    modules = [dpa(), dpa()]

    def step(module, q, k, v):
        with te_fuser.fp8_autocast(fp8_recipe=recipe):
            return module(q, k, v)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for module, fn in zip(modules, (step, compiled)):
        q, k, v = inputs(6)
        out = fn(module, q, k, v)
        out.float().sum().backward()
        results.append([out.detach(), q.grad, k.grad, v.grad])
        assert isinstance(module._fp8_recipe, Float8CurrentScaling)
    for a, b in zip(*results):
        assert torch.equal(a, b)
