"""te_fuser.LayerNormLinear: float64 references, FP8 (the norm writing FP8 itself), TE's return
order, one autograd node, nothing on ctx after backward, TP/SP on 2 gloo ranks, meta init,
state_dict and errors."""

import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import te_fuser
from te_fuser import recipe
from te_fuser.ops.basic import norm as norm_ops

from _module_checks import (assert_close64, ctx_walk_check, fuser_nodes, grads_of, leaf64, norm64,
                            retained_bytes_check, spawn)

IN, OUT, TOKENS = 64, 64, 32


def _module(normalization="LayerNorm", generator=None, **kwargs):
    m = te_fuser.LayerNormLinear(IN, OUT, normalization=normalization, device="cpu", **kwargs)
    with torch.no_grad():  # non-trivial norm parameters and bias
        m.layer_norm_weight.normal_(1.0, 0.5, generator=generator)
        if m.layer_norm_bias is not None:
            m.layer_norm_bias.normal_(0.0, 0.5, generator=generator)
        if m.bias is not None:
            m.bias.normal_(generator=generator)
    return m


def _input(generator, dtype=torch.float32, shape=(4, TOKENS // 4, IN)):
    x = torch.randn(*shape, generator=generator, dtype=torch.float64) * 3 + 1
    x[0, 0] = 0.0  # an all-zero row: rstd = 1/sqrt(eps)
    return x.to(dtype).requires_grad_()


def _reference(m, x, dy, dln=None):
    """(out, ln_out, dx, d layer_norm_weight, d layer_norm_bias, dW, db) in float64."""
    x64, g64, b64 = leaf64(x), leaf64(m.layer_norm_weight), leaf64(m.layer_norm_bias)
    w64, bias64 = leaf64(m.weight), leaf64(m.bias)
    ln = norm64(x64, g64, b64, m.eps, m.normalization, m.zero_centered_gamma)
    out = F.linear(ln, w64, bias64)
    loss = (out * dy.double()).sum()
    if dln is not None:
        loss = loss + (ln * dln.double()).sum()
    loss.backward()
    return [out, ln] + grads_of(x64, g64, b64, w64, bias64)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64(normalization, zero_centered_gamma, dtype, generator):
    m = _module(normalization, generator, zero_centered_gamma=zero_centered_gamma, params_dtype=dtype)
    x = _input(generator, dtype)
    dy = torch.randn(*x.shape[:-1], OUT, generator=generator).to(dtype)
    out = m(x)
    out.backward(dy)
    ref = _reference(m, x, dy)
    rtol = 1e-5 if dtype == torch.float32 else 2 ** -6
    got = [out, None] + grads_of(x, m.layer_norm_weight, m.layer_norm_bias, m.weight, m.bias)
    for name, g, r in zip(["out", "ln_out", "dx", "dgamma", "dbeta", "dW", "db"], got, ref):
        if name == "ln_out" or (name == "dbeta" and normalization == "RMSNorm"):
            continue
        assert g.dtype == dtype
        assert_close64(name, g, r, rtol)


@pytest.mark.parametrize("return_bias", [False, True])
def test_return_layernorm_output_in_te_order_with_its_gradient(return_bias, generator):
    m = _module("LayerNorm", generator, return_layernorm_output=True, return_bias=return_bias)
    x = _input(generator)
    dy = torch.randn(*x.shape[:-1], OUT, generator=generator)
    dln = torch.randn(*x.shape, generator=generator)
    result = m(x)
    if return_bias:  # TE: (out, bias, ln_out)
        out, bias, ln_out = result
        assert bias is m.bias
        out = out + bias
    else:  # TE: (out, ln_out)
        out, ln_out = result
    assert ln_out.shape == x.shape and ln_out.dtype == x.dtype
    torch.autograd.backward([out, ln_out], [dy, dln])
    ref = _reference(m, x, dy, dln)
    assert_close64("out", out, ref[0], 1e-5)
    assert_close64("ln_out", ln_out, ref[1], 1e-5)
    for name, g, r in zip(["dx", "dgamma", "dbeta", "dW", "db"],
                          grads_of(x, m.layer_norm_weight, m.layer_norm_bias, m.weight, m.bias), ref[2:]):
        assert_close64(name, g, r, 1e-5)
    assert len(fuser_nodes(ln_out)) == 1 and fuser_nodes(ln_out)[0] is fuser_nodes(out)[0]


def test_one_autograd_node_and_te_attributes():
    m = te_fuser.LayerNormLinear(IN, OUT, normalization="RMSNorm", eps=1e-6, zero_centered_gamma=True,
                                 device="cpu")
    assert [n for n, _ in m.named_parameters()] == ["layer_norm_weight", "weight", "bias"]
    assert m.layer_norm_bias is None and m.normalization == "RMSNorm" and m.eps == 1e-6
    assert m.zero_centered_gamma and m.use_bias and m.tp_size == 1 and m.ub_name is None
    assert torch.equal(m.layer_norm_weight, torch.zeros(IN))  # zero-centered gamma starts at 0
    out = m(torch.randn(TOKENS, IN, requires_grad=True))
    assert len(fuser_nodes(out)) == 1 and out.grad_fn is fuser_nodes(out)[0]
    split = te_fuser.LayerNormLinear(IN, 3 * OUT, parameters_split=("q", "k", "v"), device="cpu")
    assert [n for n, _ in split.named_parameters()] == [
        "layer_norm_weight", "layer_norm_bias", "q_weight", "k_weight", "v_weight", "q_bias", "k_bias", "v_bias"]
    assert split.weight.shape == (3 * OUT, IN)


FP8_RECIPES = {"delayed": lambda: recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=4),
               "current": lambda: recipe.Float8CurrentScaling()}


@pytest.mark.parametrize("recipe_name", list(FP8_RECIPES))
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_fp8_equals_norm_then_linear_modules(recipe_name, normalization, generator):
    """The fused module gives exactly what te_fuser.LayerNorm/RMSNorm followed by te_fuser.Linear
    give (the linear quantizing the norm output with the same scale), and is within FP8
    precision of float64 -- not closer than float32 would be."""
    fused = _module(normalization, generator)
    norm_cls = te_fuser.LayerNorm if normalization == "LayerNorm" else te_fuser.RMSNorm
    norm = norm_cls(IN, device="cpu")
    linear = te_fuser.Linear(IN, OUT, device="cpu")
    with torch.no_grad():
        norm.weight.copy_(fused.layer_norm_weight)
        if fused.layer_norm_bias is not None:
            norm.bias.copy_(fused.layer_norm_bias)
        linear.weight.copy_(fused.weight), linear.bias.copy_(fused.bias)
    x = _input(generator)
    x2 = x.detach().clone().requires_grad_()
    dy = torch.randn(*x.shape[:-1], OUT, generator=generator)
    fp8_recipe = FP8_RECIPES[recipe_name]()
    for step in range(2):  # the second step runs with scales from the first (delayed scaling)
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            out = fused(x)
            out2 = linear(norm(x2))
        out.backward(dy)
        out2.backward(dy)
        assert torch.equal(out, out2), f"step {step}"
    for a, b in [(x.grad, x2.grad), (fused.layer_norm_weight.grad, norm.weight.grad),
                 (fused.weight.grad, linear.weight.grad), (fused.bias.grad, linear.bias.grad)]:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    ref = _reference(fused, x, dy)
    err = assert_close64("out", out, ref[0], 2 ** -3)
    assert err > 1e-3, "FP8 must be visibly less precise than float32"


def test_norm_writes_fp8_directly_under_delayed_scaling(monkeypatch, generator):
    """Delayed scaling: the norm kernel gets the linear's FP8 scale and writes FP8; with current
    scaling, or when the norm output is returned, it writes high precision."""
    calls = []
    real = norm_ops.fused.layernorm

    def spy(*args, fp8_out=None, **kwargs):
        calls.append(fp8_out)
        return real(*args, fp8_out=fp8_out, **kwargs)

    monkeypatch.setattr(norm_ops.fused, "layernorm", spy)
    x = _input(generator)
    for fp8_recipe, return_ln, direct in [(recipe.DelayedScaling(), False, True),
                                          (recipe.Float8CurrentScaling(), False, False),
                                          (recipe.DelayedScaling(), True, False)]:
        m = _module("LayerNorm", generator, return_layernorm_output=return_ln)
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            m(x)
        fp8_out = calls.pop()
        assert (fp8_out is not None) == direct, (fp8_recipe, return_ln)
        if direct:
            linear = m._ops[1]
            dtype, scale, amax = fp8_out
            assert dtype == torch.float8_e4m3fn
            assert scale.data_ptr() == linear._forward_quantizers[0].scale.data_ptr()


def test_hybrid_backward_state_is_e5m2(generator):
    m = _module("RMSNorm", generator)
    with te_fuser.fp8_autocast(fp8_recipe=recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID)):
        out = m(_input(generator))
    out.sum().backward()
    linear = m._ops[1]
    assert linear._fp8_states[0].fp8_dtype == torch.float8_e4m3fn
    assert linear._fp8_states[1].fp8_dtype == torch.float8_e5m2
    assert linear._backward_quantizers[0].fp8_dtype == torch.float8_e5m2


