"""te_fuser.DotProductAttention and the attention kernels against float64 torch SDPA."""

import contextlib
import math

import pytest
import torch

import te_fuser
from te_fuser.attention.backends import ENV_BACKEND, clear_cache
from te_fuser.attention.function import from_kernel_layout, to_kernel_layout
from te_fuser.kernels import attention as attn_kernels
from te_fuser.kernels import cpu as cpu_kernels

from attention_reference import attention as reference_attention
from attention_reference import segments
from _no_grad_path import run_with_and_without_grad

# The CPU paths the 16-bit and FP8 tests run on: the portable build and the best this CPU has (AMX tiles for
# bf16/FP8 q/k/v where it has AMX, else its widest vectors), selected with the ISA cap.
ISA_PATHS = sorted({"portable", cpu_kernels.detected_isa()}, key=cpu_kernels.TIERS.index)


@pytest.fixture(autouse=True)
def te_fuser_cpu_kernels(monkeypatch):
    """These tests are of te_fuser's own kernels: DotProductAttention runs them, whatever the selection
    table prefers on this CPU (attention_fwd / attention_bwd always do; tests/test_attention_backends.py
    tests the other backends)."""
    monkeypatch.setenv(ENV_BACKEND, "te_fuser")
    clear_cache()  # the selection reads the environment once per kind of problem
    yield
    monkeypatch.undo()
    clear_cache()


@pytest.fixture(params=ISA_PATHS)
def cpu_isa(request):
    with cpu_kernels.isa(request.param):
        yield request.param


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and te_fuser._extension.has_cuda_kernels() else [])

# (forward atol, grad atol, relative) per input dtype; outputs and grads are O(1).
TOLERANCES = {
    torch.float32: (2e-5, 1e-4, 1e-4),
    torch.bfloat16: (2e-2, 6e-2, 2e-2),
    torch.float16: (3e-3, 1e-2, 3e-3),
}


def make_inputs(fmt, batch, seq_q, seq_kv, heads, kv_heads, dim, dtype, device="cpu", requires_grad=True):
    def one(seq, h):
        shape = {"sbhd": (seq, batch, h, dim), "bshd": (batch, seq, h, dim), "thd": (seq, h, dim)}[fmt]
        return torch.randn(shape, dtype=torch.float32, device=device).to(dtype).requires_grad_(requires_grad)

    return one(seq_q, heads), one(seq_kv, kv_heads), one(seq_kv, kv_heads)


def reference(q, k, v, fmt, causal, scale, lens_q=None, lens_kv=None, cu_q=None, cu_kv=None, dout=None):
    """Float64 output (user layout, heads not merged) and the grads of sum(out * dout)."""
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    kq, kk, kv_ = (to_kernel_layout(t, fmt) for t in leaves)
    segs = segments(kq.shape[0], kq.shape[1], kk.shape[1], lens_q, lens_kv, cu_q, cu_kv)
    out = from_kernel_layout(reference_attention(kq, kk, kv_, segs, causal, scale), fmt)
    grads = torch.autograd.grad(out, leaves, dout.detach().cpu().double()) if dout is not None else None
    return out.detach(), grads


def reference_lse(q, k, scale, causal):
    """Float64 log-sum-exp of the scores, [b, h, s_q], for one bshd sequence per batch row of equal lengths."""
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool).tril(), float("-inf"))
    return torch.logsumexp(s, dim=-1)


def assert_close(actual, expected, atol, rtol, what):
    actual = actual.detach().cpu().double()
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def run_module(module, q, k, v, **kwargs):
    out = module(q, k, v, **kwargs)
    dout = torch.randn_like(out)
    out.backward(dout)
    return out, dout


def unmerge(out, heads):
    return out.reshape(*out.shape[:-1], heads, -1)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "padding", "padding_causal"])
def test_batched_formats_and_masks(fmt, mask_type):
    torch.manual_seed(1)
    batch, seq, heads, kv_heads, dim = 3, 37, 4, 2, 17
    q, k, v = make_inputs(fmt, batch, seq, seq, heads, kv_heads, dim, torch.float32)
    module = te_fuser.DotProductAttention(heads, dim, num_gqa_groups=kv_heads, qkv_format=fmt, attn_mask_type=mask_type)
    lens = torch.tensor([37, 20, 1], dtype=torch.int32)
    kwargs = {}
    if "padding" in mask_type:
        mask = torch.arange(seq)[None, :] >= lens[:, None]
        kwargs["attention_mask"] = mask.view(batch, 1, 1, seq)
    out, dout = run_module(module, q, k, v, **kwargs)
    padded = "padding" in mask_type
    ref, grads = reference(q, k, v, fmt, "causal" in mask_type, 1 / math.sqrt(dim),
                           lens if padded else None, lens if padded else None, dout=unmerge(dout, heads))
    atol, gatol, rtol = TOLERANCES[torch.float32]
    assert_close(unmerge(out, heads), ref, atol, rtol, "out")
    for name, t, g in zip("qkv", (q, k, v), grads):
        assert_close(t.grad, g, gatol, rtol, f"d{name}")


