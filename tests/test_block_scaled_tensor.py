"""MXFP8Tensor and Float8BlockwiseQTensor: their values against the float64 references, their usages,
the ops that keep them quantized, the shell prepare_for_saving leaves, pickling, deepcopy and
state_dict round trips, their data held as TE holds it (uint8 bytes)."""

import copy
import io
import pickle

import pytest
import torch

import block_scaling_reference as ref
import te_fuser
from te_fuser.recipe import Float8BlockScaling, MXFP8BlockScaling
from te_fuser.tensor import (Float8BlockQuantizer, Float8BlockwiseQTensor, MXFP8Quantizer, MXFP8Tensor,
                             QuantizedTensor)
from te_fuser.tensor._block_scaled_tensor import fp8_data

QUANTIZERS = {
    "mxfp8": lambda **usage: MXFP8Quantizer(torch.float8_e4m3fn, **usage),
    "block1d": lambda **usage: Float8BlockQuantizer(torch.float8_e4m3fn, block_scaling_dim=1, **usage),
    "block2d": lambda **usage: Float8BlockQuantizer(torch.float8_e5m2, block_scaling_dim=2,
                                                    force_pow_2_scales=False, **usage),
}
BLOCK_ARGS = {"block1d": (torch.float8_e4m3fn, 1, True), "block2d": (torch.float8_e5m2, 2, False)}  # dtype, dim, pow2


def make(kind, rowwise=True, columnwise=True):
    return QUANTIZERS[kind](rowwise=rowwise, columnwise=columnwise)


def reference_values(kind, x, columnwise):
    """float64 values the kind's rowwise or columnwise data stands for, in x's shape."""
    x2 = x.reshape(-1, x.shape[-1])
    if kind == "mxfp8":
        return ref.mxfp8_values(x2, torch.float8_e4m3fn, columnwise).reshape(x.shape)
    fp8_dtype, dim, pow2 = BLOCK_ARGS[kind]
    return ref.float8_block_values(x2, fp8_dtype, dim, 0.0, pow2, columnwise).reshape(x.shape)


def reference_codes(kind, x, columnwise):
    """uint8 FP8 codes of 2-D x in the layout of the kind's data: x's (MXFP8's usages, Float8 block scaling's
    rowwise usage) or its transpose's (Float8 block scaling's columnwise usage)."""
    if kind == "mxfp8":
        return ref.mxfp8_quantize(x, torch.float8_e4m3fn, columnwise)[0]
    fp8_dtype, dim, pow2 = BLOCK_ARGS[kind]
    return ref.float8_block_quantize(x, fp8_dtype, dim, 0.0, pow2, columnwise)[0]


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


@pytest.mark.parametrize("kind", sorted(QUANTIZERS))
def test_data_buffers_hold_te_bytes(kind, generator):
    """As TE's: the data are the FP8 codes as uint8 bytes (numpy reads them, as TE's ONNX test does), MXFP8's
    scales uint8 E8M0 codes, Float8 block scaling's float32, however the tensor was made; fp8_data() views
    the codes in the FP8 dtype."""
    x = torch.randn(256, 160, generator=generator) * torch.logspace(-4, 4, 160)
    x[0, :4] = torch.tensor([0.0, -0.0, 3e4, -2e-6])
    want = {columnwise: reference_codes(kind, x, columnwise) for columnwise in (False, True)}
    q = make(kind)(x)
    empty = make(kind).make_empty(x.shape)
    empty.copy_(x)
    saved = io.BytesIO()
    torch.save(q, saved)
    saved.seek(0)
    made = {"quantize": q, "make_empty + copy_": empty, "clone": q.clone(), "deepcopy": copy.deepcopy(q),
            "pickle": pickle.loads(pickle.dumps(q)), "torch.load": torch.load(saved)}
    if kind == "block2d":  # columnwise bytes transposed from the rowwise ones
        made["update_usage"] = make(kind, columnwise=False)(x)
        made["update_usage"].update_usage(columnwise_usage=True)
    top, _ = q.split(128)  # FSDP2's shard
    made["split"] = top
    scale_dtype = torch.uint8 if kind == "mxfp8" else torch.float32
    for how, t in made.items():
        for columnwise in (False, True):
            data = t._columnwise_data if columnwise else t._rowwise_data
            codes = want[columnwise]
            if how == "split":
                codes = codes[:, :128] if columnwise and kind != "mxfp8" else codes[:128]
            assert data.dtype == torch.uint8, (how, columnwise)
            assert (data.numpy() == codes.numpy()).all(), (how, columnwise)
            scale = t._columnwise_scale_inv if columnwise else t._rowwise_scale_inv
            assert scale.dtype == scale_dtype, (how, columnwise)
            typed = fp8_data(t, columnwise)
            assert typed.dtype == q._fp8_dtype and typed.data_ptr() == data.data_ptr()


