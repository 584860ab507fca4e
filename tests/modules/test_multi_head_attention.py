"""te_fuser.MultiheadAttention against float64 torch (F.linear, F.layer_norm, SDPA) with TransformerEngine's
weight names and QKV layouts; FP8; RoPE; the RNG tracker; the saved-tensor discipline with its bug-on controls."""

import contextlib

import pytest
import torch

import te_fuser
from te_fuser import recipe

import layer_reference as ref
from _module_memory import leaky_attention, reachable_after_backward, retained_step_bytes, without_clearing

HIDDEN, HEADS, SEQ, BATCH = 64, 4, 16, 2


def _mha(**kwargs):
    kwargs.setdefault("attention_dropout", 0.0)
    module = te_fuser.MultiheadAttention(HIDDEN, HEADS, device="cpu", **kwargs)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "bias" in name or "layer_norm" in name:
                p.normal_(0.0 if "bias" in name else 1.0, 0.2)
    return module


def _input(generator, qkv_format="sbhd", seq=SEQ, dtype=torch.float32):
    shape = (seq, BATCH, HIDDEN) if qkv_format == "sbhd" else (BATCH, seq, HIDDEN)
    return torch.randn(shape, generator=generator).to(dtype).requires_grad_()


LAYOUTS = [  # (fuse_qkv_params, qkv_weight_interleaved, num_gqa_groups, qkv_format)
    (True, True, None, "sbhd"),
    (True, True, 2, "bshd"),
    (True, False, 2, "sbhd"),
    (False, True, 1, "sbhd"),  # split parameters: never interleaved, as in TE
]


@pytest.mark.parametrize("fuse_qkv_params,interleaved,gqa,qkv_format", LAYOUTS)
def test_self_attention_matches_float64(fuse_qkv_params, interleaved, gqa, qkv_format, generator):
    module = _mha(fuse_qkv_params=fuse_qkv_params, qkv_weight_interleaved=interleaved, num_gqa_groups=gqa,
                  qkv_format=qkv_format)
    x = _input(generator, qkv_format)
    out = module(x)
    assert out.shape == x.shape

    def reference(x64, P):
        attn, bias, _ = ref.mha(module, x64, qkv_format, P=P)
        return attn + bias

    ref.check_against_reference(module, x, out, reference, 1e-4)


def test_te_parameter_names():
    fused = _mha(fuse_qkv_params=True)
    assert set(dict(fused.named_parameters())) == {"qkv.weight", "qkv.bias", "proj.weight", "proj.bias"}
    split = _mha(num_gqa_groups=2)
    assert set(dict(split.named_parameters())) == {
        "qkv.query_weight", "qkv.key_weight", "qkv.value_weight", "qkv.query_bias", "qkv.key_bias",
        "qkv.value_bias", "proj.weight", "proj.bias"}
    assert split.qkv.key_weight.shape == (2 * HIDDEN // HEADS, HIDDEN)
    cross = _mha(attention_type="cross")
    assert set(dict(cross.named_parameters())) == {
        "query_layer.weight", "query_layer.bias", "key_value.key_weight", "key_value.value_weight",
        "key_value.key_bias", "key_value.value_bias", "proj.weight", "proj.bias"}
    assert isinstance(fused.core_attention, te_fuser.DotProductAttention)
    no_bias = _mha(bias=False, fuse_qkv_params=True)
    assert set(dict(no_bias.named_parameters())) == {"qkv.weight", "proj.weight"}


@pytest.mark.parametrize("normalization,zero_centered_gamma,fuse_qkv_params", [
    ("LayerNorm", False, True), ("RMSNorm", True, False)])
def test_input_layernorm_and_return_layernorm_output(normalization, zero_centered_gamma, fuse_qkv_params, generator):
    module = _mha(input_layernorm=True, normalization=normalization, zero_centered_gamma=zero_centered_gamma,
                  fuse_qkv_params=fuse_qkv_params, return_layernorm_output=True, return_bias=True,
                  layernorm_epsilon=1e-3)
    assert isinstance(module.layernorm_qkv, te_fuser.LayerNormLinear)
    x = _input(generator)
    out, bias, ln_out = module(x)

    def with_gamma(P):  # zero_centered_gamma: the norm multiplies by (1 + gamma)
        key = "layernorm_qkv.layer_norm_weight"
        return P | {key: P[key] + 1} if zero_centered_gamma else P

    with torch.no_grad():
        _, _, ref_ln = ref.mha(module, x, normalization=normalization, eps=1e-3,
                               P=with_gamma(ref.float64_params(module)))
    torch.testing.assert_close(ln_out.double(), ref_ln, rtol=1e-5, atol=1e-5)
    assert bias is module.proj.bias

    def reference(x64, P):
        attn, bias, _ = ref.mha(module, x64, normalization=normalization, eps=1e-3, P=with_gamma(P))
        return attn + bias

    ref.check_against_reference(module, x, out + bias, reference, 1e-4)


@pytest.mark.parametrize("fuse_qkv_params,input_layernorm", [(True, False), (False, True)])
def test_cross_attention_matches_float64(fuse_qkv_params, input_layernorm, generator):
    module = _mha(attention_type="cross", fuse_qkv_params=fuse_qkv_params, num_gqa_groups=2,
                  attn_mask_type="no_mask", input_layernorm=input_layernorm)
    x = _input(generator)
    enc = torch.randn(24, BATCH, HIDDEN, generator=generator)
    out = module(x, encoder_output=enc)

    def reference(x64, P):
        attn, bias, _ = ref.mha(module, x64, causal=False, encoder_output=enc, P=P)
        return attn + bias

    ref.check_against_reference(module, x, out, reference, 1e-4)


def _rotary(seq, dim, base=10000.0):
    """TransformerEngine's RotaryPositionEmbedding output: [s, 1, 1, dim] angles, the halves duplicated."""
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]


