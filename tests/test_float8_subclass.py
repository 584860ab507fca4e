"""Float8Tensor as a torch.Tensor: which ops stay FP8, which dequantize, autograd, saving, compile.

References: torch's own float8 casts (the bytes a scale-then-cast gives) and float64 math on the
dequantized values.
"""

import copy
import io

import pytest
import torch

import te_fuser
from te_fuser import Float8Tensor

from _torch_support import compiles_te_fuser_modules

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _random(shape, generator, dtype=torch.float32):
    x = torch.randn(*shape, generator=generator) * 3
    x.view(-1)[:2] = torch.tensor([0.0, -1e-4])  # edge values: zero and a subnormal once scaled
    return x.to(dtype)


def _quantized(x, fp8_dtype, columnwise=False, scale=0.75):
    quantizer = te_fuser.Float8Quantizer(torch.tensor([scale]), torch.zeros(1), fp8_dtype, columnwise=columnwise)
    return quantizer(x)


def _torch_cast(x, scale, fp8_dtype):
    """torch's reference bytes: scale in float32, then torch's float8 cast (saturating like TE)."""
    limit = torch.finfo(fp8_dtype).max
    return (x.float() * scale).clamp(-limit, limit).to(fp8_dtype)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_is_a_tensor_of_the_nominal_dtype(fp8_dtype, generator):
    x = _random((8, 12), generator, torch.bfloat16)
    x8 = _quantized(x, fp8_dtype)
    assert isinstance(x8, torch.Tensor) and isinstance(x8, te_fuser.QuantizedTensor)
    assert x8.shape == x.shape and x8.dtype == torch.bfloat16 and x8.device == x.device
    assert x8.fp8_data.dtype == fp8_dtype and x8._data.element_size() == 1
    assert torch.equal(x8._data.view(torch.uint8), _torch_cast(x, 0.75, fp8_dtype).view(torch.uint8))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_other_ops_see_the_dequantized_values(fp8_dtype, generator):
    x8 = _quantized(_random((6, 10), generator), fp8_dtype)
    y = _random((10, 4), generator)
    values = x8.fp8_data.double() / 0.75
    out = x8 @ y
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out.double(), values @ y.double(), rtol=1e-6, atol=1e-6)
    assert torch.equal(x8 + 1, x8.dequantize() + 1)
    assert torch.equal(torch.relu(x8), torch.relu(x8.dequantize()))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_views_share_the_fp8_bytes(fp8_dtype, generator):
    x8 = _quantized(_random((4, 6, 8), generator), fp8_dtype, columnwise=True)
    flat = x8.view(-1, 8)
    assert isinstance(flat, Float8Tensor) and flat.shape == (24, 8)
    assert flat._data.data_ptr() == x8._data.data_ptr() and flat._transpose.data_ptr() == x8._transpose.data_ptr()
    other = x8.reshape(4, 48)  # the last dim changes: the transpose no longer fits
    assert isinstance(other, Float8Tensor) and other._transpose is None
    detached = x8.detach()
    assert isinstance(detached, Float8Tensor) and detached._data.data_ptr() == x8._data.data_ptr()
    cloned = x8.clone()
    assert isinstance(cloned, Float8Tensor) and cloned._data.data_ptr() != x8._data.data_ptr()
    assert torch.equal(cloned.dequantize(), x8.dequantize())


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_parts_stay_fp8_along_any_dim(fp8_dtype, generator):
    x8 = _quantized(_random((8, 6), generator), fp8_dtype)
    values = x8.dequantize()
    parts = torch.chunk(x8, 2, dim=0)
    assert all(isinstance(p, Float8Tensor) for p in parts)
    assert torch.equal(torch.cat([p._data.view(torch.uint8) for p in parts]), x8._data.view(torch.uint8))
    for part, expected in ((x8[2:5], values[2:5]), (x8[:, 1:5:2], values[:, 1:5:2]), (x8[3], values[3]),
                           (x8[:, 4], values[:, 4]), (torch.chunk(x8, 2, dim=1)[1], values[:, 3:]),
                           (x8.unbind(1)[2], values[:, 2]), (x8.as_strided((6, 4), (1, 6)), values.as_strided((6, 4), (1, 6)))):
        assert isinstance(part, Float8Tensor) and part._data.untyped_storage().data_ptr() == x8._data.data_ptr()
        assert torch.equal(part.dequantize(), expected) and torch.equal(part + 1, expected + 1)


