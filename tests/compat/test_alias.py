"""The opt-in `transformer_engine` alias (te_fuser.compat) and its launcher."""

import importlib
import os
import subprocess
import sys
import textwrap

import pytest
from packaging.version import Version

import te_fuser
import te_fuser.compat as compat
from fake_te import FAKE_VERSION, drop_transformer_engine_modules, write_fake_te

# What megatron-core 0.16.1 imports from TE before anything runs (issue 13), in the order it hits them.
ISSUE_NAMES = [
    ("transformer_engine.pytorch.distributed", "activation_recompute_forward"),
    ("transformer_engine.pytorch.fp8", "FP8GlobalStateManager"),
    ("transformer_engine.pytorch.tensor", "QuantizedTensor"),
    ("transformer_engine.pytorch.fp8", "fp8_model_init"),
    ("transformer_engine.pytorch", "fp8_model_init"),
    ("transformer_engine.pytorch", "quantized_model_init"),
    ("transformer_engine.pytorch", "RMSNorm"),
    ("transformer_engine.pytorch", "LayerNorm"),
    ("transformer_engine.pytorch", "LayerNormLinear"),
    ("transformer_engine.pytorch", "GroupedLinear"),
    ("transformer_engine.pytorch.distributed", "CudaRNGStatesTracker"),
]
# Provided by this branch; the modules above them come with the module family.
SURFACE = {"activation_recompute_forward", "FP8GlobalStateManager", "QuantizedTensor", "fp8_model_init",
           "quantized_model_init", "CudaRNGStatesTracker"}


def test_issue_names_resolve_to_te_fuser_or_fail_naming_themselves(alias):
    from te_fuser import distributed, fp8, tensor

    owners = {"transformer_engine.pytorch": te_fuser, "transformer_engine.pytorch.distributed": distributed,
              "transformer_engine.pytorch.fp8": fp8, "transformer_engine.pytorch.tensor": tensor}
    for module_name, name in ISSUE_NAMES:
        module = importlib.import_module(module_name)
        if name in SURFACE or hasattr(te_fuser, name):
            assert getattr(module, name) is getattr(owners[module_name], name), (module_name, name)
        else:
            with pytest.raises(AttributeError, match=f"te_fuser does not provide '{name}'"):
                getattr(module, name)


def test_te_layout_and_identity(alias):
    import transformer_engine as te
    import transformer_engine.common.recipe as recipe
    import transformer_engine.pytorch as tp
    from transformer_engine.pytorch.float8_tensor import Float8Tensor
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor as Float8Tensor2

    assert te.__version__ == compat.TE_API_VERSION
    assert tp.Linear is te_fuser.Linear and tp.DotProductAttention is te_fuser.DotProductAttention
    assert recipe.DelayedScaling is te_fuser.recipe.DelayedScaling and recipe.Format is te_fuser.recipe.Format
    assert Float8Tensor is Float8Tensor2 is te_fuser.Float8Tensor
    assert tp.checkpoint is te_fuser.distributed.checkpoint  # TE's top-level checkpoint is distributed's
    # Attribute chains, as `class X(te.pytorch.distributed.CudaRNGStatesTracker)` uses them.
    assert te.pytorch.distributed.CudaRNGStatesTracker is te_fuser.distributed.CudaRNGStatesTracker
    assert te.pytorch.ops.BasicLinear is te_fuser.ops.BasicLinear and te.common.recipe is recipe
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockwiseQTensor
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Tensor
    assert MXFP8Tensor is te_fuser.tensor.MXFP8Tensor and Float8BlockwiseQTensor is te_fuser.tensor.Float8BlockwiseQTensor
    for sub in ("ops", "attention", "module", "tensor", "fp8", "distributed", "quantization"):
        assert importlib.import_module(f"transformer_engine.pytorch.{sub}").__name__ == f"transformer_engine.pytorch.{sub}"
    assert "Linear" in dir(tp)


def test_missing_names_fail_loudly(alias):
    import transformer_engine.pytorch as tp

    with pytest.raises(ModuleNotFoundError,
                       match="'transformer_engine.pytorch.triton': te_fuser does not provide"):
        import transformer_engine.pytorch.triton  # noqa: F401
    import transformer_engine.pytorch.router as router  # TE's module: te_fuser's of the same path
    import te_fuser.router

    assert router.fused_topk_with_score_function is te_fuser.router.fused_topk_with_score_function
    with pytest.raises(ModuleNotFoundError, match="te_fuser does not provide"):
        import transformer_engine.pytorch.tensor.storage.nvfp4_tensor_storage  # noqa: F401
    with pytest.raises(ModuleNotFoundError, match="transformer_engine.jax"):
        import transformer_engine.jax  # noqa: F401
    with pytest.raises(AttributeError, match="transformer_engine.pytorch.ops.FusedAdamW: te_fuser does not provide"):
        tp.ops.FusedAdamW
    with pytest.raises(ImportError, match=r"cannot import name 'fused_topk' from 'transformer_engine.pytorch'"):
        from transformer_engine.pytorch import fused_topk  # noqa: F401
    assert not hasattr(tp, "fused_topk")


def test_version_sits_between_megatrons_gates():
    # megatron-core 0.16.1: save_original_input needs >= 2.6.0dev0; >= 2.7.0.dev imports pytorch.router.
    version = Version(compat.TE_API_VERSION)
    assert Version("2.6.0dev0") <= version < Version("2.7.0.dev")


def test_never_shadows_a_real_installation(tmp_path, monkeypatch):
    drop_transformer_engine_modules()
    write_fake_te(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match="TransformerEngine installation is importable .*force=True"):
        compat.install_transformer_engine()
    assert not compat.is_installed()
    import transformer_engine

    assert transformer_engine.__version__ == FAKE_VERSION
    with pytest.raises(RuntimeError, match="will not shadow"):
        compat.install_transformer_engine()  # imported already: still refused
    try:
        compat.install_transformer_engine(force=True)
        import transformer_engine as aliased

        assert aliased.__version__ == compat.TE_API_VERSION and aliased.pytorch.Linear is te_fuser.Linear
    finally:
        compat.uninstall_transformer_engine()
    import transformer_engine as real

    assert real.__version__ == FAKE_VERSION
    drop_transformer_engine_modules()


def test_launcher_runs_a_te_script_unchanged(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import sys
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import DelayedScaling
        layer = te.Linear(16, 16, device="cpu")
        with te.fp8_autocast(fp8_recipe=DelayedScaling()):
            print(type(layer).__module__, __name__, sys.argv[1:])
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(te_fuser.__file__)),
                                                        os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "te_fuser.compat", str(script), "--steps", "2"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "te_fuser.module.linear __main__ ['--steps', '2']"


def test_launcher_module_form_and_usage(tmp_path, monkeypatch):
    from te_fuser.compat.__main__ import main

    (tmp_path / "te_client_mod.py").write_text(textwrap.dedent("""
        import sys
        import transformer_engine
        RESULT = (transformer_engine.__version__, __name__, sys.argv[1:])
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    drop_transformer_engine_modules()
    try:
        globals_ = main(["-m", "te_client_mod", "--flag"])
    finally:
        compat.uninstall_transformer_engine()
    assert globals_["RESULT"] == (compat.TE_API_VERSION, "__main__", ["--flag"])
    with pytest.raises(SystemExit, match="python -m te_fuser.compat"):
        main([])
