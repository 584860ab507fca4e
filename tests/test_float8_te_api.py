"""Float8Quantizer, Float8CurrentScalingQuantizer and Float8Tensor with TransformerEngine 2.6's API: the
constructors, TE's DType for fp8_dtype, quantize(out=), update_quantized, make_empty, set_usage, copy,
calibrate, and the tensor's TE attributes (`_data` / `_transpose` as uint8 bytes, `_fp8_dtype` as a DType).

References: torch's own float8 casts (tests/fp8_reference.py) and float64 math.
"""

import inspect

import pytest
import torch

import te_fuser.tex as tex
from fp8_reference import edge_values, fp8_max, reference_current_scale, reference_quantize
from te_fuser import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor
from te_fuser.te_dtype import DType

from _gloo_ranks import run_cases

FORMATS = [(DType.kFloat8E4M3, torch.float8_e4m3fn), (DType.kFloat8E5M2, torch.float8_e5m2)]
# TE 2.6's signatures: (name, kind, default); inspect.Parameter.empty where TE has none.
EMPTY = inspect.Parameter.empty
POS, KW = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
TE_SIGNATURES = {
    Float8Quantizer: [("scale", POS, EMPTY), ("amax", POS, EMPTY), ("fp8_dtype", POS, EMPTY),
                      ("rowwise", KW, True), ("columnwise", KW, True)],
    Float8CurrentScalingQuantizer: [("fp8_dtype", POS, EMPTY), ("device", POS, None), ("rowwise", KW, True),
                                    ("columnwise", KW, True), ("with_amax_reduction", KW, False),
                                    ("amax_reduction_group", KW, None), ("force_pow_2_scales", KW, False),
                                    ("amax_epsilon", KW, 0.0)],
}


