"""Throughput of te_fuser's CUDA attention against torch SDPA (flash and cuDNN backends), same run.

te_fuser runs bf16 inputs, and ("te_fp8") the same inputs quantized to float8_e4m3fn with
per-tensor scales (bf16 output), as fp8_dpa does; bf16 for SDPA. Head dims 128 and 64, causal and not, sequence lengths 2k / 8k / 16k with batch * seqlen = 16k
tokens and heads = 2048 / head_dim. Forward FLOPs = 4 * b * h * s^2 * d (halved when causal); the
backward counts 2.5x the forward, so fwd+bwd = 3.5x. Times are medians of CUDA-event timings; peak
memory is the allocator's peak above what was allocated before the call.

    python benchmarks/bench_attention_cuda.py [--iters 20]
"""

import argparse
import math
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import te_fuser
import te_fuser.kernels.attention

TOKENS = 16 * 1024
HIDDEN = 2048


def median_ms(fn, iters, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_mib(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def ours(q, k, v, dout, causal, backward):
    scale = 1.0 / math.sqrt(q.shape[-1])

    def run():
        out, lse = torch.ops.te_fuser.attention_fwd(q, k, v, None, None, None, None, scale, causal, 0.0, 0, 0,
                                                    None, None, None, None)
        if backward:
            torch.ops.te_fuser.attention_bwd(dout, q, k, v, out, lse, None, None, None, None, scale, causal,
                                             0.0, 0, 0, None, None, None)

    return run


def ours_fp8(q, k, v, dout, causal, backward):
    """The same problem on e4m3 copies of q, k, v (amax-scaled per tensor), output in bf16."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    quantized, descales = [], []
    for t in (q, k, v):
        descale = (t.abs().amax().float() / torch.finfo(torch.float8_e4m3fn).max).reshape(1)
        quantized.append((t.float() / descale).to(torch.float8_e4m3fn))
        descales.append(descale)

    def run():
        out, lse = torch.ops.te_fuser.attention_fwd(*quantized, None, None, None, None, scale, causal, 0.0, 0, 0,
                                                    *descales, torch.bfloat16)
        if backward:
            torch.ops.te_fuser.attention_bwd(dout, *quantized, out, lse, None, None, None, None, scale, causal,
                                             0.0, 0, 0, *descales)

    return run


def sdpa(backend, q, k, v, dout, causal, backward):
    # SDPA takes [B, H, S, D]: transposed views of the same [B, S, H, D] storage.
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_(backward) for t in (q, k, v))
    dt = dout.transpose(1, 2)

    def run():
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            if backward:
                torch.autograd.grad(out, (qt, kt, vt), dt)

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  FP8 forward on FP8 tensor cores: "
          f"{te_fuser.kernels.attention.fp8_tensor_cores('cuda')}")
    header = f"{'pass':8} {'hdim':>4} {'causal':>6} {'seqlen':>6} {'impl':>10} {'ms':>9} {'TFLOP/s':>8} {'vs flash':>8} {'peak MiB':>9}"
    print(header)
    print("-" * len(header))
    for backward in (False, True):
        for head_dim in (128, 64):
            for causal in (False, True):
                for seqlen in (2048, 8192, 16384):
                    b, h = TOKENS // seqlen, HIDDEN // head_dim
                    gen = torch.Generator(device="cuda").manual_seed(0)
                    q, k, v, dout = (torch.randn(b, seqlen, h, head_dim, device="cuda", dtype=torch.bfloat16,
                                                 generator=gen) for _ in range(4))
                    flops = 4 * b * h * seqlen * seqlen * head_dim / (2 if causal else 1) * (3.5 if backward else 1)
                    impls = {
                        "te_fuser": ours(q, k, v, dout, causal, backward),
                        "te_fp8": ours_fp8(q, k, v, dout, causal, backward),
                        "flash": sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, dout, causal, backward),
                        "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, dout, causal, backward),
                    }
                    results = {}
                    for name, fn in impls.items():
                        try:
                            results[name] = (median_ms(fn, args.iters), peak_mib(fn))
                        except RuntimeError as err:  # a backend that does not cover this case
                            print(f"  {name}: unavailable ({str(err).splitlines()[0][:80]})")
                    flash_ms = results.get("flash", (math.nan,))[0]
                    for name, (ms, mib) in results.items():
                        print(f"{'fwd+bwd' if backward else 'fwd':8} {head_dim:4d} {str(causal):>6} {seqlen:6d} {name:>10} "
                              f"{ms:9.3f} {flops / ms / 1e9:8.1f} {flash_ms / ms:8.2f} {mib:9.1f}")
                    del q, k, v, dout, impls
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
