"""attention_fwd / attention_bwd on te_fuser's CPU kernel check their arguments in Python only after the
binding refused them (validate.call_checked): every case they name is a refusal of the binding too, the
checks the binding lacks still run before it, and valid input skips the Python checks."""

import math

import pytest
import torch

from te_fuser.kernels import attention as attn
from te_fuser.kernels import cpu as cpu_kernels

from _binding_refusals import assert_refused_then_named

ops = torch.ops.te_fuser

# The op's arguments after q, k, v (attention_fwd) or dout, q, k, v, out, lse (attention_bwd), in its order.
FWD_DEFAULTS = dict(cu_seqlens_q=None, cu_seqlens_kv=None, seqlens_q=None, seqlens_kv=None, softmax_scale=0.25,
                    causal=False, dropout_p=0.0, seed=0, offset=0, q_descale=None, k_descale=None, v_descale=None,
                    out_dtype=None)
BWD_DEFAULTS = {name: value for name, value in FWD_DEFAULTS.items() if name != "out_dtype"}


def _fwd(q, k, v, **kwargs):
    """attention_fwd(q, k, v, **kwargs), and the raw op with the same arguments."""
    args = {**FWD_DEFAULTS, **kwargs}
    return lambda: attn.attention_fwd(q, k, v, **args), lambda: ops.attention_fwd(q, k, v, *args.values())


def _bwd(dout, q, k, v, out, lse, **kwargs):
    """attention_bwd(dout, q, k, v, out, lse, **kwargs), and the raw op with the same arguments."""
    args = {**BWD_DEFAULTS, **kwargs}
    return (lambda: attn.attention_bwd(dout, q, k, v, out, lse, **args),
            lambda: ops.attention_bwd(dout, q, k, v, out, lse, *args.values()))


