"""Fused element-wise / normalization kernels against float64 torch autograd references."""

import pytest
import torch
import torch.nn.functional as F

import te_fuser  # noqa: F401
from te_fuser.kernels import cpu, fused

from _binding_refusals import assert_refused_then_named
from activation_reference import ACTIVATIONS64, GATED64, activation64

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Output rounding of the dtype plus float32 math; bounds relative to max |reference|.
TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _close(actual, expected, dtype, scale=None):
    expected = expected.double()
    scale = scale if scale is not None else max(expected.abs().max().item(), 1.0)
    err = (actual.double() - expected).abs().max().item()
    assert err <= TOL[dtype] * scale, f"max error {err} > {TOL[dtype] * scale}"


def _rand(*shape, dtype=torch.float32, scale=3.0):
    x = torch.randn(*shape, dtype=torch.float64) * scale
    edges = torch.tensor([0.0, -0.0, 1e-3, -12.0], dtype=torch.float64)  # edge values
    n = min(x.numel(), edges.numel())
    x.view(-1)[:n] = edges[:n]
    return x.to(dtype)


ACTS = list(ACTIVATIONS64)
GATED = list(GATED64)

# The fused ops are built once per x86-64 level: baseline (portable), v3 (avx2), v4 (avx512 and up).
TIERS = [t for t in cpu.available_isa() if t in ("portable", "avx2", "avx512")]


@pytest.fixture(params=TIERS)
def tier(request):
    with cpu.isa(request.param):
        yield request.param


def _ref_act(act, z):
    return activation64(z, act)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", [(3, 5, 70), (1, 1), (600, 33), (2, 1100)])
def test_bias_activation_forward_and_backward(dtype, act, shape, tier):
    x = _rand(*shape, dtype=dtype)
    b = _rand(shape[-1], dtype=dtype)
    g = _rand(*shape, dtype=dtype, scale=1.0)
    y = fused.bias_activation(x, b, act)
    assert y.dtype == dtype and y.shape == x.shape
    x64 = x.double().requires_grad_()
    b64 = b.double().requires_grad_()
    ref = _ref_act(act, x64 + b64)
    ref.backward(g.double())
    _close(y, ref.detach(), dtype)
    dx, db = fused.activation_bias_backward(g, x, b, act)
    _close(dx, x64.grad, dtype)
    _close(db, b64.grad, dtype, scale=max(b64.grad.abs().max().item(), 1.0) * (shape[0] if len(shape) == 2 else 15))


def test_dbias_is_deterministic_across_thread_counts():
    x, g, b = _rand(4096, 64), _rand(4096, 64), _rand(64)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _, db1 = fused.activation_bias_backward(g, x, b, "gelu")
        torch.set_num_threads(max(old, 2))
        _, db2 = fused.activation_bias_backward(g, x, b, "gelu")
    finally:
        torch.set_num_threads(old)
    assert torch.equal(db1, db2)


def test_gelu_matches_torch_tanh_gelu_exactly_enough():
    # The tanh form, not the erf one: they differ by up to ~5e-4 near |x| = 2.
    x = torch.linspace(-8, 8, 4001)
    y = fused.bias_activation(x, None, "gelu")
    assert (y - F.gelu(x, approximate="tanh")).abs().max() < 1e-6
    assert (y - F.gelu(x)).abs().max() > 1e-4


def test_gelu_special_values_are_torchs():
    # Infinities, NaN, overflowing x^3 and the far negative tail, where the kernel's form
    # x / (1 + exp(-2u)) must give torch's -0 / NaN rather than a tiny value or an infinity.
    x = torch.tensor([float("-inf"), float("inf"), float("nan"), -1e30, 1e30, -3e12, 3e12, -20.0, -12.0,
                      -9.9, 20.0, 0.0, -0.0, 1e-30, -1e-30, 1e-45, -1e-45])
    y = fused.bias_activation(x, None, "gelu")
    ref = F.gelu(x, approximate="tanh")
    assert torch.equal(y.isnan(), ref.isnan())
    finite = ~ref.isnan()
    assert torch.equal(y[finite].signbit(), ref[finite].signbit())
    assert torch.equal(y.isinf(), ref.isinf()) and torch.equal(y[ref.isinf()], ref[ref.isinf()])
    finite &= ~ref.isinf()
    assert ((y[finite] - ref[finite]).abs() <= 1e-6 * ref[finite].abs().clamp(min=1.0)).all()
    dx, _ = fused.activation_bias_backward(torch.ones_like(x), x, None, "gelu")
    dref = torch.ops.aten.gelu_backward(torch.ones_like(x), x, approximate="tanh")
    assert torch.equal(dx.isnan(), dref.isnan())
    assert torch.allclose(dx[~dref.isnan()], dref[~dref.isnan()], rtol=0, atol=2e-6)


