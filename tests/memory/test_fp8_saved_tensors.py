"""What FP8 layers save for backward: FP8 operands in one layout, never a 16-bit copy (issue 15, "Memory").

Every storage autograd saved during one FP8 forward is listed (te_fuser.memory.saved_for_backward:
saved_tensors_hooks, each storage once) with its dtype and bytes, for te_fuser.Linear,
DotProductAttention under fp8_dpa and one block of the example GPT. The checks:
  * no 16-bit or float32 tensor of an FP8 operand's size is saved (Linear: x and W; attention: q, k, v and
    the output o; between the GPT's two FP8 MLP linears, GELU's input), and in the GPT no float tensor whose values are those of a saved FP8 tensor
    (a 16-bit copy found by value: the FP8 data times one scale, in either layout);
  * no operand is saved both row-major and transposed (the same FP8 bytes in both layouts);
  * under fp8_mha the attention output's FP8 bytes are saved once: the output projection keeps the
    attention's bytes, not a transposed copy (the FP8 bytes saved equal the sum of what each op needs);
  * what the ctxs keep besides (the shells of the saved FP8 tensors, through every attribute they
    carry) reaches no tensor bytes.
Each check runs once more on the bug it is meant to catch (monkeypatched back in) and must fail there.
"""

import pytest
import torch

import te_fuser
from te_fuser.attention.dot_product_attention import dot_product_attention as dpa_module
from te_fuser.attention import function as attention_function
from te_fuser.attention.function import FusedAttentionFunction
from te_fuser.examples.gpt import GPT, GPTConfig
from te_fuser.memory.saved import saved_for_backward
from te_fuser.ops.basic import activation as activation_module
from te_fuser.ops.basic import linear as linear_module
from te_fuser.tensor import Float8Tensor

from _fuser_ctx_walk import reachable_tensors
from memory_patterns import shell_keeps_a_link

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
WIDE = (torch.bfloat16, torch.float16, torch.float32)
RECIPES = {
    "delayed": lambda: te_fuser.recipe.DelayedScaling(fp8_dpa=True),
    "current": lambda: te_fuser.recipe.Float8CurrentScaling(fp8_dpa=True),
}


def listing(saved) -> str:
    return "\n".join(f"  {e.op:42s} {e.slot:28s} {str(e.shape):20s} {str(e.dtype):20s} {e.nbytes:>9d}"
                     for e in saved)


def wide_copies_by_size(saved, operand_numels, op_filter=""):
    """Saved float tensors (from ops whose name contains op_filter) with the element count of an FP8 operand."""
    return [e for e in saved if e.dtype in WIDE and op_filter in e.op and e.tensor.numel() in operand_numels]


def _as_matrix(t):
    return t.reshape(-1, t.shape[-1]) if t.dim() >= 1 else t.reshape(1, 1)


def _is_scaled_copy(wide: torch.Tensor, fp8: torch.Tensor) -> bool:
    """Whether wide's values are fp8's times one scale, up to FP8 rounding, in either layout."""
    f = _as_matrix(fp8).float()
    w = _as_matrix(wide.detach()).float()
    for candidate in (w, w.t()):
        if candidate.shape != f.shape:
            continue
        scale = (candidate * f).sum() / (f * f).sum().clamp_min(1e-30)
        err = (candidate - scale * f).abs()
        # E4M3 rounds to 2^-4 relative (E5M2 2^-3), plus the subnormal step.
        tol = 0.13 * candidate.abs() + scale.abs() * 2.0**-9
        if bool((err <= tol).float().mean() >= 0.999):
            return True
    return False


def wide_copies_by_value(saved):
    """(float entry, FP8 entry) pairs where the float tensor holds the FP8 operand's values."""
    fp8 = [e for e in saved if e.dtype in FP8]
    wide = [e for e in saved if e.dtype in WIDE and e.tensor.numel() > 1]
    return [(w, f) for w in wide for f in fp8 if w.tensor.numel() == f.tensor.numel()
            and _is_scaled_copy(w.tensor, f.tensor)]


def both_layouts(saved):
    """Pairs of saved FP8 tensors holding the same bytes, one the transpose of the other."""
    fp8 = [e for e in saved if e.dtype in FP8 and e.tensor.dim() >= 2]
    pairs = []
    for i, a in enumerate(fp8):
        for b in fp8[i + 1:]:
            if a.tensor.numel() != b.tensor.numel():
                continue
            ma, mb = (_as_matrix(e.tensor).view(torch.uint8) for e in (a, b))
            if ma.t().shape == mb.shape and torch.equal(ma.t(), mb):
                pairs.append((a, b))
    return pairs


