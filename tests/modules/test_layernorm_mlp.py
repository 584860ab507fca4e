"""te_fuser.LayerNormMLP: float64 references for each activation, FP8, TE's names and return
order, one autograd node, nothing on ctx after backward, TP/SP on 2 gloo ranks, meta init,
state_dict and errors."""

import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import te_fuser
from te_fuser import recipe

from _module_checks import (assert_close64, ctx_walk_check, fuser_nodes, grads_of, leaf64, norm64,
                            retained_bytes_check, spawn)
from activation_reference import GATED64, TE_ACTIVATIONS, activation64

HIDDEN, FFN, TOKENS = 32, 64, 32
PARAMS = ["layer_norm_weight", "layer_norm_bias", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"]




def _module(generator, **kwargs):
    m = te_fuser.LayerNormMLP(HIDDEN, FFN, device="cpu", **kwargs)
    with torch.no_grad():
        m.layer_norm_weight.normal_(1.0, 0.5, generator=generator)
        for name in ("layer_norm_bias", "fc1_bias", "fc2_bias"):
            if getattr(m, name) is not None:
                getattr(m, name).normal_(0.0, 0.5, generator=generator)
        m.fc1_weight.normal_(0.0, 0.2, generator=generator)
        m.fc2_weight.normal_(0.0, 0.2, generator=generator)
    return m


def _input(generator, dtype=torch.float32, tokens=TOKENS):
    x = torch.randn(2, tokens // 2, HIDDEN, generator=generator, dtype=torch.float64) * 2 - 0.5
    x[0, 0] = 0.0
    return x.to(dtype).requires_grad_()


def _reference(m, x, dy, dln=None):
    """[out, ln_out] + grads of x and PARAMS, in float64. For a 16-bit module the intermediate
    tensors are rounded to its dtype where the module rounds them (gradients pass straight
    through), so relu's mask sees the same pre-activation signs."""
    leaves = [leaf64(x)] + [leaf64(getattr(m, n)) for n in PARAMS]
    x64, g64, b64, w1, b1, w2, b2 = leaves

    def rnd(t):
        return t if x.dtype == torch.float32 else t + (t.to(x.dtype).double() - t).detach()

    ln = rnd(norm64(x64, g64, b64, m.eps, m.normalization, m.zero_centered_gamma))
    h = rnd(F.linear(ln, w1)) + (0 if b1 is None else b1)  # the module's GEMM output is rounded, the bias added in float32
    out = F.linear(rnd(activation64(h, m.activation)), w2, b2)
    loss = (out * dy.double()).sum()
    if dln is not None:
        loss = loss + (ln * dln.double()).sum()
    loss.backward()
    return [out, ln] + grads_of(*leaves)


@pytest.mark.parametrize("activation", TE_ACTIVATIONS)
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64(activation, normalization, dtype, generator):
    m = _module(generator, activation=activation, normalization=normalization, params_dtype=dtype,
                zero_centered_gamma=normalization == "RMSNorm")
    # TE's fc1 for a gated activation has both halves: 2 * ffn_hidden_size rows.
    assert m.fc1_weight.shape == ((2 if activation in GATED64 else 1) * FFN, HIDDEN)
    x = _input(generator, dtype)
    dy = torch.randn(*x.shape, generator=generator).to(dtype)
    out = m(x)
    out.backward(dy)
    assert len(fuser_nodes(out)) == 1 and out.grad_fn is fuser_nodes(out)[0]
    ref = _reference(m, x, dy)
    rtol = 1e-5 if dtype == torch.float32 else 2 ** -6
    got = grads_of(x, *[getattr(m, n) for n in PARAMS])
    assert_close64("out", out, ref[0], rtol)
    for name, g, r in zip(["dx"] + PARAMS, got, ref[2:]):
        if r is None:  # RMSNorm has no layer_norm_bias
            continue
        assert g.dtype == dtype, name
        assert_close64(name, g, r, rtol)


@pytest.mark.parametrize("return_bias", [False, True])
def test_no_bias_return_bias_and_layernorm_output(return_bias, generator):
    m = _module(generator, activation="swiglu", bias=not return_bias, return_bias=return_bias,
                return_layernorm_output=True)
    assert [n for n, _ in m.named_parameters()] == (PARAMS[:3] + [PARAMS[4]] if return_bias else PARAMS)
    assert m.fc1_weight.shape == (2 * FFN, HIDDEN)
    x = _input(generator)
    dy, dln = torch.randn(*x.shape, generator=generator), torch.randn(*x.shape, generator=generator)
    result = m(x)
    if return_bias:
        out, bias, ln_out = result  # TE's order
        assert bias is None and m.fc1_bias is None
    else:
        out, ln_out = result
    torch.autograd.backward([out, ln_out], [dy, dln])
    ref = _reference(m, x, dy, dln)
    assert_close64("out", out, ref[0], 1e-5)
    assert_close64("ln_out", ln_out, ref[1], 1e-5)
    for name, g, r in zip(["dx"] + PARAMS, grads_of(x, *[getattr(m, n) for n in PARAMS]), ref[2:]):
        if r is not None:
            assert_close64(name, g, r, 1e-5)


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("activation", TE_ACTIVATIONS)
def test_fp8_equals_the_same_ops_unfused(recipe_name, activation, generator):
    """Under FP8 the module gives what te_fuser.ops.Sequential of the same ops gives, and is within
    FP8 precision of float64 (and visibly less precise than float32)."""
    from te_fuser import ops

    m = _module(generator, activation=activation)
    act = {"gelu": ops.GELU, "qgelu": ops.QGELU, "relu": ops.ReLU, "srelu": ops.SReLU, "silu": ops.SiLU,
           "geglu": ops.GEGLU, "qgeglu": ops.QGEGLU, "reglu": ops.ReGLU, "sreglu": ops.SReGLU,
           "swiglu": ops.SwiGLU}[activation]
    rows = 2 if activation in GATED64 else 1
    chain = ops.Sequential(ops.LayerNorm(HIDDEN), ops.BasicLinear(HIDDEN, rows * FFN), ops.Bias(rows * FFN), act(),
                           ops.BasicLinear(FFN, HIDDEN), ops.Bias(HIDDEN))
    with torch.no_grad():
        for dst, name in zip([chain[0].weight, chain[0].bias, chain[1].weight, chain[2].bias, chain[4].weight,
                              chain[5].bias], PARAMS):
            dst.copy_(getattr(m, name))
    fp8_recipe = recipe.DelayedScaling(amax_history_len=4) if recipe_name == "delayed" else recipe.Float8CurrentScaling()
    x = _input(generator)
    x2 = x.detach().clone().requires_grad_()
    dy = torch.randn(*x.shape, generator=generator)
    for step in range(2):
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            out, out2 = m(x), chain(x2)
        out.backward(dy)
        out2.backward(dy)
        assert torch.equal(out, out2), f"step {step}"
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m.fc1_weight.grad, chain[1].weight.grad, rtol=1e-6, atol=1e-6)
    ref = _reference(m, x, dy)
    err = assert_close64("out", out, ref[0], 2 ** -3)
    assert err > 1e-3


def test_hybrid_backward_states_are_e5m2(generator):
    m = _module(generator)
    with te_fuser.fp8_autocast(fp8_recipe=recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID)):
        out = m(_input(generator))
    out.sum().backward()
    linears = [op for op in m._ops if isinstance(op, te_fuser.ops.BasicLinear)]
    assert len(linears) == 2
    for op in linears:
        assert op._fp8_states[0].fp8_dtype == torch.float8_e4m3fn
        assert op._fp8_states[1].fp8_dtype == torch.float8_e5m2


