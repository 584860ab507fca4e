"""Dense 16/32-bit CPU attention routed to torch's CPU flash attention (te_fuser.kernels.attention,
ROUTE_TO_TORCH_CPU_FLASH): the same float64-reference and layout tests as te_fuser's own kernels, and
which problems take the route."""

import pytest
import torch

from te_fuser.kernels import attention as attn_kernels
from te_fuser.kernels import cpu as cpu_kernels

# Collected here again, run with the route on (test_attention.py's own fixture turns it off there).
import test_attention as _own_kernel_tests  # noqa: E402

cpu_isa = _own_kernel_tests.cpu_isa
test_batched_formats_and_masks = _own_kernel_tests.test_batched_formats_and_masks
test_edge_values_and_fully_masked_rows = _own_kernel_tests.test_edge_values_and_fully_masked_rows
test_half_dtypes = _own_kernel_tests.test_half_dtypes
test_head_dims_and_lengths = _own_kernel_tests.test_head_dims_and_lengths
test_lse_matches_logsumexp = _own_kernel_tests.test_lse_matches_logsumexp
test_outputs_follow_the_input_dim_order_like_the_fake_kernels = (
    _own_kernel_tests.test_outputs_follow_the_input_dim_order_like_the_fake_kernels)
test_strided_qkv_views_need_no_copy = _own_kernel_tests.test_strided_qkv_views_need_no_copy



@pytest.fixture(autouse=True)
def te_fuser_cpu_kernels(monkeypatch):
    """Overrides test_attention.py's fixture of that name: the route is on, for every CPU tier (in use it
    is taken on ROUTED_ISAS only), so these tests run on any CPU."""
    monkeypatch.setattr(attn_kernels, "ROUTE_TO_TORCH_CPU_FLASH", True)
    monkeypatch.setattr(attn_kernels, "ROUTED_ISAS", cpu_kernels.TIERS)


class _NoKernels:
    """Stands in for torch.ops.te_fuser: any call of te_fuser's attention kernels fails."""

    def __getattr__(self, name):
        raise AssertionError(f"te_fuser's kernel {name} was called")


def _gpt_qkv(dtype, generator):
    """q, k, v as gpt.py makes them: views of one [s, b, heads, (q k v), d] projection, in kernel layout."""
    qkv = torch.randn(40, 2, 4, 3, 16, generator=generator).to(dtype)
    return tuple(qkv[:, :, :, i].permute(1, 0, 2, 3) for i in range(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_routed_problems_match_te_fuser_kernels_without_calling_them(dtype, causal, generator, monkeypatch):
    q, k, v = _gpt_qkv(dtype, generator)
    dout = torch.randn(q.shape, generator=generator).to(dtype)
    monkeypatch.setattr(attn_kernels, "ROUTE_TO_TORCH_CPU_FLASH", False)
    expected = attn_kernels.attention_fwd(q, k, v, causal=causal, softmax_scale=0.3)
    expected_grads = attn_kernels.attention_bwd(dout, q, k, v, *expected, causal=causal, softmax_scale=0.3)
    monkeypatch.setattr(attn_kernels, "ROUTE_TO_TORCH_CPU_FLASH", True)
    monkeypatch.setattr(attn_kernels, "_ops", _NoKernels())
    out, lse = attn_kernels.attention_fwd(q, k, v, causal=causal, softmax_scale=0.3)
    grads = attn_kernels.attention_bwd(dout, q, k, v, out, lse, causal=causal, softmax_scale=0.3)
    # Both round once to dtype from float32: at most one unit in the last place of dtype apart.
    atol = {torch.float32: 2e-6, torch.bfloat16: 2e-2}[dtype]
    for name, actual, wanted in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (*expected, *expected_grads)):
        assert actual.dtype == wanted.dtype and actual.stride() == wanted.stride(), name
        torch.testing.assert_close(actual.float(), wanted.float(), atol=atol, rtol=1e-2, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("case", ["dropout", "seqlens", "gqa", "causal_cross", "fp8", "route_off", "unrouted_isa"])
def test_other_problems_keep_te_fuser_kernels(case, generator, monkeypatch):
    """Dropout (te_fuser's RNG), padding, grouped heads, causal cross-attention (the route is kept to the
    self-attention lengths it was measured on) and FP8 keep te_fuser's kernels; so does everything with
    the route off or on a CPU tier outside ROUTED_ISAS (AVX-512 and AMX CPUs)."""
    q, k, v = _gpt_qkv(torch.float32, generator)
    kwargs = {}
    if case == "dropout":
        kwargs = dict(dropout_p=0.1)
    elif case == "seqlens":
        kwargs = dict(seqlens_q=torch.tensor([40, 30], dtype=torch.int32),
                      seqlens_kv=torch.tensor([40, 30], dtype=torch.int32))
    elif case == "gqa":
        k, v = k[:, :, :2], v[:, :, :2]
    elif case == "causal_cross":
        k, v, kwargs = k[:, :30], v[:, :30], dict(causal=True)
    elif case == "fp8":
        one = torch.ones(1)
        q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
        kwargs = dict(q_descale=one, k_descale=one, v_descale=one)
    elif case == "unrouted_isa":
        monkeypatch.setattr(attn_kernels, "ROUTED_ISAS", tuple(t for t in cpu_kernels.TIERS
                                                                if t != cpu_kernels.current_isa()))
    else:
        monkeypatch.setattr(attn_kernels, "ROUTE_TO_TORCH_CPU_FLASH", False)
    monkeypatch.setattr(attn_kernels, "_ops", _NoKernels())
    with pytest.raises(AssertionError, match="attention_fwd was called"):
        attn_kernels.attention_fwd(q, k, v, **kwargs)
