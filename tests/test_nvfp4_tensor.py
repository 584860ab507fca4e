"""NVFP4Tensor and NVFP4Quantizer: values against the float64 reference (nvfp4_reference.py) in both usages
(the columnwise one with the Hadamard transform undone), the ops that keep the format, the shell
prepare_for_saving leaves (six buffers: data, scales and amax of each usage), pickling, deepcopy and
state_dict round trips, TE's quantizer fields and the refusals."""

import copy
import io

import pytest
import torch

import nvfp4_reference as ref
import te_fuser
from te_fuser.tensor import NVFP4Quantizer, NVFP4Tensor, QuantizedTensor
from te_fuser.tensor._block_scaled_tensor import BlockScaledRecord
from te_fuser.te_dtype import DType

QUANTIZERS = {
    "1d": lambda **usage: NVFP4Quantizer(**usage),
    "2d": lambda **usage: NVFP4Quantizer(with_2d_quantization=True, **usage),
    "rht": lambda **usage: NVFP4Quantizer(with_rht=True, **usage),
}
FLAGS = {"1d": {}, "2d": {"block_2d": True}, "rht": {"rht": True}}


def make(kind, rowwise=True, columnwise=True):
    return QUANTIZERS[kind](rowwise=rowwise, columnwise=columnwise)


def reference_values(kind, x2, columnwise):
    """float64 values a usage stands for, in x2's layout (the padding to 16s dropped); the transform undone
    (exactly) for rht."""
    flags = dict(FLAGS[kind])
    rows, cols = x2.shape
    if not columnwise:
        flags.pop("rht", None)
        return ref.values(x2, **flags)[:, :cols]
    stored = ref.values(x2, columnwise=True, **flags)  # (cols, rows rounded up to 16)
    if flags.get("rht"):
        m = ref.hadamard_matrix()
        stored = (stored.reshape(stored.shape[0], -1, 16) @ m.t()).reshape(stored.shape)
    return stored[:, :rows].t()


