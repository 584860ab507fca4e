"""FP8 Linear on the CPU: te_fuser.Linear under fp8_autocast (bf16 params) against torch.nn.Linear
in bf16 and te_fuser.Linear in float32, forward+backward, in one run; then where the FP8 step's time
goes (torch.profiler, by op).

    python benchmarks/bench_fp8_linear.py [--tokens 2048] [--features 2048] [--repeats 5]

Rows: nn.Linear bf16 (the goal's baseline), te_fuser.Linear fp32 (the fp32 path), and
te_fuser.Linear FP8 on the best CPU path (--all-isa: once per path, te_fuser.kernels.cpu.isa). Ratios are
medians measured in the same run, the steps interleaved (benchmarks/bench_linear.py's timer).
Goals of issue 14: FP8 >= 0.8x nn.Linear bf16 and >= 3x te_fuser fp32.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_linear import time_interleaved  # noqa: E402

import te_fuser  # noqa: E402
from te_fuser import recipe  # noqa: E402
from te_fuser.kernels import cpu  # noqa: E402


def make_step(layer, x, grad, context):
    def step():
        with context():
            out = layer(x)
        out.backward(grad)
        layer.zero_grad(set_to_none=True)
        x.grad = None
    return step


def profile_rows(step, top):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return total, [(e.key, e.count, e.self_cpu_time_total) for e in events[:top]]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--features", type=int, default=2048, help="in = out features")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--top", type=int, default=10, help="profile rows to print")
    parser.add_argument("--all-isa", action="store_true", help="an FP8 row for every CPU path, not only the best")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    f = args.features
    print(f"tokens={args.tokens} {f}->{f} threads={torch.get_num_threads()} "
          f"cpu isa: detected={cpu.detected_isa()} available={cpu.available_isa()}")

    torch.manual_seed(0)
    fp8 = lambda: te_fuser.fp8_autocast(fp8_recipe=recipe.DelayedScaling())  # noqa: E731
    plain = torch.enable_grad
    nn_bf16 = torch.nn.Linear(f, f, dtype=torch.bfloat16)
    ours_bf16 = te_fuser.Linear(f, f, params_dtype=torch.bfloat16, device="cpu")
    ours_f32 = te_fuser.Linear(f, f, params_dtype=torch.float32, device="cpu")
    x16 = torch.randn(args.tokens, f, dtype=torch.bfloat16, requires_grad=True)
    g16 = torch.randn(args.tokens, f, dtype=torch.bfloat16)
    x32 = x16.detach().float().requires_grad_()
    g32 = g16.float()

    steps = {"nn.Linear bf16": make_step(nn_bf16, x16, g16, plain),
             "te_fuser fp32": make_step(ours_f32, x32, g32, plain)}
    fp8_rows = []
    isas = list(reversed(cpu.available_isa()))
    for name in isas if args.all_isa else isas[:1]:
        inner = make_step(ours_bf16, x16, g16, fp8)

        def step(inner=inner, name=name):
            with cpu.isa(name):
                inner()
        row = f"te_fuser FP8 [{name}]"
        steps[row] = step
        fp8_rows.append((row, name))
    seconds = time_interleaved(steps, torch.device("cpu"), args.repeats)

    base_bf16 = seconds["nn.Linear bf16"][0]
    base_f32 = seconds["te_fuser fp32"][0]
    print(f"{'step (fwd+bwd)':<28} {'median ms':>10} {'min ms':>9} {'vs nn bf16':>11} {'vs te fp32':>11}")
    for name, (median, best) in seconds.items():
        print(f"{name:<28} {median * 1e3:>10.1f} {best * 1e3:>9.1f} {base_bf16 / median:>10.2f}x "
              f"{base_f32 / median:>10.2f}x")
    print("goals: FP8 >= 0.80x nn.Linear bf16, >= 3.00x te_fuser fp32")

    row, name = fp8_rows[0]
    total, rows = profile_rows(steps[row], args.top)
    print(f"\nwhere the time of '{row}' goes (self CPU time, one step, {total / 1e3:.1f} ms in all):")
    for key, count, us in rows:
        print(f"  {key:<44} x{count:<3} {us / 1e3:>9.2f} ms {100 * us / total:>6.1f}%")


if __name__ == "__main__":
    main()