def test_gelu_float64_accuracy_over_its_range():
    # The tanh approximation evaluated in float64 is the reference; float32 inputs drawn over the
    # range where GELU and its gradient change, both tails included.
    x = torch.cat([torch.randn(20000) * 4, torch.empty(2000).uniform_(-60, 60)])
    xd = x.double()
    u = 0.7978845608028654 * (xd + 0.044715 * xd ** 3)
    y = fused.bias_activation(x, None, "gelu")
    assert (y.double() - 0.5 * xd * (1 + torch.tanh(u))).abs().max() < 2e-6 * xd.abs().clamp(min=1).max()
    dx, _ = fused.activation_bias_backward(torch.ones_like(x), x, None, "gelu")
    t = torch.tanh(u)
    dref = 0.5 * (1 + t) + 0.5 * xd * (1 - t * t) * 0.7978845608028654 * (1 + 3 * 0.044715 * xd * xd)
    assert (dx.double() - dref).abs().max() < 2e-6


# Zeros, tiny, past the kernels' exp clamps (|x| > 87 / 1.702 / 2u), huge yet finite in every float32
# formula, infinite and NaN.
EDGES = [0.0, -0.0, 1e-30, -1e-30, 1e-3, -12.0, 20.0, -20.0, 60.0, -60.0, 100.0, -100.0, 1e12, -1e12,
         float("inf"), float("-inf"), float("nan")]


def _assert_matches(got, ref, what, rtol=2e-6):
    """NaN where the float64 reference is NaN, the same infinities where it rounds to one, and the
    finite values within rtol relative (1 below 1)."""
    ref32 = ref.float()
    got = got.double()
    assert torch.equal(got.isnan(), ref32.isnan()), f"{what}: NaN at {got.isnan().nonzero().flatten().tolist()}, " \
        f"reference at {ref32.isnan().nonzero().flatten().tolist()}"
    inf = ref32.isinf()
    assert torch.equal(got[inf], ref32[inf].double()) and not got[~inf].isinf().any(), f"{what}: infinities"
    finite = ~(inf | ref32.isnan())
    err = ((got[finite] - ref[finite]).abs() / ref[finite].abs().clamp(min=1.0)).max().item()
    assert err <= rtol, f"{what}: relative error {err}"


@pytest.mark.parametrize("act", ACTS)
def test_activation_edge_values(act, tier):
    """Every activation at its edges against float64 torch: the values, the NaN and the infinities."""
    x = torch.tensor(EDGES)
    x64 = x.double().requires_grad_()
    ref = _ref_act(act, x64)
    ref.backward(torch.ones_like(ref))
    _assert_matches(fused.bias_activation(x, None, act), ref.detach(), f"{act} forward")
    dx, _ = fused.activation_bias_backward(torch.ones_like(x), x, None, act, compute_dbias=False)
    _assert_matches(dx, x64.grad, f"{act} backward")


@pytest.mark.parametrize("act", GATED)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_activation(act, dtype, tier):
    """TE's gated activations against float64 torch: act(first half) * second half, and the gradient."""
    x = _rand(7, 3, 130, dtype=dtype)
    g = _rand(7, 3, 65, dtype=dtype, scale=1.0)
    x64 = x.double().requires_grad_()
    ref = activation64(x64, act)
    ref.backward(g.double())
    y = fused.gated_activation(x, act)
    assert y.dtype == dtype and y.shape == (7, 3, 65)
    _close(y, ref.detach(), dtype)
    _close(fused.gated_activation_backward(g, x, act), x64.grad, dtype)


@pytest.mark.parametrize("act", GATED)
def test_gated_activation_edge_values(act, tier):
    """The edge values in the activated half (gates of +-1.5) and in the gate (activated half 0.75)."""
    edges = torch.tensor(EDGES)
    ones = torch.full_like(edges, 0.75)
    gates = torch.where(torch.arange(len(EDGES)) % 2 == 0, 1.5, -1.5)
    x = torch.stack([torch.cat([edges, gates]), torch.cat([ones, edges])])
    x64 = x.double().requires_grad_()
    ref = activation64(x64, act)
    ref.backward(torch.ones_like(ref))
    _assert_matches(fused.gated_activation(x, act), ref.detach(), f"{act} forward")
    _assert_matches(fused.gated_activation_backward(torch.ones(2, len(EDGES)), x, act), x64.grad, f"{act} backward")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("cols", [96, 512, 1100])  # rows of one tile (loaded once) and of several
