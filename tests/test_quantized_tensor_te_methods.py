"""TransformerEngine's tensor methods on te_fuser's quantized tensors: update_usage (keep or drop a usage),
`t.data = ...` (adopt another quantized tensor's buffers, or quantize into them), 0-d tensors under Float8
block scaling (TE's 1 x 1 matrix), and Float8BlockQuantizer(all_gather_usage=True): TE's COMPACT format,
its layouts checked index by index against the GEMM-ready format and its values against the float64
reference (block_scaling_reference)."""

import io

import pytest
import torch

import block_scaling_reference as ref
from te_fuser.ops.block_gemm import block_scaled_gemm_nt, gemm_operand
from te_fuser.tensor import (Float8BlockQuantizer, Float8BlockwiseQTensor, Float8CurrentScalingQuantizer,
                             MXFP8Quantizer, NVFP4Quantizer)
from te_fuser.tensor.float8_blockwise_tensor import Float8BlockScaleTensorFormat

QUANTIZERS = {
    "mxfp8": lambda **usage: MXFP8Quantizer(torch.float8_e4m3fn, **usage),
    "nvfp4": lambda **usage: NVFP4Quantizer(**usage),
    "block1d": lambda **usage: Float8BlockQuantizer(torch.float8_e4m3fn, block_scaling_dim=1, **usage),
    "block2d": lambda **usage: Float8BlockQuantizer(torch.float8_e4m3fn, block_scaling_dim=2, **usage),
}
BUFFERS = ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv")


def bits(t):
    return t.contiguous().view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


@pytest.mark.parametrize("kind", sorted(QUANTIZERS))
def test_update_usage_drops_a_usage_and_keeps_the_other(kind, generator):
    x = torch.randn(130, 256, generator=generator) * 4
    both = QUANTIZERS[kind](rowwise=True, columnwise=True)
    t = both.quantize(x)
    rowwise_values, columnwise_values = t.dequantize(torch.float32), t.columnwise_dequantize(torch.float32)
    kept_buffers = (t._columnwise_data, t._columnwise_scale_inv)
    t.update_usage(rowwise_usage=False)
    assert t._rowwise_data is None and t._rowwise_scale_inv is None
    assert (t._columnwise_data, t._columnwise_scale_inv) == kept_buffers  # the same tensors, not copies
    assert torch.equal(t.dequantize(torch.float32), columnwise_values)
    u = both.quantize(x)
    u.update_usage(columnwise_usage=False)
    assert u._columnwise_data is None and torch.equal(u.dequantize(torch.float32), rowwise_values)
    u.update_usage()  # None: what is held stays
    assert u._rowwise_data is not None and u._columnwise_data is None
    with pytest.raises(ValueError, match="both False"):
        u.update_usage(rowwise_usage=False, columnwise_usage=False)
    with pytest.raises(ValueError, match="rowwise_usage=True"):
        t.update_usage(rowwise_usage=True)
    if kind != "block2d":  # other scales along the other dimension: not made from the rowwise data
        with pytest.raises(ValueError, match="columnwise_usage=True"):
            u.update_usage(columnwise_usage=True)


def test_update_usage_makes_128x128_columnwise_data_from_the_rowwise_bytes(generator):
    """A 2D block's columnwise data is its rowwise bytes transposed under the same scale: the bytes a quantizer
    with both usages writes, padding of the scales included."""
    x = torch.randn(300, 200, generator=generator) * 3
    both = QUANTIZERS["block2d"](rowwise=True, columnwise=True).quantize(x)
    t = QUANTIZERS["block2d"](rowwise=True, columnwise=False).quantize(x)
    t.update_usage(columnwise_usage=True)
    for name in BUFFERS:
        assert torch.equal(bits(getattr(t, name)), bits(getattr(both, name))), name


@pytest.mark.parametrize("make_quantizer", [lambda: Float8CurrentScalingQuantizer(torch.float8_e4m3fn),
                                            lambda: QUANTIZERS["block1d"](rowwise=True, columnwise=True),
                                            lambda: QUANTIZERS["mxfp8"](rowwise=True, columnwise=True)])
def test_setting_data(make_quantizer, generator):
    """t.data = y: a plain tensor is quantized into t's own buffers with t's quantizer (torch's setter left the
    old values); a quantized tensor of t's kind lends its buffers and its nominal dtype."""
    q = make_quantizer()
    x, y = (torch.randn(64, 256, generator=generator) for _ in range(2))
    t = q.update_quantized(x.to(torch.bfloat16), q.make_empty(x.shape, dtype=torch.bfloat16))
    held = t.__tensor_flatten__()[0]
    t.data = y.to(torch.bfloat16)
    assert torch.equal(t.dequantize(), q.quantize(y.to(torch.bfloat16)).dequantize())
    assert t.__tensor_flatten__()[0] == held
    other = q.quantize(y)  # float32 nominal dtype
    t.data = other
    assert t.dtype == torch.float32 and torch.equal(t.dequantize(), other.dequantize())
    assert all(getattr(t, name) is getattr(other, name) for name in other.__tensor_flatten__()[0])
    with pytest.raises(ValueError, match="shape"):
        t.data = torch.zeros(3)
    assert type(t.data) is type(t)  # the getter is torch's: a detached alias in the format


