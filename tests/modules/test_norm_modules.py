"""te_fuser.LayerNorm and te_fuser.RMSNorm modules: TE's constructor, float64 references,
sequence_parallel tags, one autograd node, nothing on ctx after backward, meta init, errors."""

import pytest
import torch

import te_fuser

from _module_checks import assert_close64, ctx_walk_check, fuser_nodes, grads_of, leaf64, norm64, retained_bytes_check

SIZE = 48
NORMS = {"LayerNorm": te_fuser.LayerNorm, "RMSNorm": te_fuser.RMSNorm}


@pytest.mark.parametrize("name", list(NORMS))
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64(name, zero_centered_gamma, dtype, generator):
    m = NORMS[name](SIZE, eps=1e-3, zero_centered_gamma=zero_centered_gamma, params_dtype=dtype, device="cpu")
    assert m.weight.dtype == dtype
    assert torch.equal(m.weight, torch.full((SIZE,), 0.0 if zero_centered_gamma else 1.0, dtype=dtype))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(generator=generator)
    x = (torch.randn(3, 5, SIZE, generator=generator, dtype=torch.float64) * 4 + 2).to(dtype)
    x[0, 0] = 0.0
    x.requires_grad_()
    dy = torch.randn(x.shape, generator=generator).to(dtype)
    out = m(x)
    out.backward(dy)
    assert len(fuser_nodes(out)) == 1 and out.grad_fn is fuser_nodes(out)[0]
    x64, w64, b64 = leaf64(x), leaf64(m.weight), leaf64(m.bias)
    ref = norm64(x64, w64, b64, 1e-3, name, zero_centered_gamma)
    ref.backward(dy.double())
    rtol = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert_close64("out", out, ref, rtol)
    for label, got, expect in zip(["dx", "dweight", "dbias"], grads_of(x, m.weight, m.bias), grads_of(x64, w64, b64)):
        if expect is not None:
            assert_close64(label, got, expect, rtol)


def test_te_constructor_and_attributes():
    ln = te_fuser.LayerNorm(SIZE, 1e-6, sequence_parallel=True, device="cpu")
    assert [n for n, _ in ln.named_parameters()] == ["weight", "bias"]
    assert ln.weight.sequence_parallel is True and ln.bias.sequence_parallel is True
    assert ln.eps == 1e-6 and ln.normalized_shape == (SIZE,)
    rms = te_fuser.RMSNorm((SIZE,), device="cpu", dtype=torch.bfloat16)
    assert [n for n, _ in rms.named_parameters()] == ["weight"] and rms.weight.dtype == torch.bfloat16
    assert not hasattr(rms.weight, "sequence_parallel")  # None: TE leaves the attribute unset
    x = torch.randn(4, SIZE)
    # Outside fp8_autocast or inside it, a standalone norm returns high precision.
    with te_fuser.fp8_autocast():
        assert ln(x).dtype == torch.float32
    torch.testing.assert_close(ln(x), torch.nn.functional.layer_norm(x, (SIZE,), eps=1e-6))
    assert ln.get_extra_state().numel() == 0  # no FP8 quantizers: TE's empty state
    # Megatron's TENorm passes TE's older keyword hidden_size instead of normalized_shape.
    by_old_name = te_fuser.RMSNorm(hidden_size=SIZE, eps=1e-6, device="cpu")
    assert by_old_name.normalized_shape == (SIZE,) and by_old_name.eps == 1e-6


@pytest.mark.parametrize("name", list(NORMS))
def test_nothing_on_ctx_after_backward(name, monkeypatch):
    m = NORMS[name](SIZE, device="cpu")
    ctx_walk_check(m, lambda: torch.randn(64, SIZE, requires_grad=True), None, monkeypatch)
    # Saved besides the input (which the caller holds anyway): rstd, a float32 per row.
    retained_bytes_check(m, lambda: torch.randn(64, SIZE, requires_grad=True), None, monkeypatch,
                         min_leak=64 * 4)


def test_meta_init_then_reset_parameters():
    m = te_fuser.LayerNorm(SIZE, device="meta", zero_centered_gamma=True, sequence_parallel=False)
    assert m.weight.device.type == "meta"
    m.reset_parameters()
    assert m.weight.device.type == "cpu" and torch.equal(m.weight, torch.zeros(SIZE))
    assert m.weight.sequence_parallel is False
    assert m(torch.randn(2, SIZE)).shape == (2, SIZE)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="last dimension only"):
        te_fuser.LayerNorm((4, 8), device="cpu")
    with pytest.raises(ValueError, match="params_dtype or dtype"):
        te_fuser.RMSNorm(8, params_dtype=torch.float32, dtype=torch.float32, device="cpu")
    with pytest.raises(NotImplementedError, match="sm_margin"):
        te_fuser.RMSNorm(8, sm_margin=4, device="cpu")
    with pytest.raises(ValueError, match="eps"):
        te_fuser.LayerNorm(8, eps=-1.0, device="cpu")
    with pytest.raises(TypeError, match="normalized_shape or hidden_size"):
        te_fuser.LayerNorm(8, hidden_size=8, device="cpu")
    with pytest.raises(TypeError, match="normalized_shape or hidden_size"):
        te_fuser.RMSNorm(device="cpu")
    m = te_fuser.RMSNorm(8, device="cpu")
    with pytest.raises(ValueError, match="last dimension must be 8"):
        m(torch.randn(2, 7))
    with pytest.raises(TypeError, match="torch.Tensor"):
        m([0.0] * 8)
