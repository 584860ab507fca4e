"""The names TE 2.6's own tests import from `pytorch.utils`, `pytorch.distributed`, `pytorch.jit`,
`pytorch.module.base` and `pytorch.module`: their answers, their errors, and their alias paths."""

import importlib
import types

import pytest
import torch

import te_fuser
from te_fuser import utils
from te_fuser.module import base


@pytest.mark.parametrize("module,name,target", [
    ("transformer_engine.pytorch.distributed", "fp8_autocast", "te_fuser.fp8_autocast"),
    ("transformer_engine.pytorch.fp8", "fp8_autocast", "te_fuser.fp8_autocast"),
    ("transformer_engine.pytorch.utils", "get_device_compute_capability", "te_fuser.utils.get_device_compute_capability"),
    ("transformer_engine.pytorch.utils", "is_bf16_compatible", "te_fuser.utils.is_bf16_compatible"),
    ("transformer_engine.pytorch.utils", "get_cudnn_version", "te_fuser.utils.get_cudnn_version"),
    ("transformer_engine.pytorch.utils", "init_method_normal", "te_fuser.utils.init_method_normal"),
    ("transformer_engine.pytorch.utils", "scaled_init_method_normal", "te_fuser.utils.scaled_init_method_normal"),
    ("transformer_engine.pytorch.utils", "get_default_init_method", "te_fuser.utils.get_default_init_method"),
    ("transformer_engine.pytorch.utils", "attention_mask_func", "te_fuser.utils.attention_mask_func"),
    ("transformer_engine.pytorch.utils", "gpu_autocast_ctx", "te_fuser.utils.gpu_autocast_ctx"),
    ("transformer_engine.pytorch.jit", "dgelu_fused_", "te_fuser.jit.dgelu_fused_"),
    ("transformer_engine.pytorch.jit", "l2normalization_backward_fused", "te_fuser.jit.l2normalization_backward_fused"),
    ("transformer_engine.pytorch.module.base", "get_workspace", "te_fuser.module.base.get_workspace"),
    ("transformer_engine.pytorch.module.base", "get_multi_stream_cublas_workspace",
     "te_fuser.module.base.get_multi_stream_cublas_workspace"),
    ("transformer_engine.pytorch.cpp_extensions", "general_gemm", "te_fuser.cpp_extensions.gemm.general_gemm"),
    ("transformer_engine.pytorch.cpp_extensions", "general_grouped_gemm",
     "te_fuser.cpp_extensions.gemm.general_grouped_gemm"),
    ("transformer_engine.pytorch", "Fp8Padding", "te_fuser.module.fp8_padding.Fp8Padding"),
    ("transformer_engine.pytorch.module", "Fp8Unpadding", "te_fuser.module.fp8_unpadding.Fp8Unpadding"),
    ("transformer_engine.pytorch.quantization", "get_align_size_for_quantization",
     "te_fuser.quantization.get_align_size_for_quantization"),
    ("transformer_engine.pytorch.optimizers", "MultiTensorApply", "te_fuser.optimizers.MultiTensorApply"),
    ("transformer_engine.pytorch.optimizers", "multi_tensor_l2norm", "te_fuser.tex.multi_tensor_l2norm"),
    ("transformer_engine.pytorch.transformer", "TransformerLayer", "te_fuser.TransformerLayer"),
    ("transformer_engine.pytorch.optimizers.multi_tensor_apply", "multi_tensor_applier",
     "te_fuser.optimizers.multi_tensor_applier"),
    ("transformer_engine_torch", "multi_tensor_scale", "te_fuser.kernels.multi_tensor.multi_tensor_scale"),
    ("transformer_engine_torch", "multi_tensor_l2norm", "te_fuser.kernels.multi_tensor.multi_tensor_l2norm"),
    ("transformer_engine_torch", "multi_tensor_unscale_l2norm",
     "te_fuser.kernels.multi_tensor.multi_tensor_unscale_l2norm"),
    ("transformer_engine_torch", "multi_tensor_compute_scale_and_scale_inv",
     "te_fuser.kernels.multi_tensor.multi_tensor_compute_scale_and_scale_inv"),
])
def test_alias_paths(alias, module, name, target):
    target_module, target_name = target.rsplit(".", 1)
    found = getattr(importlib.import_module(module), name)
    assert found is getattr(importlib.import_module(target_module), target_name)


