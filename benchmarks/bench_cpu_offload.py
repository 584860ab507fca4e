"""get_cpu_offload_context on a GPU: the device bytes held between forward and backward, the step's peak and its
time, with the first layers' activations offloaded to pinned host memory and without, in one run.

    python benchmarks/bench_cpu_offload.py [--layers 8] [--tokens 8192] [--hidden 4096] [--module linear|layer]

All but the last layer are offloaded (TE's num_layers = layers - 1). Bytes are torch.cuda's allocator
statistics above the level at the start of the step; times are medians of interleaved steps.

The copies can hide behind compute only as far as the link allows: forward cannot end before the moved bytes
have reached the host, nor backward before they are back. So each offloaded step is set beside its floor,
max(forward without offload, moved / D2H bandwidth) + max(backward without offload, moved / H2D bandwidth),
with the pinned-memory bandwidths measured in the same run. A step at its floor overlaps fully.
"""

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_linear import time_interleaved  # noqa: E402

import te_fuser  # noqa: E402
from te_fuser import recipe  # noqa: E402

MiB = 1 << 20


def make_models(kind, layers, hidden):
    if kind == "linear":
        return [te_fuser.Linear(hidden, hidden, params_dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
    return [te_fuser.TransformerLayer(hidden, 4 * hidden, hidden // 128, hidden_dropout=0.0, attention_dropout=0.0,
                                      params_dtype=torch.bfloat16, device="cuda") for _ in range(layers)]


def make_step(models, x, fp8_recipe, offload, record):
    def step():
        if offload:
            context, sync = te_fuser.get_cpu_offload_context(True, len(models) - 1, len(models))
        else:
            context, sync = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), lambda t: t
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        forward_start = torch.cuda.Event(enable_timing=True)
        forward_start.record()
        h = x
        for model in models:
            with te_fuser.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe), context:
                h = model(h)
            h = sync(h)
        forward_end = torch.cuda.Event(enable_timing=True)
        forward_end.record()
        torch.cuda.synchronize()
        between = torch.cuda.memory_allocated() - start
        backward_start, backward_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        backward_start.record()
        h.backward(torch.ones_like(h))
        backward_end.record()
        torch.cuda.synchronize()
        record.update(between=between, peak=torch.cuda.max_memory_allocated() - start)
        record.setdefault("forward_ms", []).append(forward_start.elapsed_time(forward_end))
        record.setdefault("backward_ms", []).append(backward_start.elapsed_time(backward_end))
        for model in models:
            model.zero_grad(set_to_none=True)
    return step


def copy_bandwidth(nbytes, repeats=5):
    """(device -> pinned host, pinned host -> device) bytes per second: medians of non-blocking copies."""
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rates = []
    for dst, src in ((host, device), (device, host)):
        times = []
        for _ in range(repeats + 1):  # the first copy is a warm-up
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        rates.append(nbytes / statistics.median(times[1:]))
    return rates


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--module", choices=("linear", "layer"), default="linear")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"gpu: {torch.cuda.get_device_name()} | torch {torch.__version__} | {args.layers} x {args.module}, "
          f"hidden {args.hidden}, {args.tokens} tokens, bf16 params")
    torch.manual_seed(0)
    models = make_models(args.module, args.layers, args.hidden)
    shape = (args.tokens, args.hidden) if args.module == "linear" else (args.tokens // 4, 4, args.hidden)
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    recipes = {"bf16": None, "FP8 current": recipe.Float8CurrentScaling()}
    steps, records = {}, {}
    for name, fp8_recipe in recipes.items():
        for offload in (False, True):
            key = f"{name}, {'offload' if offload else 'no offload'}"
            records[key] = {}
            steps[key] = make_step(models, x, fp8_recipe, offload, records[key])
    seconds = time_interleaved(steps, torch.device("cuda"), args.repeats)
    d2h, h2d = copy_bandwidth(256 * MiB)
    print(f"pinned copies: device -> host {d2h / 1e9:.1f} GB/s, host -> device {h2d / 1e9:.1f} GB/s")
    print(f"{'recipe, offload':<26} {'between MiB':>12} {'peak MiB':>9} {'median ms':>10} {'/ no offload':>13} "
          f"{'floor ms':>9} {'/ floor':>8}")
    for key, (median, _) in seconds.items():
        record = records[key]
        line = (f"{key:<26} {record['between'] / MiB:>12.0f} {record['peak'] / MiB:>9.0f} {median * 1e3:>10.2f} ")
        if key.endswith(", no offload"):
            print(line + f"{1:>12.2f}x")
            continue
        base = records[key.replace(", offload", ", no offload")]
        moved = base["between"] - record["between"]
        floor_ms = (max(statistics.median(base["forward_ms"]), moved / d2h * 1e3)
                    + max(statistics.median(base["backward_ms"]), moved / h2d * 1e3))
        base_seconds = seconds[key.replace(", offload", ", no offload")][0]
        print(line + f"{median / base_seconds:>12.2f}x {floor_ms:>9.2f} {median * 1e3 / floor_ms:>7.2f}x")


if __name__ == "__main__":
    main()
