"""ONNX export (te_fuser.export): each module exported with torch.onnx (dynamo) and te_translation_table, run by
ONNX Runtime, against the module's own eager inference output. TensorRT's FP8 / MXFP8 operators run in ONNX
Runtime as Python operators written here from the float64 references (fp8_reference.py,
block_scaling_reference.py), not from te_fuser's kernels, so the graph's quantization is checked against the
formats' specs as well."""

import numpy as np
import pytest
import torch

import block_scaling_reference as ref
import te_fuser
from fp8_reference import reference_quantize
from te_fuser.kernels.fp8_block import mxfp8_scale_shape
from te_fuser.export import is_in_onnx_export_mode, onnx_export
from te_fuser.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                             NVFP4BlockScaling)

ort = pytest.importorskip("onnxruntime", reason="CI installs onnxruntime (.ci/run's TEST_EXTRAS)")
ortx = pytest.importorskip("onnxruntime_extensions")
pytest.importorskip("onnxscript")

E4M3 = torch.float8_e4m3fn


def _np(t: torch.Tensor) -> np.ndarray:
    """numpy's view of t; bfloat16 through ml_dtypes (an onnx dependency), as ONNX Runtime takes it."""
    if t.dtype == torch.bfloat16:
        import ml_dtypes  # pylint: disable=import-outside-toplevel

        return t.detach().float().numpy().astype(ml_dtypes.bfloat16)
    return t.detach().numpy()


@ortx.onnx_op(op_type="trt::TRT_FP8QuantizeLinear", domain="trt",
              inputs=[ortx.PyCustomOpDef.dt_float, ortx.PyCustomOpDef.dt_float],
              outputs=[ortx.PyCustomOpDef.dt_uint8])
def _fp8_quantize(x, scale_inv):
    scale = 1.0 / torch.from_numpy(np.asarray(scale_inv, dtype=np.float32)).reshape(1)
    return reference_quantize(torch.from_numpy(x), scale, E4M3).view(torch.uint8).numpy()


@ortx.onnx_op(op_type="trt::TRT_FP8DequantizeLinear", domain="trt",
              inputs=[ortx.PyCustomOpDef.dt_uint8, ortx.PyCustomOpDef.dt_float],
              outputs=[ortx.PyCustomOpDef.dt_float])
def _fp8_dequantize(q, scale_inv):
    values = ref.fp8_decode(torch.from_numpy(q), E4M3) * float(np.asarray(scale_inv).reshape(-1)[0])
    return ref.round_f32(values).float().numpy()


@ortx.onnx_op(op_type="trt::TRT_MXFP8QuantizeLinear", domain="trt", inputs=[ortx.PyCustomOpDef.dt_float],
              outputs=[ortx.PyCustomOpDef.dt_uint8, ortx.PyCustomOpDef.dt_uint8])
def _mxfp8_quantize(x):
    x = torch.from_numpy(x)
    codes, scales = ref.mxfp8_quantize(x.reshape(-1, x.shape[-1]), E4M3)
    # te_fuser's scale layout (TE's): the graph's shape, zero codes in the padding.
    padded = torch.zeros(mxfp8_scale_shape(tuple(x.shape), False), dtype=torch.uint8)
    padded[:scales.shape[0], :scales.shape[1]] = scales
    return codes.reshape(x.shape).numpy(), padded.numpy()


@ortx.onnx_op(op_type="trt::TRT_MXFP8DequantizeLinear", domain="trt",
              inputs=[ortx.PyCustomOpDef.dt_uint8, ortx.PyCustomOpDef.dt_uint8],
              outputs=[ortx.PyCustomOpDef.dt_float])
