"""Bad input gets a TypeError or ValueError that names the argument; never a crash."""

import pytest
import torch

import te_fuser
from te_fuser.kernels import fp8 as k

from _binding_refusals import assert_refused_then_named

ONE = torch.ones(1)
ZERO = torch.zeros(1)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.complex64, torch.float64])
def test_bad_input_dtype(dtype):
    x = torch.ones(8, dtype=dtype)
    with pytest.raises(TypeError, match="x must have dtype"):
        k.quantize(x, ONE, ZERO.clone(), torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="x must have dtype"):
        k.compute_amax(x)


def test_unknown_fp8_dtype():
    for bad in (torch.float16, torch.float8_e4m3fnuz, "e4m3", None):
        with pytest.raises(ValueError, match="fp8_dtype must be one of"):
            k.quantize(torch.ones(4), ONE, ZERO.clone(), bad)
    with pytest.raises(ValueError, match="fp8_dtype"):
        te_fuser.Float8Quantizer(ONE, ZERO.clone(), torch.bfloat16)


@pytest.mark.parametrize("scale", [torch.ones(2), torch.ones(1, dtype=torch.float64), torch.ones(1, dtype=torch.bfloat16),
                                   torch.ones(()).int(), 1.0])
def test_bad_scale(scale):
    with pytest.raises(TypeError, match="scale must be"):
        k.quantize(torch.ones(4), scale, ZERO.clone(), torch.float8_e4m3fn)


def test_bad_amax():
    with pytest.raises(TypeError, match="amax must be a float32 tensor with one element"):
        k.quantize(torch.ones(4), ONE, torch.zeros(3), torch.float8_e4m3fn)


def test_mismatched_devices():
    with pytest.raises(ValueError, match="scale is on meta but x is on cpu"):
        k.quantize(torch.ones(4), torch.ones(1, device="meta"), ZERO.clone(), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale_inv is on meta"):
        k.dequantize(torch.ones(4).to(torch.float8_e4m3fn), torch.ones(1, device="meta"))


def test_non_contiguous_input():
    x = torch.ones(8, 8).t()
    with pytest.raises(ValueError, match="x must be contiguous"):
        k.quantize(x, ONE, ZERO.clone(), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="x must be contiguous"):
        k.cast_transpose(x, ONE, ZERO.clone(), torch.float8_e4m3fn)


def test_dequantize_bad_arguments():
    with pytest.raises(TypeError, match="data must have dtype"):
        k.dequantize(torch.ones(4), ONE)
    with pytest.raises(ValueError, match="dtype must be one of"):
        k.dequantize(torch.ones(4).to(torch.float8_e5m2), ONE, torch.int8)


def test_cast_transpose_needs_a_matrix():
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        k.cast_transpose(torch.ones(4), ONE, ZERO.clone(), torch.float8_e4m3fn)


def test_scaling_update_bad_arguments():
    h, s, si = torch.zeros(4, 2), torch.ones(2), torch.ones(2)
    with pytest.raises(ValueError, match="amax_compute_algo"):
        k.delayed_scaling_update(h, s, si, 448.0, 0, "mean")
    with pytest.raises(ValueError, match="scale must have"):
        k.delayed_scaling_update(h, torch.ones(3), si, 448.0, 0)
    with pytest.raises(ValueError, match="amax_history must be 2-D"):
        k.delayed_scaling_update(torch.zeros(4), s, si, 448.0, 0)
    with pytest.raises(TypeError, match="scale must have dtype"):
        k.delayed_scaling_update(h, s.double(), si, 448.0, 0)
    with pytest.raises(ValueError, match="margin"):
        k.delayed_scaling_update(h, s, si, 448.0, 500)
    with pytest.raises(ValueError, match="margin must be an integer"):
        k.delayed_scaling_update(h, s, si, 448.0, 0.5)
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="epsilon"):
            k.current_scale(ONE, 448.0, epsilon=bad)
    for bad in (0.0, -448.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="fp8_max_value must be positive and finite"):
            k.current_scale(ONE, bad)


def test_raw_ops_reject_bad_input_without_crashing():
    """The torch.ops entry points check too (RuntimeError from the binding)."""
    ops = torch.ops.te_fuser
    with pytest.raises(RuntimeError, match="input must be float32, bfloat16 or float16"):
        ops.fp8_quantize(torch.ones(4, dtype=torch.int32), ONE, ZERO.clone(), torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="scale must be a float32 tensor with one element"):
        ops.fp8_quantize(torch.ones(4), torch.ones(2), ZERO.clone(), torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="input must be contiguous"):
        ops.fp8_quantize(torch.ones(4, 4).t(), ONE, ZERO.clone(), torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="fp8_dtype must be"):
        ops.fp8_quantize(torch.ones(4), ONE, ZERO.clone(), torch.float16)
    with pytest.raises(RuntimeError, match="amax_compute_algo|argument"):
        ops.fp8_delayed_scaling_update(torch.zeros(2, 1), torch.ones(1), torch.ones(1), 448.0, 0, 7)