def _t(*shape):
    return torch.randn(*shape)


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def _bad_calls():
    """(name, wrapper call, the same arguments to the raw op, error, message): every check of attention_fwd and
    attention_bwd that runs after the binding refused."""
    e4, meta, one = torch.float8_e4m3fn, torch.device("meta"), torch.ones(1)
    q, k, v, dout, out = (_t(2, 8, 4, 16) for _ in range(5))
    lse = _t(2, 4, 8)
    q8, k8, v8 = (t.to(e4) for t in (q, k, v))
    pq, pk, pv, pdout, pout = (t[:1] for t in (q, k, v, dout, out))  # packed (thd) problems: batch 1
    cu = dict(cu_seqlens_q=_i32(0, 3, 8), cu_seqlens_kv=_i32(0, 5, 8))
    fp8 = dict(q_descale=one, k_descale=one, v_descale=one)
    strided = _t(2, 8, 4, 32)[..., ::2]  # head_dim 16 with stride 2
    return [
        ("fwd q dtype", *_fwd(q.double(), k.double(), v.double()), TypeError, "q must have dtype"),
        ("fwd q float8_e5m2", *_fwd(*(t.to(torch.float8_e5m2) for t in (q, k, v))), TypeError, "q must have dtype"),
        ("fwd k dtype", *_fwd(q, k.int(), v), TypeError, "k must have dtype"),
        ("fwd k not a tensor", *_fwd(q, None, v), TypeError, "k must be a torch.Tensor"),
        ("fwd v a list", *_fwd(q, k, [[1.0]]), TypeError, "v must be a torch.Tensor"),
        ("fwd q rank", *_fwd(q[0], k, v), ValueError, "q must be 4-D"),
        ("fwd v rank", *_fwd(q, k, v[..., None]), ValueError, "v must be 4-D"),
        ("fwd v head_dim stride", *_fwd(q, k, strided), ValueError, r"v must have a contiguous last \(head_dim\)"),
        ("fwd q head_dim stride", *_fwd(strided, k, v), ValueError, r"q must have a contiguous last \(head_dim\)"),
        ("fwd k dtype mismatch", *_fwd(q, k.bfloat16(), v.bfloat16()), TypeError, "q, k and v must share a dtype"),
        ("fwd v dtype mismatch", *_fwd(q, k, v.half()), TypeError, "q, k and v must share a dtype"),
        ("fwd k on meta", *_fwd(q, k.to(meta), v), ValueError, "k is on meta but q is on cpu"),
        ("fwd batch", *_fwd(q, _t(3, 8, 4, 16), _t(3, 8, 4, 16)), ValueError, "k has batch size 3 but q has 2"),
        ("fwd head_dim", *_fwd(q, _t(2, 8, 4, 8), _t(2, 8, 4, 8)), ValueError, "k has head_dim 8 but q has 16"),
        ("fwd k/v seq", *_fwd(q, k, _t(2, 7, 4, 16)), ValueError, "k and v must have the same sequence length"),
        ("fwd k/v heads", *_fwd(q, k, _t(2, 8, 2, 16)), ValueError, "k and v must have the same sequence length"),
        ("fwd heads not a multiple", *_fwd(q, _t(2, 8, 3, 16), _t(2, 8, 3, 16)), ValueError,
         r"q's heads \(4\) must be a multiple of k's heads \(3\)"),
        ("fwd head_dim 0", *_fwd(_t(2, 8, 4, 0), _t(2, 8, 4, 0), _t(2, 8, 4, 0)), ValueError,
         "head_dim must be positive"),
        ("fwd cu_seqlens_q alone", *_fwd(pq, pk, pv, cu_seqlens_q=_i32(0, 8)), ValueError,
         "cu_seqlens_q and cu_seqlens_kv must be given together"),
        ("fwd cu_seqlens_kv alone", *_fwd(pq, pk, pv, cu_seqlens_kv=_i32(0, 8)), ValueError,
         "cu_seqlens_q and cu_seqlens_kv must be given together"),
        ("fwd packed batch", *_fwd(q, k, v, **cu), ValueError, r"packed \(cu_seqlens\) inputs must have batch size 1"),
        ("fwd seqlens with cu_seqlens", *_fwd(pq, pk, pv, seqlens_kv=_i32(8), **cu), ValueError,
         "seqlens and cu_seqlens cannot be combined"),
        ("fwd cu_seqlens_q 2-D", *_fwd(pq, pk, pv, cu_seqlens_q=_i32(0, 8)[None], cu_seqlens_kv=_i32(0, 8)),
         ValueError, "cu_seqlens_q must be 1-D with N \\+ 1 offsets"),
        ("fwd cu_seqlens_q a list", *_fwd(pq, pk, pv, cu_seqlens_q=[0, 8], cu_seqlens_kv=_i32(0, 8)), TypeError,
         "cu_seqlens_q must be a torch.Tensor"),
        ("fwd cu_seqlens_kv dtype", *_fwd(pq, pk, pv, cu_seqlens_q=_i32(0, 8), cu_seqlens_kv=torch.tensor([0, 8])),
         TypeError, "cu_seqlens_kv must be a 1-D torch.int32 tensor"),
        ("fwd cu_seqlens_kv numel", *_fwd(pq, pk, pv, cu_seqlens_q=_i32(0, 8), cu_seqlens_kv=_i32(0, 4, 8)),
         ValueError, "cu_seqlens_kv must have 2 elements"),
        ("fwd cu_seqlens_q past the tokens", *_fwd(pq, pk, pv, cu_seqlens_q=_i32(0, 9), cu_seqlens_kv=_i32(0, 8)),
         ValueError, "cu_seqlens_q must start at 0, be non-decreasing and end at most at the 8 tokens"),
        ("fwd cu_seqlens_q start", *_fwd(pq, pk, pv, cu_seqlens_q=_i32(1, 8), cu_seqlens_kv=_i32(0, 8)),
         ValueError, "cu_seqlens_q must start at 0"),
        ("fwd cu_seqlens_kv decreasing", *_fwd(pq, pk, pv, cu_seqlens_q=_i32(0, 4, 8), cu_seqlens_kv=_i32(0, 6, 4)),
         ValueError, "cu_seqlens_kv must start at 0, be non-decreasing"),
        ("fwd cu_seqlens_kv on meta",
         *_fwd(pq, pk, pv, cu_seqlens_q=_i32(0, 8), cu_seqlens_kv=_i32(0, 8).to(meta)), ValueError,
         "cu_seqlens_kv is on meta but q is on cpu"),
        ("fwd seqlens_q dtype", *_fwd(q, k, v, seqlens_q=torch.tensor([8, 8])), TypeError,
         "seqlens_q must be a 1-D torch.int32 tensor"),
        ("fwd seqlens_q 2-D", *_fwd(q, k, v, seqlens_q=_i32(8, 8)[None]), TypeError,
         "seqlens_q must be a 1-D torch.int32 tensor"),
        ("fwd seqlens_kv a list", *_fwd(q, k, v, seqlens_kv=[8, 8]), TypeError, "seqlens_kv must be a torch.Tensor"),
        ("fwd seqlens_kv numel", *_fwd(q, k, v, seqlens_kv=_i32(8)), ValueError, "seqlens_kv must have 2 elements"),
        ("fwd seqlens_q values", *_fwd(q, k, v, seqlens_q=_i32(8, 9)), ValueError, r"seqlens_q must lie in \[0, 8\]"),
        ("fwd seqlens_kv negative", *_fwd(q, k, v, seqlens_kv=_i32(-1, 8)), ValueError,
         r"seqlens_kv must lie in \[0, 8\]"),
        ("fwd seqlens_q on meta", *_fwd(q, k, v, seqlens_q=_i32(8, 8).to(meta)), ValueError,
         "seqlens_q is on meta but q is on cpu"),
        ("fwd softmax_scale inf", *_fwd(q, k, v, softmax_scale=math.inf), ValueError, "softmax_scale must be finite"),
        ("fwd softmax_scale nan", *_fwd(q, k, v, softmax_scale=math.nan), ValueError, "softmax_scale must be finite"),
        ("fwd q_descale missing", *_fwd(q8, k8, v8, **{**fp8, "q_descale": None}), ValueError,
         "q_descale is required for torch.float8_e4m3fn inputs"),
        ("fwd k_descale shape", *_fwd(q8, k8, v8, **{**fp8, "k_descale": torch.ones(2)}), TypeError,
         "k_descale must be a float32 tensor with one element"),
        ("fwd v_descale dtype", *_fwd(q8, k8, v8, **{**fp8, "v_descale": one.double()}), TypeError,
         "v_descale must be a float32 tensor with one element"),
        ("fwd q_descale a float", *_fwd(q8, k8, v8, **{**fp8, "q_descale": 1.0}), TypeError,
         "q_descale must be a torch.Tensor"),
        ("fwd k_descale on meta", *_fwd(q8, k8, v8, **{**fp8, "k_descale": one.to(meta)}), ValueError,
         "k_descale is on meta but q is on cpu"),
        ("fwd descale without FP8", *_fwd(q, k, v, v_descale=one), ValueError,
         "v_descale is only accepted with float8_e4m3fn inputs"),
        ("fwd out_dtype for non-FP8", *_fwd(q, k, v, out_dtype=torch.bfloat16), ValueError,
         "out_dtype must be q's dtype torch.float32 for non-FP8 inputs"),
        ("fwd out_dtype float64", *_fwd(q8, k8, v8, out_dtype=torch.float64, **fp8), ValueError,
         "out_dtype must be one of"),
        ("bwd q rank", *_bwd(dout, q[0], k, v, out, lse), ValueError, "q must be 4-D"),
        ("bwd k dtype", *_bwd(dout, q, k.int(), v, out, lse), TypeError, "k must have dtype"),
        ("bwd v not a tensor", *_bwd(dout, q, k, None, out, lse), TypeError, "v must be a torch.Tensor"),
        ("bwd k dtype mismatch", *_bwd(dout, q, k.half(), v.half(), out, lse), TypeError,
         "q, k and v must share a dtype"),
        ("bwd k head_dim stride", *_bwd(dout, q, strided, v, out, lse), ValueError,
         r"k must have a contiguous last \(head_dim\)"),
        ("bwd v on meta", *_bwd(dout, q, k, v.to(meta), out, lse), ValueError, "v is on meta but q is on cpu"),
        ("bwd batch", *_bwd(dout, q, _t(1, 8, 4, 16), _t(1, 8, 4, 16), out, lse), ValueError,
         "k has batch size 1 but q has 2"),
        ("bwd head_dim", *_bwd(dout, q, _t(2, 8, 4, 8), _t(2, 8, 4, 8), out, lse), ValueError,
         "k has head_dim 8 but q has 16"),
        ("bwd k/v seq", *_bwd(dout, q, k, _t(2, 5, 4, 16), out, lse), ValueError,
         "k and v must have the same sequence length"),
        ("bwd heads not a multiple", *_bwd(dout, q, _t(2, 8, 3, 16), _t(2, 8, 3, 16), out, lse), ValueError,
         "must be a multiple of k's heads"),
        ("bwd cu_seqlens_kv alone", *_bwd(pdout, pq, pk, pv, pout, lse[0], cu_seqlens_kv=_i32(0, 8)), ValueError,
         "cu_seqlens_q and cu_seqlens_kv must be given together"),
        ("bwd cu_seqlens_q dtype", *_bwd(pdout, pq, pk, pv, pout, lse[0], cu_seqlens_q=torch.tensor([0, 8]),
                                         cu_seqlens_kv=_i32(0, 8)), TypeError,
         "cu_seqlens_q must be a 1-D torch.int32 tensor"),
        ("bwd cu_seqlens_q decreasing", *_bwd(pdout, pq, pk, pv, pout, lse[0], cu_seqlens_q=_i32(0, 6, 4),
                                              cu_seqlens_kv=_i32(0, 4, 8)), ValueError,
         "cu_seqlens_q must start at 0, be non-decreasing"),
        ("bwd seqlens_kv numel", *_bwd(dout, q, k, v, out, lse, seqlens_kv=_i32(8, 8, 8)), ValueError,
         "seqlens_kv must have 2 elements"),
        ("bwd seqlens_q values", *_bwd(dout, q, k, v, out, lse, seqlens_q=_i32(8, 12)), ValueError,
         r"seqlens_q must lie in \[0, 8\]"),
        ("bwd softmax_scale nan", *_bwd(dout, q, k, v, out, lse, softmax_scale=math.nan), ValueError,
         "softmax_scale must be finite"),
        ("bwd k_descale missing", *_bwd(dout, q8, k8, v8, out, lse, **{**fp8, "k_descale": None}), ValueError,
         "k_descale is required for torch.float8_e4m3fn inputs"),
        ("bwd descale without FP8", *_bwd(dout, q, k, v, out, lse, q_descale=one), ValueError,
         "q_descale is only accepted with float8_e4m3fn inputs"),
        ("bwd dout dtype", *_bwd(dout.int(), q, k, v, out, lse), TypeError, "dout must have dtype"),
        ("bwd out dtype", *_bwd(dout, q, k, v, out.double(), lse), TypeError, "out must have dtype"),
        ("bwd FP8 out and dout", *_bwd(dout.to(e4), q8, k8, v8, out.to(e4), lse, **fp8), TypeError,
         "dout must have dtype"),
        ("bwd dout not a tensor", *_bwd(None, q, k, v, out, lse), TypeError, "dout must be a torch.Tensor"),
        ("bwd out a list", *_bwd(dout, q, k, v, [1.0], lse), TypeError, "out must be a torch.Tensor"),
        ("bwd dout on meta", *_bwd(dout.to(meta), q, k, v, out, lse), ValueError, "dout is on meta but q is on cpu"),
        ("bwd out on meta", *_bwd(dout, q, k, v, out.to(meta), lse), ValueError, "out is on meta but q is on cpu"),
        ("bwd dout shape", *_bwd(dout[:, :7], q, k, v, out, lse), ValueError, "dout must have q's shape"),
        ("bwd out rank", *_bwd(dout, q, k, v, out[0], lse), ValueError, "out must have q's shape"),
        ("bwd out head_dim stride", *_bwd(dout, q, k, v, strided, lse), ValueError,
         "out must have a contiguous last dimension"),
        ("bwd dout head_dim stride", *_bwd(strided, q, k, v, out, lse), ValueError,
         "dout must have a contiguous last dimension"),
        ("bwd out and dout dtypes", *_bwd(dout, q, k, v, out.bfloat16(), lse), TypeError,
         "out and dout must share a dtype"),
        ("bwd dout not q's dtype", *_bwd(dout.bfloat16(), q, k, v, out.bfloat16(), lse), TypeError,
         "dout must have q's dtype torch.float32"),
        ("bwd lse dtype", *_bwd(dout, q, k, v, out, lse.double()), TypeError, "lse must have dtype"),
        ("bwd lse not a tensor", *_bwd(dout, q, k, v, out, None), TypeError, "lse must be a torch.Tensor"),
        ("bwd lse on meta", *_bwd(dout, q, k, v, out, lse.to(meta)), ValueError, "lse is on meta but q is on cpu"),
        ("bwd lse shape", *_bwd(dout, q, k, v, out, lse[:, :, :7]), ValueError,
         r"lse must be a contiguous float32 tensor of shape \(2, 4, 8\)"),
        ("bwd lse layout", *_bwd(dout, q, k, v, out, _t(2, 8, 4).transpose(1, 2)), ValueError,
         "lse must be a contiguous float32 tensor"),
        ("bwd packed lse shape", *_bwd(pdout, pq, pk, pv, pout, lse[:1], **cu), ValueError,
         r"lse must be a contiguous float32 tensor of shape \(4, 8\)"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())), ids=[call[0] for call in _bad_calls()])
