"""MXFP8Tensor and Float8BlockwiseQTensor: their values against the float64 references, their usages,
the ops that keep them quantized, the shell prepare_for_saving leaves, pickling, deepcopy and
state_dict round trips."""

import copy
import io

import pytest
import torch

import block_scaling_reference as ref
import te_fuser
from te_fuser.tensor import (Float8BlockQuantizer, Float8BlockwiseQTensor, MXFP8Quantizer, MXFP8Tensor,
                             QuantizedTensor)

QUANTIZERS = {
    "mxfp8": lambda **usage: MXFP8Quantizer(torch.float8_e4m3fn, **usage),
    "block1d": lambda **usage: Float8BlockQuantizer(torch.float8_e4m3fn, block_scaling_dim=1, **usage),
    "block2d": lambda **usage: Float8BlockQuantizer(torch.float8_e5m2, block_scaling_dim=2,
                                                    force_pow_2_scales=False, **usage),
}


def make(kind, rowwise=True, columnwise=True):
    return QUANTIZERS[kind](rowwise=rowwise, columnwise=columnwise)


def reference_values(kind, x, columnwise):
    """float64 values the kind's rowwise or columnwise data stands for, in x's shape."""
    x2 = x.reshape(-1, x.shape[-1])
    if kind == "mxfp8":
        return ref.mxfp8_values(x2, torch.float8_e4m3fn, columnwise).reshape(x.shape)
    fp8_dtype, dim, pow2 = (torch.float8_e4m3fn, 1, True) if kind == "block1d" else (torch.float8_e5m2, 2, False)
    return ref.float8_block_values(x2, fp8_dtype, dim, 0.0, pow2, columnwise).reshape(x.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", sorted(QUANTIZERS))
def test_values_match_the_references(kind, dtype, generator):
    x = (torch.randn(3, 70, 200, generator=generator) * 10).to(dtype)
    q = make(kind)(x)
    assert isinstance(q, QuantizedTensor) and q.shape == x.shape and q.dtype == dtype
    for columnwise, got in ((False, q.dequantize(torch.float32)), (True, q.columnwise_dequantize(torch.float32))):
        want = ref.round_f32(reference_values(kind, x, columnwise)).float()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert q.dequantize().dtype == dtype  # the nominal dtype by default
    only_columnwise = make(kind, rowwise=False)(x)
    assert only_columnwise._rowwise_data is None
    torch.testing.assert_close(only_columnwise.dequantize(torch.float32), q.columnwise_dequantize(torch.float32))


@pytest.mark.parametrize("kind", sorted(QUANTIZERS))
def test_ops_keep_the_format_or_dequantize(kind):
    x = torch.randn(130, 64)
    q = make(kind)(x)
    for same in (q.detach(), q.clone(), q.to("cpu", copy=True)):
        assert type(same) is type(q) and torch.equal(same.dequantize(), q.dequantize())
    assert q.clone()._rowwise_data.data_ptr() != q._rowwise_data.data_ptr()
    assert q.detach()._rowwise_data is q._rowwise_data
    plain = q * 2
    assert type(plain) is torch.Tensor and torch.equal(plain, q.dequantize() * 2)
    assert q.to(torch.float64).dtype == torch.float64
    y = torch.randn(130, 64)
    q.copy_(y)  # requantized by its quantizer, both usages
    fresh = make(kind)(y)
    assert torch.equal(q.dequantize(), fresh.dequantize())
    assert torch.equal(q.columnwise_dequantize(), fresh.columnwise_dequantize())


@pytest.mark.parametrize("kind", sorted(QUANTIZERS))
def test_prepare_for_saving_leaves_an_empty_shell(kind):
    q = make(kind)(torch.randn(64, 256))
    values = q.dequantize()
    buffers = [q._rowwise_data, q._rowwise_scale_inv, q._columnwise_data, q._columnwise_scale_inv]
    tensors, objects = te_fuser.prepare_for_saving(q, None)
    assert [t is b for t, b in zip(tensors, buffers)] == [True] * 4 and tensors[4] is None
    assert objects[0] is q and all(b is None for b in q._buffers())
    with pytest.raises(RuntimeError, match="shell"):
        q.dequantize()
    with pytest.raises(RuntimeError, match="shell"):
        q + 1
    restored, none = te_fuser.restore_from_saved(objects, tensors)
    assert restored is q and none is None and torch.equal(q.dequantize(), values)
    q.clear()
    assert all(b is None for b in q._buffers())


@pytest.mark.parametrize("kind", sorted(QUANTIZERS))
def test_pickling_deepcopy_and_state_dict(kind):
    q = make(kind)(torch.randn(128, 96, dtype=torch.bfloat16))
    buf = io.BytesIO()
    torch.save({"t": q}, buf)
    buf.seek(0)
    loaded = torch.load(buf)["t"]  # weights_only=True, torch's default
    assert type(loaded) is type(q) and loaded.dtype == q.dtype
    for mine, theirs in zip(q._buffers(), loaded._buffers()):
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))
    twin = copy.deepcopy(q)
    assert torch.equal(twin.dequantize(), q.dequantize()) and twin._rowwise_data.data_ptr() != q._rowwise_data.data_ptr()

    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(q, requires_grad=False)
    other = torch.nn.Module()
    other.weight = torch.nn.Parameter(make(kind)(torch.zeros(128, 96, dtype=torch.bfloat16)), requires_grad=False)
    buf = io.BytesIO()
    torch.save(module.state_dict(), buf)
    buf.seek(0)
    other.load_state_dict(torch.load(buf))
    for mine, theirs in zip(q._buffers(), other.weight._buffers()):  # the bytes as they were, both usages
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))