@pytest.mark.parametrize("mask_type", ["padding", "padding_causal"])
def test_thd_packed(mask_type):
    torch.manual_seed(2)
    heads, kv_heads, dim = 4, 1, 65
    cu_q = torch.tensor([0, 5, 5, 70, 71, 200], dtype=torch.int32)
    cu_kv = torch.tensor([0, 9, 12, 60, 61, 190], dtype=torch.int32)
    # A few tokens past the last sequence: they belong to none and must come out 0.
    q, k, v = make_inputs("thd", 1, 203, 190, heads, kv_heads, dim, torch.float32)
    module = te_fuser.DotProductAttention(heads, dim, num_gqa_groups=kv_heads, qkv_format="thd", attn_mask_type=mask_type)
    out, dout = run_module(module, q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    assert out.shape == (203, heads * dim)
    ref, grads = reference(q, k, v, "thd", "causal" in mask_type, 1 / math.sqrt(dim), cu_q=cu_q, cu_kv=cu_kv,
                           dout=unmerge(dout, heads))
    atol, gatol, rtol = TOLERANCES[torch.float32]
    assert_close(unmerge(out, heads), ref, atol, rtol, "out")
    assert torch.all(out[200:] == 0)
    for name, t, g in zip("qkv", (q, k, v), grads):
        assert_close(t.grad, g, gatol, rtol, f"d{name}")


@pytest.mark.parametrize("dim", [1, 17, 65, 100])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims_and_lengths(dim, causal):
    """Head dims off the vector width, cross-attention lengths off the tile sizes (tiles are 128 x 64)."""
    torch.manual_seed(3)
    q, k, v = make_inputs("bshd", 2, 131, 67, 2, 2, dim, torch.float32)
    module = te_fuser.DotProductAttention(2, dim, qkv_format="bshd", attn_mask_type="causal" if causal else "no_mask",
                                          attention_type="cross", softmax_scale=0.3)
    out, dout = run_module(module, q, k, v)
    ref, grads = reference(q, k, v, "bshd", causal, 0.3, dout=unmerge(dout, 2))
    atol, gatol, rtol = TOLERANCES[torch.float32]
    assert_close(unmerge(out, 2), ref, atol, rtol, "out")
    for name, t, g in zip("qkv", (q, k, v), grads):
        assert_close(t.grad, g, gatol, rtol, f"d{name}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask_type", ["causal", "padding_causal"])
def test_half_dtypes(dtype, mask_type, cpu_isa):
    torch.manual_seed(4)
    q, k, v = make_inputs("sbhd", 2, 70, 70, 4, 4, 32, dtype)
    lens = torch.tensor([70, 33], dtype=torch.int32)
    kwargs = {}
    if mask_type == "padding_causal":
        kwargs["attention_mask"] = (torch.arange(70)[None, :] >= lens[:, None]).view(2, 1, 1, 70)
    module = te_fuser.DotProductAttention(4, 32, qkv_format="sbhd", attn_mask_type=mask_type)
    out, dout = run_module(module, q, k, v, **kwargs)
    assert out.dtype == dtype and q.grad.dtype == dtype
    padded = mask_type == "padding_causal"
    ref, grads = reference(q, k, v, "sbhd", True, 1 / math.sqrt(32), lens if padded else None,
                           lens if padded else None, dout=unmerge(dout, 4))
    atol, gatol, rtol = TOLERANCES[dtype]
    assert_close(unmerge(out, 4), ref, atol, rtol, "out")
    for name, t, g in zip("qkv", (q, k, v), grads):
        assert_close(t.grad, g, gatol, rtol, f"d{name}")


@pytest.mark.parametrize("threads", [1, 4])
def test_mqa_backward_both_thread_splits(threads, cpu_isa):
    """One (sequence, kv head) unit: 1 thread runs the fused backward, 4 threads the two-pass split."""
    torch.manual_seed(13)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k, v = make_inputs("bshd", 1, 150, 140, 4, 1, 24, torch.bfloat16)
        lens_q, lens_kv = torch.tensor([147], dtype=torch.int32), torch.tensor([133], dtype=torch.int32)
        out, lse = attn_kernels.attention_fwd(q.detach(), k.detach(), v.detach(), seqlens_q=lens_q,
                                              seqlens_kv=lens_kv, causal=True)
        dout = torch.randn_like(out)
        grads = attn_kernels.attention_bwd(dout, q.detach(), k.detach(), v.detach(), out, lse, seqlens_q=lens_q,
                                           seqlens_kv=lens_kv, causal=True)
    finally:
        torch.set_num_threads(previous)
    _, ref = reference(q, k, v, "bshd", True, 1 / math.sqrt(24), lens_q, lens_kv, dout=dout)
    atol, gatol, rtol = TOLERANCES[torch.bfloat16]
    for name, g, r in zip("qkv", grads, ref):
        assert_close(g, r, gatol, rtol, f"d{name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("threads", [1, 3])
def test_forward_over_several_query_tiles(dtype, causal, threads, cpu_isa):
    """Sequences of several 128-row query tiles with padding and GQA, split over threads in different ways
    (the CPU forward computes two consecutive tiles of a head together when one call holds both)."""
    torch.manual_seed(17)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # 5 query tiles per head: one thread takes 2 units at a time (40 units), so some blocks pair two
        # tiles of a head and some do not, as a head's last tile would pair with the next head's first.
        q, k, v = make_inputs("bshd", 2, 600, 300, 4, 2, 72, dtype, requires_grad=False)
        lens_q, lens_kv = torch.tensor([600, 270], dtype=torch.int32), torch.tensor([300, 203], dtype=torch.int32)
        out, lse = attn_kernels.attention_fwd(q, k, v, seqlens_q=lens_q, seqlens_kv=lens_kv, causal=causal,
                                              softmax_scale=0.2)
    finally:
        torch.set_num_threads(previous)
    ref, _ = reference(q, k, v, "bshd", causal, 0.2, lens_q, lens_kv)
    atol, _, rtol = TOLERANCES[dtype]
    assert_close(out, ref, atol, rtol, "out")
    assert torch.all(lse[1, :, 270:] == float("-inf")) and torch.isfinite(lse[1, :, :270]).all()


@pytest.mark.skipif("avx512_bf16" not in cpu_kernels.available_isa(), reason="this CPU has no avx512_bf16 tier")
@pytest.mark.parametrize("dim", [17, 40, 72])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("threads", [1, 8])
def test_vector_path_with_bf16_products(dim, causal, threads):
    """The vector path's bf16 products (vdpbf16ps, the avx512_bf16 tier; also on an AMX CPU under that cap):
    GQA, ragged lengths that are no multiple of the tiles, head dims that are no multiple of 32 (odd: a padded
    pair). 1 thread runs the fused backward, 8 the two-pass split. Against float64 SDPA with the bf16
    tolerances, and against the float32-product path (the avx512 tier): P (and dS) are rounded to bf16 (relative
    2^-9, to nearest even) before their products, so out moves by at most 2^-9 sum_j p_j |v_j| / l <= 2^-9 max|v|,
    and each out is rounded to bf16 (2^-9 of |out|) on both paths; the gradients move by about 2^-8 of their
    largest magnitude (checked at twice that)."""
    torch.manual_seed(29)
    q, k, v = make_inputs("bshd", 2, 203, 150, 4, 2, dim, torch.bfloat16, requires_grad=False)
    lens_q, lens_kv = torch.tensor([203, 137], dtype=torch.int32), torch.tensor([150, 91], dtype=torch.int32)
    kwargs = dict(seqlens_q=lens_q, seqlens_kv=lens_kv, causal=causal)
    dout = torch.randn(q.shape).to(torch.bfloat16)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = {}
        for isa in ("avx512_bf16", "avx512"):
            with cpu_kernels.isa(isa):
                out, lse = attn_kernels.attention_fwd(q, k, v, **kwargs)
                results[isa] = (out, attn_kernels.attention_bwd(dout, q, k, v, out, lse, **kwargs))
    finally:
        torch.set_num_threads(previous)
    ref, ref_grads = reference(q, k, v, "bshd", causal, 1 / math.sqrt(dim), lens_q, lens_kv, dout=dout)
    atol, gatol, rtol = TOLERANCES[torch.bfloat16]
    out, grads = results["avx512_bf16"]
    out32, grads32 = results["avx512"]
    assert_close(out, ref, atol, rtol, "out")
    assert_close(out, out32.double(), 2**-9 * v.abs().max().item(), 2**-8, "out vs float32 products")
    for name, g, g32, r in zip("qkv", grads, grads32, ref_grads):
        assert_close(g, r, gatol, rtol, f"d{name}")
        assert_close(g, g32.double(), 2**-7 * r.abs().max().item(), 0, f"d{name} vs float32 products")


def test_edge_values_and_fully_masked_rows():
    """Large scores (no overflow in exp), zero-length kv sequences (output 0, no NaN, zero grads)."""
    torch.manual_seed(5)
    q, k, v = make_inputs("bshd", 2, 20, 20, 1, 1, 8, torch.float32, requires_grad=False)
    q = (q * 30).requires_grad_()
    k = k.requires_grad_()
    v = v.requires_grad_()
    lens_q = torch.tensor([20, 12], dtype=torch.int32)
    lens_kv = torch.tensor([20, 0], dtype=torch.int32)
    out, lse = attn_kernels.attention_fwd(q.detach(), k.detach(), v.detach(), seqlens_q=lens_q, seqlens_kv=lens_kv,
                                          causal=True)
    assert torch.isfinite(out).all()
    assert torch.all(out[1] == 0) and torch.all(lse[1] == float("-inf"))
    dout = torch.randn_like(out)
    dq, dk, dv = attn_kernels.attention_bwd(dout, q.detach(), k.detach(), v.detach(), out, lse, seqlens_q=lens_q,
                                            seqlens_kv=lens_kv, causal=True)
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all() and torch.all(g[1] == 0)
    ref, grads = reference(q, k, v, "bshd", True, 1 / math.sqrt(8), lens_q, lens_kv, dout=dout)
    assert_close(out, ref, 2e-5, 1e-4, "out")
    for name, g, r in zip("qkv", (dq, dk, dv), grads):
        assert_close(g, r, 2e-3, 1e-4, f"d{name}")


@pytest.mark.parametrize("growth", [0.02, 0.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_that_grow_along_the_keys(growth, dtype, cpu_isa):
    """Keys whose scores grow along the sequence, over several 64-key tiles: the forward keeps each query's
    running max until a later tile beats it by more than its headroom (2^8), then rescales. A growth of 0.02 per
    key stays within that headroom from tile to tile; 0.3 per key passes it in every tile (scores reach ~500)."""
    torch.manual_seed(23)
    q, k, v = make_inputs("bshd", 1, 300, 300, 2, 2, 32, dtype, requires_grad=False)
    direction = torch.randn(32)
    direction = direction / direction.norm()
    q = (q.float() * 0.2 + direction * 3).to(dtype)
    k = (k.float() * 0.2 + direction * (growth * torch.arange(300.0)).view(1, 300, 1, 1)).to(dtype)
    for causal in (False, True):
        out, lse = attn_kernels.attention_fwd(q, k, v, causal=causal, softmax_scale=1.0)
        ref, _ = reference(q, k, v, "bshd", causal, 1.0)
        # Scores reach ~270 with the fast growth: float32 rounds them by ~1e-5, which the outputs inherit.
        atol, _, rtol = TOLERANCES[dtype] if dtype != torch.float32 else (3e-4, 0, 1e-4)
        assert_close(out, ref, atol, rtol, f"out causal={causal}")
        torch.testing.assert_close(lse.double(), reference_lse(q, k, 1.0, causal), atol=1e-4, rtol=1e-5)


def test_nan_in_a_late_key_reaches_the_queries_that_see_it(cpu_isa):
    """A NaN key in the third key tile makes NaN the output rows and the dq rows that attend to it (it is not
    skipped as a zero probability), and leaves the earlier output rows of a causal problem finite."""
    torch.manual_seed(24)
    q, k, v = make_inputs("bshd", 1, 200, 200, 1, 1, 16, torch.float32, requires_grad=False)
    k[0, 150, 0, 3] = float("nan")
    out, lse = attn_kernels.attention_fwd(q, k, v, causal=True)
    assert torch.isfinite(out[0, :150]).all()
    assert torch.isnan(out[0, 150:]).all()
    # Earlier rows of dq may be NaN too (0 * NaN in the dq product, as in SDPA's math backward).
    dq, _, _ = attn_kernels.attention_bwd(torch.randn_like(out), q, k, v, out, lse, causal=True)
    assert torch.isnan(dq[0, 150:]).all()


def test_lse_matches_logsumexp():
    torch.manual_seed(6)
    q, k, v = make_inputs("bshd", 1, 90, 90, 2, 2, 16, torch.float32, requires_grad=False)
    _, lse = attn_kernels.attention_fwd(q, k, v, causal=True, softmax_scale=0.5)
    torch.testing.assert_close(lse.double(), reference_lse(q, k, 0.5, True), atol=1e-5, rtol=1e-6)


def test_strided_qkv_views_need_no_copy():
    """q, k, v sliced out of one fused projection (non-dense views) give the same result as copies."""
    torch.manual_seed(7)
    qkv = torch.randn(50, 2, 3, 4, 16)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    module = te_fuser.DotProductAttention(4, 16, qkv_format="sbhd")
    out = module(q, k, v)
    expected = module(q.contiguous(), k.contiguous(), v.contiguous())
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("shape, perm", [((2, 5, 3, 8), (0, 1, 2, 3)), ((5, 2, 3, 8), (1, 0, 2, 3)),
                                         ((5, 1, 3, 8), (1, 0, 2, 3)), ((3, 1, 1, 8), (2, 1, 0, 3))])
def test_outputs_follow_the_input_dim_order_like_the_fake_kernels(shape, perm):
    """out/dq/dk/dv keep q/k/v's dim order (an sbhd view gives sbhd-dense results), with the fake kernels' strides."""
    q = torch.randn(shape).permute(perm)
    out, lse = attn_kernels.attention_fwd(q, q, q)
    grads = attn_kernels.attention_bwd(torch.ones_like(out), q, q, q, out, lse)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fq = mode.from_tensor(q)
        f_out, f_lse = torch.ops.te_fuser.attention_fwd(fq, fq, fq, None, None, None, None, 0.3, False, 0.0, 0, 0,
                                                         None, None, None, None)
        f_grads = torch.ops.te_fuser.attention_bwd(f_out, fq, fq, fq, f_out, f_lse, None, None, None, None, 0.3,
                                                   False, 0.0, 0, 0, None, None, None)
    assert out.stride() == f_out.stride() and lse.shape == f_lse.shape
    assert all(g.stride() == f.stride() for g, f in zip(grads, f_grads))
    order = sorted(range(3), key=lambda d: -q.stride(d))
    assert out.permute(*order, 3).is_contiguous()


# FP8 --------------------------------------------------------------------------------------------------------------

def quantize_e4m3(t):
    amax = t.abs().max().float().clamp(min=1e-12)
    scale = 448.0 / amax
    data = (t.float() * scale).to(torch.float8_e4m3fn)
    return data, (1.0 / scale).reshape(1).float()


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_kernels_against_dequantized_reference(causal, cpu_isa):
    torch.manual_seed(8)
    q, k, v = make_inputs("bshd", 2, 75, 75, 4, 2, 32, torch.float32, requires_grad=False)
    (q8, qs), (k8, ks), (v8, vs) = (quantize_e4m3(t) for t in (q, k, v))
    lens = torch.tensor([75, 40], dtype=torch.int32)
    out, lse = attn_kernels.attention_fwd(q8, k8, v8, seqlens_q=lens, seqlens_kv=lens, causal=causal, q_descale=qs,
                                          k_descale=ks, v_descale=vs, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    deq = [d.double() * s.double() for d, s in ((q8, qs), (k8, ks), (v8, vs))]
    dout = torch.randn(out.shape).to(torch.bfloat16)
    ref, grads = reference(*deq, "bshd", causal, 1 / math.sqrt(32), lens, lens, dout=dout)
    assert_close(out, ref, 2e-2, 2e-2, "fp8 out")
    dq, dk, dv = attn_kernels.attention_bwd(dout, q8, k8, v8, out, lse, seqlens_q=lens, seqlens_kv=lens,
                                            causal=causal, q_descale=qs, k_descale=ks, v_descale=vs)
    assert dq.dtype == torch.bfloat16 and dq.shape == q.shape
    for name, g, r in zip("qkv", (dq, dk, dv), grads):
        assert_close(g, r, 6e-2, 2e-2, f"fp8 d{name}")


def test_cpu_decodes_fp8_inside_the_kernel():
    """The CPU path never reports FP8 tensor cores (the CUDA side is checked in test_attention_cuda.py)."""
    assert te_fuser.kernels.attention.fp8_tensor_cores("cpu") is False


def _saved_e4m3(out):
    """out as the FP8 backward reads it back: E4M3 with a current scale, through torch's own cast. The scale is
    448 / amax correctly rounded to float32, as a CUDA float division gives it (torch's CPU division of a
    tensor may be off by an ulp, which moves values that land on a rounding tie)."""
    out = out.detach().float()
    scale = torch.tensor(448.0 / out.abs().amax().item(), dtype=torch.float32)
    return (out * scale).to(torch.float8_e4m3fn).double() / scale.double()


def _grads_with_saved_out(q, k, v, dout, saved_out, scale, causal=True):
    """Float64 attention gradients ([b, h, s, d] operands) whose D = rowsum(dout * out) is taken from
    saved_out, as an attention backward that saves its output in FP8 computes them."""
    visible = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool)
    visible = visible.tril() if causal else visible
    p = torch.softmax((q @ k.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf")), dim=-1)
    ds = p * (dout @ v.transpose(-1, -2) - (dout * saved_out).sum(-1, keepdim=True))
    return ds @ k * scale, ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ dout


def test_fp8_dpa_module(cpu_isa, generator):
    """With fp8_dpa, the module's output and grads match float64 math on the FP8-dequantized inputs and, for
    D = rowsum(dout * out) in dq and dk, on the E4M3 output the backward saves (its 2^-4 rounding would
    otherwise dominate the comparison)."""
    q, k, v = (torch.randn(40, 2, 2, 16, generator=generator).bfloat16().requires_grad_() for _ in range(3))
    module = te_fuser.DotProductAttention(2, 16, qkv_format="sbhd", attn_mask_type="causal")
    recipe = te_fuser.recipe.Float8CurrentScaling(fp8_dpa=True)
    with te_fuser.fp8_autocast(fp8_recipe=recipe):
        out = module(q, k, v)
    dout = torch.randn(out.shape, generator=generator).bfloat16()
    out.backward(dout)
    deq = []
    for t in (q, k, v):
        quantized = te_fuser.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)(t.detach())
        deq.append(quantized.dequantize(torch.float32).double())
    ref, _ = reference(*deq, "sbhd", True, 0.25)
    assert_close(unmerge(out, 2), ref, 2e-2, 2e-2, "fp8 out")
    heads_first = lambda t: t.double().reshape(40, 2, 2, 16).permute(1, 2, 0, 3)  # noqa: E731 (sbhd -> bhsd)
    grads = _grads_with_saved_out(*(heads_first(t) for t in deq), heads_first(dout), heads_first(_saved_e4m3(out)),
                                  0.25)
    for name, t, g in zip("qkv", (q, k, v), grads):
        assert_close(heads_first(t.grad), g, 2e-2, 2e-2, f"fp8 d{name}")
    # Without fp8_dpa the module runs in high precision: the results differ from the FP8 ones.
    plain = module(q.detach(), k.detach(), v.detach())
    assert not torch.equal(plain, out.detach())


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_dpa_grads_with_the_output_saved_in_fp8(causal):
    """q, k, v and out are saved in FP8; the backward matches float64 math on the dequantized inputs and the E4M3
    output it saved, at head_dim 64, 128 tokens."""
    torch.manual_seed(11)
    q, k, v = make_inputs("bshd", 2, 128, 128, 4, 4, 64, torch.bfloat16)
    with torch.no_grad():
        v[0, 0, 0, :4] = torch.tensor([0.0, -3.5, 1e-3, 6.0])  # zero, a large and a tiny value
    module = te_fuser.DotProductAttention(4, 64, qkv_format="bshd",
                                          attn_mask_type="causal" if causal else "no_mask")
    with te_fuser.fp8_autocast(fp8_recipe=te_fuser.recipe.Float8CurrentScaling(fp8_dpa=True)):
        out = module(q, k, v)
    node = out.grad_fn.next_functions[0][0]
    # The four saved 4-D tensors are FP8 bytes (uint8, TE's layout) of E4M3 tensors: no 16-bit copy.
    assert [t.dtype for t in node.saved_tensors if t is not None and t.dim() == 4] == [torch.uint8] * 4
    assert {shell.fp8_dtype for shell in node.tensor_objects if shell is not None} == {torch.float8_e4m3fn}
    dout = torch.randn_like(out)
    out.backward(dout)
    deq = [te_fuser.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)(t.detach()).dequantize(torch.float32).double()
           for t in (q, k, v)]
    ref, _ = reference(*deq, "bshd", causal, 0.125)
    assert_close(unmerge(out, 4), ref, 2e-2, 2e-2, "fp8 out")
    heads_first = lambda t: t.double().reshape(2, 128, 4, 64).transpose(1, 2)  # noqa: E731 (bshd -> bhsd)
    grads = _grads_with_saved_out(*(heads_first(t) for t in deq), heads_first(dout), heads_first(_saved_e4m3(out)),
                                  0.125, causal)
    for name, t, g in zip("qkv", (q, k, v), grads):
        assert_close(heads_first(t.grad), g, 2e-2, 2e-2, f"fp8 d{name}")


@pytest.mark.parametrize("fp8_dpa", [False, True])
def test_no_grad_runs_without_the_autograd_function(monkeypatch, fp8_dpa):
    """Under torch.no_grad the module calls the kernels directly: the same output as with grad on,
    no autograd Function, and (fp8_dpa) no FP8 copy of the output made for a backward."""
    from te_fuser.attention import function

    torch.manual_seed(12)
    q, k, v = make_inputs("bshd", 2, 32, 32, 4, 4, 16, torch.bfloat16)
    module = te_fuser.DotProductAttention(4, 16, qkv_format="bshd", attn_mask_type="causal")

    def fp8():
        return te_fuser.fp8_autocast(enabled=fp8_dpa, fp8_recipe=te_fuser.recipe.Float8CurrentScaling(fp8_dpa=True))

    expected, out, saved_copies = run_with_and_without_grad(
        monkeypatch, function.FusedAttentionFunction, (function, "quantize_saved_output"), fp8,
        lambda: module(q, k, v))
    assert out.grad_fn is None
    assert torch.equal(out, expected)
    assert not saved_copies


def test_fp8_dpa_delayed_scaling_records_amax():
    torch.manual_seed(10)
    q, k, v = make_inputs("bshd", 1, 24, 24, 2, 2, 8, torch.float32)
    module = te_fuser.DotProductAttention(2, 8, qkv_format="bshd")
    recipe = te_fuser.recipe.DelayedScaling(fp8_dpa=True)
    with te_fuser.fp8_autocast(fp8_recipe=recipe):
        module(q, k, v).sum().backward()
    history = module._fp8_state.amax_history
    expected = torch.stack([t.detach().abs().max() for t in (q, k, v)])
    torch.testing.assert_close(history[-1], expected)  # the newest completed amaxes
    assert q.grad is not None and torch.isfinite(q.grad).all()


# Dropout ------------------------------------------------------------------------------------------------------------

def dropout_keep_mask(batch, heads, seq_q, seq_kv, p, seed, offset):
    """The kernel's keep mask [B, H, Sq, Skv]: with q = k = 0 and v = I, out[i, j] = keep_ij / ((1 - p) Skv)."""
    q = torch.zeros(batch, seq_q, heads, seq_kv)
    v = torch.eye(seq_kv).view(1, seq_kv, 1, seq_kv).expand(batch, seq_kv, heads, seq_kv).contiguous()
    out, _ = attn_kernels.attention_fwd(q, torch.zeros(batch, seq_kv, heads, seq_kv), v, dropout_p=p, seed=seed,
                                        offset=offset)
    return (out > 0).permute(0, 2, 1, 3)


def test_dropout_keep_rate_and_reproducibility():
    p = 0.3
    mask = dropout_keep_mask(2, 3, 64, 80, p, seed=1234, offset=7)
    rate = mask.double().mean().item()
    # 30720 Bernoulli(0.7) draws: the standard deviation of the mean is 0.0026.
    assert abs(rate - (1 - p)) < 0.015
    assert torch.equal(mask, dropout_keep_mask(2, 3, 64, 80, p, seed=1234, offset=7))
    assert not torch.equal(mask, dropout_keep_mask(2, 3, 64, 80, p, seed=1234, offset=8))
    assert not torch.equal(mask, dropout_keep_mask(2, 3, 64, 80, p, seed=1235, offset=7))
    # Masks of different heads and batch entries are not copies of each other.
    assert not torch.equal(mask[0, 0], mask[0, 1]) and not torch.equal(mask[0, 0], mask[1, 0])


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_forward_and_grads_match_masked_reference(causal):
    torch.manual_seed(11)
    p, seed, offset = 0.2, 99, 3
    q, k, v = make_inputs("bshd", 2, 70, 50, 2, 1, 24, torch.float32)
    out, lse = attn_kernels.attention_fwd(q.detach(), k.detach(), v.detach(), causal=causal, dropout_p=p,
                                          seed=seed, offset=offset)
    dout = torch.randn_like(out)
    dq, dk, dv = attn_kernels.attention_bwd(dout, q.detach(), k.detach(), v.detach(), out, lse, causal=causal,
                                            dropout_p=p, seed=seed, offset=offset)
    mask = dropout_keep_mask(2, 2, 70, 50, p, seed, offset)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    segs = segments(2, 70, 50)
    ref = reference_attention(*leaves, segs, causal, 1 / math.sqrt(24), dropout_mask=mask, dropout_p=p)
    grads = torch.autograd.grad(ref, leaves, dout.double())
    assert_close(out, ref.detach(), 3e-5, 1e-4, "dropout out")
    for name, g, r in zip("qkv", (dq, dk, dv), grads):
        assert_close(g, r, 2e-4, 1e-4, f"dropout d{name}")


def test_module_dropout_seeded_and_only_in_training():
    q, k, v = make_inputs("sbhd", 2, 30, 30, 2, 2, 8, torch.float32, requires_grad=False)
    module = te_fuser.DotProductAttention(2, 8, attention_dropout=0.5)
    torch.manual_seed(0)
    a = module(q, k, v)
    b = module(q, k, v)
    torch.manual_seed(0)
    c = module(q, k, v)
    assert torch.equal(a, c) and not torch.equal(a, b)
    module.eval()
    torch.testing.assert_close(module(q, k, v), te_fuser.DotProductAttention(2, 8)(q, k, v), atol=0, rtol=0)


def test_module_dropout_uses_the_rng_state_tracker_fork():
    """With get_rng_state_tracker, the dropout seed is drawn inside tracker().fork(), from the forked RNG state."""
    class Tracker:
        def __init__(self):
            self.forks = 0
            self.state = torch.Generator().manual_seed(77).get_state()

        @contextlib.contextmanager
        def fork(self):
            self.forks += 1
            outer = torch.get_rng_state()
            torch.set_rng_state(self.state)
            try:
                yield
            finally:
                self.state = torch.get_rng_state()
                torch.set_rng_state(outer)

    q, k, v = make_inputs("sbhd", 1, 16, 16, 2, 2, 8, torch.float32, requires_grad=False)
    outs = []
    for _ in range(2):
        tracker = Tracker()
        module = te_fuser.DotProductAttention(2, 8, attention_dropout=0.3, get_rng_state_tracker=lambda: tracker)
        torch.manual_seed(0)
        outer_state = torch.get_rng_state()
        outs.append(module(q, k, v))
        assert tracker.forks == 1
        assert torch.equal(torch.get_rng_state(), outer_state), "the default generator must not advance"
    assert torch.equal(outs[0], outs[1])  # same tracker stream, same mask
    tracker.state = torch.Generator().manual_seed(78).get_state()
    assert not torch.equal(module(q, k, v), outs[0])  # another tracker stream, another mask


# torch.compile ----------------------------------------------------------------------------------------------------

def test_torch_compile_fullgraph_forward_and_backward():
    torch.manual_seed(12)
    module = te_fuser.DotProductAttention(4, 16, num_gqa_groups=2, qkv_format="sbhd")
    q, k, v = make_inputs("sbhd", 2, 33, 33, 4, 2, 16, torch.float32)
    compiled = torch.compile(module, fullgraph=True)  # inductor: the fake kernels must describe the outputs
    out = compiled(q, k, v)
    out.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    expected = module(q, k, v)
    expected.sum().backward()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, t.grad, atol=0, rtol=0)


@pytest.mark.parametrize("call", ["self_attention_x_x_x", "one_padding_mask", "one_cu_seqlens", "dynamic_shapes"])
def test_torch_compile_fullgraph_traces_repeated_inputs_and_dynamic_shapes(call):
    """torch.compile cannot trace an autograd.Function given one tensor twice, nor math on a symbolic
    scale: the module must still trace (results equal to eager)."""
    torch.manual_seed(13)
    if call == "one_cu_seqlens":
        module = te_fuser.DotProductAttention(2, 16, qkv_format="thd", attn_mask_type="padding")
        cu = torch.tensor([0, 4, 10], dtype=torch.int32)
        q, k, v = make_inputs("thd", 1, 10, 10, 2, 2, 16, torch.float32)
        args, kwargs = (q, k, v), dict(cu_seqlens_q=cu, cu_seqlens_kv=cu)
    elif call == "one_padding_mask":
        module = te_fuser.DotProductAttention(2, 16, qkv_format="bshd", attn_mask_type="padding")
        q, k, v = make_inputs("bshd", 2, 12, 12, 2, 2, 16, torch.float32)
        mask = torch.zeros(2, 1, 1, 12, dtype=torch.bool)
        mask[0, ..., 9:] = True
        args, kwargs = (q, k, v), dict(attention_mask=mask)
    else:
        module = te_fuser.DotProductAttention(2, 16, qkv_format="bshd", attn_mask_type="causal")
        q, k, v = make_inputs("bshd", 1, 12, 12, 2, 2, 16, torch.float32)
        args, kwargs = ((q, q, q) if call == "self_attention_x_x_x" else (q, k, v)), {}
    leaves = (q,) if call == "self_attention_x_x_x" else (q, k, v)
    compiled = torch.compile(lambda *a: module(*a, **kwargs), fullgraph=True, dynamic=call == "dynamic_shapes")
    out = compiled(*args)
    out.sum().backward()
    grads = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    expected = module(*args, **kwargs)
    expected.sum().backward()
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    for g, t in zip(grads, leaves):
        torch.testing.assert_close(g, t.grad, atol=1e-6, rtol=1e-6)


def test_left_padding_is_refused_under_compile_too():
    module = te_fuser.DotProductAttention(2, 16, qkv_format="bshd", attn_mask_type="padding")
    q, k, v = make_inputs("bshd", 2, 12, 12, 2, 2, 16, torch.float32, requires_grad=False)
    mask = torch.zeros(2, 1, 1, 12, dtype=torch.bool)
    mask[1, ..., :5] = True  # left padding: the kernels take lengths
    with pytest.raises(ValueError, match="right padding"):
        module(q, k, v, attention_mask=mask)
    compiled = torch.compile(lambda m: module(q, k, v, attention_mask=m), fullgraph=True)
    right = torch.zeros_like(mask)
    right[1, ..., 7:] = True
    torch.testing.assert_close(compiled(right), module(q, k, v, attention_mask=right), atol=1e-6, rtol=1e-6)
    with pytest.raises(RuntimeError, match="right padding"):
        compiled(mask)


@pytest.mark.parametrize("isa", ["portable", "avx2"])
@pytest.mark.parametrize("scale", [0.0, -0.7])
def test_causal_with_a_non_positive_scale_on_every_tier(isa, scale):
    """Torch's CPU flash kernel (the portable tier's route) gives NaN here: such problems stay on te_fuser's."""
    if isa not in cpu_kernels.available_isa():
        pytest.skip(f"this CPU has no {isa} tier")
    torch.manual_seed(14)
    q, k, v = make_inputs("bshd", 1, 8, 8, 2, 2, 16, torch.float32)
    module = te_fuser.DotProductAttention(2, 16, qkv_format="bshd", attn_mask_type="causal", softmax_scale=scale)
    dout = torch.randn(1, 8, 2, 16)
    with cpu_kernels.isa(isa):
        out = module(q, k, v)
        out.backward(dout.reshape(1, 8, 32))
    ref, grads = reference(q, k, v, "bshd", True, scale, dout=dout)
    assert_close(out.reshape(1, 8, 2, 16), ref, 1e-5, 1e-5, f"{isa} out")
    for name, t, g in zip("qkv", (q, k, v), grads):
        assert_close(t.grad, g, 1e-5, 1e-5, f"{isa} d{name}")


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_backward_with_no_query_tokens(fmt):
    module = te_fuser.DotProductAttention(1, 8, qkv_format=fmt, attn_mask_type="padding" if fmt == "thd" else "no_mask")
    q, k, v = make_inputs(fmt, 1, 0, 4, 1, 1, 8, torch.float32)
    kwargs = {}
    if fmt == "thd":
        kwargs = dict(cu_seqlens_q=torch.tensor([0, 0], dtype=torch.int32),
                      cu_seqlens_kv=torch.tensor([0, 4], dtype=torch.int32))
    out = module(q, k, v, **kwargs)
    assert out.numel() == 0
    out.sum().backward()
    assert q.grad.shape == q.shape and torch.equal(k.grad, torch.zeros_like(k))
    assert torch.equal(v.grad, torch.zeros_like(v))


def test_fp8_second_backward_is_refused_clearly():
    q, k, v = make_inputs("bshd", 1, 16, 16, 2, 2, 16, torch.float32)
    module = te_fuser.DotProductAttention(2, 16, qkv_format="bshd")
    with te_fuser.fp8_autocast(fp8_recipe=te_fuser.recipe.Float8CurrentScaling(fp8_dpa=True)):
        out = module(q, k, v)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        out.sum().backward()


# Bad inputs -------------------------------------------------------------------------------------------------------

def test_bad_inputs_raise_clear_errors():
    module = te_fuser.DotProductAttention(4, 16, num_gqa_groups=2)
    q, k, v = make_inputs("sbhd", 2, 8, 8, 4, 2, 16, torch.float32, requires_grad=False)
    with pytest.raises(ValueError, match="head dim"):
        module(q[..., :8], k, v)
    with pytest.raises(TypeError, match="must match"):
        module(q, k.half(), v)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        module(q.double(), k, v)
    with pytest.raises(ValueError, match="4-D"):
        module(q[0], k, v)
    with pytest.raises(ValueError, match="heads"):
        module(q, q, v)
    with pytest.raises(ValueError, match="same shape"):
        module(q, k, v[:4])
    with pytest.raises(ValueError, match="cu_seqlens"):
        module(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), qkv_format="thd")
    tq, tk, tv = (t.flatten(0, 1) for t in (q, k, v))
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        module(tq, tk, tv, qkv_format="thd", attn_mask_type="padding",
               cu_seqlens_q=torch.tensor([0, 9, 17], dtype=torch.int32),
               cu_seqlens_kv=torch.tensor([0, 8, 16], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        module(tq, tk, tv, qkv_format="thd", attn_mask_type="padding",
               cu_seqlens_q=torch.tensor([0, 9, 5], dtype=torch.int32),
               cu_seqlens_kv=torch.tensor([0, 8, 16], dtype=torch.int32))
    with pytest.raises(TypeError, match="int32"):
        module(tq, tk, tv, qkv_format="thd", attn_mask_type="padding", cu_seqlens_q=torch.tensor([0, 8, 16]),
               cu_seqlens_kv=torch.tensor([0, 8, 16]))
    with pytest.raises(ValueError, match="right padding"):
        module(q, k, v, attn_mask_type="padding", attention_mask=torch.tensor([[True] + [False] * 7] * 2).view(2, 1, 1, 8))
    # Padded bshd/sbhd layouts with cu_seqlens: integer offsets that do not decrease.
    with pytest.raises(TypeError, match="cu_seqlens_q must hold int32 or int64"):
        module(q, k, v, attn_mask_type="padding", cu_seqlens_q=torch.tensor([0.0, 5.7, 10.0]),
               cu_seqlens_kv=torch.tensor([0, 8, 16], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_kv must not decrease"):
        module(q, k, v, attn_mask_type="padding", cu_seqlens_q=torch.tensor([0, 8, 16], dtype=torch.int32),
               cu_seqlens_kv=torch.tensor([0, 9, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="shape"):
        module(q, k, v, attn_mask_type="padding", attention_mask=torch.zeros(2, 1, 1, 5, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="window_size"):
        te_fuser.DotProductAttention(4, 16, window_size=(128, 0))
    with pytest.raises(NotImplementedError, match="window_size"):
        module(q, k, v, window_size=(4, 4))
    with pytest.raises(NotImplementedError, match="attention_type"):
        te_fuser.DotProductAttention(4, 16, attention_type="decoder")
    with pytest.raises(NotImplementedError, match="attn_mask_type"):
        module(q, k, v, attn_mask_type="causal_bottom_right")
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        module(q, k, v, alibi_slopes=torch.ones(4))
    with pytest.raises(NotImplementedError, match="qkv_format"):
        module(q, k, v, qkv_format="sbhd_2bshd")


def test_kernel_wrappers_validate():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="contiguous last"):
        attn_kernels.attention_fwd(q.transpose(1, 3), q.transpose(1, 3), q.transpose(1, 3))
    with pytest.raises(ValueError, match="dropout_p"):
        attn_kernels.attention_fwd(q, q, q, dropout_p=1.0)
    with pytest.raises(ValueError, match="q_descale"):
        attn_kernels.attention_fwd(q.to(torch.float8_e4m3fn), q.to(torch.float8_e4m3fn), q.to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="seqlens_q"):
        attn_kernels.attention_fwd(q, q, q, seqlens_q=torch.tensor([9], dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple"):
        attn_kernels.attention_fwd(q, torch.randn(1, 8, 3, 16), torch.randn(1, 8, 3, 16))
    out, lse = attn_kernels.attention_fwd(q, q, q)
    with pytest.raises(ValueError, match="lse"):
        attn_kernels.attention_bwd(out, q, q, q, out, lse[:, :1])
    # The raw op checks too (RuntimeError from the binding, no crash).
    with pytest.raises(RuntimeError, match="seqlens|size"):
        torch.ops.te_fuser.attention_fwd(q, q, q, None, None, torch.tensor([9], dtype=torch.int32), None, 0.25, False,
                                         0.0, 0, 0, None, None, None, None)


# Memory -----------------------------------------------------------------------------------------------------------

def allocated_bytes(fn):
    """Total bytes torch's CPU allocator hands out while fn runs (every allocation counted, frees ignored)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)


def test_forward_memory_is_linear_in_sequence_length():
    s, d = 4096, 64
    q, k, v = (torch.randn(1, s, 1, d) for _ in range(3))
    score_matrix = s * s * 4
    ours = allocated_bytes(lambda: attn_kernels.attention_fwd(q, k, v, causal=True))
    # out (1 MiB) + lse (16 KiB) + per-thread tile scratch (~130 KiB each): far below one s x s float32 matrix.
    assert ours > s * d * 4, ours  # the measurement does see the output
    assert ours < score_matrix / 16, ours
    # The same measurement sees the s x s matrix of an implementation that materializes it.
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    naive = allocated_bytes(lambda: torch.ops.aten._scaled_dot_product_attention_math(qt, kt, vt, is_causal=True))
    assert naive > score_matrix, naive
