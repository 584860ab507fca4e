"""FusedAdam and FusedSGD (TE's `pytorch.optimizers`).

References: torch.optim.Adam / AdamW / SGD run on float64 copies, an Adam written out in float64 for what
torch lacks (bias_correction=False, SGD's wd_after_momentum), torch's own bfloat16 and float8 casts, and the
bit layout of float32 for store_param_remainders.
"""

import pytest
import torch

import te_fuser
from fp8_reference import reference_quantize
from te_fuser.optimizers import FusedAdam, FusedSGD
from te_fuser.optimizers.fused_adam import _bf16_with_remainder, _split_to_bf16
from te_fuser.tensor.float8_tensor import Float8Tensor

SHAPES = [(64, 48), (48,), (1,), (7, 3, 5)]


def _tensors(generator, dtype=torch.float32):
    return [torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype) for shape in SHAPES]


def _grads(generator, like):
    return [torch.randn(t.shape, generator=generator, dtype=torch.float64) for t in like]


def _pair(generator, dtype=torch.float32):
    """Test parameters of `dtype` and float64 reference parameters with the same values."""
    values = _tensors(generator, dtype)
    return ([torch.nn.Parameter(v.clone()) for v in values],
            [torch.nn.Parameter(v.double()) for v in values])


def _set_grads(params, refs, grads, attr="grad"):
    for p, r, g in zip(params, refs, grads):
        setattr(p, attr, g.to(p.dtype if attr == "grad" else torch.float32))
        r.grad = g.clone()


def _adam_float64(params, grads, state, lr, betas, eps, weight_decay, adam_w, bias_correction):
    """One Adam step in float64 (Kingma & Ba; L2 decay into the gradient, or AdamW's decoupled decay)."""
    state["step"] = state.get("step", 0) + 1
    b1, b2 = betas
    c1 = 1 - b1 ** state["step"] if bias_correction else 1.0
    c2 = 1 - b2 ** state["step"] if bias_correction else 1.0
    for i, (p, g) in enumerate(zip(params, grads)):
        m, v = state.setdefault(i, (torch.zeros_like(p), torch.zeros_like(p)))
        if weight_decay and not adam_w:
            g = g + weight_decay * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        update = (m / c1) / ((v / c2).sqrt() + eps)
        if weight_decay and adam_w:
            update = update + weight_decay * p
        p -= lr * update
        state[i] = (m, v)


@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_matches_torch_optim_in_float64(generator, adam_w_mode, weight_decay):
    params, refs = _pair(generator)
    options = dict(lr=5e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=weight_decay)
    optim = FusedAdam(params, adam_w_mode=adam_w_mode, **options)
    optim.add_param_group({"params": []})  # an empty group is skipped, as in TE
    reference = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(refs, **options)
    for _ in range(6):
        _set_grads(params, refs, _grads(generator, params))
        optim.step()
        reference.step()
        for p, r in zip(params, refs):
            torch.testing.assert_close(p, r.float(), rtol=1e-5, atol=1e-6)
    assert optim.param_groups[0]["step"] == 6
    assert all(optim.state[p]["exp_avg"].dtype == torch.float32 for p in params)


def test_adam_without_bias_correction(generator):
    params, refs = _pair(generator)
    optim = FusedAdam(params, lr=1e-2, betas=(0.7, 0.9), eps=1e-8, bias_correction=False, weight_decay=0.05)
    state = {}
    for _ in range(4):
        grads = _grads(generator, params)
        _set_grads(params, refs, grads)
        optim.step()
        with torch.no_grad():
            _adam_float64([r.data for r in refs], grads, state, 1e-2, (0.7, 0.9), 1e-8, 0.05, True, False)
    for p, r in zip(params, refs):
        torch.testing.assert_close(p, r.float(), rtol=1e-5, atol=1e-6)


def test_bf16_params_with_float32_masters(generator):
    values = _tensors(generator)
    params = [torch.nn.Parameter(v.bfloat16()) for v in values]
    refs = [torch.nn.Parameter(p.detach().double()) for p in params]  # the masters start at the bf16 values
    optim = FusedAdam(params, lr=1e-2, master_weights=True, use_decoupled_grad=True)
    reference = torch.optim.AdamW(refs, lr=1e-2, weight_decay=0.0)
    for _ in range(5):
        _set_grads(params, refs, _grads(generator, params), attr="decoupled_grad")
        optim.step()
        reference.step()
        for p, r in zip(params, refs):
            master = optim.get_unscaled_state(p, "master_param")
            assert master.dtype == torch.float32 and p.grad is None
            torch.testing.assert_close(master, r.float(), rtol=1e-5, atol=1e-6)
            assert torch.equal(p.detach(), master.bfloat16())  # the parameter is its master, rounded
    optim.zero_grad()
    assert all(p.decoupled_grad is None for p in params)