def test_norms(dtype, zero_centered, kind, cols):
    x = _rand(300, cols, dtype=dtype) + 0.5
    w = _rand(cols, dtype=dtype, scale=0.5)
    b = _rand(cols, dtype=dtype, scale=0.5)
    g = _rand(300, cols, dtype=dtype, scale=1.0)
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
    w_eff = w64 + 1 if zero_centered else w64
    if kind == "rms":
        ref = F.rms_norm(x64, (cols,), w_eff, 1e-5)
        y, rstd = fused.rmsnorm(x, w, 1e-5, zero_centered)
        dx, dw = fused.rmsnorm_backward(g, x, rstd, w, zero_centered)
    else:
        ref = F.layer_norm(x64, (cols,), w_eff, b64, 1e-5)
        y, mean, rstd = fused.layernorm(x, w, b, 1e-5, zero_centered)
        dx, dw, db = fused.layernorm_backward(g, x, mean, rstd, w, zero_centered)
        _close(mean, x64.detach().mean(-1), torch.float32)
    ref.backward(g.double())
    assert rstd.dtype == torch.float32 and rstd.shape == (300,)
    _close(y, ref.detach(), dtype)
    _close(dx, x64.grad, dtype)
    _close(dw, w64.grad, dtype, scale=max(w64.grad.abs().max().item(), 1.0) * 20)
    if kind == "ln":
        _close(db, b64.grad, dtype, scale=max(b64.grad.abs().max().item(), 1.0) * 20)


def test_float32_gradcheck_by_finite_differences():
    # Kernels compute in float32 at most, so torch.autograd.gradcheck (float64) does
    # not apply; central differences in float32 with a matching tolerance instead.
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    w = torch.randn(16)
    b = torch.randn(16)
    g = torch.randn(4, 16)
    y, mean, rstd = fused.layernorm(x, w, b, 1e-5)
    dx, _, _ = fused.layernorm_backward(g, x, mean, rstd, w)
    eps = 1e-2
    for i, j in [(0, 0), (1, 5), (3, 15)]:
        xp, xm = x.clone(), x.clone()
        xp[i, j] += eps
        xm[i, j] -= eps
        fd = ((fused.layernorm(xp, w, b)[0] - fused.layernorm(xm, w, b)[0]) * g).sum() / (2 * eps)
        assert abs(fd.item() - dx[i, j].item()) < 2e-2 * max(1.0, abs(fd.item()))


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_output_equals_quantizing_the_output(fp8_dtype):
    x = _rand(64, 48, dtype=torch.bfloat16)
    b = _rand(48, dtype=torch.bfloat16)
    scale = torch.tensor([3.0])
    amax = torch.zeros(1)
    y8 = fused.bias_activation(x, b, "gelu", fp8_out=(fp8_dtype, scale, amax))
    y = fused.bias_activation(x.float(), b.float(), "gelu")
    # Reference: torch's own float8 cast of the float32 output times the scale.
    ref = (y * scale).to(fp8_dtype)
    assert y8.dtype == fp8_dtype
    assert torch.equal(y8.view(torch.uint8), ref.view(torch.uint8))
    assert amax.item() == y.abs().max().item()
    # amax accumulates as a running max.
    fused.bias_activation(x * 0, None, "relu", fp8_out=(fp8_dtype, scale, amax))
    assert amax.item() == y.abs().max().item()
    # The norms emit FP8 the same way.
    w = torch.ones(48, dtype=torch.bfloat16)
    n8, _ = fused.rmsnorm(x, w, fp8_out=(fp8_dtype, scale, torch.zeros(1)))
    n, _ = fused.rmsnorm(x.float(), w.float())
    assert torch.equal(n8.view(torch.uint8), (n * scale).to(fp8_dtype).view(torch.uint8))
    # And every gated activation.
    for act in GATED:
        amax = torch.zeros(1)
        q8 = fused.gated_activation(x, act, fp8_out=(fp8_dtype, scale, amax))
        q = fused.gated_activation(x.float(), act)
        assert q8.shape == (64, 24) and q8.dtype == fp8_dtype
        assert torch.equal(q8.view(torch.uint8), (q * scale).to(fp8_dtype).view(torch.uint8)), act
        assert amax.item() == q.abs().max().item(), act


