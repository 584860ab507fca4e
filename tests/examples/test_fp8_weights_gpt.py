"""FP8 weights on the example GPT: the trainer's --fp8-weights run, parameter bytes, and the peak
memory of a whole training step (forward, backward, AdamW on float32 masters, cast back)."""

import pytest
import torch

import te_fuser as te
from te_fuser.examples import train
from te_fuser.examples.corpus import load_tokens, sample_batch
from te_fuser.examples.gpt import GPT, GPTConfig
from te_fuser.examples.master_weights import MasterWeights
from te_fuser.tensor.float8_tensor import Float8Tensor
from te_fuser.memory import MemoryTracker
from te_fuser.recipe import DelayedScaling

TINY = ["--device", "cpu", "--hidden", "32", "--heads", "2", "--layers", "1", "--seq-len", "32", "--batch-size", "2",
        "--quiet", "--plot", ""]
# The issue's model: h=512, ffn 2048, 8 heads, 1 layer (vocab 256).
ISSUE_CFG = dict(hidden_size=512, ffn_hidden_size=2048, num_heads=8, num_layers=1)


@pytest.mark.parametrize("extra", [[], ["--dtype", "bfloat16"], ["--recipe", "current"]],
                         ids=["fp32", "bf16", "current"])
def test_trainer_with_fp8_weights_learns_like_the_ordinary_run(extra):
    ref = [h["loss"] for h in train.main(["--steps", "20"] + TINY + extra)]
    fp8w = [h["loss"] for h in train.main(["--steps", "20", "--fp8-weights"] + TINY + extra)]
    print("losses, ordinary:", [round(v, 4) for v in ref], "FP8 weights:", [round(v, 4) for v in fp8w])
    # Means over 5 steps: one batch's loss is noisy.
    first, last, ref_last = sum(fp8w[:5]) / 5, sum(fp8w[-5:]) / 5, sum(ref[-5:]) / 5
    assert last < first - 0.3, fp8w
    assert abs(last - ref_last) < 0.1, (ref, fp8w)


def test_trainer_refuses_fp8_weights_where_it_does_not_support_them():
    with pytest.raises(SystemExit, match="--fp8-weights runs on one process"):
        train.main(["--steps", "1", "--fp8-weights", "--save", "x.pt"] + TINY)


def parameter_bytes(model) -> int:
    total = 0
    for p in model.parameters():
        if isinstance(p, Float8Tensor):
            total += sum(t.numel() * t.element_size() for t in (p._data, p._scale_inv, p._transpose) if t is not None)
        else:
            total += p.numel() * p.element_size()
    return total


@pytest.mark.parametrize("seq_len", [128, 256])
def test_parameter_bytes_of_fp8_weights(seq_len):
    """The linear weights take one byte per element; the embedding, position table, head and norms
    stay bf16 (as in TE). With the default position table (128) the whole model is <= 0.55x bf16;
    a 256-long table adds 16-bit bytes, and is only reported."""
    cfg = GPTConfig(seq_len=seq_len, **ISSUE_CFG)
    bf16 = GPT(cfg, dtype=torch.bfloat16)
    with te.quantized_model_init(recipe=DelayedScaling()):
        fp8 = GPT(cfg, dtype=torch.bfloat16)
    ratio = parameter_bytes(fp8) / parameter_bytes(bf16)
    print(f"seq_len {seq_len}: parameter bytes bf16 {parameter_bytes(bf16)}, FP8 weights {parameter_bytes(fp8)}, "
          f"ratio {ratio:.4f}")
    linear = [p for p in fp8.parameters() if isinstance(p, Float8Tensor)]
    assert len(linear) == 4 and all(p._transpose is None for p in linear)
    if seq_len == 128:
        assert ratio <= 0.55, ratio
    else:
        assert ratio < 0.56, ratio


def step_peak(fp8_weights: bool, fp8: bool, keep_16bit_weights: bool = False) -> int:
    """Peak CPU bytes of one training step (bf16 model, float32 masters in AdamW), counting what
    the run holds (model, masters, optimizer state) plus the step's own peak.
    keep_16bit_weights: the bug-on control, a 16-bit copy of each FP8 weight held through the step."""
    recipe = DelayedScaling(amax_history_len=4)
    cfg = GPTConfig(seq_len=256, **ISSUE_CFG)
    x, y = sample_batch(load_tokens(), 8, 256, torch.Generator().manual_seed(1))
    with MemoryTracker(device="cpu") as run:
        torch.manual_seed(0)
        with te.quantized_model_init(enabled=fp8_weights, recipe=recipe):
            model = GPT(cfg, dtype=torch.bfloat16)
        masters = MasterWeights(model)
        optimizer = torch.optim.AdamW(masters.masters, lr=1e-3)

        def step():
            copies = [p.dequantize() for p in model.parameters() if isinstance(p, Float8Tensor)] \
                if keep_16bit_weights else []
            with te.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
                logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            loss.backward()
            masters.grads_from_model()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            masters.cast_back()
            del copies
            return loss.item()

        step()  # the optimizer's state is made here
        held = run.sample()
        with MemoryTracker(device="cpu") as mem:
            step()
    return held + mem.peak_bytes


def test_training_step_peak_with_fp8_weights_is_below_bf16():
    bf16 = step_peak(fp8_weights=False, fp8=False)
    fp8_only = step_peak(fp8_weights=False, fp8=True)
    fp8w = step_peak(fp8_weights=True, fp8=True)
    control = step_peak(fp8_weights=True, fp8=True, keep_16bit_weights=True)
    mib = 2.0 ** 20
    print(f"step peak: bf16 {bf16 / mib:.2f} MiB, FP8 compute {fp8_only / mib:.2f} MiB ({fp8_only / bf16:.3f}x), "
          f"FP8 weights {fp8w / mib:.2f} MiB ({fp8w / bf16:.3f}x); control with 16-bit weight copies "
          f"{control / mib:.2f} MiB")
    assert fp8w < bf16 and fp8w < fp8_only
    weight_elems = 512 * 1536 + 512 * 512 + 2 * 512 * 2048
    # Bug-on control: the measurement sees a 16-bit copy of the FP8 weights (2 bytes per element).
    assert control - fp8w >= 2 * weight_elems * 0.9, (control, fp8w)
