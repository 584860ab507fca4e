"""te_fuser.kernels.attention_math: the CUDA problems te_fuser's CUDA kernels do not cover (float32, other
head dims) run torch's math with the kernels' semantics. Its functions take any device, so they are checked
here on the CPU against float64 SDPA per sequence (tests/attention_reference.py), with gradients from
autograd; on a GPU, DotProductAttention must take this path for float32 and odd head dims."""

import pytest
import torch

import te_fuser
from te_fuser.kernels import attention as attn_kernels
from te_fuser.kernels import attention_math

from attention_reference import attention as reference_attention, segments

CUDA = pytest.mark.skipif(not (torch.cuda.is_available() and te_fuser._extension.has_cuda_kernels()),
                          reason="needs CUDA and te_fuser's CUDA kernels")


def _lengths(case, batch, seq_q, seq_kv, generator):
    """(cu_q, cu_kv, lens_q, lens_kv) of a dense, padded or packed problem, with empty sequences and a tail."""
    if case == "padded":
        lens_q = torch.randint(0, seq_q + 1, (batch,), generator=generator, dtype=torch.int32)
        lens_kv = torch.randint(0, seq_kv + 1, (batch,), generator=generator, dtype=torch.int32)
        lens_q[0], lens_kv[-1] = seq_q, 0  # one full query range, one sequence without keys
        return None, None, lens_q, lens_kv
    if case == "packed":
        cu_q = torch.tensor([0, 5, 5, 17, seq_q - 3], dtype=torch.int32)  # an empty sequence and 3 tail tokens
        cu_kv = torch.tensor([0, 7, 9, 9, seq_kv], dtype=torch.int32)  # a sequence without keys
        return cu_q, cu_kv, None, None
    return None, None, None, None


def _reference(q, k, v, dout, lens, causal, scale):
    """Float64 (out, lse, dq, dk, dv) of kernel-layout inputs through SDPA per sequence."""
    cu_q, cu_kv, lens_q, lens_kv = lens
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    segs = segments(q.shape[0], q.shape[1], k.shape[1], lens_q, lens_kv, cu_q, cu_kv)
    out = reference_attention(*leaves, segs, causal, scale)
    grads = torch.autograd.grad(out, leaves, dout.double())
    group = q.shape[2] // k.shape[2]
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=torch.float64)
    for b, q0, lq, k0, lkv in segs:
        if lq and lkv:
            s = torch.einsum("qhd,khd->hqk", leaves[0][b, q0:q0 + lq].detach(),
                             leaves[1][b, k0:k0 + lkv].detach().repeat_interleave(group, dim=1)) * scale
            if causal:
                s = s.masked_fill(~torch.ones(lq, lkv, dtype=torch.bool).tril(), float("-inf"))
            lse[b, :, q0:q0 + lq] = torch.logsumexp(s, dim=-1)
    return out.detach(), (lse[0] if cu_q is not None else lse), grads


@pytest.mark.parametrize("case", ["dense", "padded", "packed"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 4, 16), (6, 2, 40)])
def test_math_path_against_float64_sdpa(case, causal, heads, kv_heads, dim, generator):
    batch, seq_q, seq_kv = (1, 30, 26) if case == "packed" else (3, 19, 23)
    q = torch.randn(batch, seq_q, heads, dim, generator=generator)
    k = torch.randn(batch, seq_kv, kv_heads, dim, generator=generator)
    v = torch.randn(batch, seq_kv, kv_heads, dim, generator=generator)
    dout = torch.randn(batch, seq_q, heads, dim, generator=generator)
    lens = _lengths(case, batch, seq_q, seq_kv, generator)
    scale = 0.3
    out, lse = attention_math.attention_fwd(q, k, v, *lens, scale, causal, (None, None, None))
    grads = attention_math.attention_bwd(dout, q, k, v, out, lse, *lens, scale, causal, (None, None, None))
    r_out, r_lse, r_grads = _reference(q, k, v, dout, lens, causal, scale)
    torch.testing.assert_close(out.double(), r_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), r_lse, atol=1e-5, rtol=1e-5)  # -inf where a row sees no key
    for name, g, r in zip(("dq", "dk", "dv"), grads, r_grads):
        torch.testing.assert_close(g.double(), r, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_math_path_decodes_fp8_with_its_descales(generator):
    values = [torch.randn(2, 11, 2, 24, generator=generator) for _ in range(3)]
    descales = [torch.tensor([d]) for d in (0.02, 0.05, 0.01)]
    fp8 = [(t / d).to(torch.float8_e4m3fn) for t, d in zip(values, descales)]
    decoded = [f.float() * d for f, d in zip(fp8, descales)]  # torch's own decode
    lens = (None, None, None, None)
    out, lse = attention_math.attention_fwd(*fp8, *lens, 0.2, True, descales)
    expected, expected_lse = attention_math.attention_fwd(*decoded, *lens, 0.2, True, (None, None, None))
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    torch.testing.assert_close(lse, expected_lse, atol=0, rtol=0)


def test_only_cuda_problems_outside_the_kernels_take_the_math_path():
    assert not attention_math.applies(torch.empty(1, 4, 2, 48))  # the CPU kernels take every head dim
    if not torch.cuda.is_available():
        return
    for dtype, dim, expected in ((torch.float32, 64, True), (torch.bfloat16, 16, True), (torch.bfloat16, 64, False),
                                 (torch.float16, 128, False), (torch.float8_e4m3fn, 80, True)):
        q = torch.empty(1, 4, 2, dim, dtype=dtype, device="cuda")
        assert attention_math.applies(q) == expected, (dtype, dim)


@CUDA
@pytest.mark.parametrize("dtype, dim", [(torch.float32, 64), (torch.bfloat16, 16), (torch.float16, 80)])
def test_cuda_dot_product_attention_outside_the_kernels(dtype, dim, generator):
    """What TE runs on its unfused path (float32, odd head dims) runs on CUDA through the math path."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
    heads, seq, batch = 4, 37, 2
    q, k, v = (torch.randn(seq, batch, heads, dim, device="cuda").to(dtype).requires_grad_() for _ in range(3))
    module = te_fuser.DotProductAttention(heads, dim, qkv_format="sbhd", attn_mask_type="causal")
    out = module(q, k, v)
    dout = torch.randn_like(out)
    out.backward(dout)
    leaves = [t.detach().cpu().double().transpose(0, 1).requires_grad_() for t in (q, k, v)]  # bshd
    ref = reference_attention(*leaves, segments(batch, seq, seq), True, dim ** -0.5)
    grads = torch.autograd.grad(ref, leaves, dout.detach().cpu().double().view(seq, batch, heads, dim).transpose(0, 1))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.detach().cpu().double().view(seq, batch, heads, dim).transpose(0, 1), ref.detach(),
                               atol=tol, rtol=tol)
    for t, g in zip((q, k, v), grads):
        torch.testing.assert_close(t.grad.cpu().double().transpose(0, 1), g, atol=5 * tol, rtol=5 * tol)


@CUDA
def test_cuda_dropout_outside_the_kernels_is_refused_clearly():
    q = torch.randn(2, 8, 2, 64, device="cuda")
    with pytest.raises(NotImplementedError, match="attention dropout on CUDA needs te_fuser's CUDA kernels"):
        attn_kernels.attention_fwd(q, q, q, dropout_p=0.1)
