"""Block-scaled recipes' Linear: te_fuser.Linear (bf16 params) forward+backward under Float8CurrentScaling,
MXFP8BlockScaling, Float8BlockScaling and NVFP4BlockScaling, and torch.nn.Linear in bf16, in one run; then,
on the CPU, where the block-scaled steps' time goes (torch.profiler, by op). On a GPU each row names the
block GEMM engine its step ran (te_fuser.kernels.gemm.last_block_gemm_engine).

    python benchmarks/bench_block_linear.py [--tokens 1024] [--features 1024] [--repeats 5] [--device cpu|cuda]

Ratios are medians measured in the same run, the steps interleaved (benchmarks/bench_linear.py's timer).
Goals of issue 31: MXFP8 <= 1.2x and NVFP4 <= 1.5x the time of te_fuser's FP8 (current scaling) Linear.
"""

import argparse
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fp8_linear import make_step, profile_rows  # noqa: E402
from bench_gpt import cpu_model  # noqa: E402
from bench_linear import time_interleaved  # noqa: E402

import te_fuser  # noqa: E402
from te_fuser import recipe  # noqa: E402
from te_fuser.kernels import cpu  # noqa: E402
from te_fuser.kernels import gemm as gemm_kernels  # noqa: E402

RECIPES = {"FP8 current": recipe.Float8CurrentScaling, "MXFP8": recipe.MXFP8BlockScaling,
           "Float8 block": recipe.Float8BlockScaling, "NVFP4": recipe.NVFP4BlockScaling}
GOALS = {"MXFP8": 1.2, "NVFP4": 1.5}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--features", type=int, default=1024, help="in = out features (a multiple of 128)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--top", type=int, default=8, help="profile rows to print per recipe")
    parser.add_argument("--profile", default="MXFP8,NVFP4",
                        help="comma-separated recipes to profile on the CPU ('' for none)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="Recipe type changed")  # one layer takes each recipe in turn
    if args.threads:
        torch.set_num_threads(args.threads)
    f = args.features
    device = torch.device(args.device)
    if device.type == "cuda":
        where = f"gpu: {torch.cuda.get_device_name(device)} | torch {torch.__version__}"
    else:
        where = (f"cpu: {cpu_model()} | te_fuser cpu isa: {cpu.current_isa()} (detected {cpu.detected_isa()}) | "
                 f"threads={torch.get_num_threads()}")
    print(f"{where} | tokens={args.tokens} {f}->{f}")

    torch.manual_seed(0)
    layer = te_fuser.Linear(f, f, params_dtype=torch.bfloat16, device=device)
    nn_bf16 = torch.nn.Linear(f, f, dtype=torch.bfloat16, device=device)
    x = torch.randn(args.tokens, f, dtype=torch.bfloat16, device=device, requires_grad=True)
    grad = torch.randn(args.tokens, f, dtype=torch.bfloat16, device=device)
    steps = {"nn.Linear bf16": make_step(nn_bf16, x, grad, torch.enable_grad)}
    engines = {}
    for name, make_recipe in RECIPES.items():
        fp8_recipe = make_recipe()
        steps[name] = make_step(layer, x, grad, lambda r=fp8_recipe: te_fuser.fp8_autocast(fp8_recipe=r))
        if device.type != "cpu" and name != "FP8 current":
            steps[name]()
            engines[name] = gemm_kernels.last_block_gemm_engine()
    seconds = time_interleaved(steps, device, args.repeats)

    fp8 = seconds["FP8 current"][0]
    bf16 = seconds["nn.Linear bf16"][0]
    print(f"{'step (fwd+bwd)':<18} {'median ms':>10} {'min ms':>9} {'/ FP8 time':>11} {'/ bf16 time':>12}")
    for name, (median, best) in seconds.items():
        goal = f"  (goal <= {GOALS[name]:.1f}x)" if name in GOALS and device.type == "cpu" else ""
        engine = f"  [{engines[name]}]" if name in engines else ""
        print(f"{name:<18} {median * 1e3:>10.2f} {best * 1e3:>9.2f} {median / fp8:>10.2f}x {median / bf16:>11.2f}x"
              f"{goal}{engine}")

    for name in filter(None, args.profile.split(",") if device.type == "cpu" else []):
        total, rows = profile_rows(steps[name], args.top)
        print(f"\nwhere the time of '{name}' goes (self CPU time, one step, {total / 1e3:.1f} ms in all):")
        for key, count, us in rows:
            print(f"  {key:<44} x{count:<3} {us / 1e3:>9.2f} ms {100 * us / total:>6.1f}%")


if __name__ == "__main__":
    main()
