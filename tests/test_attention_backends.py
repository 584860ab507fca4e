"""The attention backends as DotProductAttention runs them, against float64 SDPA per sequence: forward,
gradients and lse, on every mask, layout and GQA case each one says it supports, and a clear refusal of the
others. On the CPU: te_fuser's kernels, torch's CPU flash kernel, the unfused math path; on a GPU, where
there is one, te_fuser's CUDA kernels, cuDNN, FlashAttention and the unfused path. Then the overrides
(TE_FUSER_ATTENTION_BACKEND, TE's NVTE_* switches, the module's attention_backend), the debug log, and FP8
q/k/v, which never reach a 16-bit library kernel."""

import logging
import math

import pytest
import torch

import te_fuser
from te_fuser.attention.backends import BACKENDS, ENV_BACKEND, Call, Lengths, clear_cache, describe, selection
from te_fuser.attention.function import to_kernel_layout
from te_fuser.kernels import attention as attn_kernels
from te_fuser.kernels import cpu as cpu_kernels

from attention_reference import attention as reference_attention
from attention_reference import segments

CPU_BACKENDS = ("te_fuser", "cpu_flash", "unfused")
GPU_BACKENDS = ("te_fuser", "cudnn", "flash", "unfused")
HAS_GPU = torch.cuda.is_available() and te_fuser._extension.has_cuda_kernels()
DEVICE_BACKENDS = [("cpu", b) for b in CPU_BACKENDS] + [("cuda", b) for b in GPU_BACKENDS if HAS_GPU]
DIM = 32
TOLERANCES = {torch.float32: (2e-5, 1e-4, 1e-4), torch.bfloat16: (2e-2, 6e-2, 2e-2)}

# (name, qkv_format, mask type, seq_q, seq_kv, kv heads): heads are 4, batch 2 (thd: 3 packed sequences).
CASES = [
    ("bshd_no_mask", "bshd", "no_mask", 45, 45, 4),
    ("sbhd_causal_gqa", "sbhd", "causal", 45, 45, 2),
    ("bshd_causal_mqa_cross", "bshd", "causal", 37, 52, 1),
    ("bshd_cross_gqa", "bshd", "no_mask", 52, 37, 2),
    ("bshd_padding", "bshd", "padding", 45, 45, 4),
    ("sbhd_padding_causal_gqa", "sbhd", "padding_causal", 45, 45, 2),
    ("thd_padding", "thd", "padding", 70, 70, 4),
    ("thd_padding_causal_gqa", "thd", "padding_causal", 70, 70, 2),
]