def test_remainders_split_and_rebuild_float32_exactly(generator):
    bits = torch.randint(-2**31, 2**31 - 1, (100_000,), generator=generator, dtype=torch.int64).to(torch.int32)
    master = bits.view(torch.float32)
    master = master[torch.isfinite(master) & (master.abs() < 3e38)]
    param, remainder = torch.empty_like(master, dtype=torch.bfloat16), torch.empty_like(master, dtype=torch.int16)
    _split_to_bf16(master, param, remainder)
    assert torch.equal(_bf16_with_remainder(param, remainder).view(torch.int32), master.view(torch.int32))
    # The bfloat16 part is master rounded to nearest (ties, 0x8000 remainders, up rather than to even).
    tie = (master.view(torch.int32) & 0xFFFF) == 0x8000
    assert torch.equal(param[~tie], master[~tie].bfloat16())


def test_store_param_remainders_runs_as_float32_masters(generator):
    """The master rebuilt from bf16 + int16 is bitwise the float32 master of a run that keeps one."""
    values = [v.bfloat16() for v in _tensors(generator)]
    with_remainders = [torch.nn.Parameter(v.clone()) for v in values]
    with_masters = [torch.nn.Parameter(v.clone()) for v in values]
    options = dict(lr=1e-2, weight_decay=0.01, master_weights=True)
    optim = FusedAdam(with_remainders, store_param_remainders=True, **options)
    full = FusedAdam(with_masters, **options)
    for _ in range(5):
        grads = _grads(generator, values)
        for a, b, g in zip(with_remainders, with_masters, grads):
            a.grad, b.grad = g.bfloat16(), g.bfloat16()
        optim.step()
        full.step()
    for a, b in zip(with_remainders, with_masters):
        remainder = optim.state[a]["master_param"]
        assert remainder.dtype == torch.int16 and optim.get_unscaled_state(a, "master_param") is remainder
        rebuilt = _bf16_with_remainder(a.detach(), remainder)
        assert torch.equal(rebuilt, full.get_unscaled_state(b, "master_param"))