def _whole_and_reference(generator, quantizer):
    """A Float8Tensor that writes through its quantizer (as FP8 weights do), and its values."""
    q8 = quantizer(_random((8, 6), generator))
    x8 = Float8Tensor(q8._data, q8._scale_inv, q8._fp8_dtype, torch.float32, q8._transpose, quantizer=quantizer)
    return x8, x8.dequantize(torch.float64)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("write", ["slice_copy", "select_fill", "column_setitem", "strided_mul", "view_of_part"])
def test_a_write_into_a_part_keeps_the_rest(fp8_dtype, write, generator):
    """The scale belongs to the whole tensor: writing a part must not change what the other bytes
    mean. With current scaling the whole is requantized with the new amax (the rest is re-rounded
    to the new scale, within half its step); its transpose follows."""
    quantizer = te_fuser.Float8CurrentScalingQuantizer(fp8_dtype, columnwise=True)
    x8, ref = _whole_and_reference(generator, quantizer)
    big = 40.0  # well above the values' amax: the scale must change
    with torch.no_grad():
        if write == "slice_copy":
            x8[1:3].copy_(torch.full((2, 6), big)); ref[1:3] = big
        elif write == "select_fill":
            x8[5] = big; ref[5] = big
        elif write == "column_setitem":
            x8[:, 2] = -big; ref[:, 2] = -big
        elif write == "strided_mul":
            x8[::3, 1::2].mul_(big); ref[::3, 1::2] *= big
        else:
            x8[4:6].view(-1)[3:9].fill_(big); ref.view(-1)[27:33] = big
    limit = torch.finfo(fp8_dtype).max
    scale = limit / ref.abs().max()
    assert x8._scale_inv.item() == pytest.approx(1 / scale.item(), rel=1e-6)
    expected = (ref.float() * scale.float()).clamp(-limit, limit).to(fp8_dtype)
    assert torch.equal(x8._data.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(x8._transpose.view(torch.uint8), x8._data.view(torch.uint8).t())


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_a_write_into_a_part_without_quantizer_keeps_the_scale(fp8_dtype, generator):
    x8 = _quantized(_random((8, 6), generator), fp8_dtype, columnwise=True)
    before = x8._data.view(torch.uint8).clone()
    new = _random((8,), generator)
    x8[:, 3].copy_(new)
    expected = before.clone()
    expected[:, 3] = _torch_cast(new, 0.75, fp8_dtype).view(torch.uint8)
    assert torch.equal(x8._data.view(torch.uint8), expected) and x8._scale_inv.item() == pytest.approx(1 / 0.75)
    assert torch.equal(x8._transpose.view(torch.uint8), expected.t())
    # From a Float8Tensor with another scale: its values, in this tensor's scale.
    src = _quantized(_random((2, 6), generator), fp8_dtype, scale=2.0)
    x8[6:8].copy_(src)
    expected[6:8] = _torch_cast(src.dequantize(), 0.75, fp8_dtype).view(torch.uint8)
    assert torch.equal(x8._data.view(torch.uint8), expected)
    # A broadcast source, as copy_ allows.
    x8[0].fill_(1.5)
    x8[1].copy_(torch.tensor(-2.0))
    expected[0:2] = _torch_cast(torch.tensor([[1.5], [-2.0]]).expand(2, 6), 0.75, fp8_dtype).view(torch.uint8)
    assert torch.equal(x8._data.view(torch.uint8), expected)


def test_the_bug_pattern_is_caught():
    """Control: the old behaviour (a part's quantizer writing a fresh scale into the shared scale_inv
    without requantizing the rest) changes the rest's values, which the test above would see."""
    quantizer = te_fuser.Float8CurrentScalingQuantizer(torch.float8_e4m3fn, columnwise=False)
    x8 = quantizer(torch.linspace(-1, 1, 48).reshape(8, 6))
    rest = x8.dequantize()[3:].clone()
    part = x8[0:3]
    fresh = quantizer.quantize(torch.full((3, 6), 40.0))
    part._data.view(torch.uint8).copy_(fresh._data.view(torch.uint8))
    part._scale_inv.copy_(fresh._scale_inv)  # what quantize_ did before it knew about parts
    assert not torch.allclose(x8.dequantize()[3:], rest, rtol=0.1)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_copy_and_in_place_ops_requantize_with_the_own_scale(fp8_dtype, generator):
    x8 = _quantized(_random((5, 7), generator), fp8_dtype, columnwise=True)
    new = _random((5, 7), generator)
    x8.copy_(new)
    assert torch.equal(x8._data.view(torch.uint8), _torch_cast(new, 0.75, fp8_dtype).view(torch.uint8))
    assert torch.equal(x8._transpose.view(torch.uint8), x8._data.view(torch.uint8).t())
    before = x8.dequantize()
    step = _random((5, 7), generator)
    x8.add_(step, alpha=0.5)
    assert torch.equal(x8._data.view(torch.uint8), _torch_cast(before + 0.5 * step, 0.75, fp8_dtype).view(torch.uint8))
    # From another Float8Tensor: its bytes and scale, exactly.
    src = _quantized(_random((5, 7), generator), fp8_dtype, scale=2.0)
    x8.copy_(src)
    assert torch.equal(x8._data.view(torch.uint8), src._data.view(torch.uint8))
    assert torch.equal(x8.dequantize(), src.dequantize())
    # Into a plain tensor: the dequantized values.
    plain = torch.empty(5, 7, dtype=torch.float64)
    plain.copy_(x8)
    assert torch.equal(plain, x8.dequantize(torch.float64))


def test_to_dtype_dequantizes_to_device_keeps_fp8(generator):
    x8 = _quantized(_random((4, 4), generator, torch.bfloat16), torch.float8_e4m3fn)
    assert type(x8.to(torch.float32)) is torch.Tensor
    assert torch.equal(x8.to(torch.float32), x8.dequantize(torch.float32))
    assert x8.to("cpu") is x8
    moved = x8.to("cpu", copy=True)
    assert isinstance(moved, Float8Tensor) and moved._data.data_ptr() != x8._data.data_ptr()
    assert torch.equal(moved.dequantize(), x8.dequantize())


def test_autograd_through_a_float8_tensor(generator):
    x8 = _quantized(_random((3, 5), generator), torch.float8_e4m3fn)
    x8.requires_grad_(True)
    weight = _random((5, 2), generator)
    (x8 @ weight).square().sum().backward()
    values, weight = x8.dequantize(torch.float64), weight.double()
    expected = 2 * (values @ weight) @ weight.t()
    assert type(x8.grad) is torch.Tensor and x8.grad.dtype == torch.float32
    torch.testing.assert_close(x8.grad.double(), expected, rtol=1e-5, atol=1e-5)


def test_parameter_state_dict_and_pickle_round_trip(generator, tmp_path):
    x8 = _quantized(_random((6, 4), generator, torch.bfloat16), torch.float8_e5m2, columnwise=True)
    param = torch.nn.Parameter(x8)
    assert isinstance(param, torch.nn.Parameter) and isinstance(param, Float8Tensor) and param.requires_grad
    module = torch.nn.Module()
    module.weight = param
    path = tmp_path / "fp8.pt"
    torch.save(module.state_dict(), path)
    loaded = torch.load(path, weights_only=True)["weight"]
    assert isinstance(loaded, Float8Tensor) and loaded.dtype == torch.bfloat16
    assert torch.equal(loaded._data.view(torch.uint8), x8._data.view(torch.uint8))
    assert torch.equal(loaded._scale_inv, x8._scale_inv) and torch.equal(loaded._transpose, x8._transpose)
    # load_state_dict into another FP8 parameter: bytes and scale are copied.
    other = torch.nn.Module()
    other.weight = torch.nn.Parameter(_quantized(torch.zeros(6, 4, dtype=torch.bfloat16), torch.float8_e5m2, scale=4.0))
    other.load_state_dict({"weight": loaded})
    assert torch.equal(other.weight.dequantize(), x8.dequantize())
    copied = copy.deepcopy(param)
    assert isinstance(copied, Float8Tensor) and copied._data.data_ptr() != x8._data.data_ptr()
    assert torch.equal(copied.dequantize(), x8.dequantize())
    buffer = io.BytesIO()
    torch.save(x8, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=True).dequantize(), x8.dequantize())