RECIPES = {"no_fp8": None, "delayed": recipe.DelayedScaling(amax_history_len=4),
           "current": recipe.Float8CurrentScaling()}


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("return_ln", [False, True])
def test_nothing_on_ctx_after_backward(recipe_name, return_ln, monkeypatch):
    torch.manual_seed(0)
    m = te_fuser.LayerNormLinear(IN, OUT, return_layernorm_output=return_ln, device="cpu")
    first = (lambda r: r[0] + r[1].sum()) if return_ln else (lambda r: r)
    ctx_walk_check(m, lambda: torch.randn(TOKENS, IN, requires_grad=True), RECIPES[recipe_name], monkeypatch,
                   first)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_retained_bytes(recipe_name, monkeypatch):
    torch.manual_seed(0)
    m = te_fuser.LayerNormLinear(IN, 256, device="cpu")
    tokens = 256
    # Saved: the input and norm output (x, FP8 x.T under FP8) at least tokens * IN bytes.
    retained_bytes_check(m, lambda: torch.randn(tokens, IN, requires_grad=True), RECIPES[recipe_name],
                         monkeypatch, min_leak=tokens * IN)


def test_meta_init_then_reset_parameters():
    m = te_fuser.LayerNormLinear(IN, OUT, device="meta", normalization="LayerNorm")
    assert m.weight.device.type == "meta"
    m.reset_parameters()
    assert m.weight.device.type == "cpu" and m.layer_norm_bias.device.type == "cpu"
    assert torch.equal(m.layer_norm_weight, torch.ones(IN)) and torch.equal(m.bias, torch.zeros(OUT))
    assert 0.01 < m.weight.std().item() < 0.04  # TE's default init: normal(0, 0.023)
    assert m(torch.randn(TOKENS, IN)).shape == (TOKENS, OUT)