@pytest.mark.parametrize("kind", sorted(QUANTIZERS))
def test_constructor_takes_bytes_or_fp8_codes(kind, generator):
    """Data given as uint8 bytes or in the tensor's FP8 dtype are held as the same bytes (a view, never a cast
    of the values); data of another dtype are refused, naming the argument."""
    q = make(kind)(torch.randn(130, 256, generator=generator) * 100)
    cls, fp8_dtype = type(q), q._fp8_dtype

    def build(rowwise_data, columnwise_data):
        return cls(q.shape, q.dtype, rowwise_data=rowwise_data, rowwise_scale_inv=q._rowwise_scale_inv,
                   columnwise_data=columnwise_data, columnwise_scale_inv=q._columnwise_scale_inv,
                   fp8_dtype=fp8_dtype, **q._meta())

    held = (q._rowwise_data, q._columnwise_data)
    for given in (held, tuple(data.view(fp8_dtype) for data in held)):
        t = build(*given)
        for mine, theirs in zip((t._rowwise_data, t._columnwise_data), held):
            assert mine.dtype == torch.uint8 and mine.data_ptr() == theirs.data_ptr() and torch.equal(mine, theirs)
        assert torch.equal(t.dequantize(), q.dequantize())
        assert torch.equal(t.columnwise_dequantize(), q.columnwise_dequantize())
    if kind == "mxfp8":  # TE's create_tensor_from_data, over bytes or codes
        for data in (q._rowwise_data, q._rowwise_data.view(fp8_dtype)):
            t = q._quantizer.create_tensor_from_data(data, q._rowwise_scale_inv, q.dtype)
            assert t._rowwise_data.dtype == torch.uint8 and t._rowwise_data.data_ptr() == q._rowwise_data.data_ptr()
            assert torch.equal(t.dequantize(), q.dequantize())
    other = torch.float8_e5m2 if fp8_dtype == torch.float8_e4m3fn else torch.float8_e4m3fn
    with pytest.raises(ValueError, match=f"rowwise_data must hold uint8 bytes or {fp8_dtype}, got {other}"):
        build(held[0].view(other), held[1])
    with pytest.raises(ValueError, match=f"columnwise_data must hold uint8 bytes or {fp8_dtype}, got torch.int8"):
        build(held[0], held[1].view(torch.int8))


@pytest.mark.parametrize("quantized_weight", [False, True])
@pytest.mark.parametrize("recipe", [MXFP8BlockScaling, Float8BlockScaling])
def test_module_gemms_read_the_bytes_as_fp8_codes(recipe, quantized_weight, generator):
    """A Linear's three GEMMs over integers in [-8, 8] (exact in E4M3 under power-of-two block scales, their
    sums exact in float32) equal float64 matmuls bit for bit, with the weight quantized by the module or a
    quantized parameter (fp8_model_init)."""
    def integers(*shape):
        return torch.randint(-8, 9, shape, generator=generator).float()

    with te_fuser.fp8_model_init(enabled=quantized_weight, recipe=recipe()):
        layer = te_fuser.Linear(256, 128, bias=False, params_dtype=torch.float32)
    w = integers(128, 256)
    with torch.no_grad():
        layer.weight.copy_(w)
    if quantized_weight:
        assert layer.weight._rowwise_data.dtype == torch.uint8 and torch.equal(layer.weight.dequantize(), w)
    x = integers(64, 256).requires_grad_()
    dy = integers(64, 128)
    with te_fuser.fp8_autocast(fp8_recipe=recipe()):
        y = layer(x)
    y.backward(dy)
    x64, w64, dy64 = x.detach().double(), w.double(), dy.double()
    assert torch.equal(y, (x64 @ w64.t()).float())
    assert torch.equal(x.grad, (dy64 @ w64).float())
    assert torch.equal(layer.weight.grad, (dy64.t() @ x64).float())