def test_fp8_gradient_output():
    x, g, b = _rand(32, 16), _rand(32, 16), _rand(16)
    amax = torch.zeros(1)
    dx8, db = fused.activation_bias_backward(g, x, b, "gelu", fp8_out=(torch.float8_e5m2, torch.tensor([2.0]), amax))
    dx, db_ref = fused.activation_bias_backward(g, x, b, "gelu")
    assert torch.equal(dx8.view(torch.uint8), (dx * 2.0).to(torch.float8_e5m2).view(torch.uint8))
    assert torch.equal(db, db_ref) and amax.item() == dx.abs().max().item()


def test_bad_arguments_raise_clear_errors():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="bias must be 1-D"):
        fused.bias_activation(x, torch.randn(7))
    with pytest.raises(TypeError, match="x must have dtype"):
        fused.bias_activation(x.double())
    with pytest.raises(ValueError, match="contiguous"):
        fused.bias_activation(x.t())
    with pytest.raises(ValueError, match="activation must be one of"):
        fused.bias_activation(x, None, "tanh")
    with pytest.raises(ValueError, match="even"):
        fused.gated_activation(torch.randn(2, 5))
    with pytest.raises(ValueError, match="activation must be one of"):
        fused.gated_activation(torch.randn(2, 4), "gelu")  # not a gated activation
    with pytest.raises(ValueError, match="activation must be one of"):
        fused.bias_activation(x, None, "swiglu")  # a gated one needs gated_activation
    with pytest.raises(ValueError, match="grad must have the shape"):
        fused.activation_bias_backward(torch.randn(4, 7), x)
    with pytest.raises(ValueError, match="eps"):
        fused.rmsnorm(x, torch.ones(8), eps=-1.0)
    with pytest.raises(TypeError, match="fp8_out"):
        fused.bias_activation(x, fp8_out=(torch.float8_e4m3fn, torch.ones(1)))
    # The raw op checks on its own too.
    with pytest.raises(RuntimeError, match="bias must be 1-D"):
        torch.ops.te_fuser.bias_act_forward(x, torch.randn(3), 1)
    with pytest.raises(RuntimeError, match="scale must be a float32 tensor with one element"):
        torch.ops.te_fuser.bias_act_forward_fp8(x, None, 1, torch.float8_e4m3fn, torch.ones(2), torch.zeros(1))
    with pytest.raises(RuntimeError, match=r"activation must be 0 \(none\), .* 5 \(silu\), got 6"):
        torch.ops.te_fuser.bias_act_forward(x, None, 6)
    with pytest.raises(RuntimeError, match=r"a gated activation must be 1 \(geglu\), .*, got 0"):
        torch.ops.te_fuser.gated_act_forward(x, 0)