def test_state_dict_round_trip_with_fp8_state(generator):
    m = _module("LayerNorm", generator)
    fp8_recipe = recipe.DelayedScaling(amax_history_len=8)
    x = _input(generator)
    for _ in range(2):
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            out = m(x)
        out.sum().backward()
    assert m.get_extra_state() is not None
    buffer = io.BytesIO()
    torch.save(m.state_dict(), buffer)
    buffer.seek(0)
    clone = te_fuser.LayerNormLinear(IN, OUT, device="cpu")
    clone.load_state_dict(torch.load(buffer, weights_only=False))
    for key, value in m._ops[1].fp8_extra_state()["forward"].items():
        assert torch.equal(clone._ops[1].fp8_extra_state()["forward"][key], value), key
    with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
        assert torch.equal(clone(x), m(x))


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="normalization"):
        te_fuser.LayerNormLinear(8, 8, normalization="BatchNorm", device="cpu")
    with pytest.raises(NotImplementedError, match="parallel_mode='row'"):
        te_fuser.LayerNormLinear(8, 8, parallel_mode="row", device="cpu")
    with pytest.raises(ValueError, match="parallel_mode"):
        te_fuser.LayerNormLinear(8, 8, parallel_mode="diagonal", device="cpu")
    for option in [dict(ub_overlap_ag=True), dict(ub_name="qkv"), dict(symmetric_ar_type="two_shot")]:
        with pytest.raises(NotImplementedError, match=next(iter(option))):
            te_fuser.LayerNormLinear(8, 8, device="cpu", **option)
    with pytest.raises(ValueError, match="positive"):
        te_fuser.LayerNormLinear(0, 8, device="cpu")
    m = te_fuser.LayerNormLinear(8, 4, device="cpu")
    with pytest.raises(ValueError, match="last dimension must be 8"):
        m(torch.randn(3, 7))
    with pytest.raises(TypeError, match="torch.Tensor"):
        m([1.0] * 8)
    # Outside fp8_autocast fp8_output / fp8_grad do nothing (TE): a plain tensor.
    assert type(m(torch.randn(3, 8), fp8_output=True, fp8_grad=True)) is torch.Tensor


# -- tensor parallel: column, with and without sequence parallelism, on 2 gloo ranks ---------
SEQ, BATCH = 16, 2