def runs(device, backend, fmt, mask, dtype, square):
    """What each backend declares it runs (backends/*.py), checked both ways below."""
    padded, causal_ok = fmt != "thd" and "padding" in mask, "causal" not in mask or square
    if backend == "unfused":
        return True
    if backend == "te_fuser":
        return device == "cpu" or dtype != torch.float32
    if backend == "cpu_flash":
        return fmt != "thd" and not padded
    sixteen_bit = dtype != torch.float32
    if backend == "flash":
        return sixteen_bit and not padded and causal_ok
    return sixteen_bit and fmt != "thd" and not padded and causal_ok  # cudnn


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    for name in (ENV_BACKEND, "NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN", "NVTE_DEBUG",
                 "NVTE_DEBUG_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    clear_cache()
    yield
    clear_cache()


def _inputs(fmt, seq_q, seq_kv, kv_heads, dtype, generator, device="cpu"):
    """q, k, v (4 heads, head dim DIM) with a few rows of large values, and the lengths of the case."""
    def one(seq, heads):
        shape = {"sbhd": (seq, 2, heads, DIM), "bshd": (2, seq, heads, DIM), "thd": (seq, heads, DIM)}[fmt]
        t = torch.randn(shape, generator=generator)
        t.view(-1, DIM)[::7] *= 6.0  # edge values: scores far from 0
        return t.to(device=device, dtype=dtype).requires_grad_()
    return one(seq_q, 4), one(seq_kv, kv_heads), one(seq_kv, kv_heads)


def _case_kwargs(fmt, mask, seq_q, seq_kv, device="cpu"):
    """(forward kwargs, lens_q, lens_kv, cu_seqlens) of a case (the lengths on the CPU for the reference)."""
    if fmt == "thd":
        cu = torch.tensor([0, 31, 31, seq_q - 4], dtype=torch.int32)  # an empty sequence, 4 tokens in none
        on_device = cu.to(device)
        return dict(cu_seqlens_q=on_device, cu_seqlens_kv=on_device), None, None, cu
    if "padding" in mask:
        lens = torch.tensor([seq_q, seq_q // 3], dtype=torch.int32)
        padding = (torch.arange(seq_q)[None, :] >= lens[:, None]).view(2, 1, 1, seq_q)
        return dict(attention_mask=padding.to(device)), lens, lens, None
    return {}, None, None, None


def _reference(q, k, v, fmt, causal, scale, lens, cu, dout):
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    kq, kk, kv = (to_kernel_layout(t, fmt) for t in leaves)
    segs = segments(kq.shape[0], kq.shape[1], kk.shape[1], lens, lens, cu, cu)
    out = reference_attention(kq, kk, kv, segs, causal, scale)
    grads = torch.autograd.grad(out, leaves, to_kernel_layout(dout.cpu().double(), fmt))
    return out, grads


def _close(actual, expected, atol, rtol, what):
    """Close within atol of the largest expected magnitude (the large-score rows make gradients of tens)."""
    actual = actual.detach().cpu().double()
    atol = atol * max(1.0, expected.abs().max().item())
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("device, backend", DEVICE_BACKENDS, ids=[f"{d}-{b}" for d, b in DEVICE_BACKENDS])
def test_backend_against_float64_sdpa(device, backend, case, dtype, generator):
    _, fmt, mask, seq_q, seq_kv, kv_heads = case
    q, k, v = _inputs(fmt, seq_q, seq_kv, kv_heads, dtype, generator, device)
    kwargs, lens, _, cu = _case_kwargs(fmt, mask, seq_q, seq_kv, device)
    module = te_fuser.DotProductAttention(4, DIM, num_gqa_groups=kv_heads, qkv_format=fmt, attn_mask_type=mask,
                                          attention_type="self" if seq_q == seq_kv else "cross",
                                          softmax_scale=0.3, attention_backend=backend)
    if not runs(device, backend, fmt, mask, dtype, seq_q == seq_kv):
        with pytest.raises(ValueError, match=f"attention backend '{backend}'.*cannot run this problem: .+"):
            module(q, k, v, **kwargs)
        return
    out = module(q, k, v, **kwargs)
    assert out.grad_fn.next_functions[0][0].backend == backend
    dout = torch.randn(out.shape, generator=generator).to(device=device, dtype=dtype)
    out.backward(dout)
    heads_out = out.view(*out.shape[:-1], 4, DIM)
    ref, grads = _reference(q, k, v, fmt, "causal" in mask, 0.3, lens, cu, dout.view(heads_out.shape))
    atol, gatol, rtol = TOLERANCES[dtype]
    _close(to_kernel_layout(heads_out, fmt), ref, atol, rtol, "out")
    for name, t, g in zip("qkv", (q, k, v), grads):
        _close(t.grad, g, gatol, rtol, f"d{name}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_lse_is_the_natural_log_sum_exp(backend, causal, generator):
    """Every backend's forward gives lse in te_fuser's convention: float32 [b, h, s], natural log."""
    q, k, v = (torch.randn(2, 40, 4, 16, generator=generator) for _ in range(3))
    _, lse, state = BACKENDS[backend].forward(q, k, v, Lengths(), Call(0.5, causal))
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * 0.5
    if causal:
        scores = scores.masked_fill(~torch.ones(40, 40, dtype=torch.bool).tril(), float("-inf"))
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 40) and state == ()
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1), atol=1e-5, rtol=1e-6)


# Overrides ---------------------------------------------------------------------------------------------------

def setenv(monkeypatch, name, value):
    """Sets a variable the selection reads, and forgets the choices made (so that they are logged again)."""
    monkeypatch.setenv(name, value)
    clear_cache()


def _qkv():
    return tuple(torch.randn(1, 32, 2, 16, requires_grad=True) for _ in range(3))


def _ran(module):
    out = module(*_qkv())
    return out.grad_fn.next_functions[0][0].backend


def test_the_environment_names_one_backend(monkeypatch):
    module = te_fuser.DotProductAttention(2, 16, qkv_format="bshd")
    for name in CPU_BACKENDS:
        setenv(monkeypatch, ENV_BACKEND, name)
        assert _ran(module) == name
    setenv(monkeypatch, ENV_BACKEND, "flash")
    with pytest.raises(ValueError, match="'flash' \\(TE_FUSER_ATTENTION_BACKEND=flash\\) cannot run .*CUDA kernel"):
        module(*_qkv())
    setenv(monkeypatch, ENV_BACKEND, "fastest")
    with pytest.raises(ValueError, match="TE_FUSER_ATTENTION_BACKEND='fastest' is not an attention backend"):
        module(*_qkv())


def test_the_module_argument_wins_over_the_environment(monkeypatch):
    setenv(monkeypatch, ENV_BACKEND, "te_fuser")
    module = te_fuser.DotProductAttention(2, 16, qkv_format="bshd", attention_backend="unfused")
    assert _ran(module) == "unfused"
    module.attention_backend = "cpu_flash"
    assert _ran(module) == "cpu_flash"
    module.attention_backend = None
    assert _ran(module) == "te_fuser"
    with pytest.raises(ValueError, match="attention_backend='cudnn9' is not an attention backend"):
        module.attention_backend = "cudnn9"
    with pytest.raises(ValueError, match="attention_backend='x' is not an attention backend"):
        te_fuser.DotProductAttention(2, 16, attention_backend="x")


def test_multihead_attention_passes_its_backend_on():
    mha = te_fuser.MultiheadAttention(32, 2, attention_backend="unfused", attention_dropout=0.0)
    assert mha.core_attention.attention_backend == "unfused"


@pytest.mark.parametrize("isa, preferred", [("portable", "cpu_flash"), (cpu_kernels.detected_isa(), None)])
def test_te_switches_take_backends_out_of_the_automatic_choice(isa, preferred, monkeypatch):
    """NVTE_FLASH_ATTN=0 takes torch's CPU flash kernel out (the portable tier's first choice);
    NVTE_UNFUSED_ATTN=0 the math path; NVTE_FUSED_ATTN=0 te_fuser's kernels (TE's FusedAttention family:
    test_attention_te_backend_query.py)."""
    module = te_fuser.DotProductAttention(2, 16, qkv_format="bshd")
    with cpu_kernels.isa(isa):
        row = selection.preference_for(describe(*_qkv()[:2], Lengths(), True, "none", 0.25))
        assert preferred is None or row.order[0] == preferred
        assert _ran(module) == row.order[0]
        setenv(monkeypatch, "NVTE_FLASH_ATTN", "0")
        assert _ran(module) == "te_fuser"
        setenv(monkeypatch, ENV_BACKEND, "cpu_flash")  # a named backend is not subject to TE's switches
        assert _ran(module) == "cpu_flash"


def test_backend_for_explains_the_choice(monkeypatch):
    q, k, v = (torch.randn(2, 24, 2, 16) for _ in range(3))
    lens = torch.tensor([24, 10], dtype=torch.int32)
    with cpu_kernels.isa("portable"):
        dense = attn_kernels.backend_for(q, k, v, causal=True)
        padded = attn_kernels.backend_for(q, k, v, seqlens_q=lens, seqlens_kv=lens, causal=True)
        seeded = attn_kernels.backend_for(q, k, v, dropout_p=0.1, seeded_dropout=True)
    assert dense.backend == "cpu_flash" and "Zen 1" in dense.source
    assert padded.backend == "te_fuser"
    assert padded.passed_over["cpu_flash"] == "it takes dense batches only, not padded sequences"
    assert seeded.backend == "te_fuser" and seeded.passed_over["cpu_flash"] == "it has no dropout"
    assert "CUDA kernel" in padded.passed_over["cudnn"] and "CUDA kernel" in padded.passed_over["flash"]
    assert str(padded).splitlines()[0].startswith("te_fuser runs it")
    setenv(monkeypatch, "NVTE_UNFUSED_ATTN", "0")
    with cpu_kernels.isa("portable"):
        assert attn_kernels.backend_for(q, k, v).passed_over["unfused"] == "NVTE_UNFUSED_ATTN=0"
    assert dense.passed_over["te_fuser"] == "supported, after cpu_flash in this device's order"


@pytest.mark.parametrize("level", [0, 1, 2])
def test_nvte_debug_logs_the_choice(level, monkeypatch, caplog):
    setenv(monkeypatch, "NVTE_DEBUG", "1")
    setenv(monkeypatch, "NVTE_DEBUG_LEVEL", str(level))
    with caplog.at_level(logging.DEBUG, logger="te_fuser.attention"):
        te_fuser.DotProductAttention(2, 16, qkv_format="bshd", attention_backend="unfused")(*_qkv())
    messages = [r.getMessage() for r in caplog.records if r.name == "te_fuser.attention"]
    selected = [m for m in messages if m.startswith("Selected backend = unfused")]
    disabled = [m for m in messages if m.startswith("Disabling ")]
    assert len(selected) == (level >= 1)
    assert len(disabled) == (len(BACKENDS) - 1 if level >= 2 else 0)
    assert level < 2 or "Disabling te_fuser: not named (the module's attention_backend='unfused')" in disabled


# FP8 -----------------------------------------------------------------------------------------------------------

def test_fp8_dpa_stays_on_te_fusers_fp8_kernels(monkeypatch):
    """Under fp8_dpa the automatic choice is te_fuser's FP8 kernels even where a 16-bit library kernel is
    first for the same problem in 16 bits (the portable tier's torch CPU flash), and naming a library
    kernel for FP8 q/k/v is refused, not run on dequantized values. The unfused path, named, runs them:
    its float32 math decodes the E4M3 values with their scales (as it does on CUDA for the head dims
    te_fuser's CUDA kernels lack)."""
    recipe = te_fuser.recipe.Float8CurrentScaling(fp8_dpa=True)
    q, k, v = (torch.randn(1, 32, 2, 16).bfloat16().requires_grad_() for _ in range(3))
    module = te_fuser.DotProductAttention(2, 16, qkv_format="bshd")
    with cpu_kernels.isa("portable"):
        assert _ran_with(module, (q, k, v)) == "cpu_flash"
        with te_fuser.fp8_autocast(fp8_recipe=recipe):
            out = module(q, k, v)
        node = out.grad_fn.next_functions[0][0]
        assert node.backend == "te_fuser" and node.fp8
        module.attention_backend = "cpu_flash"
        with te_fuser.fp8_autocast(fp8_recipe=recipe), pytest.raises(ValueError) as refused:
            module(q, k, v)
        assert "not torch.float8_e4m3fn (FP8 attention runs on te_fuser's FP8 kernels)" in str(refused.value)
        module.attention_backend = "unfused"
        with te_fuser.fp8_autocast(fp8_recipe=recipe):
            unfused = module(q, k, v)
        assert unfused.grad_fn.next_functions[0][0].backend == "unfused"
    torch.testing.assert_close(unfused, out, atol=2e-2, rtol=2e-2)
    (out.sum() + unfused.sum()).backward()


def _ran_with(module, qkv):
    return module(*qkv).grad_fn.next_functions[0][0].backend


def test_the_function_refuses_a_library_kernel_named_for_fp8_inputs():
    """FusedAttentionFunction called directly with quantizers and a library backend's name: refused, not run."""
    from te_fuser.attention.function import FusedAttentionFunction

    q, k, v = (torch.randn(1, 32, 2, 16, requires_grad=True) for _ in range(3))
    quantizers = [te_fuser.Float8CurrentScalingQuantizer(torch.float8_e4m3fn) for _ in range(3)]
    with pytest.raises(ValueError, match="'cpu_flash'.*float8_e4m3fn"):
        FusedAttentionFunction.apply(q, k, v, "bshd", None, None, None, None, 0.25, True, 0.0, 0, 0, "cpu_flash",
                                     None, quantizers, None)
    out = FusedAttentionFunction.apply(q, k, v, "bshd", None, None, None, None, 0.25, True, 0.0, 0, 0, "te_fuser",
                                       None, quantizers, None)
    assert out.grad_fn.backend == "te_fuser"