def _bad_calls():
    """(what, wrapper call, raw op call, exception, message): each bad argument of the wrappers, which
    check only after the binding refused (fused.call_checked), so the binding must refuse them all."""
    ops = torch.ops.te_fuser
    x, g, w, b = torch.randn(4, 8), torch.randn(4, 8), torch.ones(8), torch.zeros(8)
    y, mean, rstd = fused.layernorm(x, w, b)
    _, rstd_rms = fused.rmsnorm(x, w)
    bad_w = torch.ones(7)
    return [
        ("layernorm weight length", lambda: fused.layernorm(x, bad_w, b),
         lambda: ops.layernorm_forward(x, bad_w, b, 1e-5, False, None, None, None), ValueError, "weight must be 1-D"),
        ("layernorm bias dtype", lambda: fused.layernorm(x, w, b.double()),
         lambda: ops.layernorm_forward(x, w, b.double(), 1e-5, False, None, None, None), TypeError, "bias must have"),
        ("layernorm x dtype", lambda: fused.layernorm(x.double(), w, b),
         lambda: ops.layernorm_forward(x.double(), w, b, 1e-5, False, None, None, None), TypeError, "x must have dtype"),
        ("layernorm x layout", lambda: fused.layernorm(x.t(), w[:4], b[:4]),
         lambda: ops.layernorm_forward(x.t(), w[:4], b[:4], 1e-5, False, None, None, None), ValueError, "contiguous"),
        ("layernorm fp8 scale", lambda: fused.layernorm(x, w, b, fp8_out=(torch.float8_e4m3fn, torch.ones(2), torch.zeros(1))),
         lambda: ops.layernorm_forward(x, w, b, 1e-5, False, torch.float8_e4m3fn, torch.ones(2), torch.zeros(1)),
         TypeError, "scale"),
        ("layernorm weight on meta", lambda: fused.layernorm(x, w.to("meta"), b),
         lambda: ops.layernorm_forward(x, w.to("meta"), b, 1e-5, False, None, None, None), ValueError,
         "weight is on meta but x is on cpu"),
        ("layernorm_backward rstd on meta", lambda: fused.layernorm_backward(g, x, mean, rstd.to("meta"), w),
         lambda: ops.layernorm_backward(g, x, mean, rstd.to("meta"), w, False), ValueError, "rstd is on meta"),
        ("layernorm_backward grad shape", lambda: fused.layernorm_backward(g[:3], x, mean, rstd, w),
         lambda: ops.layernorm_backward(g[:3], x, mean, rstd, w, False), ValueError, "grad must have the shape"),
        ("layernorm_backward mean dtype", lambda: fused.layernorm_backward(g, x, mean.double(), rstd, w),
         lambda: ops.layernorm_backward(g, x, mean.double(), rstd, w, False), TypeError, "mean must have dtype"),
        ("layernorm_backward rstd rows", lambda: fused.layernorm_backward(g, x, mean, rstd[:3], w),
         lambda: ops.layernorm_backward(g, x, mean, rstd[:3], w, False), ValueError, "rstd must have shape"),
        ("rmsnorm weight length", lambda: fused.rmsnorm(x, bad_w),
         lambda: ops.rmsnorm_forward(x, bad_w, 1e-5, False, None, None, None), ValueError, "weight must be 1-D"),
        ("rmsnorm_backward rstd dtype", lambda: fused.rmsnorm_backward(g, x, rstd_rms.half(), w),
         lambda: ops.rmsnorm_backward(g, x, rstd_rms.half(), w, False), TypeError, "rstd must have dtype"),
        ("bias_activation bias length", lambda: fused.bias_activation(x, bad_w),
         lambda: ops.bias_act_forward(x, bad_w, 1), ValueError, "bias must be 1-D"),
        ("activation_bias_backward grad dtype", lambda: fused.activation_bias_backward(g.double(), x, b),
         lambda: ops.act_bias_backward(g.double(), x, b, 1, True, None, None, None), TypeError, "grad must have dtype"),
        ("gated_activation_backward grad shape", lambda: fused.gated_activation_backward(g, x),
         lambda: ops.gated_act_backward(g, x, 5), ValueError, "grad must have shape"),
        ("bias_activation bias on meta", lambda: fused.bias_activation(x, b.to("meta")),
         lambda: ops.bias_act_forward(x, b.to("meta"), 1), ValueError, "bias is on meta"),
        ("gated_activation x dtype", lambda: fused.gated_activation(x.double()),
         lambda: ops.gated_act_forward(x.double(), 5), TypeError, "x must have dtype"),
        ("gated_activation x odd last dimension", lambda: fused.gated_activation(x[:, :7].contiguous()),
         lambda: ops.gated_act_forward(x[:, :7].contiguous(), 5), ValueError, "even"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())), ids=[call[0] for call in _bad_calls()])
def test_wrappers_name_what_the_binding_refuses(case):
    assert_refused_then_named(*_bad_calls()[case][1:])


def test_empty_inputs():
    for shape in [(0, 8), (4, 0)]:
        x = torch.randn(*shape)
        assert fused.bias_activation(x, None, "gelu").shape == shape
        dx, db = fused.activation_bias_backward(x, x, None, "gelu")
        assert dx.shape == shape and db.shape == (shape[1],) and (db == 0).all()
    y, rstd = fused.rmsnorm(torch.randn(0, 8), torch.ones(8))
    assert y.shape == (0, 8) and rstd.shape == (0,)


def test_activation_ops_opcheck_and_compile():
    """The schemas and fake kernels of the activation ops, for every activation code; a gated one
    compiles with fullgraph."""
    ops = torch.ops.te_fuser
    x, g, b = _rand(6, 10), _rand(6, 5, scale=1.0), _rand(10)
    for act, code in fused.ACTIVATIONS.items():
        torch.library.opcheck(ops.bias_act_forward, (x, b, code))
        torch.library.opcheck(ops.act_bias_backward, (x, x, b, code, True))
    # test_schema is left out for the FP8 output: it compares with arithmetic that float8 tensors lack
    fp8_checks = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for act in GATED:
        code = fused.ACTIVATIONS[GATED64[act]]
        torch.library.opcheck(ops.gated_act_forward, (x, code))
        torch.library.opcheck(ops.gated_act_backward, (g, x, code))
        torch.library.opcheck(ops.gated_act_forward_fp8, (x, code, torch.float8_e4m3fn, torch.ones(1), torch.zeros(1)),
                              test_utils=fp8_checks)

    def f(t):
        return fused.gated_activation(t, "sreglu") + 1

    assert torch.equal(torch.compile(f, fullgraph=True)(x), f(x))