def test_a_0d_tensor_is_a_1x1_matrix():
    """TE quantizes a 0-d tensor as one row of one element: the bytes of the (1,)-shaped tensor's."""
    for dim in (1, 2):
        q = Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=dim)
        for value in (0.3, -7.25, 0.0, 1e-6):
            x = torch.tensor(value)
            t, flat = q.quantize(x), q.quantize(x.reshape(1))
            assert t.shape == () and t._rowwise_data.shape == () and t._columnwise_data.shape == ()
            for name in BUFFERS:
                assert torch.equal(bits(getattr(t, name)).flatten(), bits(getattr(flat, name)).flatten()), name
            want = ref.round_f32(ref.float8_block_values(x.reshape(1, 1), torch.float8_e4m3fn, dim, pow2=True))
            assert torch.equal(t.dequantize().double(), want.reshape(()))


SHAPES = [(), (256,), (311,), (256, 512), (250, 500), (7, 5, 3), (2, 3, 5, 3)]


def matrix(shape):
    rows = 1
    for n in shape[:-1]:
        rows *= n
    return (rows, shape[-1]) if shape else (1, 1)


@pytest.mark.parametrize("shape", SHAPES)
def test_compact_format_layouts_and_values(shape, generator):
    """all_gather_usage=True (TE's COMPACT format, 1D scaling): rowwise scales (rows, col blocks), columnwise
    data in the tensor's shape with scales (row blocks, cols), unpadded; the same bytes and scales as the
    GEMM-ready tensor's, placed index by index; the values of the float64 reference."""
    x = torch.randn(shape, generator=generator) * 5
    compact = Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=1,
                                   all_gather_usage=True).quantize(x)
    ready = Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True,
                                 block_scaling_dim=1).quantize(x)
    assert compact._data_format is Float8BlockScaleTensorFormat.COMPACT
    assert ready._data_format is Float8BlockScaleTensorFormat.GEMM_READY
    rows, cols = matrix(shape)
    row_blocks, col_blocks = -(-rows // 128), -(-cols // 128)
    assert compact._rowwise_data.shape == shape and compact._columnwise_data.shape == shape
    assert compact._rowwise_scale_inv.shape == (rows, col_blocks)
    assert compact._columnwise_scale_inv.shape == (row_blocks, cols)
    assert torch.equal(bits(compact._rowwise_data), bits(ready._rowwise_data))
    ready_t = bits(ready._columnwise_data).reshape(cols, rows)
    compact_cw = bits(compact._columnwise_data).reshape(rows, cols)
    for i in range(0, rows, max(1, rows // 7)):
        for j in range(0, cols, max(1, cols // 7)):
            assert compact_cw[i, j] == ready_t[j, i]
            assert compact._rowwise_scale_inv[i, j // 128] == ready._rowwise_scale_inv[j // 128, i]
            assert compact._columnwise_scale_inv[i // 128, j] == ready._columnwise_scale_inv[i // 128, j]
    x2 = x.reshape(rows, cols)
    for columnwise, got in ((False, compact.dequantize(torch.float32)),
                            (True, compact.columnwise_dequantize(torch.float32))):
        want = ref.round_f32(ref.float8_block_values(x2, torch.float8_e4m3fn, 1, pow2=True, columnwise=columnwise))
        assert torch.equal(got.reshape(rows, cols).double(), want), f"columnwise={columnwise}"
    back = compact.gemm_ready()
    assert back._data_format is Float8BlockScaleTensorFormat.GEMM_READY
    for name in BUFFERS:
        assert torch.equal(bits(getattr(back, name)), bits(getattr(ready, name))), name


def test_compact_tensors_round_trip_and_feed_the_gemm(generator):
    x = torch.randn(256, 384, generator=generator)
    q = Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=1,
                             all_gather_usage=True)
    t = q.quantize(x)
    buffer = io.BytesIO()
    torch.save(t, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded._data_format is Float8BlockScaleTensorFormat.COMPACT
    assert torch.equal(loaded.dequantize(), t.dequantize())
    filled = q.update_quantized(x, q.make_empty(x.shape))
    for name in BUFFERS:
        assert torch.equal(bits(getattr(filled, name)), bits(getattr(t, name))), name
    w = Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=False).quantize(torch.randn(64, 384))
    ready = t.gemm_ready()
    out = block_scaled_gemm_nt(*gemm_operand(t, False), *gemm_operand(w, False), 128, torch.float32)
    assert torch.equal(out, block_scaled_gemm_nt(*gemm_operand(ready, False), *gemm_operand(w, False), 128,
                                                 torch.float32))
    assert type(t.view(128, 2, 384)) is torch.Tensor  # a view of the all-gather layout is not kept quantized
    with pytest.raises(NotImplementedError, match="1D block"):
        Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=2,
                             all_gather_usage=True).quantize(x)
    with pytest.raises(NotImplementedError, match="gemm_ready"):
        t._row_layout()
    assert isinstance(t, Float8BlockwiseQTensor)