@pytest.mark.parametrize("qkv_format,rot_dim", [("sbhd", 16), ("bshd", 8)])
def test_rotary_pos_emb_matches_complex_rotation(qkv_format, rot_dim, generator):
    module = _mha(fuse_qkv_params=True, qkv_format=qkv_format)
    x = _input(generator, qkv_format)
    freqs = _rotary(SEQ + 3, rot_dim)  # longer than the sequence, and on part of the head dim only
    out = module(x, rotary_pos_emb=freqs)

    def reference(x64, P):
        attn, bias, _ = ref.mha(module, x64, qkv_format, rotary=freqs, P=P)
        return attn + bias

    ref.check_against_reference(module, x, out, reference, 1e-4)
    plain = module(x.detach())
    assert not torch.allclose(plain, out.detach(), atol=1e-3)


@pytest.mark.parametrize("fp8_recipe", [recipe.DelayedScaling(fp8_dpa=True, amax_history_len=4),
                                        recipe.Float8CurrentScaling(fp8_dpa=True)], ids=["delayed", "current"])
def test_fp8_and_fp8_dpa_within_tolerance(fp8_recipe, generator):
    module = _mha(fuse_qkv_params=True, num_gqa_groups=2, input_layernorm=True)
    x = _input(generator, seq=32)
    with torch.no_grad():
        expect, bias, _ = ref.mha(module, x)
        expect = expect + bias
    for _ in range(2):  # delayed scaling: the second step casts with the first step's amaxes
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            out = module(x)
        out.sum().backward()
    rel = ((out.double() - expect).norm() / expect.norm()).item()
    assert 1e-4 < rel < 0.08, rel  # FP8 ran (not float32-exact), and within FP8 precision
    assert module.core_attention._fp8_state is not None  # fp8_dpa: q, k, v were quantized
    assert torch.isfinite(x.grad).all() and x.grad.norm() > 0


def test_fp8_mha_recipe_and_unsupported_options_raise():
    with pytest.raises(NotImplementedError, match="ub_overlap_ag"):
        _mha(ub_overlap_ag=True)
    with pytest.raises(NotImplementedError, match="softmax_type"):
        _mha(softmax_type="off-by-one")
    with pytest.raises(ValueError, match="attention_type"):
        _mha(attention_type="encoder")
    with pytest.raises(ValueError, match="num_gqa_groups"):
        _mha(num_gqa_groups=3)
    with pytest.raises(ValueError, match="divisible by the TP size 8"):
        _mha(tp_size=8)
    module = _mha(fuse_qkv_params=True)
    x = torch.randn(SEQ, BATCH, HIDDEN)
    with pytest.raises(TypeError, match="inference_params must be an InferenceParams"):
        module(x, inference_params=object())
    with pytest.raises(ValueError, match="encoder_output"):
        _mha(attention_type="cross")(x)
    with pytest.raises(ValueError, match="freqs covers 4 positions"):
        module(x, rotary_pos_emb=_rotary(4, 16))