def _mxfp8_dequantize(q, scales):
    q = torch.from_numpy(q)
    rows, cols = q.numel() // q.shape[-1], q.shape[-1]
    scales = torch.from_numpy(scales)[:rows, :-(-cols // ref.MX_BLOCK)]
    values = ref.mxfp8_dequantize(q.reshape(rows, cols), scales, E4M3, torch.float32)
    return values.reshape(q.shape).numpy()


def export_and_run(model, args, path, recipe=None, dynamic_batch=None, run_args=None):
    """(eager outputs on run_args, ONNX Runtime's outputs on run_args), after one warm-up forward."""
    run_args = args if run_args is None else run_args
    model.eval()
    with torch.inference_mode(), te_fuser.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
        model(*args)
        dynamic_shapes = None
        if dynamic_batch is not None:
            batch = torch.export.Dim("batch", min=2, max=64)
            dynamic_shapes = tuple({dynamic_batch: batch} if isinstance(a, torch.Tensor) and a.dim() > 1 else None
                                   for a in args)
        with onnx_export(True):
            torch.onnx.export(model, args, str(path), dynamo=True,
                              custom_translation_table=te_fuser.export.te_translation_table,
                              dynamic_shapes=dynamic_shapes, optimize=False, verbose=False)
        eager = model(*run_args)
    eager = eager if isinstance(eager, tuple) else (eager,)
    options = ort.SessionOptions()
    options.register_custom_ops_library(ortx.get_library_path())
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feeds = {i.name: _np(a) for i, a in zip(session.get_inputs(), [a for a in run_args if a is not None])}
    return eager, session.run(None, feeds)


def assert_close(eager, onnx_outputs, atol, rtol=1e-5):
    assert len(eager) == len(onnx_outputs)
    for e, o in zip(eager, onnx_outputs):
        np.testing.assert_allclose(o.astype(np.float32), _np(e).astype(np.float32), atol=atol, rtol=rtol)


RECIPES = {"none": None, "delayed": DelayedScaling(), "current": Float8CurrentScaling(),
           "mxfp8": MXFP8BlockScaling()}


def _module(kind, dtype, normalization="LayerNorm", activation="gelu", zero_centered_gamma=False):
    if kind == "Linear":
        return te_fuser.Linear(64, 96, bias=True, params_dtype=dtype)
    if kind == "LayerNormLinear":
        return te_fuser.LayerNormLinear(64, 96, params_dtype=dtype, normalization=normalization,
                                        zero_centered_gamma=zero_centered_gamma, return_layernorm_output=True)
    return te_fuser.LayerNormMLP(64, 128, params_dtype=dtype, normalization=normalization, activation=activation,
                                 zero_centered_gamma=zero_centered_gamma)


def _randomize_norm(module):
    """Random norm parameters (their defaults are 1 and 0, which would hide a swapped weight and bias)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.startswith("layer_norm"):
                p.copy_(torch.randn_like(p) * 0.5)


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_linear_modules_match_eager(tmp_path, kind, recipe):
    torch.manual_seed(0)
    model = _module(kind, torch.float32)
    _randomize_norm(model)
    x = torch.randn(4, 32, 64)
    x[0, 0, :3] = torch.tensor([0.0, 30.0, -1e-6])  # a large value sets the scale, a tiny one underflows
    eager, onnx_outputs = export_and_run(model, (x,), tmp_path / "m.onnx", RECIPES[recipe], dynamic_batch=0,
                                         run_args=(torch.randn(6, 32, 64),))
    assert_close(eager, onnx_outputs, atol=1e-4 if recipe == "none" else 2e-3)


@pytest.mark.parametrize("activation", ["gelu", "qgelu", "relu", "srelu", "silu", "geglu", "qgeglu", "reglu",
                                        "sreglu", "swiglu"])
@pytest.mark.parametrize("normalization, zero_centered_gamma", [("LayerNorm", True), ("RMSNorm", False)])
def test_layernorm_mlp_activations_and_norms(tmp_path, activation, normalization, zero_centered_gamma):
    torch.manual_seed(1)
    model = _module("LayerNormMLP", torch.float32, normalization, activation, zero_centered_gamma)
    _randomize_norm(model)
    eager, onnx_outputs = export_and_run(model, (torch.randn(2, 16, 64),), tmp_path / "m.onnx", DelayedScaling())
    assert_close(eager, onnx_outputs, atol=2e-3)


def test_float16_layernorm_linear(tmp_path):
    torch.manual_seed(2)
    model = _module("LayerNormLinear", torch.float16)
    eager, onnx_outputs = export_and_run(model, (torch.randn(4, 8, 64, dtype=torch.float16),), tmp_path / "m.onnx")
    assert all(o.dtype == np.float16 for o in onnx_outputs)
    assert_close(eager, onnx_outputs, atol=2e-3, rtol=1e-2)


def test_bfloat16_graph_keeps_its_dtype(tmp_path):
    """ONNX Runtime takes no bfloat16 from numpy here: the graph's inputs and outputs are checked instead."""
    import onnx  # pylint: disable=import-outside-toplevel

    model = _module("LayerNormMLP", torch.bfloat16).eval()
    x = torch.randn(4, 8, 64, dtype=torch.bfloat16)
    with torch.inference_mode(), onnx_export(True):
        torch.onnx.export(model, (x,), str(tmp_path / "m.onnx"), dynamo=True, optimize=False,
                          custom_translation_table=te_fuser.export.te_translation_table)
    graph = onnx.load(str(tmp_path / "m.onnx")).graph
    assert [v.type.tensor_type.elem_type for v in (*graph.input, *graph.output)] == [onnx.TensorProto.BFLOAT16] * 2


@pytest.mark.parametrize("qkv_format", ["sbhd", "bshd"])
@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "padding", "padding_causal", "arbitrary"])
def test_dot_product_attention(tmp_path, qkv_format, mask_type):
    torch.manual_seed(3)
    s, b, h, g, d = 24, 3, 4, 2, 16
    shape = lambda heads: (s, b, heads, d) if qkv_format == "sbhd" else (b, s, heads, d)  # noqa: E731
    q, k, v = torch.randn(shape(h)), torch.randn(shape(g)), torch.randn(shape(g))
    mask = None
    if "padding" in mask_type:
        lengths = torch.tensor([24, 17, 5])
        mask = (torch.arange(s)[None, :] >= lengths[:, None]).reshape(b, 1, 1, s)
    elif mask_type == "arbitrary":
        mask = torch.rand(b, 1, s, s) < 0.4
        mask[0, 0, 3] = True  # a row with every key masked
    model = te_fuser.DotProductAttention(h, d, num_gqa_groups=g, qkv_format=qkv_format, attn_mask_type=mask_type,
                                         attention_dropout=0.3)
    eager, onnx_outputs = export_and_run(model, (q, k, v, mask), tmp_path / "a.onnx")
    assert_close(eager, onnx_outputs, atol=1e-5)


