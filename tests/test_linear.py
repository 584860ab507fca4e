"""te_fuser.Linear: numerics against float64 F.linear, TE's constructor options, FP8 and errors."""

import io

import pytest
import torch
import torch.nn.functional as F

import te_fuser
from te_fuser import recipe

from _torch_support import compiles_te_fuser_modules

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and te_fuser._extension.has_cuda_kernels() else [])


def _data(m, k, n, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype).requires_grad_()
    dy = torch.randn(m, n, generator=g).to(device=device, dtype=dtype)
    return x, dy


def _reference(layer, x, dy):
    """out, dx, dW, db in float64 from the layer's own parameters."""
    x64 = x.detach().double().requires_grad_()
    w64 = layer.weight.detach().double().requires_grad_()
    b64 = layer.bias.detach().double().requires_grad_()
    out = F.linear(x64, w64, b64)
    out.backward(dy.double())
    return out.detach(), x64.grad, w64.grad, b64.grad


def _run(layer, x, dy, **fwd):
    out = layer(x, **fwd)
    out.backward(dy)
    return out.detach(), x.grad, layer.weight.grad, layer.bias.grad


# Without FP8: float32 is float32 GEMM rounding (sum of k products, ~k * 2^-24 relative to
# sum |x||w|); bfloat16 rounds inputs-products accumulate in float32 and the result to
# bf16 (2^-8 relative) -- so the bounds are relative to the magnitudes |x| @ |W|.T etc.
_HP_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_high_precision_matches_float64(device, dtype):
    torch.manual_seed(0)
    layer = te_fuser.Linear(96, 40, params_dtype=dtype, device=device)
    with torch.no_grad():
        layer.bias.normal_()
    x, dy = _data(50, 96, 40, dtype, device)
    got = _run(layer, x, dy)
    ref = _reference(layer, x, dy)
    scales = [
        x.detach().double().abs() @ layer.weight.detach().double().abs().T + 1,
        dy.double().abs() @ layer.weight.detach().double().abs(),
        dy.double().abs().T @ x.detach().double().abs(),
        dy.double().abs().sum(0),
    ]
    for name, a, r, s in zip(("out", "dgrad", "wgrad", "bgrad"), got, ref, scales):
        err = (a.double() - r).abs()
        assert (err <= _HP_RTOL[dtype] * s).all(), f"{name}: max err {err.max()}"
        assert a.dtype == dtype


def test_float32_is_bitwise_torch_linear():
    torch.manual_seed(0)
    layer = te_fuser.Linear(64, 32, device="cpu")
    ref = torch.nn.Linear(64, 32)
    ref.load_state_dict({"weight": layer.weight.detach(), "bias": layer.bias.detach()})
    x = torch.randn(4, 7, 64)
    assert torch.equal(layer(x), ref(x))


# --- FP8 error bound -----------------------------------------------------------------
# A value v cast with scale s to a format with m mantissa bits is off by at most
#   u |v| + h / s,   u = 2^-(m+1) (round to nearest), h = half the subnormal step,
# E4M3: u = 2^-4, h = 2^-10;   E5M2: u = 2^-3, h = 2^-17   (in scaled units).
# For a GEMM of quantized operands a~ = a + ea, b~ = b + eb (|ea|, |eb| <= those bounds):
#   |a~ b~^T - a b^T| <= |ea| |b|^T + |a| |eb|^T + |ea| |eb|^T  (+ float32 accumulation).
E4M3 = (2.0 ** -4, 2.0 ** -10, 448.0)
E5M2 = (2.0 ** -3, 2.0 ** -17, 57344.0)


def _cast_error(t, fmt):
    u, h, fp8_max = fmt
    scale = fp8_max / t.abs().max()  # current scaling
    return u * t.abs() + h / scale


def _gemm_bound(a, ea, b, eb):
    return ea @ b.abs().T + a.abs() @ eb.T + ea @ eb.T + 1e-5 * (a.abs() @ b.abs().T) + 1e-6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["HYBRID", "E4M3"])
