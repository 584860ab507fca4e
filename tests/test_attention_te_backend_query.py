"""TE 2.6's attention introspection on te_fuser: AttentionParams (TE's fields and defaults),
get_attention_backend's answers under TE's NVTE_* switches, and that DotProductAttention, given the same
problem and environment, runs a backend of the family it named (read off the autograd node) and records
TE's view of that choice in _attention_backends.

`available_backends` is checked against runs, not against the selection's own bookkeeping: a family is
available exactly when DotProductAttention runs the problem with only that family switched on.

Facts from TE 2.6 (transformer_engine/pytorch/attention/dot_product_attention/utils.py,
cpp_extensions/fused_attn.py): the fields below with their defaults, in this order; the 6-tuple
(use_flash_attention, flash_attention_backend, use_fused_attention, fused_attention_backend,
use_unfused_attention, [flash, fused, unfused]); FusedAttnBackend F16_max512_seqlen = 0,
F16_arbitrary_seqlen = 1, FP8 = 2, No_Backend = -1.
"""

import dataclasses
import logging

import pytest
import torch

import te_fuser
from te_fuser.attention.backends import clear_cache, selection
from te_fuser.attention.dot_product_attention import _attention_backends
from te_fuser.attention.dot_product_attention.utils import (AttentionParams, check_set_window_size, problem_of,
                                                             get_attention_backend)
from te_fuser.cpp_extensions.fused_attn import FusedAttnBackend
from te_fuser.kernels import cpu as cpu_kernels

TE_ATTENTION_PARAMS = [
    ("qkv_type", torch.Tensor), ("qkv_dtype", torch.bfloat16), ("qkv_layout", "sbh3d"), ("batch_size", 1),
    ("num_heads", 16), ("num_gqa_groups", 16), ("max_seqlen_q", 128), ("max_seqlen_kv", 128),
    ("head_dim_qk", 64), ("head_dim_v", 64), ("attn_mask_type", "no_mask"), ("window_size", None),
    ("alibi_slopes_shape", None), ("core_attention_bias_type", "no_bias"), ("core_attention_bias_shape", "1hss"),
    ("core_attention_bias_requires_grad", True), ("pad_between_seqs", False), ("attention_dropout", 0.0),
    ("context_parallel", False), ("deterministic", False), ("is_training", True), ("fp8", False),
    ("fp8_meta", None), ("inference_params", None),
]
SWITCHES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
FAMILIES = ("FlashAttention", "FusedAttention", "UnfusedDotProductAttention")
HEADS, DIM = 4, 16

