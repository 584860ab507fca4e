"""Fused attention against torch scaled_dot_product_attention, in one run.

    python benchmarks/bench_attention.py [--batch B --heads H --seq S --dim D --dtype float32 --no-causal]
        [--fp8-dpa] [--isa portable|avx2|avx512|avx512_bf16|amx] [--backends auto,te_fuser,cpu_flash]

Each of --backends is te_fuser.DotProductAttention (bshd) as users call it, with that attention_backend
("auto": the one the selection picks, named in the output). --fp8-dpa runs them under an FP8 recipe with
fp8_dpa (q/k/v quantized to E4M3, te_fuser's kernels decode them; bf16 inputs by default) against SDPA in
the input dtype. --isa caps te_fuser's CPU kernels at a tier (te_fuser.kernels.cpu.set_isa), to compare
the paths on one machine.

Times forward and forward+backward (median of interleaved runs, so both sides
see the same machine load), TFLOP/s with forward = 4 b h s^2 d (halved when
causal) and backward = 2.5 x forward, and the peak memory allocated above the
inputs during the call (te_fuser.memory.MemoryTracker on CPU and CUDA). On CUDA,
SDPA's flash and cuDNN backends are timed separately.
"""

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F

import te_fuser
from te_fuser.memory import MemoryTracker

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_interleaved(fns, device, repeats):
    """Median seconds of each fn, running them in turn `repeats` times after a warm-up."""
    for fn in fns.values():
        fn()
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) for name, s in samples.items()}


def memory_bytes(fn, device):
    """Peak bytes allocated during fn above the level at its start (te_fuser.memory.MemoryTracker)."""
    with MemoryTracker(device=device) as mem:
        fn()
    return mem.peak_bytes


def sdpa_backend(name):
    if name == "sdpa":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[name])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--fp8-dpa", dest="fp8_dpa", action="store_true")
    parser.add_argument("--isa", default=None)
    parser.add_argument("--backends", default="auto",
                        help="comma-separated attention_backend values, 'auto' for the automatic choice")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" or args.fp8_dpa else "float32")]
    if args.isa is not None:
        te_fuser.kernels.cpu.set_isa(args.isa)
    b, h, s, d = args.batch, args.heads, args.seq, args.dim
    scale = d ** -0.5
    fwd_flops = 4 * b * h * s * s * d / (2 if args.causal else 1)
    print(f"device={device} threads={torch.get_num_threads()} b={b} h={h} s={s} d={d} dtype={dtype} "
          f"causal={args.causal} fp8_dpa={args.fp8_dpa}"
          + (f" cpu_isa={te_fuser.kernels.cpu.current_isa()}" if device.type == "cpu" else ""))

    # Each side in its preferred dense layout: te_fuser bshd, SDPA bhsd.
    ours_in = [torch.randn(b, s, h, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]
    sdpa_in = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in ours_in]
    dout = torch.randn(b, s, h, d, device=device, dtype=dtype)
    dout_sdpa = dout.transpose(1, 2).contiguous()

    recipe = te_fuser.recipe.Float8CurrentScaling(fp8_dpa=True)
    mask = "causal" if args.causal else "no_mask"

    def ours_fns(backend):
        module = te_fuser.DotProductAttention(h, d, qkv_format="bshd", attn_mask_type=mask, softmax_scale=scale,
                                              attention_backend=None if backend == "auto" else backend)

        def fwd():
            with torch.no_grad(), te_fuser.fp8_autocast(enabled=args.fp8_dpa, fp8_recipe=recipe):
                return module(*ours_in).view(b, s, h, d)

        def fwd_bwd():
            with te_fuser.fp8_autocast(enabled=args.fp8_dpa, fp8_recipe=recipe):
                out = module(*ours_in)
            out.backward(dout.view(b, s, h * d))
        return fwd, fwd_bwd

    ours = {}
    for backend in args.backends.split(","):
        choice = te_fuser.kernels.attention.backend_for(
            *(t.detach() for t in ours_in), causal=args.causal, softmax_scale=scale,
            backend=None if backend == "auto" else backend)
        ours[f"te_fuser/{choice.backend}" if backend == "auto" else f"te_fuser/{backend}"] = ours_fns(backend)

    def sdpa_fns(backend):
        def fwd():
            with torch.no_grad(), sdpa_backend(backend):
                return F.scaled_dot_product_attention(*sdpa_in, is_causal=args.causal, scale=scale)

        def fwd_bwd():
            with sdpa_backend(backend):
                F.scaled_dot_product_attention(*sdpa_in, is_causal=args.causal, scale=scale).backward(dout_sdpa)
        return fwd, fwd_bwd

    # Same answer before timing anything; under fp8_dpa against SDPA on the E4M3-rounded q, k, v that
    # te_fuser's kernels see (a row that sees one key is that key's v, 3 mantissa bits off the input's).
    ref_in = sdpa_in
    if args.fp8_dpa:
        quantizer = te_fuser.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
        ref_in = [quantizer(t.detach()).dequantize(torch.float32) for t in sdpa_in]
    with torch.no_grad():
        ref = F.scaled_dot_product_attention(*ref_in, is_causal=args.causal, scale=scale).transpose(1, 2)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for fwd, _ in ours.values():
        torch.testing.assert_close(fwd().float(), ref.float(), atol=tol, rtol=tol)

    backends = ["sdpa"] + (["sdpa_flash", "sdpa_cudnn"] if device.type == "cuda" else [])
    fwd_fns = {name: fns[0] for name, fns in ours.items()}
    fb_fns = {name: fns[1] for name, fns in ours.items()}
    first = next(iter(ours))
    for name in backends:
        try:
            fwd, fwd_bwd = sdpa_fns(name)
            fwd_bwd()
            fwd_fns[name], fb_fns[name] = fwd, fwd_bwd
        except RuntimeError as err:  # a backend this GPU/dtype does not support
            print(f"{name}: unavailable ({str(err).splitlines()[0]})")
    t_fwd = timed_interleaved(fwd_fns, device, args.repeats)
    t_fb = timed_interleaved(fb_fns, device, args.repeats)

    print(f"{'impl':>18} {'fwd ms':>8} {'fwd TFLOP/s':>12} {'fwd mem MiB':>12} {'fwd+bwd ms':>11} "
          f"{'fwd+bwd TFLOP/s':>16} {'fwd+bwd mem MiB':>16} {'fwd speedup':>12} {'fwd+bwd speedup':>16}")
    for name in fwd_fns:
        for t in ours_in + sdpa_in:
            t.grad = None
        mem_f, mem_fb = memory_bytes(fwd_fns[name], device), memory_bytes(fb_fns[name], device)
        print(f"{name:>18} {t_fwd[name] * 1e3:8.2f} {fwd_flops / t_fwd[name] / 1e12:12.3f} {mem_f / 2**20:12.1f} "
              f"{t_fb[name] * 1e3:11.2f} {3.5 * fwd_flops / t_fb[name] / 1e12:16.3f} {mem_fb / 2**20:16.1f} "
              f"{t_fwd[name] / t_fwd[first]:11.2f}x {t_fb[name] / t_fb[first]:15.2f}x")
    print(f"speedup = that implementation's time / {first}'s time (> 1: {first} is faster)")


if __name__ == "__main__":
    main()
