"""get_cpu_offload_context on a GPU: the device bytes held between forward and backward, the step's peak and its
time, with the first layers' activations offloaded to pinned host memory and without, in one run.

    python benchmarks/bench_cpu_offload.py [--layers 8] [--tokens 8192] [--hidden 4096] [--module linear|layer]

All but the last layer are offloaded (TE's num_layers = layers - 1). Bytes are torch.cuda's allocator
statistics above the level at the start of the step; times are medians of interleaved steps.
"""

import argparse
import os
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
        h = x
        for model in models:
            with te_fuser.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe), context:
                h = model(h)
            h = sync(h)
        torch.cuda.synchronize()
        between = torch.cuda.memory_allocated() - start
        h.backward(torch.ones_like(h))
        torch.cuda.synchronize()
        record.update(between=between, peak=torch.cuda.max_memory_allocated() - start)
        for model in models:
            model.zero_grad(set_to_none=True)
    return step


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
    print(f"{'recipe, offload':<26} {'between MiB':>12} {'peak MiB':>9} {'median ms':>10} {'/ no offload':>13}")
    for key, (median, _) in seconds.items():
        base = key.replace(", offload", ", no offload")
        print(f"{key:<26} {records[key]['between'] / MiB:>12.0f} {records[key]['peak'] / MiB:>9.0f} "
              f"{median * 1e3:>10.2f} {median / seconds[base][0]:>12.2f}x")


if __name__ == "__main__":
    main()