@compiles_te_fuser_modules
def test_compile_fullgraph_traces_float8_tensor_inputs(generator):
    x8 = _quantized(_random((8, 16), generator), torch.float8_e4m3fn)
    y = _random((16,), generator)

    def use(t, y):
        return t.view(2, 4, 16).dequantize() * y

    compiled = torch.compile(use, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x8, y), use(x8, y), rtol=0, atol=0)


def test_a_shell_refuses_every_op(generator):
    x8 = _quantized(_random((4, 4), generator), torch.float8_e4m3fn)
    _, shell = x8.prepare_for_saving()
    for op in (lambda t: t + 1, lambda t: t.view(-1), lambda t: t.clone(), lambda t: t.dequantize()):
        with pytest.raises(RuntimeError, match="holds no data"):
            op(shell)


def test_bad_construction_is_refused():
    data = torch.zeros(2, 2, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="data must hold uint8 bytes or torch.float8_e5m2"):
        Float8Tensor(data, torch.ones(1), torch.float8_e5m2, torch.float32)
    with pytest.raises(ValueError, match="needs its shape"):
        Float8Tensor(None, torch.ones(1), torch.float8_e4m3fn, torch.float32)
    with pytest.raises(ValueError, match="fp8_dtype must be"):
        Float8Tensor(data, torch.ones(1), torch.float8_e4m3fnuz, torch.float32)
    with pytest.raises(ValueError, match="nominal dtype"):
        Float8Tensor(data, torch.ones(1), torch.float8_e4m3fn, torch.int32)
    for scale_inv in (torch.ones(1, dtype=torch.float64), torch.ones(2)):
        with pytest.raises(ValueError, match="scale_inv must be a float32 tensor of one element"):
            Float8Tensor(data, scale_inv, torch.float8_e4m3fn, torch.float32)
    with pytest.raises(ValueError, match="transpose must have shape"):
        Float8Tensor(data, torch.ones(1), torch.float8_e4m3fn, torch.float32, torch.zeros(4, 1, dtype=torch.float8_e4m3fn))
    x8 = Float8Tensor(data, torch.ones(1), torch.float8_e4m3fn, torch.float32)
    with pytest.raises(ValueError, match="src has shape"):
        x8.quantize_(torch.zeros(3))