def test_transformer_layer_under_fp8(tmp_path):
    torch.manual_seed(4)
    layer = te_fuser.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                      self_attn_mask_type="causal", activation="swiglu", normalization="RMSNorm")
    eager, onnx_outputs = export_and_run(layer, (torch.randn(16, 2, 64),), tmp_path / "t.onnx", DelayedScaling())
    assert_close(eager, onnx_outputs, atol=5e-3)


def _float64_attention(q, k, v, mask, scale):
    """[b, h, s, d] float64; the masked scores set to -10000 (TE's unfused attention)."""
    scores = (q @ k.transpose(-1, -2)) * scale
    return torch.softmax(scores.masked_fill(mask, -10000.0), dim=-1) @ v


def test_arbitrary_mask_matches_float64_forward_and_backward():
    torch.manual_seed(5)
    s, b, h, d = 12, 2, 3, 8
    q, k, v = (torch.randn(s, b, h, d, requires_grad=True) for _ in range(3))
    mask = torch.rand(b, h, s, s) < 0.5
    mask[1, 2, 4] = True  # every key masked: the row averages v, as in TE
    model = te_fuser.DotProductAttention(h, d, attn_mask_type="arbitrary", attention_dropout=0.0)
    out = model(q, k, v, attention_mask=mask)
    dout = torch.randn_like(out)
    out.backward(dout)
    q64, k64, v64 = (t.detach().double().permute(1, 2, 0, 3).requires_grad_() for t in (q, k, v))
    ref_out = _float64_attention(q64, k64, v64, mask, d ** -0.5)
    ref_out.backward(dout.double().reshape(s, b, h, d).permute(1, 2, 0, 3))
    torch.testing.assert_close(out.double(), ref_out.permute(2, 0, 1, 3).reshape(s, b, h * d), atol=1e-5, rtol=1e-5)
    for got, want in ((q, q64), (k, k64), (v, v64)):
        torch.testing.assert_close(got.grad.double(), want.grad.permute(2, 0, 1, 3), atol=1e-5, rtol=1e-5)