def _fake_cuda(monkeypatch, major, minor):
    """torch.cuda answering as one device of compute capability major.minor."""
    props = types.SimpleNamespace(major=major, minor=minor)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)


@pytest.mark.parametrize("capability,bf16", [((7, 0), False), ((8, 6), True), ((9, 0), True), ((12, 0), True)])
def test_capability_queries_follow_torch_cuda(monkeypatch, capability, bf16):
    _fake_cuda(monkeypatch, *capability)
    assert utils.get_device_compute_capability() == capability
    assert utils.is_bf16_compatible() is bf16
    assert base.get_cublas_workspace_size_bytes() == (32 if capability >= (9, 0) else 4) * 2**20


def test_capability_queries_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert utils.get_device_compute_capability() == (0, 0)
    assert utils.is_bf16_compatible() is True  # the CPU computes in bfloat16
    assert base.get_cublas_workspace_size_bytes() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_capability_of_the_real_device():
    assert utils.get_device_compute_capability() == torch.cuda.get_device_capability()


@pytest.mark.parametrize("encoded,version", [(8907, (8, 9, 7)), (8600, (8, 6, 0)), (90100, (9, 1, 0)),
                                             (91002, (9, 10, 2)), (None, (0, 0, 0))])
def test_cudnn_version_decoding(monkeypatch, encoded, version):
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: encoded)
    assert utils.get_cudnn_version() == version


def test_cudnn_version_without_cudnn(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)
    assert utils.get_cudnn_version() == (0, 0, 0)


def test_workspace_is_allocated_once():
    first = base.get_workspace()
    assert first.dtype == torch.uint8 and first.numel() == base.get_cublas_workspace_size_bytes()
    assert base.get_workspace() is first
    streams = base.get_multi_stream_cublas_workspace()
    assert len(streams) == base.NUM_CUBLAS_STREAMS and all(w.numel() == first.numel() for w in streams)
    assert base.get_multi_stream_cublas_workspace() is streams


@pytest.mark.parametrize("make,std", [(lambda: utils.init_method_normal(0.5), 0.5),
                                      (lambda: utils.scaled_init_method_normal(0.5, 8), 0.125),
                                      (utils.get_default_init_method, 0.023)])
def test_normal_initializers(make, std):
    t = torch.empty(400_000, dtype=torch.float64)
    assert make()(t) is t
    # The sample's std is within 1% of std (its relative standard error is 0.11%), its mean within 5 errors.
    assert abs(t.std().item() / std - 1) < 0.01
    assert abs(t.mean().item()) < 5 * std / 400_000 ** 0.5


def test_constant_initializer():
    for value in (0.0, 1.0, -2.5):
        assert torch.equal(utils.init_method_constant(value)(torch.empty(3)), torch.full((3,), value))


def test_initializer_arguments_are_checked():
    with pytest.raises(ValueError, match="sigma"):
        utils.init_method_normal("0.02")
    with pytest.raises(ValueError, match="sigma"):
        utils.scaled_init_method_normal(float("nan"), 2)
    with pytest.raises(ValueError, match="num_layers"):
        utils.scaled_init_method_normal(0.02, 0)
    with pytest.raises(ValueError, match="val"):
        utils.init_method_constant(None)


def test_attention_mask_func_masks_in_place():
    scores = torch.randn(2, 3, 4, 4)
    mask = torch.rand(2, 1, 4, 4) > 0.5
    expected = torch.where(mask, torch.tensor(-10000.0), scores)
    assert utils.attention_mask_func(scores, mask) is scores
    assert torch.equal(scores, expected)
    with pytest.raises(TypeError, match="attention_mask must be a bool tensor"):
        utils.attention_mask_func(scores, mask.float())


def test_gpu_autocast_ctx_is_cuda_autocast():
    ctx = utils.gpu_autocast_ctx(enabled=False)
    assert isinstance(ctx, torch.amp.autocast) and ctx.device == "cuda"


def test_distributed_fp8_autocast_is_fp8_autocast():
    assert te_fuser.distributed.fp8_autocast is te_fuser.fp8_autocast
