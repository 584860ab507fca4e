"""CUDA fused attention (torch.ops.te_fuser.attention_fwd / attention_bwd on CUDA tensors).

References are independent of the kernels: float64 torch.nn.functional.scaled_dot_product_attention
per sequence (which also gives the gradients through autograd), the same attention run by torch in
the kernel's own low precision (to scale the tolerances to what that precision allows), a Python
Philox for the dropout mask, and the CPU kernels for CPU/CUDA agreement.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import te_fuser
import te_fuser.kernels.attention


def _has_attention_kernel(dispatch_key):
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("te_fuser::attention_fwd", dispatch_key)
    except RuntimeError:  # the op is not defined in this build
        return False


def _has_cuda_attention():
    return torch.cuda.is_available() and _has_attention_kernel("CUDA")


pytestmark = pytest.mark.skipif(not _has_cuda_attention(), reason="needs CUDA and te_fuser's CUDA attention")

CUDA = torch.device("cuda")


# ----------------------------------------------------------------------------- op calls


def attn_fwd(q, k, v, *, cu_q=None, cu_kv=None, lens_q=None, lens_kv=None, scale=None, causal=False,
             dropout_p=0.0, seed=0, offset=0, descales=(None, None, None), out_dtype=None):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.ops.te_fuser.attention_fwd(q, k, v, cu_q, cu_kv, lens_q, lens_kv, scale, causal, dropout_p,
                                            seed, offset, *descales, out_dtype)


def attn_bwd(dout, q, k, v, out, lse, *, cu_q=None, cu_kv=None, lens_q=None, lens_kv=None, scale=None,
             causal=False, dropout_p=0.0, seed=0, offset=0, descales=(None, None, None)):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.ops.te_fuser.attention_bwd(dout, q, k, v, out, lse, cu_q, cu_kv, lens_q, lens_kv, scale, causal,
                                            dropout_p, seed, offset, *descales)


# ----------------------------------------------------------------------------- references


def reference(q, k, v, dout, scale, causal, seqs):
    """SDPA per sequence in q's dtype on q's device; seqs = [(batch, q_begin, q_len, kv_begin, kv_len)].

    Causal is an explicit top-left (tril) mask so every SDPA backend agrees on the alignment.
    Returns out, lse ([B, Hq, Sq], -inf where a row sees no key) and dq, dk, dv (zeros outside sequences).
    """
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), -math.inf, dtype=torch.float64, device=q.device)
    for b, q0, lq, k0, lk in seqs:
        if lq == 0 or lk == 0:
            continue
        qs = q[b, q0:q0 + lq].transpose(0, 1)  # [H, S, D]
        ks = k[b, k0:k0 + lk].transpose(0, 1).repeat_interleave(group, dim=0)
        vs = v[b, k0:k0 + lk].transpose(0, 1).repeat_interleave(group, dim=0)
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril() if causal else None
        out[b, q0:q0 + lq] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale).transpose(0, 1)
        s = (qs.detach().double() @ ks.detach().double().transpose(1, 2)) * scale
        if causal:
            s = s.masked_fill(~mask, -math.inf)
        lse[b, :, q0:q0 + lq] = torch.logsumexp(s, dim=-1)
    if not out.requires_grad:
        return out, lse, torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    grads = torch.autograd.grad(out, (q, k, v), dout, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip((q, k, v), grads)]
    return out.detach(), lse, *grads


def batched_seqs(b, sq, skv, lens_q=None, lens_kv=None):
    return [(i, 0, sq if lens_q is None else lens_q[i], 0, skv if lens_kv is None else lens_kv[i]) for i in range(b)]


def packed_seqs(lens_q, lens_kv):
    cq, ck = np.cumsum([0] + lens_q), np.cumsum([0] + lens_kv)
    return [(0, int(cq[i]), lens_q[i], int(ck[i]), lens_kv[i]) for i in range(len(lens_q))]


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_close_to_reference(name, ours, ref64, lowp, factor, floor):
    """Our error against float64 is at most `factor` times torch's own low-precision error (plus a floor)."""
    err, base = max_err(ours, ref64), max_err(lowp, ref64)
    assert err <= factor * base + floor, f"{name}: error {err:.3e} vs torch low-precision error {base:.3e}"