def test_wrappers_name_what_the_binding_refuses(case):
    assert_refused_then_named(*_bad_calls()[case][1:])


def _kept_checks():
    """(name, wrapper call, raw op call, error, message): inputs the binding takes, or takes differently, which
    the wrappers refuse before any kernel runs, as before."""
    q, k, v = (_t(2, 8, 4, 16) for _ in range(3))
    return [
        # The binding rounds dropout_p to float: -1e-50 becomes -0.0, which it takes.
        ("dropout_p tiny negative", *_fwd(q, k, v, dropout_p=-1e-50), ValueError, r"dropout_p must lie in \[0, 1\)"),
        # The binding reads an int as a ScalarType (6: float32).
        ("out_dtype an int", *_fwd(q, k, v, out_dtype=6), ValueError, "out_dtype must be one of"),
    ]


@pytest.mark.parametrize("case", range(len(_kept_checks())), ids=[call[0] for call in _kept_checks()])
def test_checks_the_binding_lacks_run_before_it(case):
    _, wrapper, raw, error, message = _kept_checks()[case]
    raw()  # taken by the binding
    with pytest.raises(error, match=message):
        wrapper()


def test_arguments_that_fail_to_convert_get_the_checks_first():
    """The fast path converts the scalars (and the default scale from q's head_dim) before the call; where that
    fails, the error of the first bad argument is raised, as when every check ran first."""
    q, k, v = (_t(2, 8, 4, 16) for _ in range(3))
    for bad in (None, [[1.0]], 1.0):
        with pytest.raises(TypeError, match="q must be a torch.Tensor"):
            attn.attention_fwd(bad, k, v)
    with pytest.raises(ValueError, match="q must be 4-D"):  # the default scale reads head_dim: q.shape[3]
        attn.attention_fwd(q[0], k, v)
    empty = _t(2, 8, 4, 0)
    with pytest.raises(ValueError, match="head_dim must be positive"):  # the default scale: 1 / sqrt(0)
        attn.attention_fwd(empty, empty, empty)
    with pytest.raises(TypeError, match="k must have dtype"):  # k's check comes before the seed's conversion
        attn.attention_fwd(q, k.int(), v, seed="x")
    with pytest.raises(ValueError, match="invalid literal for int"):  # as int(seed) raised it before
        attn.attention_fwd(q, k, v, seed="x")
    with pytest.raises(ValueError, match="could not convert string to float"):
        attn.attention_fwd(q, k, v, softmax_scale="x")
    out, lse = attn.attention_fwd(q, k, v)
    with pytest.raises(TypeError, match="dout must have dtype"):
        attn.attention_bwd(q.int(), q, k, v, out, lse, offset=[])


