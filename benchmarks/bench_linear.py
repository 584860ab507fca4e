"""te_fuser.Linear against torch.nn.Linear: forward+backward time and peak memory, in one run.

    python benchmarks/bench_linear.py [--tokens N] [--in-features K] [--out-features N] [--device cpu|cuda]

Rows: torch.nn.Linear and te_fuser.Linear in the parameter dtype, then te_fuser.Linear
under fp8_autocast (delayed scaling). On the CPU the FP8 GEMM is te_fuser's own
(te_fuser.kernels.gemm, on the best CPU path); on CUDA it is torch._scaled_mm.
Peak memory: te_fuser.memory.MemoryTracker (CUDA allocator statistics, CPU allocation events)
(bytes allocated above the level at the start of the step). "saved" is what autograd
holds between forward and backward (the activation memory of the layer).
"""

import argparse
import statistics
import time

import torch

import te_fuser
from te_fuser import recipe
from te_fuser.memory import MemoryTracker


def time_interleaved(steps, device, repeats, warmup=3):
    """(median, min) seconds per step, after `warmup` untimed calls of each; the steps take turns,
    in alternating order, so machine noise and cache state hit them alike."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for step in steps.values():
        for _ in range(warmup):
            step()
    samples = {name: [] for name in steps}
    for r in range(repeats):
        order = list(steps.items())
        for name, step in order if r % 2 == 0 else order[::-1]:  # no step always runs first
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            samples[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(v), min(v)) for name, v in samples.items()}


def peak_bytes(fn, device):
    """Peak bytes allocated during fn above the level at its start (te_fuser.memory.MemoryTracker)."""
    with MemoryTracker(device=device) as mem:
        fn()
    return mem.peak_bytes


def saved_bytes(layer, x, context):
    """Bytes of the tensors autograd keeps for backward (distinct storages)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), context():
        out = layer(x)
    out.sum().backward()
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--in-features", type=int, default=1024)
    parser.add_argument("--out-features", type=int, default=1024)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: float32 on CPU, bf16 on CUDA)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    print(f"device={device} dtype={dtype} tokens={args.tokens} {args.in_features}->{args.out_features} "
          f"threads={torch.get_num_threads()}")

    torch.manual_seed(0)
    reference = torch.nn.Linear(args.in_features, args.out_features, device=device, dtype=dtype)
    ours = te_fuser.Linear(args.in_features, args.out_features, params_dtype=dtype, device=device)
    ours.load_state_dict({**reference.state_dict(), "_extra_state": None})
    x = torch.randn(args.tokens, args.in_features, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(args.tokens, args.out_features, device=device, dtype=dtype)

    plain = torch.enable_grad
    fp8 = lambda: te_fuser.fp8_autocast(fp8_recipe=recipe.DelayedScaling())  # noqa: E731
    rows = [("torch.nn.Linear", reference, plain), ("te_fuser.Linear", ours, plain),
            ("te_fuser.Linear FP8", ours, fp8)]
    # Same answer before timing anything.
    torch.testing.assert_close(ours(x), reference(x))

    steps = {}
    for name, layer, context in rows:
        def step(layer=layer, context=context):
            with context():
                out = layer(x)
            out.backward(grad)
        steps[name] = step
    seconds = time_interleaved(steps, device, args.repeats)
    results = {}
    for name, layer, context in rows:
        results[name] = (seconds[name], peak_bytes(steps[name], device), saved_bytes(layer, x, context))
        layer.zero_grad(set_to_none=True)
        x.grad = None

    base_median, base_min = results["torch.nn.Linear"][0]
    print(f"{'layer':<22} {'median ms':>10} {'min ms':>9} {'vs nn (median)':>15} {'vs nn (min)':>12} "
          f"{'peak MiB':>9} {'saved MiB':>10}")
    for name, ((median, best), peak, saved) in results.items():
        print(f"{name:<22} {median * 1e3:>10.3f} {best * 1e3:>9.3f} {base_median / median:>14.3f}x "
              f"{base_min / best:>11.3f}x {peak / 2**20:>9.2f} {saved / 2**20:>10.2f}")
    if device.type == "cpu":
        print("(CPU FP8 row: te_fuser's FP8 GEMM on the best CPU path; see bench_fp8_linear.py)")


if __name__ == "__main__":
    main()