def test_return_bias(generator):
    module = _mha(fuse_qkv_params=True, return_bias=True)
    x = _input(generator)
    out, bias = module(x)
    assert bias is module.proj.bias
    attn, ref_bias, _ = ref.mha(module, x)
    torch.testing.assert_close(out.double(), attn, rtol=1e-4, atol=1e-4)


class _CountingTracker:
    """An RNG tracker with its own CPU generator state, counting forks."""

    def __init__(self, seed):
        self.state = torch.Generator().manual_seed(seed).get_state()
        self.forks = 0

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        del name
        self.forks += 1
        outer = torch.get_rng_state()
        torch.set_rng_state(self.state)
        try:
            yield
        finally:
            self.state = torch.get_rng_state()
            torch.set_rng_state(outer)


def test_attention_dropout_draws_from_the_rng_tracker(generator):
    tracker = _CountingTracker(1234)
    module = te_fuser.MultiheadAttention(HIDDEN, HEADS, attention_dropout=0.5, fuse_qkv_params=True, device="cpu",
                                         get_rng_state_tracker=lambda: tracker)
    x = _input(generator)
    forks_at_init = tracker.forks  # the linears' weight initialization forks too
    outer = torch.get_rng_state()
    a = module(x)
    assert tracker.forks == forks_at_init + 1
    assert torch.equal(torch.get_rng_state(), outer)  # the dropout seed came from the tracker's generator
    b = module(x)
    assert not torch.allclose(a, b)  # a fresh mask per call
    module.eval()
    torch.testing.assert_close(module(x), module(x))  # no dropout in eval mode


@pytest.mark.parametrize("fp8_recipe", [None, recipe.DelayedScaling(fp8_dpa=True, amax_history_len=4)],
                         ids=["no_fp8", "delayed_fp8_dpa"])
def test_checkpoint_core_attention_recomputes_the_same_values(fp8_recipe, generator):
    """With dropout drawn from the RNG tracker: the recompute replays the tracker's state, so values and
    grads equal the run without checkpointing, and the attention's own saved tensors are recomputed."""
    class Tracker(te_fuser.distributed.CudaRNGStatesTracker):
        forks = 0

        def fork(self, *args, **kwargs):
            self.forks += 1
            return super().fork(*args, **kwargs)

    trackers = [Tracker(), Tracker()]
    for tracker in trackers:
        tracker.add("model-parallel-rng", 99)
    modules = []
    for tracker in trackers:
        torch.manual_seed(5)
        modules.append(te_fuser.MultiheadAttention(HIDDEN, HEADS, attention_dropout=0.3, fuse_qkv_params=True,
                                                   device="cpu", get_rng_state_tracker=lambda t=tracker: t))
    x = _input(generator, seq=32)
    results = []
    for module, checkpointed in zip(modules, (False, True)):
        xi = x.detach().clone().requires_grad_()
        # Where a GPU exists the tracker forks its generator, not the CPU's that this CPU module's dropout
        # draws from (as in TE): both runs start that one from the same state too.
        torch.manual_seed(6)
        with te_fuser.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
            out = module(xi, checkpoint_core_attention=checkpointed)
        out.backward(torch.ones_like(out))
        results.append((out.detach(), xi.grad, module.qkv.weight.grad))
    for got, expect in zip(results[1], results[0]):
        torch.testing.assert_close(got, expect, rtol=0, atol=0)
    assert trackers[1].forks == trackers[0].forks + 1  # the recompute forked the tracker again


@pytest.mark.parametrize("fp8_recipe", [None, recipe.DelayedScaling(fp8_dpa=True, amax_history_len=4)],
                         ids=["no_fp8", "delayed_fp8_dpa"])