def test_empty_q_gets_zero_gradients_without_the_kernel():
    """attention_bwd answers an empty q itself: the binding refuses zero query heads."""
    q, dout, out = (_t(2, 8, 0, 16) for _ in range(3))
    k, v, lse = _t(2, 8, 4, 16), _t(2, 8, 4, 16), _t(2, 0, 8)
    with pytest.raises(RuntimeError):
        ops.attention_bwd(dout, q, k, v, out, lse, *BWD_DEFAULTS.values())
    dq, dk, dv = attn.attention_bwd(dout, q, k, v, out, lse)
    assert dq.shape == q.shape and not dk.any() and not dv.any()


def _problem(dtype):
    q, k, v, dout = (_t(2, 8, 4, 16).to(dtype) for _ in range(4))
    return q, k, v, dout, dict(seqlens_q=_i32(8, 5), seqlens_kv=_i32(6, 8), causal=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_valid_cpu_calls_skip_the_python_checks(dtype, monkeypatch):
    q, k, v, dout, kwargs = _problem(dtype)
    out, lse = attn.attention_fwd(q, k, v, **kwargs)
    grads = attn.attention_bwd(dout, q, k, v, out, lse, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("a Python check ran")

    for name in ("_check_qkv", "_check_lengths", "_check_scalars", "_check_descales", "check_dtype",
                 "check_same_device"):
        monkeypatch.setattr(attn, name, refuse)
    again = attn.attention_fwd(q, k, v, **kwargs)
    grads_again = attn.attention_bwd(dout, q, k, v, out, lse, **kwargs)
    for actual, expected in zip((*again, *grads_again), (out, lse, *grads)):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
        assert actual.stride() == expected.stride()


def test_torch_compile_checks_before_the_fake_kernel():
    """The fake kernels check no shapes: under torch.compile the wrapper's checks run first."""
    q, k, v = (_t(2, 8, 4, 16) for _ in range(3))
    compiled = torch.compile(lambda q, k, v: attn.attention_fwd(q, k, v)[0], backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), attn.attention_fwd(q, k, v)[0])
    with pytest.raises(RuntimeError, match="k has head_dim 8 but q has 16"):  # Dynamo's Unsupported, naming it
        compiled(q, _t(2, 8, 4, 8), _t(2, 8, 4, 8))
