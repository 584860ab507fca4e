"""te_fuser.GroupedLinear against per-split F.linear in float64, FP8 against torch's float8 casts,
and the saved-tensor discipline with its bug-on control."""

import pytest
import torch
import torch.nn.functional as F

import te_fuser
from te_fuser import recipe

from _module_memory import reachable_after_backward, retained_step_bytes, without_clearing
from fp8_torch_reference import current_scaled_round_trip

IN, OUT = 32, 48


def _layer(num_gemms=3, **kwargs):
    layer = te_fuser.GroupedLinear(num_gemms, IN, OUT, device="cpu", **kwargs)
    with torch.no_grad():
        for i in range(num_gemms):
            if layer.use_bias:
                getattr(layer, f"bias{i}").normal_()
    return layer


def _reference(layer, x, m_splits, dy):
    """Per-split F.linear in float64: (out, dx, [dW_i], [db_i])."""
    x64 = x.detach().double().reshape(-1, IN).requires_grad_()
    ws = [getattr(layer, f"weight{i}").detach().double().requires_grad_() for i in range(layer.num_gemms)]
    bs = [getattr(layer, f"bias{i}").detach().double().requires_grad_() for i in range(layer.num_gemms)]
    out = torch.cat([F.linear(xi, w, b) for xi, w, b in zip(x64.split(m_splits), ws, bs)])
    out.backward(dy.double().reshape(-1, OUT))
    return out.reshape(*x.shape[:-1], OUT), x64.grad.reshape(x.shape), [w.grad for w in ws], [b.grad for b in bs]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_matches_per_split_linear_in_float64(dtype, tol, generator):
    layer = _layer(4, params_dtype=dtype)
    m_splits = [5, 0, 17, 10]  # an expert without tokens included
    x = torch.randn(8, 4, IN, generator=generator).to(dtype).requires_grad_()  # 32 rows over [s, b]
    dy = torch.randn(8, 4, OUT, generator=generator).to(dtype)
    out = layer(x, m_splits)
    out.backward(dy)
    ref_out, ref_dx, ref_dw, ref_db = _reference(layer, x, m_splits, dy)
    assert out.shape == (8, 4, OUT) and out.dtype == dtype
    close = dict(rtol=tol, atol=tol)
    torch.testing.assert_close(out.double(), ref_out, **close)
    torch.testing.assert_close(x.grad.double(), ref_dx, **close)
    for i in range(4):
        torch.testing.assert_close(getattr(layer, f"weight{i}").grad.double(), ref_dw[i], **close)
        torch.testing.assert_close(getattr(layer, f"bias{i}").grad.double(), ref_db[i], **close)
    assert torch.count_nonzero(layer.weight1.grad) == 0  # the empty split's expert gets a zero gradient


def test_one_autograd_node_and_tensor_m_splits(generator):
    layer = _layer(2)
    x = torch.randn(32, IN, generator=generator, requires_grad=True)
    out = layer(x, torch.tensor([16, 16]))
    assert type(out.grad_fn).__name__ == "_FuserFunctionBackward"
    leaves = {id(f.variable) for f, _ in out.grad_fn.next_functions if hasattr(f, "variable")}
    assert leaves == {id(x)} | {id(p) for p in layer.parameters()}