def test_arbitrary_mask_refusals():
    model = te_fuser.DotProductAttention(2, 8, attn_mask_type="arbitrary")
    q = torch.randn(4, 2, 2, 8)
    with pytest.raises(TypeError, match="attention_mask must be a torch.bool tensor"):
        model(q, q, q, attention_mask=torch.zeros(2, 1, 4, 4))
    with pytest.raises(ValueError, match="does not broadcast"):
        model(q, q, q, attention_mask=torch.zeros(3, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="'sbhd' or 'bshd'"):
        model(q.reshape(8, 2, 8), q.reshape(8, 2, 8), q.reshape(8, 2, 8), qkv_format="thd",
              cu_seqlens_q=torch.tensor([0, 4, 8], dtype=torch.int32),
              cu_seqlens_kv=torch.tensor([0, 4, 8], dtype=torch.int32))


@pytest.mark.parametrize("recipe", [Float8BlockScaling(), NVFP4BlockScaling()])
def test_recipes_without_an_onnx_form_are_refused(recipe):
    model = te_fuser.Linear(64, 64)
    with torch.inference_mode(), te_fuser.fp8_autocast(fp8_recipe=recipe), onnx_export(True):
        with pytest.raises(NotImplementedError, match=type(recipe).__name__):
            model(torch.randn(32, 64))


def test_export_mode_is_scoped():
    assert not is_in_onnx_export_mode()
    with onnx_export(True):
        assert is_in_onnx_export_mode()
        with onnx_export(False):
            assert not is_in_onnx_export_mode()
        assert is_in_onnx_export_mode()
    with pytest.raises(RuntimeError, match="inside"):
        with onnx_export(True):
            raise RuntimeError("inside")
    assert not is_in_onnx_export_mode()


def test_quantizers_create_tensors_from_codes():
    """TE's create_tensor_from_data: te_fuser's tensors over given codes dequantize as the spec says."""
    torch.manual_seed(6)
    codes = torch.randint(0, 256, (8, 64), dtype=torch.uint8)
    codes[codes & 0x7F == 0x7F] = 0  # no NaN codes
    quantizer = te_fuser.Float8Quantizer(torch.tensor([4.0]), torch.zeros(1), E4M3)
    t = quantizer.create_tensor_from_data(codes, fake_dtype=torch.float32)
    assert torch.equal(t.dequantize().double(), ref.fp8_decode(codes, E4M3) / 4.0)
    scales = torch.randint(110, 140, (8, 2), dtype=torch.uint8)
    padded = torch.zeros(mxfp8_scale_shape((8, 64), False), dtype=torch.uint8)
    padded[:8, :2] = scales
    mx_quantizer = te_fuser.tensor.mxfp8_tensor.MXFP8Quantizer(E4M3)
    mx = mx_quantizer.create_tensor_from_data(codes, padded, torch.float32)
    assert torch.equal(mx.dequantize(), ref.mxfp8_dequantize(codes, scales, E4M3, torch.float32))
    with pytest.raises(ValueError, match="scale_inv must be uint8 of shape"):
        mx_quantizer.create_tensor_from_data(codes, scales)