def test_nothing_left_on_ctx_after_backward_and_both_bugs_are_caught(fp8_recipe, monkeypatch, generator):
    module = _mha(fuse_qkv_params=True, input_layernorm=True)
    x = _input(generator, seq=32)

    def forward():
        with te_fuser.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
            return module(x)

    before, after, _ = reachable_after_backward(module, forward)
    assert before and after == []
    held, expected = retained_step_bytes(module, forward, [x])
    assert held <= expected + 1024, (held, expected)

    # Each bug brings back at least the FP8 (1 byte) or float32 (4 bytes) copy of q, k, v.
    qkv_bytes = 32 * BATCH * 3 * HIDDEN * (1 if fp8_recipe is not None else 4)
    for bug in (without_clearing, leaky_attention):
        with monkeypatch.context() as patch:
            bug(patch)
            _, after_leaky, _ = reachable_after_backward(module, forward)
            assert after_leaky, f"the graph walk missed the tensors left on ctx by {bug.__name__}"
            held_leaky, expected = retained_step_bytes(module, forward, [x])
            assert held_leaky >= expected + qkv_bytes // 3, (bug.__name__, held_leaky, expected)


def test_state_dict_round_trip(generator):
    module = _mha(fuse_qkv_params=True, num_gqa_groups=2)
    x = _input(generator)
    state = module.state_dict()
    assert {k for k in state if not k.endswith("_extra_state")} == {"qkv.weight", "qkv.bias", "proj.weight",
                                                                      "proj.bias"}
    fresh = te_fuser.MultiheadAttention(HIDDEN, HEADS, attention_dropout=0.0, fuse_qkv_params=True,
                                        num_gqa_groups=2, device="cpu")
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh(x), module(x), rtol=0, atol=0)


def test_thd_packed_sequences_equal_per_sequence_bshd(generator):
    """qkv_format='thd' with cu_seqlens: two packed sequences of different lengths give what each
    sequence gives alone in bshd."""
    bshd = _mha(fuse_qkv_params=True, num_gqa_groups=2, qkv_format="bshd")
    thd = _mha(fuse_qkv_params=True, num_gqa_groups=2, qkv_format="thd", attn_mask_type="padding_causal")
    thd.load_state_dict(bshd.state_dict())
    lengths = [5, 11]
    seqs = [torch.randn(1, n, HIDDEN, generator=generator) for n in lengths]
    cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
    packed = thd(torch.cat([s[0] for s in seqs]), cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=11,
                 max_seqlen_kv=11)
    expect = torch.cat([bshd(s)[0] for s in seqs])
    torch.testing.assert_close(packed, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
def test_thd_rotary_positions_restart_per_sequence(interleaved, generator):
    """rotary_pos_emb with qkv_format='thd': RoPE reads cu_seqlens, so each packed sequence's positions
    start at 0 and the packed forward and input gradient equal each sequence's alone in bshd."""
    bshd = _mha(fuse_qkv_params=True, num_gqa_groups=2, qkv_format="bshd", rotary_pos_interleaved=interleaved)
    thd = _mha(fuse_qkv_params=True, num_gqa_groups=2, qkv_format="thd", attn_mask_type="padding_causal",
               rotary_pos_interleaved=interleaved)
    thd.load_state_dict(bshd.state_dict())
    freqs = te_fuser.RotaryPositionEmbedding(HIDDEN // HEADS, rotary_percent=0.5, interleaved=interleaved)(12)
    lengths = [5, 11]
    seqs = [torch.randn(1, n, HIDDEN, generator=generator, requires_grad=True) for n in lengths]
    packed_in = torch.cat([s[0] for s in seqs]).detach().requires_grad_()
    cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
    packed = thd(packed_in, rotary_pos_emb=freqs, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=11,
                 max_seqlen_kv=11)
    expect = torch.cat([bshd(s, rotary_pos_emb=freqs)[0] for s in seqs])
    torch.testing.assert_close(packed, expect, rtol=1e-5, atol=1e-5)
    grad = torch.randn(packed.shape, generator=generator)
    packed.backward(grad)
    expect.backward(grad)
    torch.testing.assert_close(packed_in.grad, torch.cat([s.grad[0] for s in seqs]), rtol=1e-5, atol=1e-5)
    plain = thd(packed_in.detach(), cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=11, max_seqlen_kv=11)
    assert not torch.allclose(plain, packed.detach(), atol=1e-3)
