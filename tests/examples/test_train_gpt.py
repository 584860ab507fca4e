"""The main job: the example GPT trains, and keeps te_fuser's memory promises on a real model."""

import pytest
import torch

import te_fuser as te
from te_fuser.examples import train
from te_fuser.examples.corpus import load_tokens, sample_batch
from te_fuser.examples.gpt import GPT, GPTConfig
from te_fuser.memory import MemoryTracker, audit_autograd
from te_fuser.recipe import DelayedScaling

TINY = ["--device", "cpu", "--hidden", "32", "--heads", "2", "--layers", "1", "--seq-len", "32", "--batch-size", "2",
        "--quiet", "--plot", ""]


def test_loss_falls_in_a_short_run(tmp_path):
    plot = tmp_path / "run.png"
    history = train.main(["--steps", "12", "--plot", str(plot), "--quiet", "--hidden", "64", "--seq-len", "64"])
    losses = [h["loss"] for h in history]
    assert losses[-1] < losses[0] - 0.8, losses
    assert all(h["tokens_per_s"] > 0 and h["peak"] >= h["current"] > 0 for h in history)
    assert plot.stat().st_size > 10_000


def test_high_precision_and_current_scaling_train_too():
    for extra in (["--no-fp8"], ["--recipe", "current"]):
        losses = [h["loss"] for h in train.main(["--steps", "6"] + TINY + extra)]
        assert losses[-1] < losses[0], (extra, losses)


def _model_and_batch(checkpoint_blocks, seq_len=128, batch=8):
    torch.manual_seed(0)
    cfg = GPTConfig(seq_len=seq_len, hidden_size=64, num_heads=2, num_layers=3, ffn_hidden_size=256)
    model = GPT(cfg, checkpoint_blocks=checkpoint_blocks)
    x, y = sample_batch(load_tokens(), batch, seq_len, torch.Generator().manual_seed(1))
    return model, x, y


def _step(model, x, y, fp8):
    recipe = DelayedScaling(amax_history_len=4)
    with te.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
        logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    return loss


@pytest.mark.parametrize("fp8", [False, True])
def test_activation_checkpointing_same_gradients_lower_peak(fp8):
    grads, peaks = [], []
    for checkpoint_blocks in (False, True):
        model, x, y = _model_and_batch(checkpoint_blocks)
        _step(model, x, y, fp8)  # a first step sets the delayed FP8 scales
        model.zero_grad(set_to_none=True)
        with MemoryTracker(device="cpu") as mem:
            _step(model, x, y, fp8)
        peaks.append(mem.peak_bytes)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=0, atol=0, msg=name)
    assert peaks[1] < 0.8 * peaks[0], peaks


def test_no_tensor_stays_on_any_ctx_after_backward():
    model, x, y = _model_and_batch(False, seq_len=32, batch=2)
    with te.fp8_autocast(fp8_recipe=DelayedScaling()):
        logits = model(x)
    before = audit_autograd(logits)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    after = audit_autograd(logits)  # the output, and so the graph, is still alive
    assert not after.findings, str(after)
    # Before backward, ctx holds only Float8Tensor shells, the grad quantizers' scale/amax (views of the
    # modules' recipe states; amax a row of the amax history, TE's layout) and, on the first chain, the
    # backward states whose update it runs at the end of its backward: recipe state, which lives on with
    # the modules anyway, not activations.
    state_storages = {t.untyped_storage().data_ptr() for s in te.FP8GlobalState._live_states
                      for t in (s.amax_history, s.scale, s.scale_inv)}
    held = [h for finding in before.findings for h in finding.tensors]
    assert held and all(h.storage_key[1] in state_storages for h in held), str(before)


def test_checkpoint_resume_is_exact(tmp_path):
    ckpt = tmp_path / "gpt.pt"
    straight = [h["loss"] for h in train.main(["--steps", "6"] + TINY)]
    first = [h["loss"] for h in train.main(["--steps", "3", "--save", str(ckpt)] + TINY)]
    resumed = [h["loss"] for h in train.main(["--steps", "3", "--resume", str(ckpt)] + TINY)]
    assert first + resumed == straight


def test_corrupt_or_mismatched_checkpoint_is_named(tmp_path):
    ckpt = tmp_path / "gpt.pt"
    train.main(["--steps", "1", "--save", str(ckpt)] + TINY)
    bigger = [a if a != "32" else "64" for a in TINY]  # hidden 64 (and seq 64): another model
    with pytest.raises(ValueError, match="was written for model config"):
        train.main(["--steps", "1", "--resume", str(ckpt)] + bigger)
    state = torch.load(ckpt, weights_only=False)
    state["config"] = repr(GPTConfig(seq_len=32, hidden_size=32, num_heads=2, num_layers=1, ffn_hidden_size=128))
    state["model"]["blocks.0.qkv.weight"] = torch.zeros(3, 3)
    torch.save(state, ckpt)
    with pytest.raises(ValueError, match=r"blocks.0.qkv.weight' has shape \(3, 3\)"):
        train.main(["--steps", "1", "--resume", str(ckpt)] + TINY)
    ckpt.write_bytes(b"not a checkpoint at all")
    with pytest.raises(RuntimeError, match="not a readable te_fuser checkpoint"):
        train.main(["--steps", "1", "--resume", str(ckpt)] + TINY)