def violations(saved, operand_numels=(), op_filter=""):
    found = [f"16-bit/fp32 tensor of an FP8 operand's size: {e.op} {e.slot} {e.shape} {e.dtype}"
             for e in wide_copies_by_size(saved, set(operand_numels), op_filter)]
    found += [f"16-bit/fp32 copy of FP8 {f.op} {f.slot}: {w.op} {w.slot} {w.shape} {w.dtype}"
              for w, f in wide_copies_by_value(saved)]
    found += [f"both layouts saved: {a.op} {a.slot} {a.shape} and {b.op} {b.slot} {b.shape}"
              for a, b in both_layouts(saved)]
    return found


def ctx_held(out):
    """What the forward's ctx attributes reach besides what it saved (quantizers and modules aside)."""
    return [f"{path}: {tuple(t.shape)} {t.dtype}" for path, t in reachable_tensors(out, set(), saved=False)]


def seed_from(generator):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))


# -- the three forwards ----------------------------------------------------------------------------------------------

def linear_forward(recipe):
    layer = te_fuser.Linear(128, 96, bias=True, params_dtype=torch.bfloat16)
    x = (torch.randn(4, 32, 128) * 3).to(torch.bfloat16).requires_grad_()
    x.data[0, 0, :4] = torch.tensor([0.0, -0.0, 1e-3, -448.0])  # zeros, a tiny and the largest value

    def fwd():
        with te_fuser.fp8_autocast(fp8_recipe=recipe):
            return layer(x)

    out, saved = saved_for_backward(fwd)
    return out, saved, (x.numel(), layer.weight.numel())


def attention_forward(recipe):
    module = te_fuser.DotProductAttention(4, 64, qkv_format="sbhd", attn_mask_type="causal")
    q, k, v = (torch.randn(48, 2, 4, 64).to(torch.bfloat16).requires_grad_() for _ in range(3))

    def fwd():
        with te_fuser.fp8_autocast(fp8_recipe=recipe):
            return module(q, k, v)

    out, saved = saved_for_backward(fwd)
    return out, saved, (q.numel(), k.numel(), out.numel())


GPT_CFG = GPTConfig(vocab_size=64, seq_len=64, hidden_size=128, num_heads=2, num_layers=1, ffn_hidden_size=256)
GPT_TOKENS = 64 * 4


def gpt_forward(recipe):
    cfg = GPT_CFG
    model = GPT(cfg, dtype=torch.bfloat16)
    tokens = torch.randint(0, cfg.vocab_size, (64, 4))

    def fwd():
        with te_fuser.fp8_autocast(fp8_recipe=recipe):
            return model(tokens)

    out, saved = saved_for_backward(fwd)
    attention_operand = 64 * 4 * cfg.hidden_size  # q, k, v, o: [s, b, heads, head_dim]
    gelu_input = 64 * 4 * cfg.ffn_hidden_size
    return out, saved, (attention_operand, gelu_input)


def gpt_violations(saved, operands):
    attention_operand, gelu_input = operands
    return (violations(saved, (attention_operand,), op_filter="Attention")
            + violations(saved, (gelu_input,), op_filter="GELU"))


# -- the checks ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_linear_saves_one_fp8_layout_per_operand(recipe, generator):
    seed_from(generator)
    out, saved, operands = linear_forward(RECIPES[recipe]())
    print(listing(saved))
    assert violations(saved, operands) == [], listing(saved)
    fp8 = [e for e in saved if e.dtype in FP8]
    # x.T for the weight gradient, W.T for the input gradient: one byte per element each.
    assert sorted(e.shape for e in fp8) == [(128, 96), (128, 128)], listing(saved)
    assert ctx_held(out) == []
    out.float().sum().backward()  # what was kept is what backward needs


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_attention_saves_q_k_v_and_out_in_fp8(recipe, generator):
    seed_from(generator)
    out, saved, operands = attention_forward(RECIPES[recipe]())
    print(listing(saved))
    assert violations(saved, operands) == [], listing(saved)
    fp8 = [e for e in saved if e.dtype in FP8]
    assert [e.shape for e in fp8] == [(48, 2, 4, 64)] * 4 and all(e.nbytes == 48 * 2 * 4 * 64 for e in fp8)
    assert ctx_held(out) == []
    out.float().sum().backward()


def test_gpt_block_saves_no_16_bit_copy_of_an_fp8_operand(generator):
    seed_from(generator)
    out, saved, operands = gpt_forward(RECIPES["delayed"]())
    print(listing(saved))
    assert gpt_violations(saved, operands) == [], listing(saved)
    # q, k, v, o; x.T and W.T of four linears; GELU's input
    assert sum(e.dtype in FP8 for e in saved) == 4 + 2 * 4 + 1, listing(saved)
    assert ctx_held(out) == []
    out.float().sum().backward()


