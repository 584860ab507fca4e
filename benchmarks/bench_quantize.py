"""FP8 quantize+amax, cast-transpose, dequantize and the FP8 byte transpose against the memory ceiling
(x.clone()) and the torch path, in one run.

    python benchmarks/bench_quantize.py [--numel N] [--device cpu|cuda] [--isa portable,avx2,...] [--heap]

Bandwidth counts bytes read plus bytes written once: quantize reads x and writes one byte per
element; cast-transpose reads x and writes two (the FP8 matrix and its transpose); dequantize
reads one byte and writes x's dtype; transpose (CPU only) reads and writes one byte; x.clone()
reads and writes x. "of clone" is te_fuser's bandwidth over x.clone()'s, measured in the same
run. On the CPU every instruction-set path that this machine has is measured (te_fuser.kernels.cpu
caps the tier; the FP8 quantizer has a portable, an AVX2 and an AVX-512 path; the byte transpose an
AVX-512 one and, below it, SSE2's).

The torch path is `amax = x.abs().amax()` then `(x * scale).clamp(-m, m).to(fp8)`, and for
cast-transpose also `.t().contiguous()` of the FP8 matrix; for dequantize `(data.float() * scale_inv)
.to(dtype)`, and for transpose `data.view(torch.uint8).t().contiguous()`. Times are medians over --repeats
runs in which every variant takes its turn (alternating order), so that machine noise hits
them alike. Cast-transpose views x as a square matrix (4096 x 4096 for 16 Mi elements).

Every variant allocates its outputs, but not alike: glibc serves a block above its mmap threshold
(at most 32 MiB) with fresh pages that fault on first touch, and smaller ones from its heap, so by
default x.clone() of a float32 x (64 MiB) pays page faults that the 16 MiB FP8 outputs do not.
--heap re-runs the script with glibc told to keep every block on its heap (MALLOC_MMAP_THRESHOLD_,
MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_), so that no variant faults and clone is pure copy bandwidth.
"""

import argparse
import contextlib
import math
import os
import statistics
import sys
import time

import torch

from te_fuser.kernels import cpu
from te_fuser.kernels import fp8 as k

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# glibc: serve every block from the heap and never give its top back to the OS.
HEAP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**31),
            "MALLOC_TOP_PAD_": str(2**30)}


