"""Rotary position embedding (te_fuser.attention.rope, C kernels te_fuser::rope_forward / rope_backward)
against the float64 reference of rope_reference.py: every layout (sbhd, bshd, thd), interleaved or not,
partial rotation, start positions, per-sequence angles and context parallelism, on strided views with
edge values, forward and backward; gradcheck; torch.compile; TransformerEngine's RotaryPositionEmbedding
table; what the backward keeps; and the errors that name a bad argument."""

import zlib

import pytest
import torch

import te_fuser
from te_fuser.attention import rope as te_rope
from te_fuser.attention.rope import RotaryPositionEmbedding, apply_rotary_pos_emb

import rope_reference as ref
from _binding_refusals import assert_refused_then_named

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
SEQ, BATCH, HEADS, DIM = 6, 3, 2, 16
CU = [0, 5, 5, 12, 13]  # packed thd sequences: an empty one and a one-token one
CU_CP = [0, 8, 8, 20, 32]  # multiples of 2 * cp_size for cp_size = 2
MODES = ["plain", "start_positions", "cp_rank0", "cp_rank1", "per_sequence_freqs"]


def _edge_values(shape, dtype, generator):
    """Normal values with zeros, negative zeros, tiny and huge magnitudes (huge: near float16's range)."""
    x = torch.randn(shape, generator=generator, dtype=torch.float64) * 2
    pick = torch.randint(0, 12, shape, generator=generator)
    huge = 3.0e4 if dtype == torch.float16 else 1.0e30
    x = torch.where(pick == 0, 0.0, x)
    x = torch.where(pick == 1, -0.0, x)
    x = torch.where(pick == 2, x * 1e-30, x)
    x = torch.where(pick == 3, torch.sign(x) * huge, x)
    return x.to(dtype)


def _as_view(x, layout, generator):
    """x's values in a non-contiguous tensor: q's slice of a fused [..., 3 d] projection, or the head
    and channel dims stored transposed."""
    if layout == "qkv":
        big = torch.randn(*x.shape[:-1], 3 * x.shape[-1], generator=generator).to(x.dtype)
        view = big[..., x.shape[-1]:2 * x.shape[-1]]
        view.copy_(x)
        return view
    if layout == "transposed":
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)
    return x.clone()


