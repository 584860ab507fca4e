"""TE 2.6's attention layout under the alias: attention.dot_product_attention is a package (the module,
_attention_backends, utils), attention.multi_head_attention and cpp_extensions.fused_attn exist, each name
te_fuser's own object, and te_fuser's own import paths of DotProductAttention keep working."""

import importlib

import pytest

import te_fuser

DPA = "transformer_engine.pytorch.attention.dot_product_attention"
# (TE 2.6 module, name, te_fuser module holding it)
TE_NAMES = [
    (DPA, "DotProductAttention", "te_fuser.attention.dot_product_attention.dot_product_attention"),
    (DPA, "_attention_backends", "te_fuser.attention.dot_product_attention.dot_product_attention"),
    (f"{DPA}.dot_product_attention", "DotProductAttention", "te_fuser.attention.dot_product_attention"),
    (f"{DPA}.utils", "AttentionParams", "te_fuser.attention.dot_product_attention.utils"),
    (f"{DPA}.utils", "AttentionLogging", "te_fuser.attention.dot_product_attention.utils"),
    (f"{DPA}.utils", "FlashAttentionUtils", "te_fuser.attention.dot_product_attention.utils"),
    (f"{DPA}.utils", "get_attention_backend", "te_fuser.attention.dot_product_attention.utils"),
    (f"{DPA}.utils", "check_set_window_size", "te_fuser.attention.dot_product_attention.utils"),
    ("transformer_engine.pytorch.attention", "DotProductAttention", "te_fuser"),
    ("transformer_engine.pytorch.attention", "MultiheadAttention", "te_fuser"),
    ("transformer_engine.pytorch.attention.multi_head_attention", "MultiheadAttention", "te_fuser"),
    ("transformer_engine.pytorch.cpp_extensions.fused_attn", "FusedAttnBackend", "te_fuser.cpp_extensions"),
    ("transformer_engine.pytorch.cpp_extensions", "FusedAttnBackend", "te_fuser.cpp_extensions.fused_attn"),
]


@pytest.mark.parametrize("module, name, owner", TE_NAMES, ids=[f"{m.rsplit('.', 1)[-1]}.{n}" for m, n, _ in TE_NAMES])
def test_te_26_attention_names_are_te_fusers(alias, module, name, owner):
    found = getattr(importlib.import_module(module), name)
    assert found is getattr(importlib.import_module(owner), name)


def test_dot_product_attention_is_a_package_as_in_te(alias):
    package = importlib.import_module(DPA)
    assert package.__file__.endswith("dot_product_attention/__init__.py")
    assert importlib.import_module(f"{DPA}.dot_product_attention").__file__.endswith(
        "dot_product_attention/dot_product_attention.py")


def test_te_fusers_own_paths_name_one_class():
    from te_fuser.attention import DotProductAttention as from_attention
    from te_fuser.attention.dot_product_attention import DotProductAttention as from_package
    from te_fuser.attention.dot_product_attention.dot_product_attention import DotProductAttention as from_module
    from te_fuser.attention.multi_head_attention import MultiheadAttention

    assert from_attention is from_package is from_module is te_fuser.DotProductAttention
    assert te_fuser.attention.MultiheadAttention is MultiheadAttention is te_fuser.MultiheadAttention


def test_te_s_raw_fused_attention_calls_say_they_are_not_provided(alias):
    from transformer_engine.pytorch.cpp_extensions.fused_attn import fused_attn_bwd, fused_attn_fwd

    for call in (fused_attn_fwd, fused_attn_bwd):
        with pytest.raises(NotImplementedError, match=f"{call.__name__} .* not provided by te_fuser"):
            call(True, 128, 128, None, None, None, None, None)