RECIPES = {"no_fp8": None, "delayed": recipe.DelayedScaling(amax_history_len=4),
           "current": recipe.Float8CurrentScaling()}


@pytest.mark.parametrize("activation", TE_ACTIVATIONS)
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_nothing_on_ctx_after_backward(recipe_name, activation, monkeypatch):
    torch.manual_seed(0)
    m = te_fuser.LayerNormMLP(HIDDEN, FFN, activation=activation, device="cpu")
    ctx_walk_check(m, lambda: torch.randn(TOKENS, HIDDEN, requires_grad=True), RECIPES[recipe_name], monkeypatch)


@pytest.mark.parametrize("activation", TE_ACTIVATIONS)
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_retained_bytes(recipe_name, activation, monkeypatch):
    torch.manual_seed(0)
    m = te_fuser.LayerNormMLP(HIDDEN, 256, activation=activation, device="cpu")
    tokens = 256
    # Saved: at least the FFN activation, tokens * 256 bytes (FP8) or 4x that (float32).
    retained_bytes_check(m, lambda: torch.randn(tokens, HIDDEN, requires_grad=True), RECIPES[recipe_name],
                         monkeypatch, min_leak=tokens * 256)


def test_meta_init_then_reset_parameters():
    m = te_fuser.LayerNormMLP(HIDDEN, FFN, device="meta", activation="relu")
    assert m.fc1_weight.device.type == "meta"
    m.reset_parameters()
    assert all(p.device.type == "cpu" for p in m.parameters())
    assert torch.equal(m.layer_norm_weight, torch.ones(HIDDEN)) and torch.equal(m.fc2_bias, torch.zeros(HIDDEN))
    assert 0.01 < m.fc2_weight.std().item() < 0.04
    assert m(torch.randn(TOKENS, HIDDEN)).shape == (TOKENS, HIDDEN)