@pytest.mark.parametrize("state_dtype", [torch.float16, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("which", ["exp_avg", "exp_avg_sq"])
def test_low_precision_states(generator, state_dtype, which):
    params, refs = _pair(generator)
    optim = FusedAdam(params, lr=1e-3, **{f"{which}_dtype": state_dtype})
    reference = torch.optim.AdamW(refs, lr=1e-3, weight_decay=0.0)
    for _ in range(4):
        _set_grads(params, refs, _grads(generator, params))
        optim.step()
        reference.step()
    tolerance = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.uint8: 0.1}[state_dtype]
    for p, r in zip(params, refs):
        stored = optim.state[p][which]
        if state_dtype == torch.uint8:
            assert isinstance(stored, Float8Tensor) and stored._data.dtype == torch.uint8
        else:
            assert stored.dtype == state_dtype
        expected = reference.state[r][which]
        unscaled = optim.get_unscaled_state(p, which)
        assert unscaled.dtype == torch.float32
        # Relative to the largest moment, or to one step's contribution where the steps cancel out.
        scale = max(expected.abs().max().item(), 0.1 if which == "exp_avg" else 0.0)
        torch.testing.assert_close(unscaled.double() / scale, expected / scale, rtol=0, atol=tolerance)
        torch.testing.assert_close(p.double(), r, rtol=0, atol=1e-3 * 4)  # four steps of at most ~lr


def test_float16_state_fills_half_the_range(generator):
    params, _ = _pair(generator)
    optim = FusedAdam(params, lr=1e-3, exp_avg_dtype=torch.float16)
    for p, g in zip(params, _grads(generator, params)):
        p.grad = g.float() * 1e-6  # tiny moments: unscaled they would be float16 subnormals
    optim.step()
    for p in params:
        stored = optim.state[p]["exp_avg"]
        assert stored.abs().max().item() == pytest.approx(torch.finfo(torch.float16).max / 2, rel=1e-3)
        expected = 0.1 * p.grad  # first step: (1 - beta1) * g
        torch.testing.assert_close(optim.get_unscaled_state(p, "exp_avg"), expected, rtol=2e-3, atol=0)


def test_fp8_parameters_are_updated_in_place(generator):
    with te_fuser.quantized_model_init(enabled=True):
        layer = te_fuser.Linear(64, 32, bias=True)
    weight = layer.weight
    assert isinstance(weight, Float8Tensor)
    data_ptr, scale_inv_ptr = weight._data.data_ptr(), weight._scale_inv.data_ptr()
    reference = [torch.nn.Parameter(p.detach().dequantize().double() if isinstance(p, Float8Tensor)
                                    else p.detach().double()) for p in layer.parameters()]
    optim = FusedAdam(list(layer.parameters()), lr=1e-2, master_weights=True)
    torch_optim = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.0)
    for _ in range(3):
        _set_grads(list(layer.parameters()), reference, _grads(generator, reference))
        optim.step()
        torch_optim.step()
    master = optim.get_unscaled_state(weight, "master_param")
    torch.testing.assert_close(master, reference[0].float(), rtol=1e-5, atol=1e-6)
    assert weight._data.data_ptr() == data_ptr and weight._scale_inv.data_ptr() == scale_inv_ptr
    scale = weight._quantizer.scale
    expected = reference_quantize(master, scale, torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(weight._data.view(torch.uint8).reshape(expected.shape), expected)
    torch.testing.assert_close(weight._scale_inv, scale.reciprocal())
    assert weight._quantizer.amax.item() >= master.abs().max().item()  # recorded for the next scale update
    torch.testing.assert_close(layer.bias, reference[1].float(), rtol=1e-5, atol=1e-6)


def test_fp8_parameters_need_master_weights(generator):
    with te_fuser.quantized_model_init(enabled=True):
        layer = te_fuser.Linear(32, 32, bias=False)
    layer.weight.grad = torch.randn(32, 32, generator=generator)
    with pytest.raises(RuntimeError, match="master_weights"):
        FusedAdam([layer.weight]).step()


@pytest.mark.parametrize("options", [dict(), dict(exp_avg_dtype=torch.float16, master_weights=True,
                                                  master_weight_dtype=torch.float16),
                                     dict(master_weights=True, store_param_remainders=True)])
def test_state_dict_round_trip_continues_the_run(generator, options):
    values = [v.bfloat16() for v in _tensors(generator)]
    a = [torch.nn.Parameter(v.clone()) for v in values]
    b = [torch.nn.Parameter(v.clone()) for v in values]
    first, second = FusedAdam(a, lr=1e-2, **options), FusedAdam(b, lr=1e-2, **options)
    grads = [_grads(generator, values) for _ in range(6)]
    for step, gs in enumerate(grads):
        if step == 3:
            saved = second.state_dict()
            assert all(t.dtype in (torch.float32, torch.int16) for s in saved["state"].values() for t in s.values())
            second = FusedAdam(b, lr=1e-2, **options)
            second.load_state_dict(saved)
        for p, q, g in zip(a, b, gs):
            p.grad, q.grad = g.bfloat16(), g.bfloat16()
        first.step()
        second.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)