def test_fp8_current_scaling_within_derived_bound(device, fmt):
    torch.manual_seed(0)
    layer = te_fuser.Linear(64, 48, device=device)
    with torch.no_grad():
        layer.bias.normal_()
    x, dy = _data(32, 64, 48, torch.float32, device)
    with te_fuser.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling(fp8_format=recipe.Format[fmt])):
        out = layer(x)
    out.backward(dy)
    ref_out, ref_dx, ref_dw, ref_db = _reference(layer, x, dy)
    x64, w64, dy64 = x.detach().double(), layer.weight.detach().double(), dy.double()
    grad_fmt = E5M2 if fmt == "HYBRID" else E4M3
    ex, ew, edy = _cast_error(x64, E4M3), _cast_error(w64, E4M3), _cast_error(dy64, grad_fmt)
    checks = [
        ("out", out, ref_out, _gemm_bound(x64, ex, w64, ew)),
        ("dgrad", x.grad, ref_dx, _gemm_bound(dy64, edy, w64.T, ew.T)),
        ("wgrad", layer.weight.grad, ref_dw, _gemm_bound(dy64.T, edy.T, x64.T, ex.T)),
    ]
    for name, got, ref, bound in checks:
        err = (got.double() - ref).abs()
        assert (err <= bound).all(), f"{name}: worst err/bound {(err / bound).max()}"
        # ... and the bound is not vacuous: FP8 really is less precise than float32.
        assert err.max() > 1e-4
    torch.testing.assert_close(layer.bias.grad.double(), ref_db, rtol=1e-5, atol=1e-5)
    op = layer._ops[0]
    assert [q.fp8_dtype for q in op._forward_quantizers] == [torch.float8_e4m3fn] * 2
    expect_grad = torch.float8_e5m2 if fmt == "HYBRID" else torch.float8_e4m3fn
    assert op._backward_quantizers[0].fp8_dtype == expect_grad


def test_fp8_gemm_equals_dequantize_then_float32_matmul():
    from te_fuser.ops.gemm import fp8_gemm_nt

    a = torch.randn(32, 48)
    b = torch.randn(16, 48)
    qa = te_fuser.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)(a)
    qb = te_fuser.Float8CurrentScalingQuantizer(torch.float8_e5m2)(b)
    got = fp8_gemm_nt(qa.fp8_data, qa._scale_inv, qb.fp8_data, qb._scale_inv, torch.float32)
    # Independent dequantization: torch's float8 -> float32 conversion times scale_inv.
    ref = (qa.fp8_data.float() * qa._scale_inv) @ (qb.fp8_data.float() * qb._scale_inv).T
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_fp8_dims_not_divisible_by_16_raise_naming_the_dim():
    layer = te_fuser.Linear(64, 40, device="cpu")
    with te_fuser.fp8_autocast():
        with pytest.raises(ValueError, match=r"out_features \(local\) = 40 is not divisible by 16"):
            layer(torch.randn(16, 64))
    layer = te_fuser.Linear(64, 48, device="cpu")
    with te_fuser.fp8_autocast():
        with pytest.raises(ValueError, match=r"number of input rows \(tokens\) = 10"):
            layer(torch.randn(10, 64))


def test_delayed_scaling_updates_scale_and_extra_state_round_trips():
    torch.manual_seed(0)
    layer = te_fuser.Linear(32, 32, device="cpu")
    fp8_recipe = recipe.DelayedScaling(amax_history_len=8)
    x = torch.randn(16, 32)
    for _ in range(3):
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            out = layer(x)
        out.sum().backward()
    state = layer._ops[0]._fp8_states[0]
    assert state.scale[0].item() == pytest.approx(448.0 / x.abs().max().item(), rel=1e-6)
    assert state.scale[1].item() == pytest.approx(448.0 / layer.weight.detach().abs().max().item(), rel=1e-6)

    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    clone = te_fuser.Linear(32, 32, device="cpu")
    clone.load_state_dict(torch.load(buffer, weights_only=False))
    for mine, theirs in zip(layer._ops[0]._fp8_states, clone._ops[0]._fp8_states):
        for key, value in mine.state_dict().items():
            assert torch.equal(theirs.state_dict()[key], value), key
    with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
        assert torch.equal(clone(x), layer(x))
    clone.set_extra_state(torch.empty(0, dtype=torch.uint8))  # TE's "no FP8 state"
    with pytest.raises(Exception, match="pickle|truncated|_extra_state"):
        clone.set_extra_state(torch.ones(8, dtype=torch.uint8))