@pytest.mark.parametrize("fp8_recipe", [recipe.DelayedScaling(amax_history_len=2), recipe.Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_fp8_each_gemm_has_its_own_scales(fp8_recipe, generator):
    """Splits of very different magnitudes: each GEMM is cast with its own scale (a shared one would
    flush the small split to zero). Delayed scaling reaches the same scales on the second step."""
    layer = _layer(3, bias=False)
    m_splits = [16, 32, 16]
    x = torch.randn(64, IN, generator=generator)
    x[:16] *= 1e3
    x[48:] *= 1e-3
    x.requires_grad_()
    dy = torch.randn(64, OUT, generator=generator)
    for _ in range(2):
        x.grad = None
        layer.zero_grad(set_to_none=True)
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            out = layer(x, m_splits)
        out.backward(dy)
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    for i, (xi, dyi) in enumerate(zip(x.detach().split(m_splits), dy.split(m_splits))):
        w = getattr(layer, f"weight{i}").detach()
        xq, wq, dyq = current_scaled_round_trip(xi, e4m3), current_scaled_round_trip(w, e4m3), \
            current_scaled_round_trip(dyi, e5m2)
        rows = slice(sum(m_splits[:i]), sum(m_splits[:i + 1]))
        scale = xi.abs().max().item() * w.abs().max().item()
        torch.testing.assert_close(out[rows].double(), xq @ wq.T, rtol=1e-5, atol=1e-5 * scale)
        torch.testing.assert_close(x.grad[rows].double(), dyq @ wq, rtol=1e-5, atol=1e-5 * w.abs().max().item())
        torch.testing.assert_close(getattr(layer, f"weight{i}").grad.double(), dyq.T @ xq, rtol=1e-5,
                                   atol=1e-5 * xi.abs().max().item())
        # ... and FP8 really ran: the result differs from the float64 product.
        assert not torch.allclose(out[rows].double(), xi.double() @ w.double().T, rtol=1e-4, atol=0)


def test_fp8_needs_every_split_a_multiple_of_16(generator):
    layer = _layer(2)
    x = torch.randn(56, IN, generator=generator)
    with te_fuser.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        with pytest.raises(ValueError, match=r"m_splits\[1\] = 40 is not divisible by 16"):
            layer(x, [16, 40])
        layer(x[:48], [48, 0])  # 0 is a multiple of 16


@pytest.mark.parametrize("m_splits,error,match", [
    ([16, 8], ValueError, "m_splits sums to 24, but the input has 32 rows"),
    ([32], ValueError, "m_splits has 1 entries, expected num_gemms = 2"),
    ([40, -8], ValueError, "non-negative"),
    ([16.5, 15.5], TypeError, "integers"),
    (torch.tensor([[16, 16]]), ValueError, "1-D integer tensor"),
])
def test_bad_m_splits(m_splits, error, match):
    with pytest.raises(error, match=match):
        _layer(2)(torch.randn(32, IN), m_splits)


def test_bad_arguments():
    with pytest.raises(NotImplementedError, match="ub_overlap_ag"):
        te_fuser.GroupedLinear(2, IN, OUT, ub_overlap_ag=True, device="cpu")
    with pytest.raises(ValueError, match="bias=True needs TP size 1"):
        te_fuser.GroupedLinear(2, IN, OUT, tp_size=2, parallel_mode="column", device="cpu")
    with pytest.raises(ValueError, match="num_gemms must be a positive int"):
        te_fuser.GroupedLinear(0, IN, OUT, device="cpu")
    with pytest.raises(ValueError, match="parallel_mode"):
        te_fuser.GroupedLinear(2, IN, OUT, parallel_mode="rows", device="cpu")
    with pytest.raises(ValueError, match=r"in_features = 32"):
        _layer(2)(torch.randn(32, IN + 1), [16, 16])
    with pytest.raises(NotImplementedError, match="out/dgrad_out"):
        _layer(2)(torch.randn(32, IN), [16, 16], out=torch.empty(32, OUT))


def test_tensor_parallel_shards_the_weights_as_te():
    column = te_fuser.GroupedLinear(2, IN, OUT, tp_size=2, parallel_mode="column", bias=False, device="cpu")
    row = te_fuser.GroupedLinear(2, IN, OUT, tp_size=2, parallel_mode="row", bias=False, device="cpu")
    assert column.weight1.shape == (OUT // 2, IN) and column.weight1.partition_dim == 0
    assert row.weight0.shape == (OUT, IN // 2) and row.weight0.partition_dim == 1
    assert column.bias0.numel() == 0 and "bias0" not in dict(column.named_parameters())


def test_return_bias_and_fuse_wgrad_accumulation(generator):
    layer = _layer(2, return_bias=True, fuse_wgrad_accumulation=True)
    for w in (layer.weight0, layer.weight1):
        w.main_grad = torch.ones_like(w)
    x = torch.randn(32, IN, generator=generator)
    out, biases = layer(x, [16, 16])
    assert [b is p for b, p in zip(biases, (layer.bias0, layer.bias1))] == [True, True]
    dy = torch.randn(32, OUT, generator=generator)
    out.backward(dy)
    torch.testing.assert_close(out, torch.cat([x[:16] @ layer.weight0.T, x[16:] @ layer.weight1.T]).detach())
    torch.testing.assert_close(layer.weight1.main_grad, 1 + dy[16:].T @ x[16:])
    assert layer.weight1.grad is None and layer.weight1.grad_added_to_main_grad


def test_state_dict_round_trip_with_fp8_state(generator):
    layer = _layer(2)
    x = torch.randn(32, IN, generator=generator)
    with te_fuser.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=4)):
        layer(x, [16, 16])
    with te_fuser.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=4)):
        expect = layer(x, [16, 16])
    state = layer.state_dict()
    assert {f"weight{i}" for i in range(2)} | {f"bias{i}" for i in range(2)} | {"_extra_state"} == set(state)
    fresh = _layer(2)
    fresh.load_state_dict(state)
    with te_fuser.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=4)):
        got = fresh(x, [16, 16])
    torch.testing.assert_close(got, expect, rtol=0, atol=0)  # same weights, same scales


