"""TE's multi-tensor kernels (te_fuser.tex.multi_tensor_*, in torch) and optimizers.MultiTensorApply:
scale, L2 norms and FP8 scales against float64 references, the overflow flag, argument errors."""

import math
import struct

import pytest
import torch

from te_fuser import tex
from te_fuser.optimizers import MultiTensorApply, multi_tensor_applier

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def flag():
    return torch.zeros(1, dtype=torch.int32)


def tensors(dtype, sizes=(1, 129, 4000, 77)):
    return [(torch.randn(n) * 3).to(dtype) for n in sizes]


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_scale_matches_float64(in_dtype, out_dtype):
    inputs = tensors(in_dtype)
    outputs = [torch.empty(t.shape, dtype=out_dtype) for t in inputs]
    noop = flag()
    multi_tensor_applier(tex.multi_tensor_scale, noop, [inputs, outputs], 0.37)
    scale32 = torch.tensor(0.37, dtype=torch.float32).item()  # TE's kernel takes the scale as a float
    for inp, out in zip(inputs, outputs):
        assert torch.equal(out, (inp.double() * scale32).float().to(out_dtype))
    assert noop.item() == 0


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", [(0, 0), (2, 3999), (3, 40)])
def test_scale_flags_a_non_finite_input(bad, where):
    inputs = tensors(torch.float32)
    inputs[where[0]][where[1]] = bad
    noop = flag()
    multi_tensor_applier(tex.multi_tensor_scale, noop, [inputs, inputs], 2.0)  # in place
    assert noop.item() == 1
    clean = tensors(torch.float32)
    multi_tensor_applier(tex.multi_tensor_scale, noop, [clean, clean], 2.0)
    assert noop.item() == 1  # never cleared by a kernel


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_tensor", [False, True])
def test_l2norm_matches_float64(dtype, per_tensor):
    inputs = tensors(dtype)
    noop = flag()
    total, each = multi_tensor_applier(tex.multi_tensor_l2norm, noop, [inputs], per_tensor)
    want_each = torch.stack([t.double().norm() for t in inputs])
    assert total.shape == (1,) and total.dtype == torch.float32
    torch.testing.assert_close(total.double(), want_each.norm().reshape(1), rtol=1e-6, atol=0)
    if per_tensor:
        torch.testing.assert_close(each.double(), want_each, rtol=1e-6, atol=0)
    else:
        assert each.numel() == 0
    assert noop.item() == 0


@pytest.mark.parametrize("per_tensor", [False, True])
def test_unscale_l2norm_matches_float64_and_leaves_the_inputs(per_tensor):
    inputs = tensors(torch.bfloat16)
    before = [t.clone() for t in inputs]
    inv_scale = torch.tensor([0.125])
    total, each = multi_tensor_applier(tex.multi_tensor_unscale_l2norm, flag(), [inputs], inv_scale, per_tensor)
    want_each = torch.stack([(t.double() * 0.125).norm() for t in inputs])
    torch.testing.assert_close(total.double(), want_each.norm().reshape(1), rtol=1e-6, atol=0)
    if per_tensor:
        torch.testing.assert_close(each.double(), want_each, rtol=1e-6, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(inputs, before))


def test_l2norm_flags_a_non_finite_norm():
    inputs = tensors(torch.float16)
    inputs[1][5] = float("nan")
    noop = flag()
    multi_tensor_applier(tex.multi_tensor_l2norm, noop, [inputs], False)
    assert noop.item() == 1


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def reference_scale(amax: float, max_fp8: float, pow2: bool, eps: float) -> float:
    """TE's compute_scale_from_amax for one float32 amax, in Python floats (eps taken as a float32, as TE's
    kernel takes it)."""
    eps = _f32(eps)
    amax = max(amax, eps) if not math.isnan(amax) else amax
    if amax == 0 or math.isinf(amax) or math.isnan(amax):
        return 1.0
    scale = _f32(max_fp8 / amax) if max_fp8 / amax <= torch.finfo(torch.float32).max else math.inf
    if math.isinf(scale):
        scale = torch.finfo(torch.float32).max
    if pow2:
        scale = 2.0 ** math.floor(math.log2(scale))
    return scale


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("eps", [0.0, 1e-3, 100.0])
def test_compute_scale_and_scale_inv_matches_the_rule(fp8_dtype, pow2, eps):
    edge = torch.tensor([0.0, 1e-45, 1e-30, 3.0, 448.0, 1e30, float("inf"), float("nan")])
    amaxes = [edge, torch.rand(1000) * 10, torch.tensor([7.5])]
    scales = [torch.empty_like(a) for a in amaxes]
    scale_invs = [torch.empty_like(a) for a in amaxes]
    max_fp8 = torch.finfo(fp8_dtype).max
    multi_tensor_applier(tex.multi_tensor_compute_scale_and_scale_inv, flag(), [amaxes, scales, scale_invs],
                         max_fp8, pow2, eps)
    for amax, scale, scale_inv in zip(amaxes, scales, scale_invs):
        want = torch.tensor([reference_scale(a, max_fp8, pow2, eps) for a in amax.tolist()])
        assert torch.equal(scale, want), (amax, scale, want)
        assert torch.equal(scale_inv, torch.reciprocal(want))


def test_bad_arguments_name_them():
    inputs = tensors(torch.float32)
    with pytest.raises(ValueError, match="chunk_size"):
        tex.multi_tensor_scale(0, flag(), [inputs, inputs], 1.0)
    with pytest.raises(TypeError, match="noop_flag"):
        tex.multi_tensor_scale(64, torch.zeros(1), [inputs, inputs], 1.0)
    with pytest.raises(ValueError, match="tensor_lists must hold 2 lists"):
        tex.multi_tensor_scale(64, flag(), [inputs], 1.0)
    with pytest.raises(ValueError, match=r"tensor_lists\[1\]\[2\] has 5 elements"):
        tex.multi_tensor_scale(64, flag(), [inputs, inputs[:2] + [torch.zeros(5), inputs[3]]], 1.0)
    with pytest.raises(TypeError, match="inv_scale"):
        tex.multi_tensor_unscale_l2norm(64, flag(), [inputs], 0.5)
    with pytest.raises(ValueError, match="max_fp8"):
        tex.multi_tensor_compute_scale_and_scale_inv(64, flag(), [inputs, inputs, inputs], 0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        MultiTensorApply(-1)


def test_applier_passes_its_chunk_size():
    seen = []
    MultiTensorApply(333)(lambda *args: seen.append(args), "flag", "lists", 1, 2)
    assert seen == [(333, "flag", "lists", 1, 2)]
    assert multi_tensor_applier.chunk_size == 2048 * 32