def test_raw_ops_refuse_a_meta_argument_beside_real_tensors():
    """One meta argument makes the dispatcher run the fake kernel on the real ones: it must refuse,
    not hand back an uninitialised result (and leave amax unwritten)."""
    ops, meta = torch.ops.te_fuser, torch.ones(1, device="meta")
    x, amax = torch.full((4, 4), 3.0), ZERO.clone()
    with pytest.raises(RuntimeError, match="scale must be on x's device"):
        ops.fp8_quantize(x, meta, amax, torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="amax must be on x's device"):
        ops.fp8_cast_transpose(x, ONE, torch.zeros(1, device="meta"), torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="scale_inv must be on data's device"):
        ops.fp8_dequantize(x.to(torch.float8_e4m3fn), meta, torch.float32)
    with pytest.raises(RuntimeError, match="CPU tensors"):
        ops.fp8_gemm(x.to(torch.float8_e4m3fn), meta, x.to(torch.float8_e4m3fn), ONE, torch.float32, None)
    # All on meta is how shapes are traced: still fine.
    assert ops.fp8_quantize(x.to("meta"), meta, meta, torch.float8_e4m3fn).shape == (4, 4)


def _bad_calls():
    """(name, wrapper call, the same arguments to the raw op, error, message): every case a wrapper of
    quantize, cast_transpose, dequantize, fp8_gemm, delayed_scaling_update and current_scale names. The wrappers check only after the binding
    refused (validate.call_checked), so each case must be a refusal of the binding too."""
    from te_fuser.kernels.gemm import fp8_gemm

    ops, e4, meta = torch.ops.te_fuser, torch.float8_e4m3fn, torch.ones(1, device="meta")
    x, x8 = torch.ones(4, 8), torch.ones(4, 8).to(e4)
    b8 = torch.ones(6, 8).to(e4)
    h, s, si = torch.zeros(4, 3), torch.ones(3), torch.ones(3)
    si_strided = torch.ones(6)[::2]
    return [
        ("quantize x dtype", lambda: k.quantize(x.int(), ONE, ZERO.clone(), e4),
         lambda: ops.fp8_quantize(x.int(), ONE, ZERO.clone(), e4), TypeError, "x must have dtype"),
        ("quantize x layout", lambda: k.quantize(x.t(), ONE, ZERO.clone(), e4),
         lambda: ops.fp8_quantize(x.t(), ONE, ZERO.clone(), e4), ValueError, "x must be contiguous"),
        ("quantize scale shape", lambda: k.quantize(x, torch.ones(2), ZERO.clone(), e4),
         lambda: ops.fp8_quantize(x, torch.ones(2), ZERO.clone(), e4), TypeError, "scale must be"),
        ("quantize scale not a tensor", lambda: k.quantize(x, 1.0, ZERO.clone(), e4),
         lambda: ops.fp8_quantize(x, 1.0, ZERO.clone(), e4), TypeError, "scale must be"),
        ("quantize amax dtype", lambda: k.quantize(x, ONE, ZERO.double(), e4),
         lambda: ops.fp8_quantize(x, ONE, ZERO.double(), e4), TypeError, "amax must be"),
        ("quantize fp8_dtype", lambda: k.quantize(x, ONE, ZERO.clone(), torch.float16),
         lambda: ops.fp8_quantize(x, ONE, ZERO.clone(), torch.float16), ValueError, "fp8_dtype must be one of"),
        ("quantize scale on meta", lambda: k.quantize(x, meta, ZERO.clone(), e4),
         lambda: ops.fp8_quantize(x, meta, ZERO.clone(), e4), ValueError, "scale is on meta but x is on cpu"),
        ("cast_transpose 1-D x", lambda: k.cast_transpose(torch.ones(4), ONE, ZERO.clone(), e4),
         lambda: ops.fp8_cast_transpose(torch.ones(4), ONE, ZERO.clone(), e4), ValueError, "at least 2 dimensions"),
        ("cast_transpose amax on meta", lambda: k.cast_transpose(x, ONE, meta, e4),
         lambda: ops.fp8_cast_transpose(x, ONE, meta, e4), ValueError, "amax is on meta"),
        ("dequantize data dtype", lambda: k.dequantize(x, ONE),
         lambda: ops.fp8_dequantize(x, ONE, torch.float32), TypeError, "data must have dtype"),
        ("dequantize out dtype", lambda: k.dequantize(x8, ONE, torch.int8),
         lambda: ops.fp8_dequantize(x8, ONE, torch.int8), ValueError, "dtype must be one of"),
        ("dequantize scale_inv on meta", lambda: k.dequantize(x8, meta),
         lambda: ops.fp8_dequantize(x8, meta, torch.float32), ValueError, "scale_inv is on meta"),
        ("fp8_gemm a dtype", lambda: fp8_gemm(x, ONE, b8, ONE),
         lambda: ops.fp8_gemm(x, ONE, b8, ONE, torch.float32, None), TypeError, "a must have dtype"),
        ("fp8_gemm b rank", lambda: fp8_gemm(x8, ONE, b8.reshape(6, 2, 4), ONE),
         lambda: ops.fp8_gemm(x8, ONE, b8.reshape(6, 2, 4), ONE, torch.float32, None), ValueError, "b must be 2-D"),
        ("fp8_gemm inner size", lambda: fp8_gemm(x8, ONE, b8[:, :4].contiguous(), ONE),
         lambda: ops.fp8_gemm(x8, ONE, b8[:, :4].contiguous(), ONE, torch.float32, None), ValueError,
         "b must have a.shape"),
        ("fp8_gemm a layout", lambda: fp8_gemm(torch.ones(8, 4).to(e4).t(), ONE, b8, ONE),
         lambda: ops.fp8_gemm(torch.ones(8, 4).to(e4).t(), ONE, b8, ONE, torch.float32, None), ValueError,
         "a must be contiguous"),
        ("fp8_gemm scale_inv shape", lambda: fp8_gemm(x8, torch.ones(2), b8, ONE),
         lambda: ops.fp8_gemm(x8, torch.ones(2), b8, ONE, torch.float32, None), TypeError, "a_scale_inv must be"),
        ("fp8_gemm out_dtype", lambda: fp8_gemm(x8, ONE, b8, ONE, torch.int32),
         lambda: ops.fp8_gemm(x8, ONE, b8, ONE, torch.int32, None), ValueError, "out_dtype must be one of"),
        ("fp8_gemm bias shape", lambda: fp8_gemm(x8, ONE, b8, ONE, torch.float32, torch.zeros(4)),
         lambda: ops.fp8_gemm(x8, ONE, b8, ONE, torch.float32, torch.zeros(4)), ValueError, "bias must have shape"),
        ("fp8_gemm bias dtype", lambda: fp8_gemm(x8, ONE, b8, ONE, torch.float32, torch.zeros(6, dtype=torch.int64)),
         lambda: ops.fp8_gemm(x8, ONE, b8, ONE, torch.float32, torch.zeros(6, dtype=torch.int64)), TypeError,
         "bias must have dtype"),
        ("fp8_gemm bias layout", lambda: fp8_gemm(x8, ONE, b8, ONE, torch.float32, torch.zeros(6, 2)[:, 0]),
         lambda: ops.fp8_gemm(x8, ONE, b8, ONE, torch.float32, torch.zeros(6, 2)[:, 0]), ValueError,
         "bias must be contiguous"),
        ("scaling update history rank", lambda: k.delayed_scaling_update(h.flatten(), s, si, 448.0, 0),
         lambda: ops.fp8_delayed_scaling_update(h.flatten(), s, si, 448.0, 0, 0), ValueError,
         "amax_history must be 2-D"),
        ("scaling update history dtype", lambda: k.delayed_scaling_update(h.double(), s, si, 448.0, 0),
         lambda: ops.fp8_delayed_scaling_update(h.double(), s, si, 448.0, 0, 0), TypeError,
         "amax_history must have dtype"),
        ("scaling update scale dtype", lambda: k.delayed_scaling_update(h, s.half(), si, 448.0, 0),
         lambda: ops.fp8_delayed_scaling_update(h, s.half(), si, 448.0, 0, 0), TypeError,
         "scale must have dtype"),
        ("scaling update scale_inv layout", lambda: k.delayed_scaling_update(h, s, si_strided, 448.0, 0),
         lambda: ops.fp8_delayed_scaling_update(h, s, si_strided, 448.0, 0, 0), ValueError,
         "scale_inv must be contiguous"),
        ("scaling update scale size", lambda: k.delayed_scaling_update(h, s[:2], si, 448.0, 0),
         lambda: ops.fp8_delayed_scaling_update(h, s[:2], si, 448.0, 0, 0), ValueError,
         "scale must have amax_history.shape"),
        ("scaling update scale not a tensor", lambda: k.delayed_scaling_update(h, 1.0, si, 448.0, 0),
         lambda: ops.fp8_delayed_scaling_update(h, 1.0, si, 448.0, 0, 0), TypeError,
         "scale must be a torch.Tensor"),
        ("scaling update scale on meta", lambda: k.delayed_scaling_update(h, s.to("meta"), si, 448.0, 0),
         lambda: ops.fp8_delayed_scaling_update(h, s.to("meta"), si, 448.0, 0, 0), ValueError,
         "scale is on meta but amax_history is on cpu"),
        ("current_scale amax shape", lambda: k.current_scale(torch.ones(2), 448.0),
         lambda: ops.fp8_current_scale(torch.ones(2), 448.0, 0.0, False), TypeError,
         "amax must be a float32 tensor with one element"),
        ("current_scale amax dtype", lambda: k.current_scale(ONE.double(), 448.0),
         lambda: ops.fp8_current_scale(ONE.double(), 448.0, 0.0, False), TypeError,
         "amax must be a float32 tensor with one element"),
        ("fp8_gemm on meta", lambda: fp8_gemm(x8.to("meta"), meta, b8.to("meta"), meta),
         lambda: ops.fp8_gemm(x8.to("meta"), meta, b8.to("meta"), meta, torch.float32, None), ValueError,
         "a must be on the CPU"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())), ids=[call[0] for call in _bad_calls()])
def test_wrappers_name_what_the_binding_refuses(case):
    assert_refused_then_named(*_bad_calls()[case][1:])
