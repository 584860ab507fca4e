"""Fused quantize+amax against the torch path a user would write, in one run.

    python benchmarks/bench_quantize.py [--numel N] [--device cpu|cuda]

The torch path is `amax = x.abs().amax()` then `(x * scale).clamp(-m, m).to(fp8)`.
Bandwidth counts bytes read plus bytes written once (input + FP8 output);
x.clone() bandwidth of the same input is printed as the memory ceiling, and on
CUDA the fraction of a device-to-device copy of the same bytes.
"""

import argparse
import statistics
import time

import torch

from te_fuser.kernels import fp8 as k


def timed(fn, device, repeats):
    """Median seconds of fn() over `repeats` runs, after a warm-up."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def torch_path(x, scale):
    amax = x.abs().amax()
    return (x * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), amax


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=16 * 2**20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"device={device} numel={args.numel} threads={torch.get_num_threads()}")
    print(f"{'dtype':>9} {'te_fuser GB/s':>14} {'torch GB/s':>11} {'clone GB/s':>11} {'speedup':>8} {'of clone':>9}")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(args.numel, device=device).to(dtype)
        scale = torch.tensor([2.0], device=device)
        amax = torch.zeros(1, device=device)
        # Same answer from both paths before timing anything.
        ours = k.quantize(x, scale, amax, torch.float8_e4m3fn)
        ref, ref_amax = torch_path(x, scale)
        assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8)) and amax.item() == ref_amax.item()
        t_ours = timed(lambda: k.quantize(x, scale, amax, torch.float8_e4m3fn), device, args.repeats)
        t_torch = timed(lambda: torch_path(x, scale), device, args.repeats)
        t_clone = timed(lambda: x.clone(), device, args.repeats)
        moved = x.numel() * (x.element_size() + 1)
        clone_moved = 2 * x.numel() * x.element_size()
        gbs, clone_gbs = moved / t_ours / 1e9, clone_moved / t_clone / 1e9
        print(f"{str(dtype).split('.')[-1]:>9} {gbs:14.1f} {moved / t_torch / 1e9:11.1f} {clone_gbs:11.1f} "
              f"{t_torch / t_ours:7.2f}x {gbs / clone_gbs:8.0%}")


if __name__ == "__main__":
    main()