def _tp_case(rank, sequence_parallel, return_ln, gathered, fp8_recipe=None):
    world, group = 2, dist.group.WORLD
    torch.manual_seed(1234)  # the same weights on every rank
    g = torch.Generator().manual_seed(1234)
    full = _module("LayerNorm", g, return_layernorm_output=return_ln)
    with torch.no_grad():
        full.bias.mul_(0.01)  # small bias: a missing all-reduce in dgrad cannot hide behind it
    tp = te_fuser.LayerNormLinear(IN, OUT, parallel_mode="column", sequence_parallel=sequence_parallel,
                                  tp_group=group, return_layernorm_output=return_ln,
                                  return_layernorm_output_gathered=gathered, device="cpu")
    with torch.no_grad():
        tp.layer_norm_weight.copy_(full.layer_norm_weight), tp.layer_norm_bias.copy_(full.layer_norm_bias)
        tp.weight.copy_(full.weight.chunk(world, 0)[rank]), tp.bias.copy_(full.bias.chunk(world, 0)[rank])
    assert tp.layer_norm_weight.sequence_parallel is sequence_parallel
    x = torch.randn(SEQ, BATCH, IN, generator=g, requires_grad=True)
    dy = torch.randn(SEQ, BATCH, OUT, generator=g)
    dln = torch.randn(SEQ, BATCH, IN, generator=g)

    def run(module, inp, grad, grad_ln):
        with te_fuser.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe, fp8_group=group):
            r = module(inp)
        out, ln = r if return_ln else (r, None)
        torch.autograd.backward([out] + ([ln] if return_ln else []), [grad] + ([grad_ln] if return_ln else []))
        return out.detach(), ln

    def check(name, got, expect):
        if fp8_recipe is None:
            torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5, msg=name)
        else:  # each rank's weight shard has its own FP8 scale: equal within FP8 precision
            rel = ((got - expect).norm() / expect.norm()).item()
            assert rel < 0.1, f"{name}: relative error {rel}"

    out_full, ln_full = run(full, x, dy, dln)
    shard = (lambda t: t.chunk(world, 0)[rank].contiguous()) if sequence_parallel else (lambda t: t)
    x_local = shard(x.detach()).requires_grad_()
    # A gathered norm output is the whole sequence on each rank, and the gradient reaching the
    # shards is the sum over ranks: each rank contributes half of it.
    dln_local = dln / world if (gathered and sequence_parallel) else shard(dln)
    out_tp, ln_tp = run(tp, x_local, dy.chunk(world, 2)[rank].contiguous(), dln_local)
    check("out", out_tp, out_full.chunk(world, 2)[rank])
    if return_ln:
        expect_ln = ln_full.detach() if (gathered or not sequence_parallel) else shard(ln_full.detach())
        check("ln_out", ln_tp.detach(), expect_ln)
    check("dx", x_local.grad, shard(x.grad))
    check("dW", tp.weight.grad, full.weight.grad.chunk(world, 0)[rank])
    check("db", tp.bias.grad, full.bias.grad.chunk(world, 0)[rank])
    # The norm parameters' gradients are partial on each rank (Megatron all-reduces them).
    for name, p, ref in [("dgamma", tp.layer_norm_weight, full.layer_norm_weight),
                         ("dbeta", tp.layer_norm_bias, full.layer_norm_bias)]:
        grad = p.grad.clone()
        if sequence_parallel:  # without SP every rank saw the whole sequence: complete already
            dist.all_reduce(grad, group=group)
        check(name, grad, ref.grad)


def _tp_cases(rank):
    for sequence_parallel, return_ln, gathered in [(False, False, False), (True, False, False),
                                                   (True, True, False), (True, True, True)]:
        _tp_case(rank, sequence_parallel, return_ln, gathered)
    # FP8: under delayed scaling the norm writes FP8 shards that the linear gathers.
    for fp8_recipe in (recipe.DelayedScaling(), recipe.Float8CurrentScaling()):
        _tp_case(rank, True, False, False, fp8_recipe)


def test_tensor_parallel_column_and_sequence_parallel_on_two_ranks():
    spawn(_tp_cases)


def test_fuse_wgrad_accumulation_adds_the_weight_grad_into_main_grad(generator):
    m = _module("RMSNorm", generator, fuse_wgrad_accumulation=True)
    ref = _module("RMSNorm", generator)
    ref.load_state_dict(m.state_dict())
    m.weight.main_grad = torch.zeros_like(m.weight)
    x = _input(generator)
    for _ in range(2):
        m(x).sum().backward()
        ref(x).sum().backward()
    assert m.weight.grad is None and m.weight.grad_added_to_main_grad
    torch.testing.assert_close(m.weight.main_grad, ref.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.layer_norm_weight.grad, ref.layer_norm_weight.grad)
    with pytest.raises(NotImplementedError, match="parameters_split"):
        te_fuser.LayerNormLinear(IN, 2 * OUT, fuse_wgrad_accumulation=True, parameters_split=("a", "b"), device="cpu")
