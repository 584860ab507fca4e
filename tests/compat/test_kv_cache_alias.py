"""TE's KV-cache names through the transformer_engine alias: the very objects of te_fuser."""

import importlib

import te_fuser


def test_inference_params_under_te_names(alias):
    from transformer_engine.pytorch import InferenceParams
    from transformer_engine.pytorch.attention import InferenceParams as from_attention

    inference = importlib.import_module("transformer_engine.pytorch.attention.inference")
    assert InferenceParams is from_attention is inference.InferenceParams is te_fuser.InferenceParams
    for name in ("KVCacheManager", "NonPagedKVCacheManager", "PagedKVCacheManager"):
        assert getattr(inference, name) is getattr(te_fuser.attention.inference, name)
