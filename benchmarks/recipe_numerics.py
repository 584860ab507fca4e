"""How far each quantization recipe takes the example GPT from high precision, on the CPU.

    python benchmarks/recipe_numerics.py [--steps 300] [--recipes delayed,current,mxfp8,block,nvfp4]

Two measurements, every recipe in the same run:
  loss curve      te_fuser.examples.train (h=128, 2 layers, s=128, 2 x 8 sequences a step, AdamW lr 3e-3,
                  bf16 parameters) for --steps steps from the same seed and data under each recipe and
                  without one (bf16). Printed: the mean |loss - bf16 loss| over the last 50 steps, the
                  largest gap of the 20-step moving averages, and the final 20-step mean loss.
  gradient error  one forward and backward of a batch through the model (float32 parameters) under each
                  recipe against benchmarks/bench_gpt.py's PlainGPT in float64 with the same weights:
                  ||g - g64|| / ||g64|| over all parameters, and the worst single parameter.
The recipes are train.py's (MXFP8 with E4M3 gradients: HYBRID diverges in 32-element blocks).
"""

import argparse
import contextlib
import importlib.util
import io
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import te_fuser  # noqa: E402
from te_fuser.examples import train as example  # noqa: E402
from te_fuser.examples.gpt import GPT, GPTConfig  # noqa: E402
from te_fuser.kernels.cpu import current_isa  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_gpt", os.path.join(ROOT, "benchmarks", "bench_gpt.py"))
bench_gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_gpt)

TAIL, WINDOW = 50, 20


def loss_curve(recipe, steps: int) -> list:
    argv = ["--steps", str(steps), "--dtype", "bfloat16", "--plot", "", "--quiet"]
    argv += ["--no-fp8"] if recipe is None else ["--recipe", recipe]
    args = example.parse_args(argv)
    with contextlib.redirect_stdout(io.StringIO()):  # train prints every step
        history = example.train(args, torch.device("cpu"), 0, 1)
    return [r["loss"] for r in history]


def moving_average(values: list, window: int) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    return t.unfold(0, window, 1).mean(dim=1)


def curve_gap(losses: list, reference: list) -> dict:
    diff = (torch.tensor(losses, dtype=torch.float64) - torch.tensor(reference, dtype=torch.float64)).abs()
    gap = (moving_average(losses, WINDOW) - moving_average(reference, WINDOW)).abs()
    return {"tail_mean_abs": diff[-TAIL:].mean().item(), "max_smoothed": gap.max().item(),
            "final": moving_average(losses, WINDOW)[-1].item()}


def gradient_error(recipe, seed: int = 0) -> dict:
    """Relative error of the gradients under `recipe` (None: float32 without one) against float64."""
    cfg = GPTConfig()  # train.py's model
    torch.manual_seed(seed)
    model = GPT(cfg, dtype=torch.float32)
    plain = bench_gpt.PlainGPT(cfg, dtype=torch.float64)
    bench_gpt.copy_te_weights(plain, model)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    with te_fuser.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe and example.RECIPES[recipe]()):
        logits = model(x)
    F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
    F.cross_entropy(plain(x).flatten(0, 1), y.flatten()).backward()
    reference = {bench_gpt.plain_name(n): p.grad for n, p in plain.named_parameters()}
    total_err = total_ref = 0.0
    worst = (0.0, "")
    for name, p in model.named_parameters():
        ref = reference[bench_gpt.plain_name(name)]
        err = (p.grad.double() - ref).norm().item()
        total_err, total_ref = total_err + err**2, total_ref + ref.norm().item() ** 2
        worst = max(worst, (err / max(ref.norm().item(), 1e-30), name))
    return {"relative": (total_err / total_ref) ** 0.5, "worst": worst[0], "worst_name": worst[1]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--recipes", default="delayed,current,mxfp8,block,nvfp4")
    args = parser.parse_args()
    if args.steps < TAIL + WINDOW:
        parser.error(f"--steps must be at least {TAIL + WINDOW}")
    recipes = args.recipes.split(",")
    unknown = set(recipes) - set(example.RECIPES)
    if unknown:
        parser.error(f"--recipes: unknown {sorted(unknown)}; choose from {sorted(example.RECIPES)}")
    print(f"CPU: {bench_gpt.cpu_model()} (te_fuser tier {current_isa()}), torch {torch.__version__}")
    print(f"\ngradient error against float64 (one batch, float32 parameters)")
    print(f"{'recipe':10s} {'relative':>10s} {'worst param':>12s}  name")
    for recipe in [None] + recipes:
        g = gradient_error(recipe)
        print(f"{recipe or 'float32':10s} {g['relative']:10.2e} {g['worst']:12.2e}  {g['worst_name']}")
    print(f"\nloss curve over {args.steps} steps against bf16 (same seed and data)")
    reference = loss_curve(None, args.steps)
    print(f"{'recipe':10s} {'|dloss| last ' + str(TAIL):>16s} {'max |d avg' + str(WINDOW) + '|':>14s} {'final avg':>10s}")
    print(f"{'bf16':10s} {0.0:16.4f} {0.0:14.4f} {moving_average(reference, WINDOW)[-1].item():10.4f}")
    for recipe in recipes:
        gap = curve_gap(loss_curve(recipe, args.steps), reference)
        print(f"{recipe:10s} {gap['tail_mean_abs']:16.4f} {gap['max_smoothed']:14.4f} {gap['final']:10.4f}")


if __name__ == "__main__":
    main()