def fp8_mha_block_fp8_bytes(saved, cfg, tokens):
    """(FP8 bytes saved by one GPT block under fp8_mha, the bytes it needs): each operand once, in one layout."""
    h, f, t = cfg.hidden_size, cfg.ffn_hidden_size, tokens
    needed = (3 * t * h + 3 * h * h + t * h   # QKV: its FP8 output (q, k, v views), W, x.T
              + t * h + h * h                 # attention output o (also the projection's input), proj W
              + t * h + f * h                 # fc1: x.T, W
              + t * f                         # GELU's input
              + t * f + h * f)                # fc2: x.T, W
    return sum(e.nbytes for e in saved if e.dtype in FP8), needed


def test_fp8_mha_saves_the_attention_output_once(generator):
    """Under fp8_mha the attention returns the FP8 bytes it saves, and the output projection keeps those
    same bytes (row-major, transposed in backward) instead of a transposed copy."""
    seed_from(generator)
    out, saved, _ = gpt_forward(te_fuser.recipe.DelayedScaling(fp8_dpa=True, fp8_mha=True))
    got, needed = fp8_mha_block_fp8_bytes(saved, GPT_CFG, GPT_TOKENS)
    assert got == needed, listing(saved)
    out.float().sum().backward()


# -- bug-on controls -------------------------------------------------------------------------------------------------

def test_ctx_check_catches_a_shell_that_keeps_its_bytes(monkeypatch, generator):
    seed_from(generator)
    monkeypatch.setattr(Float8Tensor, "prepare_for_saving", shell_keeps_a_link(Float8Tensor.prepare_for_saving))
    out, _, _ = gpt_forward(RECIPES["delayed"]())
    assert ctx_held(out)


def _input_transposed_copy(x, caller_owned):
    """The bug: the projection saves a transposed copy of the attention's FP8 output."""
    del caller_owned
    return linear_module._saved_transpose(linear_module.with_transpose(x)), False


def test_fp8_mha_check_catches_a_second_copy_of_the_attention_output(monkeypatch, generator):
    seed_from(generator)
    monkeypatch.setattr(linear_module, "_saved_input", _input_transposed_copy)
    out, saved, _ = gpt_forward(te_fuser.recipe.DelayedScaling(fp8_dpa=True, fp8_mha=True))
    got, needed = fp8_mha_block_fp8_bytes(saved, GPT_CFG, GPT_TOKENS)
    assert got == needed + GPT_TOKENS * GPT_CFG.hidden_size
    out.float().sum().backward()  # the buggy layout still computes; only its memory differs


def _both_layouts_saved(t):
    """The bug: the saved weight/input keeps its row-major data next to the transpose."""
    return t


def _wide_input_saved(original):
    """The bug: the linear saves its 16-bit input next to the FP8 transpose it needs."""

    def forward_gemm(self, ctx, x, *args, **kwargs):
        y = original(self, ctx, x, *args, **kwargs)
        ctx.to_save = tuple(ctx.to_save) + (linear_module.high_precision(x),)
        return y

    return forward_gemm


class _Bf16SavedAttention(FusedAttentionFunction):
    """The bug: fp8_dpa ignored by what is saved (q, k, v, o kept in 16 bits)."""

    @staticmethod
    def forward(ctx, *args):
        return FusedAttentionFunction.forward(ctx, *args[:-2], None, None)


BUGS = {
    "both_layouts": lambda mp: mp.setattr(linear_module, "_saved_transpose", _both_layouts_saved),
    "wide_linear_input": lambda mp: mp.setattr(linear_module.BasicLinear, "forward_gemm",
                                                _wide_input_saved(linear_module.BasicLinear.forward_gemm)),
    "bf16_qkv": lambda mp: mp.setattr(dpa_module, "FusedAttentionFunction", _Bf16SavedAttention),
    "bf16_out": lambda mp: mp.setattr(attention_function, "quantize_saved_output", lambda out: out),
    "bf16_gelu_input": lambda mp: mp.setattr(activation_module, "quantize_saved_input", lambda x: x),
}


@pytest.mark.parametrize("bug", ["both_layouts", "wide_linear_input"])
def test_linear_checks_catch_the_bugs(bug, monkeypatch, generator):
    seed_from(generator)
    BUGS[bug](monkeypatch)
    _, saved, operands = linear_forward(RECIPES["delayed"]())
    assert violations(saved, operands)


@pytest.mark.parametrize("bug", ["bf16_qkv", "bf16_out"])
def test_attention_checks_catch_the_bugs(bug, monkeypatch, generator):
    seed_from(generator)
    BUGS[bug](monkeypatch)
    _, saved, operands = attention_forward(RECIPES["delayed"]())
    assert violations(saved, operands)


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_gpt_checks_catch_the_bugs(bug, monkeypatch, generator):
    seed_from(generator)
    BUGS[bug](monkeypatch)
    _, saved, operands = gpt_forward(RECIPES["delayed"]())
    found = gpt_violations(saved, operands)
    assert found
    if bug == "wide_linear_input":
        # Found by value, not by size: the saved 16-bit inputs hold the FP8 x.T values.
        assert any("copy of FP8" in f for f in found)