def test_is_first_microbatch_caches_the_fp8_weight():
    torch.manual_seed(0)
    layer = te_fuser.Linear(32, 32, device="cpu")
    x = torch.randn(16, 32)
    with te_fuser.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        first = layer(x, is_first_microbatch=True)
        with torch.no_grad():
            layer.weight.mul_(2.0)
        cached = layer(x, is_first_microbatch=False)
        fresh = layer(x, is_first_microbatch=None)
    bias = layer.bias.detach()
    assert torch.equal(first, cached)  # reused the FP8 weight quantized before the update
    torch.testing.assert_close(fresh - bias, 2 * (first - bias), rtol=0.15, atol=0.05)
    assert layer._ops[0]._fp8_weight_cache is None  # None does not cache


def test_parameters_split():
    torch.manual_seed(0)
    layer = te_fuser.Linear(16, 48, parameters_split={"query": 16, "key": 16, "value": 16}, device="cpu")
    names = sorted(n for n, _ in layer.named_parameters())
    assert names == ["key_bias", "key_weight", "query_bias", "query_weight", "value_bias", "value_weight"]
    assert layer.query_weight.shape == (16, 16) and layer.value_bias.shape == (16,)
    # The split parameters share one storage: the full weight is a view, no copy.
    assert layer.weight.untyped_storage().data_ptr() == layer.query_weight.untyped_storage().data_ptr()
    x = torch.randn(5, 16, requires_grad=True)
    dy = torch.randn(5, 48)
    out = layer(x)
    out.backward(dy)
    full_w = torch.cat([layer.query_weight, layer.key_weight, layer.value_weight]).detach()
    full_b = torch.cat([layer.query_bias, layer.key_bias, layer.value_bias]).detach()
    torch.testing.assert_close(out, F.linear(x, full_w, full_b))
    torch.testing.assert_close(layer.key_weight.grad, dy[:, 16:32].T @ x.detach())
    torch.testing.assert_close(layer.value_bias.grad, dy[:, 32:].sum(0))
    # A list of names splits evenly.
    even = te_fuser.Linear(16, 48, parameters_split=["a", "b", "c"], device="cpu")
    assert even.b_weight.shape == (16, 16)
    with pytest.raises(ValueError, match="sum to out_features"):
        te_fuser.Linear(16, 48, parameters_split={"q": 16, "k": 16}, device="cpu")


@pytest.mark.parametrize("fp8", [False, True])
def test_fuse_wgrad_accumulation(fp8):
    torch.manual_seed(0)
    layer = te_fuser.Linear(32, 32, fuse_wgrad_accumulation=True, device="cpu")
    plain = te_fuser.Linear(32, 32, device="cpu")
    plain.load_state_dict(layer.state_dict())
    layer.weight.main_grad = torch.ones(32, 32)
    layer.weight.grad_added_to_main_grad = False
    x = torch.randn(16, 32)
    dy = torch.randn(16, 32)

    def step(module):
        if fp8:
            with te_fuser.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
                out = module(x)
        else:
            out = module(x)
        out.backward(dy)

    step(layer)
    step(plain)  # the same GEMM numerics, gradient into .grad
    torch.testing.assert_close(layer.weight.main_grad, 1 + plain.weight.grad, rtol=1e-6, atol=1e-6)
    if not fp8:
        torch.testing.assert_close(plain.weight.grad, dy.T @ x, rtol=1e-5, atol=1e-5)
    assert layer.weight.grad is None and layer.weight.grad_added_to_main_grad is True
    assert layer.bias.grad is not None
    layer.weight.overwrite_main_grad = True
    step(layer)
    torch.testing.assert_close(layer.weight.main_grad, plain.weight.grad, rtol=1e-6, atol=1e-6)


def test_meta_device_then_reset_parameters():
    layer = te_fuser.Linear(32, 16, device="meta")
    assert layer.weight.device.type == "meta"
    layer.reset_parameters()
    assert layer.weight.device.type != "meta" and layer.bias.device == layer.weight.device
    assert torch.all(layer.bias == 0)
    out = layer(torch.randn(4, 32, device=layer.weight.device))
    assert out.shape == (4, 16)


def test_init_method_params_dtype_bias_and_return_bias():
    calls = []

    def init(w):
        calls.append(tuple(w.shape))
        torch.nn.init.constant_(w, 0.5)

    layer = te_fuser.Linear(8, 4, init_method=init, params_dtype=torch.bfloat16, return_bias=True, device="cpu")
    assert calls == [(4, 8)] and layer.weight.dtype == torch.bfloat16 and torch.all(layer.weight == 0.5)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.bias.fill_(7.0)
    out, bias = layer(x)
    assert bias is layer.bias
    torch.testing.assert_close(out, F.linear(x, layer.weight))  # bias not added
    no_bias = te_fuser.Linear(8, 4, bias=False, device="cpu")
    assert no_bias.bias is None and not no_bias.use_bias
    assert no_bias(torch.randn(2, 8)).shape == (2, 4)
    assert (layer.in_features, layer.out_features, layer.use_bias, layer.tp_size, layer.parallel_mode) == (
        8, 4, True, 1, None)