def test_compiles_fullgraph():
    def f(x, b, w):
        y = fused.bias_activation(x, b, "gelu")
        return fused.rmsnorm(y, w)[0]

    x, b, w = torch.randn(8, 16), torch.randn(16), torch.randn(16)
    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(compiled(x, b, w), f(x, b, w))


_CUDA = torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key(
    "te_fuser::bias_act_forward", "CUDA")


@pytest.mark.skipif(not _CUDA, reason="needs a GPU and a CUDA build of te_fuser")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu(dtype):
    # Same float32 math; tanhf/expf/sqrt may differ by a few ulps between CPU and GPU.
    x = _rand(300, 130, dtype=dtype)
    g = _rand(300, 130, dtype=dtype, scale=1.0)
    b = _rand(130, dtype=dtype)
    w = _rand(130, dtype=dtype, scale=0.5)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)

    def both(fn, *args, **kw):
        cpu = fn(*args, **kw)
        cuda = fn(*[a.cuda() if isinstance(a, torch.Tensor) else a for a in args], **kw)
        cpu, cuda = (cpu, cuda) if isinstance(cpu, tuple) else ((cpu,), (cuda,))
        for a, c in zip(cpu, cuda):
            if a is not None:
                torch.testing.assert_close(c.cpu().float(), a.float(), **tol)

    for act in ACTS:
        both(fused.bias_activation, x, b, act)
        both(fused.activation_bias_backward, g, x, b, act)
    for act in GATED:
        both(fused.gated_activation, x, act)
        both(fused.gated_activation_backward, g[:, :65].contiguous(), x, act)
    y, rstd = fused.rmsnorm(x, w)
    both(fused.rmsnorm, x, w)
    both(fused.rmsnorm_backward, g, x, rstd, w)
    y, mean, rstd = fused.layernorm(x, w, b)
    both(fused.layernorm, x, w, b)
    both(fused.layernorm_backward, g, x, mean, rstd, w)
    # FP8 output: the amax matches exactly, the codes within one FP8 step.
    amax_cpu, amax_gpu = torch.zeros(1), torch.zeros(1, device="cuda")
    scale = torch.tensor([4.0])
    y8 = fused.bias_activation(x, b, "gelu", fp8_out=(torch.float8_e4m3fn, scale, amax_cpu))
    y8g = fused.bias_activation(x.cuda(), b.cuda(), "gelu", fp8_out=(torch.float8_e4m3fn, scale.cuda(), amax_gpu))
    torch.testing.assert_close(y8g.cpu().float(), y8.float(), rtol=2 ** -3, atol=2 ** -9)
    torch.testing.assert_close(amax_gpu.cpu(), amax_cpu, rtol=1e-5, atol=0)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("rows, cols", [(4096, 64), (3001, 40), (2 * 2731 + 7, 24)])
def test_dbias_over_several_row_bands_matches_reference(act, rows, cols):
    """dbias sums per-band partials (bands of about 2^16 elements): 4 bands, 2 bands, and 3 bands
    whose last one holds 7 rows. Each band's rows must reach the float64 reference."""
    x, g, b = _rand(rows, cols), _rand(rows, cols, scale=1.0), _rand(cols)
    x64, b64 = x.double().requires_grad_(), b.double().requires_grad_()
    _ref_act(act, x64 + b64).backward(g.double())
    _, db = fused.activation_bias_backward(g, x, b, act)
    # float32 rounding of act' and of the sums: a small multiple of eps * sum |g| (or of the summed
    # terms g * act', which srelu's act' = 2x makes larger) per column
    bound = 1e-5 * torch.maximum(g.double().abs().sum(0), x64.grad.abs().sum(0))
    err = (db.double() - b64.grad).abs()
    worst = err.argmax().item()
    assert (err <= bound).all(), f"dbias error {err[worst].item()} at column {worst} exceeds {bound[worst].item()}"