@pytest.mark.filterwarnings("ignore:GradScaler is going to stop passing itself")
def test_capturable_with_grad_scaler_skips_inf_steps(generator):
    params, refs = _pair(generator)
    optim = FusedAdam(params, lr=1e-2, capturable=True)
    assert isinstance(optim.param_groups[0]["lr"], torch.Tensor)
    reference = torch.optim.AdamW(refs, lr=1e-2, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    for step in range(4):
        grads = _grads(generator, params)
        before = [p.detach().clone() for p in params]
        loss = sum((p * g.float()).sum() for p, g in zip(params, grads))  # gradients g
        optim.zero_grad()
        scaler.scale(loss).backward()
        if step == 2:
            params[1].grad[0] = float("inf")
        scaler.step(optim)
        scaler.update()
        if step == 2:  # skipped: nothing moved, the step count stays
            assert all(torch.equal(p, b) for p, b in zip(params, before))
            assert int(optim.param_groups[0]["step"]) == 2
            scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
            continue
        for r, g in zip(refs, grads):
            r.grad = g
        reference.step()
        for p, r in zip(params, refs):
            torch.testing.assert_close(p, r.float(), rtol=1e-5, atol=1e-6)


def test_state_memory_is_the_requested_dtypes(generator):
    """What the optimizer keeps per parameter: its states in their dtypes and one float32 scale each; no
    float32 copy of a low-precision state outlives the step."""
    params = [torch.nn.Parameter(v.bfloat16()) for v in _tensors(generator)]
    optim = FusedAdam(params, lr=1e-3, master_weights=True, master_weight_dtype=torch.float16,
                      exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.bfloat16)
    for p, g in zip(params, _grads(generator, params)):
        p.grad = g.bfloat16()
    optim.step()
    for p in params:
        state = optim.state[p]
        assert set(state) == {"exp_avg", "exp_avg_sq", "master_param"}
        assert state["exp_avg"]._data.element_size() == 1 and state["exp_avg"]._data.numel() == p.numel()
        assert state["exp_avg_sq"].dtype == torch.bfloat16 and state["master_param"].dtype == torch.float16
        assert {k: v.shape for k, v in optim._scales[p].items()} == {name: (1,) for name in state}


def test_adam_refusals():
    p = [torch.nn.Parameter(torch.zeros(4))]
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam(p, amsgrad=True)
    with pytest.raises(RuntimeError, match="exp_avg_dtype"):
        FusedAdam(p, exp_avg_dtype=torch.float64)
    with pytest.raises(RuntimeError, match="master_weight_dtype"):
        FusedAdam(p, master_weights=True, master_weight_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="capturable"):
        FusedAdam(p, capturable=True, exp_avg_sq_dtype=torch.float16)
    mixed = [torch.nn.Parameter(torch.zeros(4, dtype=torch.float16)), torch.nn.Parameter(torch.zeros(4).bfloat16())]
    for q in mixed:
        q.grad = torch.ones_like(q)
    with pytest.raises(RuntimeError, match="mix of float16 and bfloat16"):
        FusedAdam(mixed).step()


def _sgd_float64(params, grads, buffers, lr, momentum, dampening, weight_decay, nesterov, wd_after):
    for i, (p, g) in enumerate(zip(params, grads)):
        if weight_decay and not wd_after:
            g = g + weight_decay * p
        if momentum:
            buffers[i] = g.clone() if i not in buffers else momentum * buffers[i] + (1 - dampening) * g
            g = g + momentum * buffers[i] if nesterov else buffers[i]
        if weight_decay and wd_after:
            g = g + weight_decay * p
        p -= lr * g


@pytest.mark.parametrize("options", [dict(momentum=0.0), dict(momentum=0.9), dict(momentum=0.9, dampening=0.3),
                                     dict(momentum=0.9, nesterov=True, weight_decay=0.01),
                                     dict(momentum=0.5, weight_decay=0.05)])
def test_sgd_matches_torch_optim_in_float64(generator, options):
    params, refs = _pair(generator)
    optim = FusedSGD(params, lr=0.1, **options)
    reference = torch.optim.SGD(refs, lr=0.1, **options)
    for _ in range(5):
        _set_grads(params, refs, _grads(generator, params))
        optim.step()
        reference.step()
    for p, r in zip(params, refs):
        torch.testing.assert_close(p, r.float(), rtol=1e-5, atol=1e-6)


def test_sgd_half_params_match_torch_optim_bitwise(generator):
    """float16 parameters and momentum buffers, stored rounded each step, as torch's float16 SGD does."""
    params, _ = _pair(generator, torch.float16)
    refs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    optim, reference = FusedSGD(params, lr=0.25, momentum=0.125), torch.optim.SGD(refs, lr=0.25, momentum=0.125)
    for _ in range(5):
        for p, r, g in zip(params, refs, _grads(generator, params)):
            p.grad, r.grad = g.half(), g.half()
        optim.step()
        reference.step()
    for p, r in zip(params, refs):
        assert optim.state[p]["momentum_buffer"].dtype == torch.float16
        assert torch.equal(p, r)


def test_sgd_weight_decay_after_momentum_and_half_params(generator):
    params, refs = _pair(generator, torch.float16)
    optim = FusedSGD(params, lr=0.05, momentum=0.8, weight_decay=0.1, wd_after_momentum=True)
    buffers = {}
    for _ in range(4):
        grads = _grads(generator, params)
        _set_grads(params, refs, grads)
        optim.step()
        with torch.no_grad():
            _sgd_float64([r.data for r in refs], [g.half().double() for g in grads], buffers, 0.05, 0.8, 0.0,
                         0.1, False, True)
    for p, r in zip(params, refs):
        assert p.dtype == torch.float16
        torch.testing.assert_close(p.double(), r, rtol=4e-3, atol=4e-3)
    with pytest.raises(ValueError, match="Nesterov"):
        FusedSGD(params, lr=0.1, nesterov=True)