def test_the_fp8_op_list_is_written_down():
    assert "aten.view.default" in Float8Tensor.OPS and "aten.copy_.default" in Float8Tensor.OPS


def test_conversions_torch_allows_work(generator):
    x8 = _quantized(_random((4, 6), generator), torch.float8_e4m3fn)
    values = x8.dequantize()
    for dtype in (torch.int32, torch.int64, torch.bool, torch.complex64):
        assert torch.equal(x8.to(dtype), values.to(dtype))
    assert torch.equal(x8.to(torch.float64), x8.fp8_data.double() * x8._scale_inv.double())  # exact
    into = torch.zeros(4, 6, dtype=torch.int32)
    into.copy_(x8)
    assert torch.equal(into, values.to(torch.int32))
    # Sources torch would cast: float64 and integers go through float32.
    src = _random((4, 6), generator, torch.float64)
    x8.copy_(src)
    assert torch.equal(x8._data.view(torch.uint8), _torch_cast(src.float(), 0.75, torch.float8_e4m3fn).view(torch.uint8))
    x8.copy_(torch.arange(24, dtype=torch.int64).reshape(4, 6))
    assert torch.equal(x8._data.view(torch.uint8), _torch_cast(torch.arange(24.0).reshape(4, 6), 0.75,
                                                               torch.float8_e4m3fn).view(torch.uint8))


def test_new_zeros_on_another_device(generator):
    x8 = _quantized(_random((4, 6), generator), torch.float8_e4m3fn)
    out = x8.new_zeros(3, device="meta")
    assert isinstance(out, Float8Tensor) and out.device.type == "meta" and out._data.device.type == "meta"
    assert out._scale_inv.device.type == "meta"