def test_init_methods_and_state_dict_round_trip_with_fp8_state(generator):
    m = te_fuser.LayerNormMLP(HIDDEN, FFN, device="cpu", init_method=torch.nn.init.ones_,
                              output_layer_init_method=torch.nn.init.zeros_)
    assert torch.equal(m.fc1_weight, torch.ones(FFN, HIDDEN)) and not m.fc2_weight.any()
    m = _module(generator)
    fp8_recipe = recipe.DelayedScaling(amax_history_len=8)
    x = _input(generator)
    for _ in range(2):
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            out = m(x)
        out.sum().backward()
    buffer = io.BytesIO()
    torch.save(m.state_dict(), buffer)
    buffer.seek(0)
    clone = te_fuser.LayerNormMLP(HIDDEN, FFN, device="cpu")
    clone.load_state_dict(torch.load(buffer, weights_only=False))
    for a, b in zip(m._ops, clone._ops):
        if a.fp8_extra_state() is not None:
            for key, value in a.fp8_extra_state()["forward"].items():
                assert torch.equal(b.fp8_extra_state()["forward"][key], value), key
    with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
        assert torch.equal(clone(x), m(x))


def test_bad_arguments_raise_clear_errors():
    for activation in ["glu", "clamped_swiglu"]:  # later TE releases'
        with pytest.raises(NotImplementedError, match=f"'{activation}' is one of TE's activations te_fuser lacks; "
                                                      "supported: gelu, qgelu, relu, srelu, silu, geglu"):
            te_fuser.LayerNormMLP(8, 8, activation=activation, device="cpu")
    with pytest.raises(NotImplementedError, match="'tanh'.*unknown"):
        te_fuser.LayerNormMLP(8, 8, activation="tanh", device="cpu")
    for option in [dict(ub_overlap_ag=True), dict(checkpoint=True),
                   dict(activation_params={"limit": 7.0}), dict(symmetric_ar_type="one_shot")]:
        with pytest.raises(NotImplementedError, match=next(iter(option))):
            te_fuser.LayerNormMLP(8, 8, device="cpu", **option)
    with pytest.raises(ValueError, match="normalization"):
        te_fuser.LayerNormMLP(8, 8, normalization="GroupNorm", device="cpu")
    with pytest.raises(ValueError, match="ffn_hidden_size"):
        te_fuser.LayerNormMLP(8, 0, device="cpu")
    m = te_fuser.LayerNormMLP(8, 16, seq_length=4, micro_batch_size=2, device="cpu")
    with pytest.raises(ValueError, match="last dimension must be 8"):
        m(torch.randn(3, 7))


# -- set_parallel_mode: fc1 column, fc2 row, with and without sequence parallelism -----------
SEQ, BATCH = 16, 2