def test_quantizer_fields_and_errors():
    q = Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=False, amax_epsilon=1e-6,
                             force_pow_2_scales=False, block_scaling_dim=1)
    assert (q.rowwise_usage, q.columnwise_usage, q.block_len) == (True, False, 128)
    assert q.get_scale_shape((256, 384), columnwise=False) == (3, 256)
    assert q.get_columnwise_shape((2, 128, 384)) == (384, 2, 128)
    assert q.is_quantizable(torch.empty(256, 384)) and not q.is_quantizable(torch.empty(100, 384))
    assert MXFP8Quantizer(torch.float8_e5m2).get_scale_shape((64, 96), columnwise=True) == (4, 128)
    with pytest.raises(ValueError, match="block_scaling_dim"):
        Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=3)
    with pytest.raises(ValueError, match="at least one"):
        MXFP8Quantizer(torch.float8_e4m3fn, rowwise=False, columnwise=False)
    with pytest.raises(ValueError, match="fp8_dtype"):
        MXFP8Quantizer(torch.bfloat16)
    with pytest.raises(ValueError, match="data and its scale_inv"):
        MXFP8Tensor((4, 32), torch.float32, rowwise_data=torch.zeros(4, 32, dtype=torch.float8_e4m3fn))
    assert isinstance(Float8BlockwiseQTensor((1, 1), torch.float32), QuantizedTensor)


@pytest.mark.parametrize("block_dim,fp8_dtype", [(1, "kFloat8E4M3"), (2, "kFloat8E5M2")])
@pytest.mark.parametrize("rowwise,columnwise", [(True, True), (True, False), (False, True)])
def test_block_make_empty_then_update_quantized_equals_quantize(block_dim, fp8_dtype, rowwise, columnwise):
    """TE's make_empty + update_quantized: the same bytes and scales as quantize, with TE's DType accepted."""
    from te_fuser.te_dtype import DType

    q = Float8BlockQuantizer(getattr(DType, fp8_dtype), rowwise=rowwise, columnwise=columnwise,
                             block_scaling_dim=block_dim)
    x = torch.randn(2, 130, 300, dtype=torch.bfloat16) * 50
    empty = q.make_empty(x.shape, dtype=x.dtype, requires_grad=True)
    assert isinstance(empty, Float8BlockwiseQTensor) and empty.shape == x.shape and empty.dtype == x.dtype
    assert empty.requires_grad and empty._is_2D_scaled == (block_dim == 2)
    assert (empty._rowwise_data is None) != rowwise and (empty._columnwise_data is None) != columnwise
    filled = q.update_quantized(x, empty)
    expected = q.quantize(x)
    for got, want in zip(filled._buffers(), expected._buffers()):
        assert (got is None) == (want is None)
        if got is not None:
            assert got.shape == want.shape and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    scalar = torch.tensor(-3.5, dtype=torch.bfloat16)  # TE's 0-d tensor: a 1 x 1 matrix
    filled = q.update_quantized(scalar, q.make_empty((), dtype=scalar.dtype))
    assert filled.shape == () and torch.equal(filled.dequantize(), scalar)
    with pytest.raises(ValueError, match="fp8_dtype"):
        Float8BlockQuantizer(DType.kBFloat16, rowwise=True, columnwise=True)


@pytest.mark.parametrize("block_dim", [1, 2])
def test_block_view_keeping_the_last_dim_stays_quantized(block_dim):
    """A view or reshape that keeps the last dimension is a Float8BlockwiseQTensor viewing the same bytes, with
    the same scales, and both usages read back as the original's values reshaped; another view dequantizes."""
    q = Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=block_dim)
    x = torch.randn(2, 200, 300, dtype=torch.bfloat16) * 20
    t = q(x)
    for viewed in (t.view(400, 300), t.reshape(4, 100, 300), t.view(-1, 300), t.view(2, 200, 300)):
        assert type(viewed) is Float8BlockwiseQTensor and viewed.dtype == torch.bfloat16
        assert viewed._rowwise_data.data_ptr() == t._rowwise_data.data_ptr()
        assert viewed._columnwise_data.data_ptr() == t._columnwise_data.data_ptr()
        assert viewed._rowwise_scale_inv is t._rowwise_scale_inv
        assert torch.equal(viewed.dequantize(), t.dequantize().reshape(viewed.shape))
        assert torch.equal(viewed.columnwise_dequantize(), t.columnwise_dequantize().reshape(viewed.shape))
    other = t.view(2, 300, 200)
    assert not isinstance(other, QuantizedTensor)
    assert torch.equal(other, t.dequantize().view(2, 300, 200))
    w = q(x).requires_grad_()
    assert w.view(400, 300).grad_fn is not None  # autograd records the view as for any tensor
