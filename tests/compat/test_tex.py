"""`transformer_engine_torch` (TE's compiled module, `tex`) under the alias: te_fuser.tex, its DType and
the dtype maps of `pytorch.constants`."""

import sys

import pytest
import torch

import te_fuser.compat as compat
import te_fuser.tex
from fake_te import drop_transformer_engine_modules
from te_fuser.te_dtype import DType, fp8_torch_dtype, te_dtype

# TE 2.6's Python DType members and their numbers (transformer_engine.h's NVTEDType), and the NVFP4
# member of the TE versions that have NVFP4.
TE_MEMBERS = {"kByte": 0, "kInt32": 2, "kFloat32": 4, "kFloat16": 5, "kBFloat16": 6, "kFloat8E4M3": 7, "kFloat8E5M2": 8,
              "kFloat4E2M1": 10}


def test_dtype_members_and_numbers():
    assert {m.name: int(m) for m in DType} == TE_MEMBERS
    assert str(DType.kFloat8E4M3) == "DType.kFloat8E4M3"
    assert [10, 20][DType.kByte] == 10  # an index, as TE's pybind enum
    assert DType.kFloat8E4M3 != 7 and DType.kFloat8E4M3 != torch.float8_e4m3fn  # not an int, not a torch dtype


def _format_facts(dtype: torch.dtype):
    """(bits, largest finite, is floating) of a torch dtype, from torch's own tables."""
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    return info.bits, float(info.max), dtype.is_floating_point


def test_constants_maps_match_each_member_meaning():
    from te_fuser.constants import TE_DType, TE_DType_To_Torch

    expected = {  # what each TE name means: bits, largest finite value, floating point
        "kByte": (8, 255.0, False), "kInt32": (32, 2.0 ** 31 - 1, False), "kFloat32": (32, 3.4028234663852886e38, True),
        "kFloat16": (16, 65504.0, True), "kBFloat16": (16, 3.3895313892515355e38, True),
        "kFloat8E4M3": (8, 448.0, True), "kFloat8E5M2": (8, 57344.0, True)}
    assert {te.name: _format_facts(t) for te, t in TE_DType_To_Torch.items()} == expected
    assert {t: te for te, t in TE_DType_To_Torch.items()} == TE_DType
    assert te_dtype(torch.bfloat16) is DType.kBFloat16
    with pytest.raises(ValueError, match="no member for torch.float64"):
        te_dtype(torch.float64)


def test_fp8_dtype_takes_either_spelling_and_names_bad_input():
    assert fp8_torch_dtype(DType.kFloat8E4M3) is torch.float8_e4m3fn
    assert fp8_torch_dtype(DType.kFloat8E5M2) is torch.float8_e5m2
    assert fp8_torch_dtype(torch.float8_e5m2) is torch.float8_e5m2
    for bad in (DType.kBFloat16, torch.float16, "e4m3", 7):
        with pytest.raises(ValueError, match="fp8_dtype must be DType.kFloat8E4M3"):
            fp8_torch_dtype(bad)
    with pytest.raises(ValueError, match="^out_dtype must be"):
        fp8_torch_dtype(torch.float32, "out_dtype")


def test_alias_resolves_tex_to_te_fuser(alias):
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.constants import TE_DType
    from transformer_engine_torch import DType as TE_DType_enum

    assert tex.DType is DType is TE_DType_enum and TE_DType[torch.float8_e4m3fn] is tex.DType.kFloat8E4M3
    assert tex.FP8TensorMeta is te_fuser.tex.FP8TensorMeta
    assert tex.FP8FwdTensors.GEMM2_INPUT == 3 and tex.FP8BwdTensors.GRAD_INPUT3 == 5
    with pytest.raises(AttributeError, match="transformer_engine_torch.general_gemm: te_fuser does not provide"):
        tex.general_gemm
    with pytest.raises(ImportError, match="cannot import name 'CommOverlap' from 'transformer_engine_torch'"):
        from transformer_engine_torch import CommOverlap  # noqa: F401
    with pytest.raises(ModuleNotFoundError, match="'transformer_engine_torch' is not a package"):
        import transformer_engine_torch.ops  # noqa: F401


def test_uninstall_removes_tex():
    drop_transformer_engine_modules()
    compat.install_transformer_engine()
    import transformer_engine_torch  # noqa: F401

    compat.uninstall_transformer_engine()
    assert "transformer_engine_torch" not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        import transformer_engine_torch  # noqa: F401,F811


def test_a_real_tex_is_never_shadowed(tmp_path, monkeypatch):
    drop_transformer_engine_modules()
    (tmp_path / "transformer_engine_torch.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match="transformer_engine_torch.py.*will not shadow"):
        compat.install_transformer_engine()
    assert not compat.is_installed()
    try:
        import transformer_engine_torch

        assert transformer_engine_torch.REAL
    finally:
        drop_transformer_engine_modules()


def test_fp8_tensor_meta_holds_what_it_is_given():
    meta = te_fuser.tex.FP8TensorMeta()
    assert (meta.scale, meta.scale_inv, meta.amax_history) == (None, None, None)
    history = torch.zeros(4, 2)
    meta.amax_history = history
    assert meta.amax_history is history and "amax_history=(4, 2)" in repr(meta)