def check_against_reference(q, k, v, dout, scale, causal, seqs, got, lse_shape=None):
    """got = (out, lse, dq, dk, dv) from the kernels; compares with float64 and low-precision torch."""
    ref = reference(q.double(), k.double(), v.double(), dout.double(), scale, causal, seqs)
    lowp = reference(q, k, v, dout, scale, causal, seqs)
    out, lse, dq, dk, dv = got
    assert_close_to_reference("out", out, ref[0], lowp[0], 2.0, 1e-3)
    lse_ref = ref[1] if lse_shape is None else ref[1].reshape(lse_shape)
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite), "lse must be -inf exactly on rows that see no key"
    assert (lse[~finite] == -math.inf).all()
    assert max_err(lse[finite], lse_ref[finite]) < 2e-2
    for name, g, r, lp in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[2:], lowp[2:]):
        assert_close_to_reference(name, g, r, lp, 3.0, 2e-3)


def randn(*shape, dtype, generator):
    return torch.randn(*shape, generator=generator, dtype=torch.float32).to(device=CUDA, dtype=dtype)


# ----------------------------------------------------------------------------- dense batches

SHAPES = [  # B, Sq, Skv, Hq, Hkv
    (2, 128, 128, 4, 4),
    (1, 77, 131, 6, 2),  # odd lengths, GQA
    (2, 200, 65, 4, 1),  # MQA, more queries than keys
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_float64_sdpa(dtype, head_dim, causal, shape, generator):
    b, sq, skv, hq, hkv = shape
    q, k, v = randn(b, sq, hq, head_dim, dtype=dtype, generator=generator), randn(b, skv, hkv, head_dim, dtype=dtype, generator=generator), \
        randn(b, skv, hkv, head_dim, dtype=dtype, generator=generator)
    dout = randn(b, sq, hq, head_dim, dtype=dtype, generator=generator)
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = attn_fwd(q, k, v, scale=scale, causal=causal)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == (b, hq, sq)
    dq, dk, dv = attn_bwd(dout, q, k, v, out, lse, scale=scale, causal=causal)
    check_against_reference(q, k, v, dout, scale, causal, batched_seqs(b, sq, skv), (out, lse, dq, dk, dv))


@pytest.mark.parametrize("head_dim", [32, 96])
def test_other_head_dims(head_dim, generator):
    q = randn(2, 93, 4, head_dim, dtype=torch.bfloat16, generator=generator)
    k, v = randn(2, 70, 2, head_dim, dtype=torch.bfloat16, generator=generator), randn(2, 70, 2, head_dim, dtype=torch.bfloat16, generator=generator)
    dout = randn(2, 93, 4, head_dim, dtype=torch.bfloat16, generator=generator)
    out, lse = attn_fwd(q, k, v, scale=0.3, causal=True)
    grads = attn_bwd(dout, q, k, v, out, lse, scale=0.3, causal=True)
    check_against_reference(q, k, v, dout, 0.3, True, batched_seqs(2, 93, 70), (out, lse, *grads))


def test_sbhd_views_keep_their_dim_order(generator):
    s, b, h, d = 97, 2, 4, 64
    q_sbhd, k_sbhd, v_sbhd = (randn(s, b, h, d, dtype=torch.bfloat16, generator=generator) for _ in range(3))
    q, k, v = (t.transpose(0, 1) for t in (q_sbhd, k_sbhd, v_sbhd))  # [B, S, H, D] views
    dout = randn(s, b, h, d, dtype=torch.bfloat16, generator=generator).transpose(0, 1)
    out, lse = attn_fwd(q, k, v, causal=True)
    assert out.transpose(0, 1).is_contiguous(), "out must be laid out like q (sbhd)"
    grads = attn_bwd(dout, q, k, v, out, lse, causal=True)
    assert all(g.transpose(0, 1).is_contiguous() for g in grads)
    check_against_reference(q, k, v, dout, 1 / 8, True, batched_seqs(b, s, s), (out, lse, *grads))


def test_packed_qkv_slices(generator):
    """q, k, v as slices of one [B, S, 3, H, D] buffer: strided heads, still 16-byte aligned rows."""
    qkv = randn(2, 81, 3, 4, 64, dtype=torch.float16, generator=generator)
    q, k, v = qkv.unbind(2)
    dout = randn(2, 81, 4, 64, dtype=torch.float16, generator=generator)
    out, lse = attn_fwd(q, k, v)
    grads = attn_bwd(dout, q, k, v, out, lse)
    check_against_reference(q, k, v, dout, 1 / 8, False, batched_seqs(2, 81, 81), (out, lse, *grads))


# ----------------------------------------------------------------------------- padding and packing


@pytest.mark.parametrize("causal", [False, True])
def test_padding_with_seqlens(causal, generator):
    b, sq, skv, h, d = 3, 100, 90, 4, 64
    lens_q, lens_kv = [100, 37, 1], [90, 0, 53]  # one sequence sees no key at all
    q = randn(b, sq, h, d, dtype=torch.bfloat16, generator=generator)
    k, v = randn(b, skv, 2, d, dtype=torch.bfloat16, generator=generator), randn(b, skv, 2, d, dtype=torch.bfloat16, generator=generator)
    dout = randn(b, sq, h, d, dtype=torch.bfloat16, generator=generator)
    lq, lk = (torch.tensor(x, dtype=torch.int32, device=CUDA) for x in (lens_q, lens_kv))
    out, lse = attn_fwd(q, k, v, lens_q=lq, lens_kv=lk, causal=causal)
    grads = attn_bwd(dout, q, k, v, out, lse, lens_q=lq, lens_kv=lk, causal=causal)
    check_against_reference(q, k, v, dout, 1 / 8, causal, batched_seqs(b, sq, skv, lens_q, lens_kv),
                            (out, lse, *grads))
    assert (out[1, 37:] == 0).all() and (out[1] == 0).all() and (grads[0][2, 1:] == 0).all()
    assert (grads[1][2, 53:] == 0).all() and (grads[2][1] == 0).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_packed_thd_with_cu_seqlens(causal, head_dim, generator):
    lens_q, lens_kv = [5, 0, 130, 64, 1], [7, 3, 129, 64, 0]
    tq, tkv = sum(lens_q) + 9, sum(lens_kv) + 4  # trailing tokens belong to no sequence
    q = randn(1, tq, 4, head_dim, dtype=torch.bfloat16, generator=generator)
    k, v = randn(1, tkv, 2, head_dim, dtype=torch.bfloat16, generator=generator), randn(1, tkv, 2, head_dim, dtype=torch.bfloat16, generator=generator)
    dout = randn(1, tq, 4, head_dim, dtype=torch.bfloat16, generator=generator)
    cu_q = torch.tensor(np.cumsum([0] + lens_q), dtype=torch.int32, device=CUDA)
    cu_kv = torch.tensor(np.cumsum([0] + lens_kv), dtype=torch.int32, device=CUDA)
    out, lse = attn_fwd(q, k, v, cu_q=cu_q, cu_kv=cu_kv, causal=causal)
    assert lse.shape == (4, tq)
    grads = attn_bwd(dout, q, k, v, out, lse, cu_q=cu_q, cu_kv=cu_kv, causal=causal)
    scale = 1 / math.sqrt(head_dim)
    check_against_reference(q, k, v, dout, scale, causal, packed_seqs(lens_q, lens_kv), (out, lse, *grads),
                            lse_shape=(4, tq))
    assert (out[0, -9:] == 0).all() and (grads[1][0, -4:] == 0).all() and (grads[2][0, -4:] == 0).all()


def test_no_keys_gives_zeros_and_minus_inf(generator):
    q = randn(2, 33, 2, 64, dtype=torch.float16, generator=generator)
    k = v = torch.empty(2, 0, 2, 64, dtype=torch.float16, device=CUDA)
    out, lse = attn_fwd(q, k, v)
    assert (out == 0).all() and (lse == -math.inf).all()
    dq, dk, dv = attn_bwd(torch.ones_like(q), q, k, v, out, lse)
    assert (dq == 0).all() and dk.shape == k.shape and dv.shape == v.shape


# ----------------------------------------------------------------------------- FP8


P_SCALE = 256.0  # the tensor-core forward quantizes 256 * P to e4m3


def fp8_p_model(q, k, v, scale, causal):
    """The tensor-core forward's arithmetic in float64: P = exp(s - rowmax) rounded as e4m3(256 P) / 256,
    normalised by the sum of the unrounded P (padded [B, S, H, D] batches of equal length)."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), -math.inf)
    p = (s - s.amax(-1, keepdim=True)).exp()
    p_q = (p * P_SCALE).float().to(torch.float8_e4m3fn).double() / P_SCALE
    vv = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    return torch.einsum("bhqk,bkhd->bqhd", p_q, vv) / p.sum(-1).transpose(1, 2).unsqueeze(-1)


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_inputs_match_dequantized_reference(out_dtype, causal, generator):
    b, s, h, d = 2, 75, 4, 128
    scales = [0.5, 2.0, 0.125]
    data = [randn(b, s, h, d, dtype=torch.float32, generator=generator) * 3 for _ in range(3)]
    fp8 = [(x / sc).to(torch.float8_e4m3fn) for x, sc in zip(data, scales)]
    descales = tuple(torch.tensor([sc], dtype=torch.float32, device=CUDA) for sc in scales)
    deq = [t.float() * sc for t, sc in zip(fp8, scales)]  # what the kernel must attend over
    out, lse = attn_fwd(*fp8, causal=causal, descales=descales, out_dtype=out_dtype)
    expect_dtype = torch.float32 if out_dtype is None else out_dtype
    assert out.dtype == expect_dtype
    dout = randn(b, s, h, d, dtype=expect_dtype, generator=generator)
    grads = attn_bwd(dout, *fp8, out, lse, causal=causal, descales=descales)
    assert all(g.dtype == expect_dtype for g in grads)
    ref = reference(*(x.double() for x in deq), dout.double(), 1 / math.sqrt(d), causal, batched_seqs(b, s, s))
    assert max_err(lse, ref[1]) < 2e-2
    if te_fuser.kernels.attention.fp8_tensor_cores(CUDA):
        # P went through e4m3 (relative step 2^-3): the output follows the float64 model of that rounding,
        # and the gradients (16-bit backward from the same lse, delta from this out) stay within a few %.
        model = fp8_p_model(*(x.double() for x in deq), 1 / math.sqrt(d), causal)
        # (A float64 simulation of the kernel's tile-wise rounding puts it 0.1-0.3% from the model and
        # 0.5-0.6% from the exact output at this size; a mispaired P or V element costs O(1).)
        assert rel_err(out, model) < 1e-2, f"out vs the P-in-e4m3 model: {rel_err(out, model):.3e}"
        assert rel_err(out, ref[0]) < 3e-2
        for name, g, r in zip(("dq", "dk", "dv"), grads, ref[2:]):
            assert rel_err(g, r) < 6e-2, f"{name}: relative error {rel_err(g, r):.3e}"
        return
    # The decode path multiplies bfloat16/float16 MMA operands: compare with torch in that precision.
    lowp_dtype = torch.bfloat16 if expect_dtype == torch.float32 else expect_dtype
    lowp_in = [x.to(lowp_dtype) for x in deq]
    lowp = reference(*lowp_in, dout.to(lowp_dtype), 1 / math.sqrt(d), causal, batched_seqs(b, s, s))
    assert_close_to_reference("out", out, ref[0], lowp[0], 2.0, 2e-3)
    for name, g, r, lp in zip(("dq", "dk", "dv"), grads, ref[2:], lowp[2:]):
        assert_close_to_reference(name, g, r, lp, 3.0, 4e-3)


def test_fp8_tensor_cores_follow_the_architecture():
    """Hopper (the sm_90a kernels) runs FP8 attention on FP8 tensor cores; other GPUs and the CPU decode."""
    on_hopper = torch.cuda.get_device_capability(CUDA) == (9, 0)
    assert te_fuser.kernels.attention.fp8_tensor_cores(CUDA) == on_hopper
    assert not te_fuser.kernels.attention.fp8_tensor_cores("cpu")


# ----------------------------------------------------------------------------- dropout

PHILOX_M0, PHILOX_M1, PHILOX_W0, PHILOX_W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
U32 = 0xFFFFFFFF


def philox(c, k0, k1):
    """Philox-4x32-10 on numpy uint64 arrays holding 32-bit values (independent of the C header)."""
    c = [np.asarray(x, dtype=np.uint64) & U32 for x in c]
    k0, k1 = np.uint64(k0), np.uint64(k1)
    for _ in range(10):
        p0, p1 = np.uint64(PHILOX_M0) * c[0], np.uint64(PHILOX_M1) * c[2]
        c = [((p1 >> np.uint64(32)) ^ c[1] ^ k0) & U32, p1 & U32, ((p0 >> np.uint64(32)) ^ c[3] ^ k1) & U32, p0 & U32]
        k0, k1 = (k0 + np.uint64(PHILOX_W0)) & U32, (k1 + np.uint64(PHILOX_W1)) & U32
    return c


def reference_keep_mask(seed, offset, p, batch, heads, rows, cols):
    key = philox([offset & U32, offset >> 32, 0x5EED, 0xA77E], seed & U32, seed >> 32)
    bb, hh, ii, jj = np.meshgrid(np.arange(batch), np.arange(heads), np.arange(rows), np.arange(cols), indexing="ij")
    bits = philox([jj, ii, hh, bb], int(key[0]), int(key[1]))[0]
    threshold = min(max(int(p * 2**32 + 0.5), 0), U32)
    return torch.from_numpy(bits >= threshold)  # [B, H, rows, cols]


@pytest.mark.parametrize("seed,offset", [(1234, 0), (2**40 + 7, 3 * 2**33 + 11)])
def test_dropout_mask_is_the_shared_philox(seed, offset):
    """q = 0 makes every weight 1/Skv and one-hot values expose the keep mask in the output."""
    b, h, sq, skv, d, p = 2, 3, 70, 64, 64, 0.25
    q = torch.zeros(b, sq, h, d, dtype=torch.bfloat16, device=CUDA)
    k = torch.randn(b, skv, h, d, device=CUDA).to(torch.bfloat16)
    v = torch.eye(skv, d, device=CUDA).to(torch.bfloat16)[None, :, None, :].expand(b, skv, h, d).contiguous()
    out, _ = attn_fwd(q, k, v, dropout_p=p, seed=seed, offset=offset)
    kept = (out != 0).permute(0, 2, 1, 3)[..., :skv].cpu()
    assert torch.equal(kept, reference_keep_mask(seed, offset, p, b, h, sq, skv))
    expected = 1.0 / ((1 - p) * skv)
    assert max_err(out[out != 0], torch.full_like(out[out != 0], expected)) <= expected * 2**-8


def test_dropout_gradients_match_masked_reference(generator):
    """dV, dK, dQ with dropout equal float64 autograd through the explicit keep mask."""
    b, s, h, d, p, seed, offset = 1, 67, 2, 64, 0.2, 99, 5
    q, k, v, dout = (randn(b, s, h, d, dtype=torch.bfloat16, generator=generator) for _ in range(4))
    out, lse = attn_fwd(q, k, v, causal=True, dropout_p=p, seed=seed, offset=offset)
    grads = attn_bwd(dout, q, k, v, out, lse, causal=True, dropout_p=p, seed=seed, offset=offset)
    keep = reference_keep_mask(seed, offset, p, b, h, s, s).to(CUDA)
    q64, k64, v64 = (t.double().requires_grad_(True) for t in (q, k, v))
    sc = (q64.transpose(1, 2) @ k64.transpose(1, 2).transpose(2, 3)) / 8
    sc = sc.masked_fill(torch.ones(s, s, dtype=torch.bool, device=CUDA).triu(1), -math.inf)
    probs = torch.softmax(sc, -1) * keep / (1 - p)
    ref = (probs @ v64.transpose(1, 2)).transpose(1, 2)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    assert max_err(out, ref) < 3e-2
    for g, r in zip(grads, ref_grads):
        assert max_err(g, r) < 6e-2 * max(1.0, r.abs().max().item())


# ----------------------------------------------------------------------------- CPU agreement


@pytest.mark.skipif(not _has_attention_kernel("CPU"), reason="needs te_fuser's CPU attention")
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("packed", [False, True])
def test_cpu_and_cuda_agree(dropout_p, packed, generator):
    d = 64
    if packed:
        lens = [19, 0, 70]
        cu = torch.tensor(np.cumsum([0] + lens), dtype=torch.int32)
        q, k, v, dout = (randn(1, sum(lens), 4, d, dtype=torch.bfloat16, generator=generator) for _ in range(4))
        extra = dict(cu_q=cu, cu_kv=cu)
    else:
        q, k, v, dout = (randn(2, 75, 4, d, dtype=torch.bfloat16, generator=generator) for _ in range(4))
        extra = {}
    common = dict(causal=True, dropout_p=dropout_p, seed=7, offset=123)
    cpu_args = [t.cpu() for t in (q, k, v)]
    cpu_extra = {key: t.cpu() for key, t in extra.items()}
    cuda_extra = {key: t.to(CUDA) for key, t in extra.items()}
    out_c, lse_c = attn_fwd(*cpu_args, **cpu_extra, **common)
    out_g, lse_g = attn_fwd(q, k, v, **cuda_extra, **common)
    assert max_err(out_g.cpu(), out_c) < 2e-2
    fin = torch.isfinite(lse_c)
    assert torch.equal(torch.isfinite(lse_g.cpu()), fin) and max_err(lse_g.cpu()[fin], lse_c[fin]) < 1e-2
    grads_c = attn_bwd(dout.cpu(), *cpu_args, out_c, lse_c, **cpu_extra, **common)
    grads_g = attn_bwd(dout, q, k, v, out_g, lse_g, **cuda_extra, **common)
    for gc, gg in zip(grads_c, grads_g):
        assert max_err(gg.cpu(), gc) < 5e-2 * max(1.0, gc.abs().max().item())


# ----------------------------------------------------------------------------- errors


def test_unsupported_head_dim_is_a_clear_error():
    q = torch.zeros(1, 8, 2, 80, dtype=torch.bfloat16, device=CUDA)
    with pytest.raises(RuntimeError, match="head dims 32, 64, 96, 128"):
        attn_fwd(q, q, q)


def test_float32_inputs_are_rejected_on_cuda():
    q = torch.zeros(1, 8, 2, 64, dtype=torch.float32, device=CUDA)
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        attn_fwd(q, q, q)