# (name, qkv_format, mask, seq_q, seq_kv, kv heads, dtype, dropout)
CASES = [
    ("bshd_no_mask_fp32", "bshd", "no_mask", 24, 24, 4, torch.float32, 0.0),
    ("sbhd_causal_bf16_gqa", "sbhd", "causal", 24, 24, 2, torch.bfloat16, 0.0),
    ("bshd_causal_cross_fp16", "bshd", "causal", 12, 24, 4, torch.float16, 0.0),
    ("bshd_padding_bf16", "bshd", "padding", 24, 24, 4, torch.bfloat16, 0.0),
    ("thd_padding_causal_fp32", "thd", "padding_causal", 30, 30, 1, torch.float32, 0.0),
    ("bshd_dropout_fp32", "bshd", "no_mask", 24, 24, 4, torch.float32, 0.2),
]
ENVIRONMENTS = [
    {},
    {"NVTE_FLASH_ATTN": "0"},
    {"NVTE_FUSED_ATTN": "0"},
    {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "0"},
    {"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"},
    {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"},
]
ISAS = sorted({"portable", cpu_kernels.detected_isa()})


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in SWITCHES + ("TE_FUSER_ATTENTION_BACKEND", "NVTE_DEBUG", "NVTE_DEBUG_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    clear_cache()
    yield
    clear_cache()


def _switch(monkeypatch, environment):
    for name in SWITCHES:
        if name in environment:
            monkeypatch.setenv(name, environment[name])
        else:
            monkeypatch.delenv(name, raising=False)


def _params(fmt, mask, seq_q, seq_kv, kv_heads, dtype, dropout):
    layout = {"bshd": "bshd_bshd_bshd", "sbhd": "sbhd_sbhd_sbhd", "thd": "thd_thd_thd"}[fmt]
    return AttentionParams(qkv_dtype=dtype, qkv_layout=layout, batch_size=2, num_heads=HEADS,
                           num_gqa_groups=kv_heads, max_seqlen_q=seq_q, max_seqlen_kv=seq_kv, head_dim_qk=DIM,
                           head_dim_v=DIM, attn_mask_type=mask, window_size=check_set_window_size(mask),
                           attention_dropout=dropout)


def _run(fmt, mask, seq_q, seq_kv, kv_heads, dtype, dropout):
    """The te_fuser backend DotProductAttention ran this case on (forward and backward)."""
    generator = torch.Generator().manual_seed(7)

    def tensor(seq, heads):
        shape = {"bshd": (2, seq, heads, DIM), "sbhd": (seq, 2, heads, DIM), "thd": (seq, heads, DIM)}[fmt]
        return torch.randn(shape, generator=generator).to(dtype).requires_grad_()
    q, k, v = tensor(seq_q, HEADS), tensor(seq_kv, kv_heads), tensor(seq_kv, kv_heads)
    kwargs = {}
    if fmt == "thd":
        cu = torch.tensor([0, seq_q // 3, seq_q], dtype=torch.int32)
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu.clone(), cu_seqlens_q_padded=cu.clone(),
                      cu_seqlens_kv_padded=cu.clone())
    elif "padding" in mask:
        masked = torch.arange(seq_q)[None, :] >= torch.tensor([seq_q, 9])[:, None]  # lengths seq_q and 9
        kwargs = dict(attention_mask=masked[:, None, None, :])
    module = te_fuser.DotProductAttention(HEADS, DIM, num_gqa_groups=kv_heads, attention_dropout=dropout,
                                          qkv_format=fmt, attn_mask_type=mask,
                                          attention_type="self" if seq_q == seq_kv else "cross")
    out = module(q, k, v, **kwargs)
    out.float().square().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad.float()).all()
    return out.grad_fn.next_functions[0][0].backend


def _runs_with_only(monkeypatch, family, case):
    """Whether DotProductAttention runs the case with only `family` switched on (and on which backend)."""
    _switch(monkeypatch, {s: ("1" if f == family else "0") for s, f in zip(SWITCHES, FAMILIES)})
    try:
        backend = _run(*case)
    except RuntimeError as error:
        assert "no attention backend can run this problem" in str(error)
        return False
    assert selection.te_family(backend) == family
    return True


def test_attention_params_has_te_26s_fields_and_defaults():
    fields = dataclasses.fields(AttentionParams)
    assert [f.name for f in fields] == [name for name, _ in TE_ATTENTION_PARAMS]
    assert [(f.name, f.default) for f in fields] == TE_ATTENTION_PARAMS


def test_attention_params_compare_fp8_meta_by_recipe_only():
    recipe = te_fuser.recipe.DelayedScaling()
    a = AttentionParams(fp8=True, fp8_meta={"recipe": recipe, "scaling_fwd": object()})
    b = AttentionParams(fp8=True, fp8_meta={"recipe": recipe, "scaling_fwd": object()})
    assert a == b
    assert a != AttentionParams(fp8=True, fp8_meta={"recipe": te_fuser.recipe.Float8CurrentScaling()})
    assert a != dataclasses.replace(b, max_seqlen_kv=256)


def test_fused_attn_backend_has_te_values():
    assert {name: int(value) for name, value in FusedAttnBackend.items()} == {
        "F16_max512_seqlen": 0, "F16_arbitrary_seqlen": 1, "FP8": 2, "No_Backend": -1}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("environment", ENVIRONMENTS,
                         ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items()) or "default")
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_dot_product_attention_runs_the_family_get_attention_backend_names(case, environment, isa, monkeypatch):
    case = case[1:]
    with cpu_kernels.isa(isa):
        available = [_runs_with_only(monkeypatch, family, case) for family in FAMILIES]
        _switch(monkeypatch, environment)
        answer = get_attention_backend(_params(*case))
        use_flash, flash_backend, use_fused, fused_backend, use_unfused, reported = answer
        assert reported == [a and environment.get(s) != "0" for a, s in zip(available, SWITCHES)]
        if not any(reported):
            assert answer == (False, None, False, None, False, [False, False, False])
            with pytest.raises(RuntimeError, match="no attention backend can run this problem"):
                _run(*case)
            return
        _attention_backends["backend_selection_requires_update"] = True  # as TE's tests do
        ran = _run(*case)
    family = selection.te_family(ran)
    assert [use_flash, use_fused, use_unfused] == [family == f for f in FAMILIES]
    assert reported[FAMILIES.index(family)]
    assert flash_backend == (ran if use_flash else None)
    assert fused_backend == (FusedAttnBackend["F16_arbitrary_seqlen"] if use_fused else None)
    assert _attention_backends["backend_selection_requires_update"] is False
    assert (_attention_backends["use_flash_attention"], _attention_backends["flash_attention_backend"],
            _attention_backends["use_fused_attention"], _attention_backends["fused_attention_backend"],
            _attention_backends["use_unfused_attention"]) == answer[:5]


def test_te_families_of_te_fusers_backends():
    assert {name: selection.te_family(name) for name in selection.BACKENDS} == {
        "te_fuser": "FusedAttention", "cudnn": "FusedAttention", "flash": "FlashAttention",
        "cpu_flash": "FlashAttention", "unfused": "UnfusedDotProductAttention"}


def test_fp8_attention_is_fused_fp8():
    recipe = te_fuser.recipe.Float8CurrentScaling(fp8_dpa=True)
    params = dataclasses.replace(_params("bshd", "causal", 32, 32, 2, torch.bfloat16, 0.0), fp8=True,
                                 fp8_meta={"recipe": recipe})
    assert get_attention_backend(params) == (False, None, True, FusedAttnBackend["FP8"], False,
                                             [False, True, True])
    q, k, v = (torch.randn(2, 32, h, DIM).bfloat16().requires_grad_() for h in (HEADS, 2, 2))
    module = te_fuser.DotProductAttention(HEADS, DIM, num_gqa_groups=2, qkv_format="bshd")
    with te_fuser.fp8_autocast(fp8_recipe=recipe):
        out = module(q, k, v)
    assert out.grad_fn.next_functions[0][0].backend == "te_fuser"
    assert _attention_backends["fused_attention_backend"] == FusedAttnBackend["FP8"]


@pytest.mark.parametrize("field, value", [
    ("core_attention_bias_type", "post_scale_bias"), ("alibi_slopes_shape", [HEADS]), ("pad_between_seqs", True),
    ("context_parallel", True), ("head_dim_v", 32), ("attn_mask_type", "causal_bottom_right"), ("window_size", (4, 4)),
    ("qkv_dtype", torch.float64),
])
def test_what_te_fusers_module_refuses_has_no_backend(field, value):
    params = dataclasses.replace(_params("bshd", "no_mask", 24, 24, 4, torch.float32, 0.0), **{field: value})
    assert get_attention_backend(params) == (False, None, False, None, False, [False, False, False])


def test_a_kv_cache_step_is_a_padded_problem():
    """With inference_params, DotProductAttention runs each decoding step on padded sequences (te_fuser's KV
    cache): the answer is that problem's, so a family is never reported that cannot run it (on the CPU, the
    dense-only CPU flash kernel)."""
    dense = _params("bshd", "no_mask", 24, 24, 4, torch.float32, 0.0)
    step = dataclasses.replace(dense, inference_params=object())
    assert problem_of(step).layout == "padded" and problem_of(dense).layout == "dense"
    flash, _, fused, _, unfused, available = get_attention_backend(step)
    assert available[1] and available[2] and fused and not flash


def test_selection_requires_update_makes_the_choice_again(monkeypatch, caplog):
    """TE's tests set backend_selection_requires_update after changing NVTE_*: te_fuser forgets its choices
    then, and the next forward chooses (and logs) again."""
    monkeypatch.setenv("NVTE_DEBUG", "1")
    monkeypatch.setenv("NVTE_DEBUG_LEVEL", "1")
    case = ("bshd", "no_mask", 24, 24, 4, torch.float32, 0.0)
    with caplog.at_level(logging.INFO, logger="te_fuser.attention"):
        _run(*case)
        _run(*case)
        assert len([r for r in caplog.records if r.getMessage().startswith("Selected backend")]) == 1
        _attention_backends["backend_selection_requires_update"] = True
        _run(*case)
    assert len([r for r in caplog.records if r.getMessage().startswith("Selected backend")]) == 2
    assert _attention_backends["backend_selection_requires_update"] is False


@pytest.mark.parametrize("mask, window, expected", [
    ("causal", None, (-1, 0)), ("causal", (-1, -1), (-1, 0)), ("padding_causal", (-1, 0), (-1, 0)),
    ("no_mask", None, (-1, -1)), ("padding", (-1, 0), (-1, -1)), ("no_mask", (3, 5), (3, 5)),
])
def test_check_set_window_size(mask, window, expected):
    assert tuple(check_set_window_size(mask, window)) == expected


@pytest.mark.parametrize("mask, window", [("causal", (-2, 0)), ("no_mask", (-3, 2)), ("bogus", None)])
def test_check_set_window_size_refuses_naming_the_argument(mask, window):
    with pytest.raises(ValueError, match="window_size|attn_mask_type"):
        check_set_window_size(mask, window)


def test_padded_offsets_equal_to_cu_seqlens_are_accepted_and_others_refused():
    q, k, v = (torch.randn(30, HEADS, DIM, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    module = te_fuser.DotProductAttention(HEADS, DIM, qkv_format="thd", attn_mask_type="padding")
    plain = module(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    same = module(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu.clone(),
                  cu_seqlens_kv_padded=cu.clone())
    torch.testing.assert_close(same, plain, rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="cu_seqlens_kv_padded differing from cu_seqlens_kv"):
        module(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu.clone(),
               cu_seqlens_kv_padded=torch.tensor([0, 12, 30], dtype=torch.int32))


def test_an_arbitrary_mask_runs_in_the_unfused_family():
    """attn_mask_type="arbitrary" runs in torch operators (TE's UnfusedDotProductAttention), not with FP8."""
    params = dataclasses.replace(_params("bshd", "no_mask", 24, 24, 4, torch.float32, 0.0), attn_mask_type="arbitrary")
    assert get_attention_backend(params) == (False, None, False, None, True, [False, False, True])
    thd = dataclasses.replace(params, qkv_layout="thd_thd_thd")
    assert get_attention_backend(thd) == (False, None, False, None, False, [False, False, False])