@pytest.mark.parametrize("option", [dict(ub_overlap_ag=True), dict(ub_overlap_rs=True), dict(ub_bulk_wgrad=True),
                                    dict(ub_bulk_dgrad=True), dict(ub_overlap_rs_dgrad=True), dict(ub_name="qkv"),
                                    dict(symmetric_ar_type="multimem_all_reduce")])
def test_unsupported_options_raise_naming_the_option(option):
    name = next(iter(option))
    with pytest.raises(NotImplementedError, match=name):
        te_fuser.Linear(8, 8, device="cpu", **option)


def test_bad_inputs_raise_clear_errors():
    layer = te_fuser.Linear(8, 4, device="cpu")
    with pytest.raises(ValueError, match="in_features = 8"):
        layer(torch.randn(3, 7))
    with pytest.raises(TypeError, match="dtype"):
        layer(torch.randn(3, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="is on meta"):
        layer(torch.randn(3, 8, device="meta"))
    with pytest.raises(TypeError, match="torch.Tensor"):
        layer([1.0] * 8)
    # Outside fp8_autocast fp8_output / fp8_grad do nothing (TE): a plain tensor.
    assert type(layer(torch.randn(3, 8), fp8_output=True, fp8_grad=True)) is torch.Tensor
    with pytest.raises(ValueError, match="parallel_mode"):
        te_fuser.Linear(8, 4, parallel_mode="diagonal", device="cpu")


def test_fusion_plan_is_cached_until_the_key_changes():
    layer = te_fuser.Linear(32, 32, device="cpu")
    fuser = layer._fuser
    x = torch.randn(16, 32, requires_grad=True)
    for _ in range(3):
        layer(x)
    assert fuser.plans_built == 1
    with te_fuser.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
        layer(x)
        layer(x)
    assert fuser.plans_built == 2
    with te_fuser.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        layer(x)
    assert fuser.plans_built == 3
    layer(x.detach())  # input no longer requires grad
    assert fuser.plans_built == 4
    with torch.no_grad():
        layer(x)
    assert fuser.plans_built == 5


def test_fp8_bfloat16_3d_input():
    torch.manual_seed(0)
    layer = te_fuser.Linear(64, 32, params_dtype=torch.bfloat16, device="cpu")
    x = torch.randn(4, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    ref = layer(x)
    for _ in range(2):
        with te_fuser.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
            out = layer(x)
        out.sum().backward()
    assert out.dtype == torch.bfloat16 and out.shape == (4, 8, 32)
    assert x.grad.dtype == torch.bfloat16 and layer.weight.grad.dtype == torch.bfloat16
    assert ((out - ref).float().norm() / ref.float().norm()) < 0.08


@compiles_te_fuser_modules
def test_torch_compile():
    torch.manual_seed(0)
    model = torch.nn.Sequential(te_fuser.Linear(32, 64, device="cpu"), torch.nn.GELU(),
                                te_fuser.Linear(64, 32, device="cpu"))
    x = torch.randn(16, 32, requires_grad=True)
    ref = model(x)
    ref.sum().backward()
    ref_grads = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad()
    out = torch.compile(model, fullgraph=True)(x)  # high precision: one graph, forward and backward
    out.sum().backward()
    torch.testing.assert_close(out, ref)
    for got, expect in zip([x.grad] + [p.grad for p in model.parameters()], ref_grads):
        torch.testing.assert_close(got, expect)
    # Under FP8 too, one graph (test_compile_fullgraph.py compares every module with eager bit for bit).
    fp8_recipe = recipe.Float8CurrentScaling()
    with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager)


def test_rng_state_tracker_forks_around_init():
    import contextlib

    forks = []

    class Tracker:
        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            forks.append(name)
            yield

    te_fuser.Linear(8, 8, get_rng_state_tracker=Tracker, rng_tracker_name="tp-rng", device="cpu")
    te_fuser.Linear(8, 8, get_rng_state_tracker=Tracker, device="cpu")
    assert forks == ["tp-rng", "model-parallel-rng"]
