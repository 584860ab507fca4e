"""Allocated memory over training steps, with and without each memory fix, as CSV and PNG.

    python benchmarks/memory_timeline.py [--device cpu|cuda] [--steps 4] [--microbatches 16]
        [--csv docs/memory_timeline.csv] [--png docs/memory_timeline.png]

Three small training loops, each run with the seed bug and with its fix:
  ctx.tensor_objects  FP8 linear layers (te_fuser.Float8Tensor) whose custom Function keeps the
                      restored quantized objects on ctx after backward (seed 000/001) vs clearing them
  logged losses       microbatch losses stored with their grad_fn (seed 002) vs te_fuser.memory.LossLog
  padded all-gather   per-layer padded buffers released with .data = empty while the true-shape
                      view lives on (seed 003) vs te_fuser.memory.release_storage
Memory is sampled with te_fuser.memory.MemoryTracker: bytes allocated since the loop began and
still alive (torch's allocator: profiler events on CPU, allocator statistics on CUDA).
The bug patterns are the ones the regression tests use (tests/memory/memory_patterns.py).
"""

import argparse
import csv
import os
import sys

import torch

from te_fuser.memory import LossLog, MemoryTracker, release_storage

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "memory"))
from memory_patterns import StageFunction, TeFuserQuantizedLinearFunction  # noqa: E402

MIB = 2**20


def fp8_layers(device, steps, fixed, layers=4, tokens=512, width=512):
    """Yields (step, phase) at each step's start and after forward and backward.

    As in a real loop, the previous step's loss (and so its graph) lives until this step's
    forward assigns a new one: with the bug its ctxs still hold the fp8 copies.
    """
    torch.manual_seed(0)
    weights = [(torch.randn(width, width, device=device) / width**0.5).requires_grad_() for _ in range(layers)]
    x = torch.randn(tokens, width, device=device)
    loss = None
    for step in range(steps):
        for w in weights:
            w.grad = None
        yield step, "start"
        h = x
        for w in weights:
            h = torch.tanh(TeFuserQuantizedLinearFunction.apply(h, w, fixed))
        loss = h.square().mean()
        del h
        yield step, "forward"
        loss.backward()
        yield step, "backward"


def logged_losses(device, steps, fixed, microbatches, batch=256, width=512):
    """Yields after each microbatch; the step's losses are reduced once, at the step's end."""
    torch.manual_seed(0)
    w = torch.randn(width, width, device=device, requires_grad=True)
    for step in range(steps):
        log = LossLog() if fixed else []
        for _ in range(microbatches):
            loss = StageFunction.apply(torch.randn(batch, width, device=device), w)
            loss.backward()
            log.append(loss)
            del loss
            yield step, "microbatch"
        mean = log.mean() if fixed else sum(value.item() for value in log) / len(log)
        assert mean > 0
        del log
        yield step, "step end"


def padded_all_gather(device, steps, fixed, layers=6, width=768, pad=512):
    """Per layer: gather into a padded buffer, use the true-shape view, release; views live to step end."""
    torch.manual_seed(0)
    x = torch.randn(256, width, device=device)
    for step in range(steps):
        views = []  # what a compiled graph's buffer aliases keep until the graph returns
        h = x
        for _ in range(layers):
            padded = torch.randn(width * width + pad, device=device)
            view = padded[: width * width].view(width, width)
            h = torch.tanh(h @ view) / width**0.5
            views.append(view)
            if fixed:
                release_storage(padded)
            else:
                padded.data = torch.empty(0, device=device)
            del padded, view
            yield step, "layer"
        del views, h
        yield step, "step end"


def scenarios(args):
    return {
        "ctx.tensor_objects": lambda fixed: fp8_layers(args.device, args.steps, fixed),
        "logged losses": lambda fixed: logged_losses(args.device, args.steps, fixed, args.microbatches),
        "padded all-gather": lambda fixed: padded_all_gather(args.device, args.steps, fixed),
    }


def record(loop, device):
    rows = []
    with MemoryTracker(device) as tracker:
        for step, phase in loop:
            rows.append((step, phase, tracker.sample()))
    return rows, tracker.peak_bytes


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(7.5, 2.4 * len(results)), dpi=90)
    for ax, (name, variants) in zip(axes, results.items()):
        for variant, color, width in (("bug", "tab:red", 2.6), ("fix", "tab:green", 1.4)):
            rows = variants[variant][0]
            ax.plot([b / MIB for _, _, b in rows], color=color, lw=width, label=variant, drawstyle="steps-post")
        ax.set_title(name, fontsize=10)
        ax.set_ylabel("allocated MiB")
        ax.legend(loc="upper left", fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("sample (step start / forward / backward; microbatch; layer)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--csv", default=os.path.join("docs", "memory_timeline.csv"))
    parser.add_argument("--png", default=os.path.join("docs", "memory_timeline.png"))
    args = parser.parse_args(argv)
    results = {}
    for name, make_loop in scenarios(args).items():
        results[name] = {variant: record(make_loop(variant == "fix"), args.device) for variant in ("bug", "fix")}
    with open(args.csv, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["scenario", "variant", "sample", "step", "phase", "allocated_bytes"])
        for name, variants in results.items():
            for variant, (rows, _) in variants.items():
                for index, (step, phase, nbytes) in enumerate(rows):
                    writer.writerow([name, variant, index, step, phase, nbytes])
    print(f"{'scenario':<20} {'peak bug':>10} {'peak fix':>10} {'bug/fix':>8} {'end bug':>10} {'end fix':>10}")
    for name, variants in results.items():
        (bug_rows, bug_peak), (fix_rows, fix_peak) = variants["bug"], variants["fix"]
        print(
            f"{name:<20} {bug_peak / MIB:9.1f}M {fix_peak / MIB:9.1f}M {bug_peak / max(fix_peak, 1):8.2f} "
            f"{bug_rows[-1][2] / MIB:9.1f}M {fix_rows[-1][2] / MIB:9.1f}M"
        )
    os.makedirs(os.path.dirname(args.png) or ".", exist_ok=True)
    plot(results, args.png)
    print(f"wrote {args.csv} and {args.png}")


if __name__ == "__main__":
    main()