def time_interleaved(steps, device, repeats):
    """Median seconds per call of each step; the steps take turns, in alternating order."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for step in steps.values():
        for _ in range(3):
            step()
    samples = {name: [] for name in steps}
    order = list(steps.items())
    for r in range(repeats):
        for name, step in order if r % 2 == 0 else order[::-1]:
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) for name, s in samples.items()}


def torch_quantize(x, scale):
    amax = x.abs().amax()
    return (x * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), amax


def torch_cast_transpose(x, scale):
    data, amax = torch_quantize(x, scale)
    return data, data.t().contiguous(), amax


def torch_dequantize(data, scale_inv, dtype):
    return (data.float() * scale_inv).to(dtype)


def torch_transpose(data):
    return data.view(torch.uint8).t().contiguous()


def check_same_answer(x, scale):
    """te_fuser and the torch path agree bit for bit before anything is timed."""
    amax = torch.zeros(1, device=x.device)
    ours = k.quantize(x, scale, amax, FP8)
    ref, ref_amax = torch_quantize(x, scale)
    assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8)) and amax.item() == ref_amax.item()
    amax.zero_()
    data, data_t = k.cast_transpose(x, scale, amax, FP8)
    ref, ref_t, _ = torch_cast_transpose(x, scale)
    assert torch.equal(data.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(data_t.view(torch.uint8), ref_t.view(torch.uint8)) and amax.item() == ref_amax.item()
    scale_inv = scale.reciprocal()
    assert torch.equal(k.dequantize(data, scale_inv, x.dtype).view(torch.uint8),
                       torch_dequantize(data, scale_inv, x.dtype).view(torch.uint8))
    if x.device.type == "cpu":
        assert torch.equal(k.transpose(data).view(torch.uint8), torch_transpose(data))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=16 * 2**20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--isa", default=None,
                        help="comma-separated CPU tiers to measure (default: the quantizer's paths this CPU has)")
    parser.add_argument("--heap", action="store_true",
                        help="keep every allocation on glibc's heap, so that no variant pays page faults")
    args = parser.parse_args()
    if args.heap and HEAP_ENV.items() - os.environ.items():
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **HEAP_ENV})
    device = torch.device(args.device)
    side = math.isqrt(args.numel)
    if side * side != args.numel:
        parser.error("--numel must be a perfect square (cast-transpose uses a square matrix)")
    if device.type == "cpu":
        paths = args.isa.split(",") if args.isa else [t for t in ("portable", "avx2", "avx512") if t in cpu.available_isa()]
    else:
        paths = [None]
    print(f"device={device} numel={args.numel} threads={torch.get_num_threads()} repeats={args.repeats}"
          + (" allocations=heap" if args.heap else "")
          + (f" cpu_tier_detected={cpu.detected_isa()}" if device.type == "cpu" else ""))
    print(f"{'op':>14} {'dtype':>9} {'path':>9} {'te_fuser GB/s':>14} {'clone GB/s':>11} {'of clone':>9} "
          f"{'torch GB/s':>11} {'vs torch':>9}")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(side, side, device=device).to(dtype)
        scale = torch.tensor([2.0], device=device)
        amax = torch.zeros(1, device=device)
        data, scale_inv = k.quantize(x, scale, amax, FP8), scale.reciprocal()
        steps = {"clone": lambda: x.clone(),
                 "torch quantize": lambda: torch_quantize(x, scale),
                 "torch cast_transpose": lambda: torch_cast_transpose(x, scale),
                 "torch dequantize": lambda: torch_dequantize(data, scale_inv, dtype)}
        for path in paths:
            with cpu.isa(path) if path else contextlib.nullcontext():
                check_same_answer(x, scale)
            steps[f"quantize {path}"] = _under(path, lambda: k.quantize(x, scale, amax, FP8))
            steps[f"cast_transpose {path}"] = _under(path, lambda: k.cast_transpose(x, scale, amax, FP8))
            steps[f"dequantize {path}"] = _under(path, lambda: k.dequantize(data, scale_inv, dtype))
        ops = [("quantize", paths, 1), ("cast_transpose", paths, 2), ("dequantize", paths, 1)]
        if device.type == "cpu" and dtype == torch.float32:  # bytes in, bytes out: once is enough
            steps["torch transpose"] = lambda: torch_transpose(data)
            for path in paths:
                steps[f"transpose {path}"] = _under(path, lambda: k.transpose(data))
            ops.append(("transpose", paths, 1))
        t = time_interleaved(steps, device, args.repeats)
        n, size = x.numel(), x.element_size()
        clone_gbs = 2 * n * size / t["clone"] / 1e9
        for op, op_paths, fp8_bytes in ops:
            # quantize and cast-transpose read x and write FP8 bytes; dequantize the other way round
            moved = n * (1 + fp8_bytes) if op == "transpose" else n * (size + fp8_bytes)
            torch_gbs = moved / t[f"torch {op}"] / 1e9
            label = "e4m3" if op == "transpose" else str(dtype).split(".")[-1]
            for path in op_paths:
                gbs = moved / t[f"{op} {path}"] / 1e9
                print(f"{op:>14} {label:>9} {path or '-':>9} {gbs:14.2f} {clone_gbs:11.2f} "
                      f"{gbs / clone_gbs:9.0%} {torch_gbs:11.2f} {gbs / torch_gbs:8.1f}x")


def _under(path, fn):
    """fn run with the CPU tier capped at `path` (None: as it is)."""
    if path is None:
        return fn

    def step():
        with cpu.isa(path):
            fn()
    return step


if __name__ == "__main__":
    main()
