"""Float8Tensor, the quantizers, and saving for backward."""

import pytest
import torch

import te_fuser
from fp8_reference import FLOAT_DTYPES, FP8_DTYPES, reference_quantize


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_delayed_quantizer_returns_float8_tensor_and_updates_amax(device, generator, dtype, fp8_dtype):
    x = (torch.randn(48, 80, generator=generator) * 20).to(dtype).to(device)
    scale = torch.tensor([0.75], device=device)
    amax = torch.zeros(1, device=device)
    q = te_fuser.Float8Quantizer(scale, amax, fp8_dtype, columnwise=False)
    t = q(x)
    assert isinstance(t, te_fuser.Float8Tensor)
    assert t.shape == x.shape and t.dtype == dtype and t.fp8_dtype == fp8_dtype and t._transpose is None
    assert amax.item() == x.float().abs().max().item()
    torch.testing.assert_close(t._scale_inv, 1 / scale, rtol=0, atol=0)
    expected = reference_quantize(x, scale, fp8_dtype)
    torch.testing.assert_close(t._data.view(torch.uint8), expected.view(torch.uint8), rtol=0, atol=0)
    torch.testing.assert_close(t.dequantize(), (expected.float() * (1 / scale)).to(dtype), rtol=0, atol=0)


def test_columnwise_usage_adds_the_transpose(device, generator):
    x = torch.randn(64, 32, generator=generator).to(device)
    q = te_fuser.Float8Quantizer(torch.ones(1, device=device), torch.zeros(1, device=device),
                                 torch.float8_e4m3fn, columnwise=True)
    t = q(x)
    assert t._transpose.shape == (32, 64)
    torch.testing.assert_close(t.transpose_dequantized(), t.dequantize().t(), rtol=0, atol=0)


def test_current_scaling_quantizer(device, generator):
    x = torch.randn(1000, generator=generator).to(device) * 1e-3
    q = te_fuser.Float8CurrentScalingQuantizer(torch.float8_e4m3fn, device=device)
    t = q(x)
    amax = x.abs().max()
    assert q.amax.item() == amax.item()
    expected_scale = torch.tensor(448.0) / amax.cpu()
    assert q.scale.item() == expected_scale.item()
    # With the scale fitted to the data, the largest element lands on the largest FP8 value.
    assert t.fp8_data.float().abs().max().item() == 448.0
    rel = ((t.dequantize() - x).abs() / x.abs().clamp_min(1e-6)).max().item()
    assert rel <= 2**-3 / 2 + 1e-6 or (t.dequantize() - x).abs().max() <= 2**-9 / expected_scale.item()


def test_prepare_for_saving_round_trip_and_shell(generator):
    x = torch.randn(16, 16, generator=generator)
    t = te_fuser.Float8Quantizer(torch.ones(1), torch.zeros(1), torch.float8_e5m2, columnwise=True)(x)
    before = t.dequantize()
    plain = torch.randn(3)
    tensors, objects = te_fuser.prepare_for_saving(plain, t, None)
    assert len(tensors) == 1 + 3 + 1 and objects[0] is None and objects[2] is None
    assert objects[1] is t and t._data is None and t._transpose is None and t._scale_inv is None
    with pytest.raises(RuntimeError, match="shell left by prepare_for_saving"):
        t.dequantize()
    restored = te_fuser.restore_from_saved(objects, tensors)
    assert restored[0] is plain and restored[1] is t and restored[2] is None
    torch.testing.assert_close(t.dequantize(), before, rtol=0, atol=0)
    t.clear()
    assert t.shape == x.shape  # a shell keeps the wrapper's metadata, not its bytes
    with pytest.raises(RuntimeError, match="holds no data"):
        t + 1
    with pytest.raises(TypeError, match="prepare_for_saving takes"):
        te_fuser.prepare_for_saving("not a tensor")
    with pytest.raises(RuntimeError, match="saved tensors"):
        te_fuser.restore_from_saved([None], [plain, plain])
    with pytest.raises(RuntimeError, match="1 saved tensors but the objects use 4"):  # too few, not an IndexError
        te_fuser.restore_from_saved([None, objects[1]], [plain])


def test_quantizer_rejects_bad_state():
    with pytest.raises(TypeError, match="scale must be a float32 tensor with one element"):
        te_fuser.Float8Quantizer(torch.ones(2), torch.zeros(1), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="rowwise"):
        te_fuser.Float8Quantizer(torch.ones(1), torch.zeros(1), torch.float8_e4m3fn, rowwise=False)
    with pytest.raises(ValueError, match="amax_epsilon"):
        te_fuser.Float8CurrentScalingQuantizer(torch.float8_e4m3fn, amax_epsilon=-1)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        te_fuser.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)([1.0, 2.0])