@pytest.mark.parametrize("shape", [(3, 32, 160), (3, 11, 37), (1, 1)])  # TE's multiples of 16, and ragged
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", sorted(QUANTIZERS))
def test_values_match_the_reference(kind, dtype, shape, generator):
    x = (torch.randn(shape, generator=generator) * 10).to(dtype)
    q = make(kind)(x)
    cols, rows = shape[-1], x.numel() // shape[-1]
    assert isinstance(q, QuantizedTensor) and q.shape == x.shape and q.dtype == dtype
    assert q._rowwise_data.shape == (*shape[:-1], -(-cols // 16) * 8)
    assert q._columnwise_data.shape == (cols, -(-rows // 16) * 8)
    assert q._amax_rowwise.dtype == torch.float32 and q._fp4_dtype == DType.kFloat4E2M1
    x2 = x.reshape(-1, cols)
    for columnwise, got in ((False, q.dequantize(torch.float32)), (True, q.columnwise_dequantize(torch.float32))):
        want = ref.round_f32(reference_values(kind, x2, columnwise)).float().reshape(x.shape)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert q.dequantize().dtype == dtype
    only_columnwise = make(kind, rowwise=False)(x)
    assert only_columnwise._rowwise_data is None and only_columnwise._amax_rowwise is None
    torch.testing.assert_close(only_columnwise.dequantize(torch.float32), q.columnwise_dequantize(torch.float32))


@pytest.mark.parametrize("kind", sorted(QUANTIZERS))
def test_ops_keep_the_format_or_dequantize(kind):
    x = torch.randn(128, 64)
    q = make(kind)(x)
    for same in (q.detach(), q.clone(), q.to("cpu", copy=True)):
        assert type(same) is NVFP4Tensor and torch.equal(same.dequantize(), q.dequantize())
        assert torch.equal(same.columnwise_dequantize(), q.columnwise_dequantize())
    assert q.clone()._amax_columnwise.data_ptr() != q._amax_columnwise.data_ptr()
    assert q.detach()._rowwise_data is q._rowwise_data
    plain = q * 2
    assert type(plain) is torch.Tensor and torch.equal(plain, q.dequantize() * 2)
    y = torch.randn(128, 64) * 100
    q.copy_(y)  # requantized by its quantizer, both usages and both amaxes
    fresh = make(kind)(y)
    for mine, theirs in zip(q._buffers(), fresh._buffers()):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("kind", sorted(QUANTIZERS))
def test_prepare_for_saving_leaves_an_empty_shell(kind):
    q = make(kind)(torch.randn(64, 256))
    values, col_values = q.dequantize(), q.columnwise_dequantize()
    buffers = q._buffers()
    assert len(buffers) == 6 and all(b is not None for b in buffers)
    tensors, objects = te_fuser.prepare_for_saving(q, None)
    assert [t is b for t, b in zip(tensors, buffers)] == [True] * 6 and tensors[6] is None
    assert objects[0] is q and all(b is None for b in q._buffers())
    with pytest.raises(RuntimeError, match="shell"):
        q.dequantize()
    restored, none = te_fuser.restore_from_saved(objects, tensors)
    assert restored is q and none is None and torch.equal(q.dequantize(), values)
    assert torch.equal(q.columnwise_dequantize(), col_values)
    record = BlockScaledRecord(NVFP4Tensor, tuple(q.shape), q.dtype, q._fp8_dtype, q._quantizer, q._meta())
    assert record.SAVED_TENSORS == 6  # what torch.compile's saving keeps: the metadata, six tensors
    assert torch.equal(record.rebuild(q._buffers()).columnwise_dequantize(), col_values)


@pytest.mark.parametrize("kind", sorted(QUANTIZERS))
def test_pickling_deepcopy_and_state_dict(kind):
    q = make(kind)(torch.randn(128, 96, dtype=torch.bfloat16))
    buf = io.BytesIO()
    torch.save({"t": q}, buf)
    buf.seek(0)
    loaded = torch.load(buf)["t"]  # weights_only=True, torch's default
    assert type(loaded) is NVFP4Tensor and loaded.dtype == q.dtype and loaded._meta() == q._meta()
    for mine, theirs in zip(q._buffers(), loaded._buffers()):
        assert torch.equal(mine, theirs)
    twin = copy.deepcopy(q)
    assert torch.equal(twin.columnwise_dequantize(), q.columnwise_dequantize())
    assert twin._rowwise_data.data_ptr() != q._rowwise_data.data_ptr()

    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(q, requires_grad=False)
    other = torch.nn.Module()
    other.weight = torch.nn.Parameter(make(kind)(torch.zeros(128, 96, dtype=torch.bfloat16)), requires_grad=False)
    buf = io.BytesIO()
    torch.save(module.state_dict(), buf)
    buf.seek(0)
    other.load_state_dict(torch.load(buf))
    for mine, theirs in zip(q._buffers(), other.weight._buffers()):  # the bytes and amaxes as they were
        assert torch.equal(mine, theirs)


def test_quantizer_fields_and_refusals():
    q = NVFP4Quantizer(rowwise=True, columnwise=False, with_rht=True, stochastic_rounding=True)
    assert (q.rowwise_usage, q.columnwise_usage, q.with_rht, q.with_post_rht_amax) == (True, False, True, True)
    assert (q.dtype, q.with_2d_quantization, q.stochastic_rounding) == (DType.kFloat4E2M1, False, True)
    assert q.get_scale_shape((256, 384), columnwise=False) == (256, 24)
    assert q.get_scale_shape((2, 80, 48), columnwise=True) == (128, 12)
    assert q.get_columnwise_shape((2, 128, 384)) == (384, 2, 128)
    assert q.convert_shape_for_fp4((4, 32)) == (4, 16) and q.convert_shape_for_fp4((4, 33)) == (4, 24)
    assert q.is_quantizable(torch.empty(32, 48)) and not q.is_quantizable(torch.empty(24, 48))
    m = q.rht_matrix
    assert torch.equal(m.double(), ref.hadamard_matrix())
    with pytest.raises(RuntimeError, match="torch.distributed"):  # its all-reduce needs a process group
        NVFP4Quantizer(with_amax_reduction=True)(torch.randn(16, 16))
    with pytest.raises(NotImplementedError, match="with_random_sign_mask"):
        NVFP4Quantizer(with_random_sign_mask=False)
    with pytest.raises(NotImplementedError, match="with_post_rht_amax"):
        NVFP4Quantizer(with_rht=True, with_post_rht_amax=False)
    with pytest.raises(ValueError, match="with_rht and with_2d_quantization"):
        NVFP4Quantizer(with_rht=True, with_2d_quantization=True)
    with pytest.raises(ValueError, match="fp4_dtype"):
        NVFP4Quantizer(fp4_dtype=DType.kFloat8E4M3)
    with pytest.raises(ValueError, match="at least one"):
        NVFP4Quantizer(rowwise=False, columnwise=False)
    with pytest.raises(ValueError, match="at least 1 dimension"):
        NVFP4Quantizer()(torch.tensor(3.0))
    with pytest.raises(ValueError, match="fp8_dtype"):
        NVFP4Tensor((16, 16), torch.float32, fp8_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="uint8"):
        NVFP4Tensor((16, 16), torch.float32, fp8_dtype=torch.uint8,
                    rowwise_data=torch.zeros(16, 8, dtype=torch.float8_e4m3fn), rowwise_scale_inv=torch.zeros(128, 4))
