"""te_fuser's CPU FP8 GEMM against torch's matmul of the same values, in one run.

    python benchmarks/bench_fp8_gemm.py [--m 2048 --n 2048 --k 2048] [--threads N] [--repeats 7]
        [--isa portable,avx2,...] [--no-bf16]

te_fuser::fp8_gemm computes (a * sa) @ (b * sb).T for E4M3 a (M, K) and b (N, K), bf16 out, on every
CPU path given (default: the best this machine has). Baselines, timed in turn with it: torch.mm of
the decoded operands in float32 (what a user without bf16 hardware would run) and in bfloat16
(--no-bf16 leaves that row out: on a CPU without bf16 arithmetic one 2048³ bf16 mm takes ~20 s).
Speedup = baseline time / fp8_gemm time (medians, steps interleaved: bench_linear.py's timer).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_linear import time_interleaved  # noqa: E402

from te_fuser.kernels import cpu  # noqa: E402
from te_fuser.kernels.gemm import fp8_gemm  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=2048)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--isa", default=None, help="comma-separated CPU paths (default: the best one)")
    parser.add_argument("--no-bf16", action="store_true", help="leave out the torch.mm bf16 row")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    isas = args.isa.split(",") if args.isa else [cpu.available_isa()[-1]]

    gen = torch.Generator().manual_seed(0)
    a = (torch.randn(args.m, args.k, generator=gen) * 4).to(torch.float8_e4m3fn)
    b = (torch.randn(args.n, args.k, generator=gen) * 4).to(torch.float8_e4m3fn)
    sa, sb = torch.tensor(0.5), torch.tensor(0.25)
    a32, b32 = a.float() * sa, b.float() * sb
    a16, b16 = a32.bfloat16(), b32.bfloat16()

    def on_isa(name):
        def step():
            with cpu.isa(name):
                fp8_gemm(a, sa, b, sb, torch.bfloat16)
        return step

    steps = {f"te_fuser fp8_gemm [{name}]": on_isa(name) for name in isas}
    steps["torch.mm fp32"] = lambda: torch.mm(a32, b32.t())
    if not args.no_bf16:
        steps["torch.mm bf16"] = lambda: torch.mm(a16, b16.t())
    times = time_interleaved(steps, torch.device("cpu"), args.repeats, warmup=2)

    flops = 2 * args.m * args.n * args.k
    print(f"m={args.m} n={args.n} k={args.k} threads={torch.get_num_threads()} "
          f"cpu isa: detected={cpu.available_isa()[-1]}")
    print(f"{'row':28} {'median ms':>10} {'min ms':>9} {'GFLOP/s':>8} {'fp32 mm / row':>14} {'bf16 mm / row':>14}")
    fp32, bf16 = times["torch.mm fp32"][0], times.get("torch.mm bf16", (None,))[0]
    for name, (median, fastest) in times.items():
        vs_bf16 = f"{bf16 / median:13.2f}x" if bf16 else f"{'-':>14}"
        print(f"{name:28} {median * 1e3:10.1f} {fastest * 1e3:9.1f} {flops / median / 1e9:8.1f} "
              f"{fp32 / median:13.2f}x {vs_bf16}")


if __name__ == "__main__":
    main()