def test_meta_device_then_reset_parameters():
    layer = te_fuser.GroupedLinear(2, IN, OUT, device="meta")
    assert layer.weight0.device.type == "meta"
    layer.reset_parameters()
    assert layer.weight1.device.type == "cpu" and 0.015 < layer.weight1.std().item() < 0.031
    assert torch.count_nonzero(layer.bias0) == 0


@pytest.mark.parametrize("fp8_recipe", [None, recipe.DelayedScaling(amax_history_len=4), recipe.Float8CurrentScaling()],
                         ids=["no_fp8", "delayed", "current"])
def test_nothing_left_on_ctx_after_backward_and_the_bug_is_caught(fp8_recipe, monkeypatch, generator):
    layer = _layer(2)
    x = torch.randn(64, IN, generator=generator, requires_grad=True)

    def forward():
        with te_fuser.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
            return layer(x * 2, [32, 32])  # an activation, not a leaf: its saved splits must be freed

    before, after, _ = reachable_after_backward(layer, forward)
    assert before and after == []
    held, expected = retained_step_bytes(layer, forward, [x])
    assert held <= expected + 1024, (held, expected)

    without_clearing(monkeypatch)
    _, after_leaky, _ = reachable_after_backward(layer, forward)
    assert after_leaky, "the graph walk missed the tensors left on the fuser's ctx"
    held_leaky, expected = retained_step_bytes(layer, forward, [x])
    # At least the saved inputs of both GEMMs (float32, or the FP8 transposes).
    assert held_leaky >= expected + 64 * IN * (4 if fp8_recipe is None else 1), (held_leaky, expected)


def test_is_first_microbatch_caches_each_fp8_weight(generator):
    layer = _layer(2)
    x = torch.randn(32, IN, generator=generator)
    fp8_recipe = recipe.Float8CurrentScaling()
    with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
        first = layer(x, [16, 16], is_first_microbatch=True)
    cache = list(layer._ops[0]._fp8_weight_cache)
    assert all(c is not None for c in cache)
    with torch.no_grad():
        layer.weight0.mul_(2)  # not seen by the next microbatch: its FP8 copy is cached
    with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
        second = layer(x, [16, 16], is_first_microbatch=False)
    assert all(a is b for a, b in zip(layer._ops[0]._fp8_weight_cache, cache))
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
        fresh = layer(x, [16, 16])  # None: quantize now, keep nothing
    assert not torch.allclose(fresh[:16], first[:16]) and layer._ops[0]._fp8_weight_cache == [None, None]