def _problem(tensor_format, mode, rot_dim, interleaved, generator):
    """(shape of t, freqs, start_positions, cu_seqlens, cp_size, cp_rank) of a case."""
    cp = 2 if mode.startswith("cp") else 1
    rank = 1 if mode == "cp_rank1" else 0
    if tensor_format == "thd":
        cu = torch.tensor(CU_CP if cp > 1 else CU, dtype=torch.int32)
        shape, batch = (cu[-1].item() // cp, HEADS, DIM), cu.numel() - 1
        lengths = (cu[1:] - cu[:-1]).tolist()
    else:
        cu = None
        shape = (SEQ, BATCH, HEADS, DIM) if tensor_format == "sbhd" else (BATCH, SEQ, HEADS, DIM)
        batch, lengths = BATCH, [SEQ] * BATCH
    rows = max(lengths) * (cp if tensor_format != "thd" else 1) + (3 if mode == "start_positions" else 0)
    freq_batch = batch if mode == "per_sequence_freqs" else 1
    freqs = torch.rand(rows, freq_batch, 1, rot_dim, generator=generator, dtype=torch.float64) * 8 - 4
    freqs[::3] *= 500  # angles far from zero
    start = None
    if mode == "start_positions":
        start = torch.tensor([int(torch.randint(0, rows - n + 1, (1,), generator=generator)) for n in lengths],
                             dtype=torch.int32)
    return shape, freqs.float(), start, cu, cp, rank


def _pair_magnitude(x, rot_dim, interleaved):
    """|x[a]| + |x[b]| on both channels of each rotated pair (a, b); 0 on the pass-through channels."""
    x = x.double().abs()
    out = torch.zeros_like(x)
    if interleaved:
        a, b = torch.arange(0, rot_dim, 2), torch.arange(1, rot_dim, 2)
    else:
        a, b = torch.arange(rot_dim // 2), torch.arange(rot_dim // 2, rot_dim)
    out[..., a] = out[..., b] = x[..., a] + x[..., b]
    return out


def _assert_within(got, expect, magnitude, dtype, what):
    """float32 math (a few float32 ulps of the inputs' size), then one rounding to dtype (half a step of
    its subnormals at least)."""
    bound = EPS[dtype] * expect.abs() + 8 * 2.0 ** -24 * magnitude + EPS[dtype] * torch.finfo(dtype).smallest_normal
    err = (got.double() - expect).abs()
    assert bool((err <= bound).all()), f"{what}: {int((err > bound).sum())} values off, worst {err.max().item()}"


@pytest.mark.parametrize("layout", ["contiguous", "qkv", "transposed"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rot_dim", [DIM, 10], ids=["full", "partial"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_reference(dtype, tensor_format, interleaved, rot_dim, mode, layout):
    generator = torch.Generator().manual_seed(zlib.crc32(f"{dtype}{tensor_format}{interleaved}{rot_dim}{mode}".encode()))
    shape, freqs, start, cu, cp, rank = _problem(tensor_format, mode, rot_dim, interleaved, generator)
    values = _edge_values(shape, dtype, generator)
    t = _as_view(values, layout, generator).requires_grad_()
    args = dict(tensor_format=tensor_format, start_positions=start, interleaved=interleaved, cu_seqlens=cu,
                cp_size=cp, cp_rank=rank)
    out = apply_rotary_pos_emb(t, freqs, fused=True, **args)
    assert out.dtype == dtype and out.shape == t.shape and out.is_contiguous()

    t64 = values.double().requires_grad_()
    expect = ref.rope(t64, freqs, **args)
    _assert_within(out, expect, _pair_magnitude(values, rot_dim, interleaved), dtype, "forward")

    grad = torch.randn(shape, generator=generator).to(dtype)
    out.backward(grad)
    (expect_grad,) = torch.autograd.grad(expect, t64, grad.double())
    _assert_within(t.grad, expect_grad, _pair_magnitude(grad, rot_dim, interleaved), dtype, "backward")
    # TransformerEngine's fused=False gives the same values: one kernel serves both
    assert torch.equal(apply_rotary_pos_emb(t.detach(), freqs, fused=False, **args), out.detach())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True])
def test_pass_through_channels_copied_bit_for_bit(dtype, interleaved):
    """Channels past freqs' last dim keep their bits, NaN payloads and infinities included."""
    t = torch.randn(4, 2, 3, 12).to(dtype)
    bits = t.view(torch.int32 if dtype == torch.float32 else torch.int16)
    bits[..., 8] = 0x7FC01234 if dtype == torch.float32 else 0x7E21  # NaN with a payload
    t[..., 9] = float("-inf")
    t[..., 10] = -0.0
    freqs = torch.rand(4, 1, 1, 8) * 6
    out = apply_rotary_pos_emb(t, freqs, interleaved=interleaved)
    itype = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(out[..., 8:].contiguous().view(itype), t[..., 8:].contiguous().view(itype))


def test_gradcheck():
    """The backward against finite differences, computed in float64 around the float32 kernel (RoPE is
    linear in t, so the differences are exact up to float32 rounding), for each layout."""
    generator = torch.Generator().manual_seed(7)
    cases = [("sbhd", False, None, 1, 0), ("bshd", True, None, 2, 1), ("thd", False, CU, 1, 0),
             ("thd", True, CU_CP, 2, 1)]
    for tensor_format, interleaved, cu, cp, rank in cases:
        cu_t = torch.tensor(cu, dtype=torch.int32) if cu else None
        shape = (cu[-1] // cp, 2, 6) if cu else (4, 2, 2, 6)
        freqs = torch.rand(16, 1, 1, 4, generator=generator) * 6
        x = torch.randn(shape, generator=generator, dtype=torch.float64, requires_grad=True)

        def f(x64):
            return apply_rotary_pos_emb(x64.float(), freqs, tensor_format, interleaved=interleaved, cu_seqlens=cu_t,
                                        cp_size=cp, cp_rank=rank).double()

        assert torch.autograd.gradcheck(f, (x,), eps=1e-3, atol=1e-3, rtol=1e-3)


def test_backward_keeps_only_positions_and_angles():
    """What autograd saves: freqs and the index tensors, never t (RoPE's backward does not read it)."""
    t = torch.randn(32, 2, 4, 16, requires_grad=True)
    freqs = RotaryPositionEmbedding(16)(32)
    saved = []

    def pack(x):
        saved.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = apply_rotary_pos_emb(t, freqs, "sbhd")
    assert [s.shape for s in saved if s is not None] == [freqs.shape]
    assert all(s.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for s in saved if s is not None)
    out.sum().backward()
    assert t.grad is not None


def test_compiles_fullgraph_forward_and_backward():
    freqs = RotaryPositionEmbedding(12, rotary_percent=0.75, interleaved=True)(10)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)

    def f(q, k):
        a = apply_rotary_pos_emb(q, freqs, "bshd", interleaved=True, fused=True)
        b = apply_rotary_pos_emb(k, freqs, "thd", interleaved=True, fused=True, cu_seqlens=cu)
        return a.sum() + (b * b).sum()

    q = torch.randn(2, 10, 3, 12, requires_grad=True)
    k = torch.randn(10, 3, 12, requires_grad=True)
    compiled = torch.compile(f, fullgraph=True)
    loss = compiled(q, k)
    loss.backward()
    grads = q.grad.clone(), k.grad.clone()
    q.grad = k.grad = None
    expect = f(q, k)
    expect.backward()
    torch.testing.assert_close(loss, expect)
    assert torch.equal(grads[0], q.grad) and torch.equal(grads[1], k.grad)


def test_opcheck():
    ops = torch.ops.te_fuser
    freqs = torch.rand(8, 1, 1, 4)
    x = torch.randn(6, 2, 3, 8, requires_grad=True)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    torch.library.opcheck(ops.rope_forward, (x, freqs, None, None, 0, False, 1, 0))
    torch.library.opcheck(ops.rope_forward, (x[:, 0], freqs, None, cu, 2, True, 1, 0))
    torch.library.opcheck(ops.rope_backward, (x.detach(), freqs, torch.tensor([0, 2], dtype=torch.int32), None,
                                              0, False, 1, 0))


def test_empty_inputs():
    freqs = torch.rand(4, 1, 1, 8)
    for shape, fmt, cu in [((0, 2, 3, 8), "sbhd", None), ((2, 0, 3, 8), "bshd", None),
                           ((0, 3, 8), "thd", torch.tensor([0], dtype=torch.int32)),
                           ((4, 0, 8), "thd", torch.tensor([0, 4], dtype=torch.int32))]:
        t = torch.randn(shape, requires_grad=True)
        out = apply_rotary_pos_emb(t, freqs, fmt, cu_seqlens=cu)
        out.sum().backward()
        assert out.shape == shape and t.grad.shape == shape


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_position_embedding_table(interleaved):
    """TransformerEngine's table: positions times base^(-2k/dim), each angle on its pair of channels."""
    module = RotaryPositionEmbedding(24, rotary_percent=0.5, rotary_base=500.0, interleaved=interleaved)
    table = module(20, offset=3)
    assert table.dtype == torch.float32 and table.shape == (20, 1, 1, 12) and table.is_contiguous()
    torch.testing.assert_close(table.double(), ref.rope_angles(20, 12, 500.0, interleaved, offset=3),
                               rtol=1e-6, atol=1e-6)
    assert "inv_freq" in module.state_dict()
    # position interpolation: fixed (within the factor's reach), dynamic beyond it
    fixed = RotaryPositionEmbedding(8, seq_len_interpolation_factor=2, pretrained_max_position_embeddings=16)
    torch.testing.assert_close(fixed(30).double(), ref.rope_angles(30, 8, position_scale=0.5), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fixed(40).double(), ref.rope_angles(40, 8, position_scale=16 / 40), rtol=1e-6,
                               atol=1e-6)


def test_rotation_of_the_table_is_the_complex_rotation():
    """With RotaryPositionEmbedding's angles, RoPE multiplies each pair (as a complex number) by e^(i p theta_k),
    and the backward rotates by -p theta_k."""
    dim, seq = 8, 5
    freqs = RotaryPositionEmbedding(dim)(seq)
    t = torch.randn(seq, 1, 1, dim, dtype=torch.float32, requires_grad=True)
    out = apply_rotary_pos_emb(t, freqs)
    theta = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    turn = torch.polar(torch.ones(seq, dim // 2, dtype=torch.float64), torch.arange(seq)[:, None] * theta)
    z = torch.complex(t[:, 0, 0, :dim // 2].double(), t[:, 0, 0, dim // 2:].double()) * turn
    torch.testing.assert_close(out[:, 0, 0].double(), torch.cat((z.real, z.imag), -1), rtol=1e-5, atol=1e-5)
    g = torch.randn(seq, 1, 1, dim)
    out.backward(g)
    zg = torch.complex(g[:, 0, 0, :dim // 2].double(), g[:, 0, 0, dim // 2:].double()) * turn.conj()
    torch.testing.assert_close(t.grad[:, 0, 0].double(), torch.cat((zg.real, zg.imag), -1), rtol=1e-5, atol=1e-5)


def test_exported_where_transformer_engine_exports_them():
    assert te_fuser.RotaryPositionEmbedding is RotaryPositionEmbedding
    assert te_fuser.attention.RotaryPositionEmbedding is RotaryPositionEmbedding
    assert set(te_rope.__all__) == {"RotaryPositionEmbedding", "apply_rotary_pos_emb"}


def _bad_calls():
    """(what, call, error, message)."""
    t = torch.randn(6, 2, 3, 8)
    f = torch.rand(8, 1, 1, 8)
    thd = torch.randn(7, 3, 8)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    A = apply_rotary_pos_emb
    return {
        "freqs 2-D": (lambda: A(t, f[:, 0, 0]), ValueError, "freqs must be"),
        "freqs third dim": (lambda: A(t, f.expand(8, 1, 2, 8)), ValueError, "freqs must be"),
        "freqs batch": (lambda: A(t, torch.rand(8, 3, 1, 8)), ValueError, r"freqs must be .* b = 2"),
        "odd rot dim": (lambda: A(t, f[..., :5]), ValueError, r"freqs' last dim \(5\) must be even"),
        "rot dim above head dim": (lambda: A(t, torch.rand(8, 1, 1, 10)), ValueError, "at most the head dim"),
        "freqs too short": (lambda: A(t, f[:4]), ValueError, "freqs covers 4 positions"),
        "freqs integer": (lambda: A(t, f.long()), TypeError, "freqs must be a floating"),
        "t float64": (lambda: A(t.double(), f), TypeError, "t must have dtype"),
        "t 3-D in sbhd": (lambda: A(thd, f), ValueError, "t must be"),
        "format": (lambda: A(t, f, "hbsd"), ValueError, "tensor_format must be one of"),
        "thd without cu_seqlens": (lambda: A(thd, f, "thd"), ValueError, "cu_seqlens must not be None"),
        "cu_seqlens not monotone": (lambda: A(thd, f, "thd", cu_seqlens=torch.tensor([0, 5, 3, 7], dtype=torch.int32)),
                                    ValueError, "cu_seqlens must start at 0 and be non-decreasing"),
        "cu_seqlens not from 0": (lambda: A(thd, f, "thd", cu_seqlens=torch.tensor([1, 3, 7], dtype=torch.int32)),
                                  ValueError, "cu_seqlens must start at 0"),
        "cu_seqlens wrong total": (lambda: A(thd, f, "thd", cu_seqlens=torch.tensor([0, 3, 6], dtype=torch.int32)),
                                   ValueError, r"cu_seqlens must end at the token count of t \(7\)"),
        "cu_seqlens float": (lambda: A(thd, f, "thd", cu_seqlens=cu.float()), TypeError, "cu_seqlens must be an int32"),
        "cu_seqlens 2-D": (lambda: A(thd, f, "thd", cu_seqlens=cu[None]), ValueError, "cu_seqlens must be 1-D"),
        "cp multiple": (lambda: A(torch.randn(4, 3, 8), f, "thd", cu_seqlens=torch.tensor([0, 6, 8], dtype=torch.int32),
                                  cp_size=2), ValueError, "multiple of 2 . cp_size"),
        "thd sequence beyond freqs": (lambda: A(thd, f[:3], "thd", cu_seqlens=cu), ValueError, "freqs covers 3"),
        "start positions beyond freqs": (lambda: A(t, f, start_positions=torch.tensor([0, 3], dtype=torch.int32)),
                                         ValueError, "sequence 1 needs positions 3 to 8"),
        "negative start": (lambda: A(t, f, start_positions=torch.tensor([0, -1], dtype=torch.int32)),
                           ValueError, "start_positions must be >= 0"),
        "start positions count": (lambda: A(t, f, start_positions=torch.tensor([0], dtype=torch.int32)),
                                  ValueError, "start_positions must have one entry per sequence"),
        "start positions with cp": (lambda: A(t, torch.rand(12, 1, 1, 8), start_positions=torch.zeros(2, dtype=torch.int32),
                                              cp_size=2), ValueError, "start_positions is supported with cp_size=1"),
        "cp_rank": (lambda: A(t, f, cp_size=2, cp_rank=2), ValueError, "cp_rank must be an int in"),
        "cp_size": (lambda: A(t, f, cp_size=0), ValueError, "cp_size must be an int >= 1"),
        "cp odd local length": (lambda: A(t[:5], torch.rand(10, 1, 1, 8), cp_size=2), ValueError,
                                "local sequence length must be even"),
        "cp freqs too short": (lambda: A(t, f, cp_size=2), ValueError, "freqs covers 8 positions; sequences of 12"),
        "freqs with grad": (lambda: A(t, f.requires_grad_()), NotImplementedError, "a gradient for freqs"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_arguments_raise_naming_them(case):
    call, error, message = _bad_calls()[case]
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("case", ["cu_seqlens not monotone", "cu_seqlens wrong total", "freqs too short",
                                  "odd rot dim", "start positions beyond freqs", "cp odd local length"])
def test_checks_after_the_binding_refused(case):
    """The wrapper checks only when the binding refused (call_checked): each such case is a binding refusal too."""
    raw = {
        "cu_seqlens not monotone": (torch.randn(7, 3, 8), torch.rand(8, 1, 1, 8), None,
                                    torch.tensor([0, 5, 3, 7], dtype=torch.int32), 2, 1, 0),
        "cu_seqlens wrong total": (torch.randn(7, 3, 8), torch.rand(8, 1, 1, 8), None,
                                   torch.tensor([0, 3, 6], dtype=torch.int32), 2, 1, 0),
        "freqs too short": (torch.randn(6, 2, 3, 8), torch.rand(4, 1, 1, 8), None, None, 0, 1, 0),
        "odd rot dim": (torch.randn(6, 2, 3, 8), torch.rand(8, 1, 1, 5), None, None, 0, 1, 0),
        "start positions beyond freqs": (torch.randn(6, 2, 3, 8), torch.rand(8, 1, 1, 8),
                                         torch.tensor([0, 3], dtype=torch.int32), None, 0, 1, 0),
        "cp odd local length": (torch.randn(5, 2, 3, 8), torch.rand(10, 1, 1, 8), None, None, 0, 2, 0),
    }[case]
    x, freqs, start, cu, fmt, cp, rank = raw
    call, error, message = _bad_calls()[case]
    assert_refused_then_named(call, lambda: torch.ops.te_fuser.rope_forward(x, freqs, start, cu, fmt, False, cp, rank),
                              error, message)


_CUDA = torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key("te_fuser::rope_forward", "CUDA")


@pytest.mark.skipif(not _CUDA, reason="needs a GPU and a CUDA build of te_fuser")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_matches_float64_reference(dtype, tensor_format, interleaved, mode):
    generator = torch.Generator().manual_seed(11)
    shape, freqs, start, cu, cp, rank = _problem(tensor_format, mode, 10, interleaved, generator)
    values = _edge_values(shape, dtype, generator)
    t = _as_view(values, "qkv", generator).cuda().requires_grad_()
    args = dict(tensor_format=tensor_format, start_positions=start, interleaved=interleaved, cu_seqlens=cu,
                cp_size=cp, cp_rank=rank)
    cuda_args = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    out = apply_rotary_pos_emb(t, freqs.cuda(), **cuda_args)
    t64 = values.double().requires_grad_()
    expect = ref.rope(t64, freqs, **args)
    _assert_within(out.cpu(), expect, _pair_magnitude(values, 10, interleaved), dtype, "forward")
    grad = torch.randn(shape, generator=generator).to(dtype)
    out.backward(grad.cuda())
    (expect_grad,) = torch.autograd.grad(expect, t64, grad.double())
    _assert_within(t.grad.cpu(), expect_grad, _pair_magnitude(grad, 10, interleaved), dtype, "backward")


@pytest.mark.skipif(not _CUDA, reason="needs a GPU and a CUDA build of te_fuser")
def test_cuda_misplaced_tokens_are_nan():
    """On the GPU, cu_seqlens and start_positions are not read on the host: tokens they misplace come out NaN."""
    t = torch.randn(6, 2, 2, 8, device="cuda")
    out = apply_rotary_pos_emb(t, torch.rand(8, 1, 1, 8, device="cuda"),
                               start_positions=torch.tensor([0, 5], dtype=torch.int32, device="cuda"))
    assert not out[:, 0].isnan().any() and out[:3, 1].isfinite().all() and out[3:, 1].isnan().all()