def _values(shape, generator, dtype=torch.float32, fp8_dtype=torch.float8_e4m3fn):
    x = torch.randn(tuple(shape), generator=generator, dtype=torch.float64) * 40
    edges = edge_values(fp8_dtype, torch.float32).double()
    edges = edges[torch.isfinite(edges)][: x.numel()]
    x.view(-1)[: edges.numel()] = edges / 40  # zeros, subnormals, values near the format's maximum
    return x.to(dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_constructors_have_tes_signatures():
    # TE's (device is required there; te_fuser lets it default to the first tensor's).
    for cls, expected in TE_SIGNATURES.items():
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
        assert [(p.name, p.kind, p.default) for p in params] == expected, cls.__name__
    with pytest.raises(TypeError):
        Float8Quantizer(torch.ones(1), torch.zeros(1), DType.kFloat8E4M3, True)  # usages are keyword-only


@pytest.mark.parametrize("te_dtype,fp8_dtype", FORMATS)
def test_delayed_quantizer_takes_te_dtype_and_casts_like_torch(te_dtype, fp8_dtype, generator):
    x = _values((24, 40), generator, torch.bfloat16, fp8_dtype)
    scale, amax = torch.full([1], 3.5), torch.zeros(1)
    q = Float8Quantizer(scale, amax, te_dtype)
    assert q.dtype is te_dtype and q.fp8_dtype is fp8_dtype and (q.rowwise_usage, q.columnwise_usage) == (True, True)
    t = q(x)
    expected = reference_quantize(x, scale, fp8_dtype)
    assert t._data.dtype == torch.uint8 and torch.equal(t._data, _bytes(expected))
    assert t.fp8_data.dtype == fp8_dtype and t.fp8_data.data_ptr() == t._data.data_ptr()  # a view of the bytes
    assert t._fp8_dtype is te_dtype and t.fp8_dtype is fp8_dtype
    assert t._transpose.dtype == torch.uint8 and torch.equal(t._transpose, _bytes(expected).t())  # columnwise
    assert not t._transpose_invalid
    assert amax.item() == x.float().abs().max().item()
    assert torch.equal(t.dequantize(torch.float64), expected.double() * torch.reciprocal(scale).double())
    same = Float8Quantizer(scale, torch.zeros(1), fp8_dtype, columnwise=False)(x)  # torch's spelling
    assert torch.equal(same._data, t._data) and same._transpose is None


def test_zero_dim_scale_and_2d_amax_as_tes_tests_pass_them(generator):
    x = _values((16, 16), generator)
    q = Float8Quantizer(torch.ones(1).squeeze(), torch.zeros(1, 1), DType.kFloat8E4M3)
    t = q(x)
    assert t._scale_inv.shape == (1,) and t._scale_inv.item() == 1.0
    assert torch.equal(t._data, _bytes(reference_quantize(x, torch.ones(1), torch.float8_e4m3fn)))
    assert q.amax.item() == x.abs().max().item()


@pytest.mark.parametrize("te_dtype,fp8_dtype", FORMATS)
@pytest.mark.parametrize("pow2,epsilon", [(False, 0.0), (True, 1e-6)])
def test_current_scaling_quantizer_matches_the_formula(te_dtype, fp8_dtype, pow2, epsilon, generator):
    x = _values((7, 5, 12), generator, torch.float16, fp8_dtype)
    q = Float8CurrentScalingQuantizer(te_dtype, "cpu", force_pow_2_scales=pow2, amax_epsilon=epsilon)
    q.set_usage(rowwise=True, columnwise=False)
    t = q(x)
    scale = reference_current_scale(x.float().abs().max(), fp8_max(fp8_dtype), epsilon, pow2)
    assert torch.equal(t._scale_inv, 1.0 / scale) and torch.equal(q.scale, scale)
    assert torch.equal(t._data, _bytes(reference_quantize(x, scale, fp8_dtype))) and t._transpose is None
    assert t._fp8_dtype is te_dtype and t.shape == x.shape and t.dtype == torch.float16


@pytest.mark.parametrize("shape", [(), (7,), (6, 10), (3, 4, 5), (2, 3, 4, 5)])
def test_transposed_bytes_in_tes_quantize_layout(shape, generator):
    """TE's quantize lays the columnwise data out as (last dim, *leading dims): the bytes of the transposed
    (rows, last dim) matrix; a vector's and a scalar's are their own bytes. te_fuser's GEMMs read the 2-D
    matrix view (fp8_data_transpose)."""
    x = _values(shape, generator)
    t = Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu")(x)
    expected = t._data if len(shape) <= 1 else t._data.permute(len(shape) - 1, *range(len(shape) - 1))
    assert t._transpose.shape == expected.shape and torch.equal(t._transpose, expected)
    last = shape[-1] if shape else 1
    assert torch.equal(_bytes(t.fp8_data_transpose), t._data.reshape(-1, last).t())
    if len(shape) >= 2:  # a view that keeps the last dim keeps the transposed bytes, in the new layout
        flat = t.view(-1, shape[-1])
        assert flat._transpose.shape == (shape[-1], x.numel() // shape[-1])
        assert flat._transpose.data_ptr() == t._transpose.data_ptr()


def test_te_dtype_is_checked_and_named():
    for bad in (DType.kBFloat16, torch.float16):
        with pytest.raises(ValueError, match="fp8_dtype must be DType.kFloat8E4M3"):
            Float8Quantizer(torch.ones(1), torch.zeros(1), bad)
        with pytest.raises(ValueError, match="fp8_dtype must be DType.kFloat8E4M3"):
            Float8CurrentScalingQuantizer(bad, "cpu")
    q = Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu")
    q.dtype = DType.kFloat8E5M2  # TE's attribute is writable
    assert q.fp8_dtype is torch.float8_e5m2
    with pytest.raises(ValueError, match="^dtype must be"):
        q.dtype = torch.int8


def test_usages_as_te_sets_them():
    q = Float8Quantizer(torch.ones(1), torch.zeros(1), DType.kFloat8E4M3)
    q.set_usage(columnwise=False)
    assert (q.rowwise_usage, q.columnwise_usage, q.internal) == (True, False, False)
    with pytest.raises(TypeError):
        q.set_usage(True)  # keyword-only, as in TE
    with pytest.raises(ValueError, match="rowwise usage cannot be turned off"):
        q.set_usage(rowwise=False)
    with pytest.raises(ValueError, match="rowwise usage cannot be turned off"):
        Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu", rowwise=False)


def test_copy_shares_the_scaling_state_not_the_usages(generator):
    q = Float8Quantizer(torch.full([1], 2.0), torch.zeros(1), DType.kFloat8E4M3)
    c = q.copy()
    assert type(c) is Float8Quantizer and c is not q and c.scale is q.scale and c.amax is q.amax
    c.set_usage(columnwise=False)
    assert q.columnwise_usage and not c.columnwise_usage
    c(_values((4, 4), generator))
    assert q.amax.item() > 0  # the copy recorded into the shared amax


def test_calibrate_sets_amax_without_casting(generator):
    x = _values((8, 8), generator)
    q = Float8Quantizer(torch.ones(1), torch.full([1], 1e6), DType.kFloat8E4M3)
    q.calibrate(x)
    assert q.amax.item() == x.abs().max().item()  # set, not max-accumulated (TE's calibration)
    cs = Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu")
    cs.calibrate(x)
    assert cs.amax.item() == 0.0


@pytest.mark.parametrize("columnwise", [True, False])
def test_make_empty_then_update_quantized(columnwise, generator):
    q = Float8CurrentScalingQuantizer(DType.kFloat8E5M2, "cpu", columnwise=columnwise)
    empty = q.make_empty([6, 10], dtype=torch.bfloat16, requires_grad=True)
    assert isinstance(empty, Float8Tensor) and empty.shape == (6, 10) and empty.dtype == torch.bfloat16
    assert empty.requires_grad and empty._quantizer is q and empty._fp8_dtype is DType.kFloat8E5M2
    assert (empty._transpose is not None) == columnwise and empty._data.dtype == torch.uint8
    if columnwise:  # TE's make_empty layout: (last dim, numel / last dim)
        assert empty._transpose.shape == (10, 6) and q.make_empty([2, 3, 5])._transpose.shape == (5, 6)
    x = _values((6, 10), generator, torch.bfloat16, torch.float8_e5m2)
    out = q.update_quantized(x, empty)
    scale = reference_current_scale(x.float().abs().max(), 57344.0, 0.0, False)
    expected = _bytes(reference_quantize(x, scale, torch.float8_e5m2))
    assert out is empty and torch.equal(empty._data, expected) and torch.equal(empty._scale_inv, 1.0 / scale)
    if columnwise:
        assert torch.equal(empty._transpose, expected.t())


def test_quantize_out_writes_in_place_and_adopts_the_format(generator):
    x = _values((8, 16), generator)
    dst = Float8CurrentScalingQuantizer(DType.kFloat8E5M2, "cpu").make_empty([8, 16])
    data, scale_inv = dst._data, dst._scale_inv
    q = Float8Quantizer(torch.full([1], 4.0), torch.zeros(1), DType.kFloat8E4M3)
    assert q.quantize(x, out=dst) is dst
    assert dst._data is data and dst._scale_inv is scale_inv  # the same buffers, written in place
    assert dst._fp8_dtype is DType.kFloat8E4M3  # TE: the destination takes the quantizer's format
    assert torch.equal(dst._data, _bytes(reference_quantize(x, torch.full([1], 4.0), torch.float8_e4m3fn)))
    assert dst._scale_inv.item() == 0.25 and q.amax.item() == x.abs().max().item()


def test_update_quantized_into_a_view_of_a_flat_buffer(generator):
    """Megatron's FP8 parameter shards: a Float8Tensor over a slice of a flat uint8 buffer, sharing the
    parameter's scale_inv; the cast lands in the buffer and in that scale_inv."""
    buffer = torch.zeros(40, dtype=torch.uint8)
    shared_scale_inv = torch.ones(1)
    shard = Float8Tensor(shape=(16,), dtype=torch.float32, data=buffer[8:24], fp8_scale_inv=shared_scale_inv,
                         fp8_dtype=DType.kFloat8E4M3)
    x = _values((16,), generator)
    Float8Quantizer(torch.full([1], 0.5), torch.zeros(1), DType.kFloat8E4M3).update_quantized(x, shard)
    assert torch.equal(buffer[8:24], _bytes(reference_quantize(x, torch.full([1], 0.5), torch.float8_e4m3fn)))
    assert not buffer[:8].any() and not buffer[24:].any() and shared_scale_inv.item() == 2.0


@pytest.mark.parametrize("flag,written", [(1.0, False), (0.0, True), (2.0, True)])
def test_noop_flag_skips_only_at_one(flag, written, generator):
    x = _values((4, 8), generator)
    q = Float8Quantizer(torch.ones(1), torch.zeros(1), DType.kFloat8E4M3)
    t = q(x)
    before = t._data.clone()
    q.update_quantized(2 * x, t, noop_flag=torch.tensor([flag]))
    assert torch.equal(t._data, before) != written
    t.quantize_(4 * x, noop_flag=torch.tensor([flag]))
    assert torch.equal(t._data, before) != written


def test_update_quantized_names_bad_arguments(generator):
    q = Float8Quantizer(torch.ones(1), torch.zeros(1), DType.kFloat8E4M3)
    with pytest.raises(TypeError, match="dst must be a Float8Tensor, got Tensor"):
        q.update_quantized(torch.ones(2), torch.ones(2))
    with pytest.raises(ValueError, match=r"src has shape \(3,\), dst \(2,\)"):
        q.update_quantized(torch.ones(3), q.make_empty([2]))
    with pytest.raises(TypeError, match="src must be a torch.Tensor"):
        q.update_quantized([1.0, 2.0], q.make_empty([2]))


def test_te_keyword_constructor_reads_uint8_bytes(generator):
    values = _values((6, 8), generator)
    codes = reference_quantize(values, torch.full([1], 2.0), torch.float8_e5m2)
    t = Float8Tensor(shape=(6, 8), dtype=torch.float16, data=_bytes(codes).clone(), fp8_scale_inv=torch.full([1], 0.5),
                     fp8_dtype=DType.kFloat8E5M2, data_transpose=_bytes(codes).t().contiguous(), requires_grad=True)
    assert t.dtype == torch.float16 and t.requires_grad and t._fp8_dtype is DType.kFloat8E5M2
    assert torch.equal(t.dequantize(torch.float64), codes.double() * 0.5)
    assert torch.equal(t.transpose_dequantized(torch.float32), (codes.float() * 0.5).t())
    with pytest.raises(TypeError, match="pass scale_inv or fp8_scale_inv, not both"):
        Float8Tensor(codes, torch.ones(1), torch.float8_e5m2, torch.float32, fp8_scale_inv=torch.ones(1))
    with pytest.raises(ValueError, match="data must hold uint8 bytes or torch.float8_e5m2, got torch.int8"):
        Float8Tensor(shape=(2,), dtype=torch.float32, data=torch.zeros(2, dtype=torch.int8),
                     fp8_scale_inv=torch.ones(1), fp8_dtype=DType.kFloat8E5M2)
    with pytest.raises(ValueError, match="fp8_dtype must be"):
        Float8Tensor(shape=(2,), dtype=torch.float32, data=torch.zeros(2, dtype=torch.uint8),
                     fp8_scale_inv=torch.ones(1), fp8_dtype=None)


def test_update_usage_makes_and_drops_the_transpose(generator):
    x = _values((5, 12), generator)
    t = Float8Quantizer(torch.ones(1), torch.zeros(1), DType.kFloat8E4M3, columnwise=False)(x)
    assert t._transpose is None and t._transpose_invalid
    t.update_usage(columnwise_usage=True)
    assert torch.equal(t._transpose, t._data.t())
    t.update_usage(rowwise_usage=True, columnwise_usage=False)
    assert t._transpose is None and t._data is not None
    with pytest.raises(ValueError, match="rowwise_usage cannot be turned off"):
        t.update_usage(rowwise_usage=False)
    with pytest.raises(ValueError, match="has no quantizer"):
        t._get_quantizer()  # a cast's tensor keeps no quantizer; make_empty's does
    q = Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu")
    assert q.make_empty([2, 2])._get_quantizer() is q


def test_te_fusers_own_quantizers_keep_one_layout(generator):
    """The TE default is columnwise=True; te_fuser's recipe states and saved-activation casts ask for
    the transpose only where a GEMM needs it (the ops set it per forward), so their tensors carry no
    second copy. Control: the default quantizer does make the transpose this check looks for."""
    from te_fuser.attention.function import quantize_saved_output
    from te_fuser.ops.basic.activation import quantize_saved_input
    from te_fuser.quantization import make_recipe_state
    from te_fuser.recipe import DelayedScaling, Float8CurrentScaling

    x = _values((16, 32), generator)
    made = [make_recipe_state(r, 2, forward=True).quantizer(1)(x) for r in (DelayedScaling(), Float8CurrentScaling())]
    made += [quantize_saved_input(x), quantize_saved_output(x)]
    assert all(t._transpose is None for t in made)
    assert Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu")(x)._transpose is not None


def test_tex_quantize_and_dequantize(generator):
    x = _values((4, 16), generator, torch.bfloat16)
    q = Float8Quantizer(torch.full([1], 8.0), torch.zeros(1), DType.kFloat8E4M3)
    expected = reference_quantize(x, torch.full([1], 8.0), torch.float8_e4m3fn)
    t = tex.quantize(x, q, None, None)
    assert torch.equal(t._data, _bytes(expected))
    out = q.make_empty(x.shape, dtype=torch.bfloat16)
    assert tex.quantize(x, q, out, torch.zeros(1)) is out and torch.equal(out._data, _bytes(expected))
    assert tex.quantize(x, q, output=None, noop=torch.ones(1)).shape == x.shape  # skipped: left uninitialized
    deq = tex.dequantize(t, DType.kFloat32)
    assert deq.dtype == torch.float32 and torch.equal(deq.double(), expected.double() / 8.0)
    with pytest.raises(ValueError, match="otype must be DType.kFloat32, kFloat16 or kBFloat16"):
        tex.dequantize(t, DType.kFloat8E4M3)
    with pytest.raises(TypeError, match="input must be a quantized tensor"):
        tex.dequantize(x, DType.kFloat32)


def _reduced_amax_case(rank):
    x = torch.full((4, 8), float(rank + 1))  # rank 0's amax is 1, rank 1's is 2
    q = Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu", with_amax_reduction=True)
    t = q(x)
    group_scale_inv = torch.tensor(2.0 / 448.0).item()  # both ranks: the group's amax, 2
    assert q.amax.item() == 2.0 and t._scale_inv.item() == group_scale_inv
    local = Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu")(x)
    assert local._scale_inv.item() == torch.tensor((rank + 1) / 448.0).item()  # control: without it, its own


def test_with_amax_reduction_casts_every_rank_with_the_groups_amax():
    run_cases([(_reduced_amax_case,)])


def test_with_amax_reduction_needs_a_process_group():
    q = Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu", with_amax_reduction=True)
    with pytest.raises(RuntimeError, match="with_amax_reduction=True needs torch.distributed"):
        q(torch.ones(2))


def test_replace_raw_data_moves_the_bytes_and_keeps_the_rest(generator):
    from te_fuser.tensor.utils import replace_raw_data

    q = Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu")
    t = q.make_empty([8, 16], dtype=torch.bfloat16)
    q.update_quantized(_values((8, 16), generator, torch.bfloat16), t)
    kept = {name: getattr(t, name) for name in ("_quantizer", "_fp8_dtype", "_scale_inv", "_transpose")}
    old = t._data
    buffer = torch.zeros(200, dtype=torch.uint8)
    replace_raw_data(t, buffer[40:168].view(8, 16))
    assert t._data.data_ptr() == buffer[40:].data_ptr() and torch.equal(t._data, old)
    assert all(getattr(t, name) is value for name, value in kept.items())
    with pytest.raises(ValueError, match=r"new_raw_data must be a uint8 tensor of shape \(8, 16\)"):
        replace_raw_data(t, torch.zeros(8, 15, dtype=torch.uint8))
    with pytest.raises(TypeError, match="tensor must be a Float8Tensor"):
        replace_raw_data(torch.zeros(2), torch.zeros(2, dtype=torch.uint8))