def _tp_case(rank, activation, sequence_parallel, fp8_recipe=None):
    world, group = 2, dist.group.WORLD
    torch.manual_seed(7)
    g = torch.Generator().manual_seed(7)
    full = _module(g, activation=activation)
    with torch.no_grad():
        full.fc2_bias.mul_(0.01)  # small: the row all-reduce must carry the output
    tp = te_fuser.LayerNormMLP(HIDDEN, FFN, activation=activation, set_parallel_mode=True, tp_group=group,
                               sequence_parallel=sequence_parallel, device="cpu")
    assert tp.size_per_partition == FFN // world
    with torch.no_grad():
        tp.layer_norm_weight.copy_(full.layer_norm_weight), tp.layer_norm_bias.copy_(full.layer_norm_bias)
        halves = 2 if activation in GATED64 else 1
        # fc1: each rank's shard of every half (TE's layout for gated activations).
        w1 = torch.cat([h.chunk(world, 0)[rank] for h in full.fc1_weight.chunk(halves, 0)])
        b1 = torch.cat([h.chunk(world, 0)[rank] for h in full.fc1_bias.chunk(halves, 0)])
        tp.fc1_weight.copy_(w1), tp.fc1_bias.copy_(b1)
        tp.fc2_weight.copy_(full.fc2_weight.chunk(world, 1)[rank]), tp.fc2_bias.copy_(full.fc2_bias)
    assert tp.fc1_weight.partition_dim == 0 and tp.fc2_weight.partition_dim == 1
    assert tp.fc2_bias.sequence_parallel is sequence_parallel
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g, requires_grad=True)
    dy = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    def run(module, inp, grad):
        with te_fuser.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe, fp8_group=group):
            out = module(inp)
        out.backward(grad)
        return out.detach()

    def check(name, got, expect):
        if fp8_recipe is None:
            torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5, msg=name)
        else:  # each rank's weight shards have their own FP8 scales: equal within FP8 precision
            rel = ((got - expect).norm() / expect.norm()).item()
            assert rel < 0.1, f"{name}: relative error {rel}"

    out_full = run(full, x, dy)
    shard = (lambda t: t.chunk(world, 0)[rank].contiguous()) if sequence_parallel else (lambda t: t)
    x_local = shard(x.detach()).requires_grad_()
    out = run(tp, x_local, shard(dy))
    check("out", out, shard(out_full))
    check("dx", x_local.grad, shard(x.grad))
    check("dW1", tp.fc1_weight.grad, torch.cat(
        [h.chunk(world, 0)[rank] for h in full.fc1_weight.grad.chunk(halves, 0)]))
    check("dW2", tp.fc2_weight.grad, full.fc2_weight.grad.chunk(world, 1)[rank])
    for name, p, ref in [("dgamma", tp.layer_norm_weight, full.layer_norm_weight),
                         ("db2", tp.fc2_bias, full.fc2_bias)]:
        grad = p.grad.clone()
        if sequence_parallel:  # partial per sequence shard: Megatron all-reduces these
            dist.all_reduce(grad, group=group)
        check(name, grad, ref.grad)


def _tp_cases(rank):
    for activation, sequence_parallel in [("gelu", False), ("gelu", True), ("swiglu", True), ("qgeglu", False)]:
        _tp_case(rank, activation, sequence_parallel)
    for fp8_recipe in (recipe.DelayedScaling(), recipe.Float8CurrentScaling()):
        _tp_case(rank, "gelu", True, fp8_recipe)


def test_set_parallel_mode_and_sequence_parallel_on_two_ranks():
    spawn(_tp_cases)


def test_fuse_wgrad_accumulation_adds_weight_grads_into_main_grad(generator):
    """As Megatron uses it: fc1/fc2 weight gradients accumulate into weight.main_grad (no .grad),
    the other parameters get .grad."""
    m = _module(generator, fuse_wgrad_accumulation=True)
    ref = _module(generator)
    ref.load_state_dict(m.state_dict())
    for w in (m.fc1_weight, m.fc2_weight):
        w.main_grad = torch.ones_like(w)
    x = _input(generator)
    for _ in range(2):
        m(x).sum().backward()
        ref(x).sum().backward()
    for name in ("fc1_weight", "fc2_weight"):
        w = getattr(m, name)
        assert w.grad is None and w.grad_added_to_main_grad
        torch.testing.assert_close(w.main_grad, 1 + getattr(ref, name).grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.fc1_bias.grad, ref.fc1_bias.grad)
    torch.testing.assert_close(m.layer_norm_weight.grad, ref.layer_norm_weight.grad)
