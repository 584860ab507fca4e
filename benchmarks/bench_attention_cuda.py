"""te_fuser.DotProductAttention as users call it, on each attention backend, against torch SDPA's flash and
cuDNN backends, in one run on one GPU.

For every case (pass fwd / fwd+bwd, head dim, causal or not, sequence length, layout) it times:
  te:auto      DotProductAttention with the automatic choice (the backend it picked is printed);
  te:<name>    the same module with attention_backend=<name> for each of --backends that supports the case
               (else the reason it does not);
  te:fp8       the module under fp8_dpa (Float8CurrentScaling: E4M3 q/k/v on te_fuser's FP8 kernels);
  sdpa:flash, sdpa:cudnn   F.scaled_dot_product_attention under sdpa_kernel (thd: torch's varlen flash op
               _flash_attention_forward with autograd; cuDNN has no varlen entry point there).
bf16 inputs, 16 Ki tokens per case, heads = 2048 / head dim (GQA off). bshd and sbhd are dense batches of
16 Ki / seq sequences; thd packs sequences of mixed lengths (between seq / 8 and seq, fixed seed) up to 16 Ki
tokens. Forward FLOPs = 4 h d sum(len^2) (halved when causal), fwd+bwd 3.5x that. Times are medians of
CUDA-event timings; peak memory is the allocator's peak above what was allocated before the call. The forward
runs with grad enabled, as in training (the graph is dropped after each call).

    python benchmarks/bench_attention_cuda.py [--iters 20] [--seqlens 2048,8192,16384] [--head-dims 128,64]
        [--layouts bshd,sbhd,thd] [--backends te_fuser,cudnn,flash] [--passes fwd,fwd+bwd]
"""

import argparse
import math
import statistics

import torch
import torch.nn.functional as F

import te_fuser
import te_fuser.kernels.attention

TOKENS = 16 * 1024
HIDDEN = 2048
LAYOUTS = ("bshd", "sbhd", "thd")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--seqlens", default="2048,8192,16384")
    parser.add_argument("--head-dims", default="128,64")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--backends", default="te_fuser,cudnn,flash")
    parser.add_argument("--passes", default="fwd,fwd+bwd")
    args = parser.parse_args(argv)
    args.seqlens = [int(s) for s in args.seqlens.split(",")]
    args.head_dims = [int(d) for d in args.head_dims.split(",")]
    args.layouts = args.layouts.split(",")
    args.backends = args.backends.split(",")
    args.passes = args.passes.split(",")
    for layout in args.layouts:
        if layout not in LAYOUTS:
            parser.error(f"--layouts: {layout!r} is not one of {LAYOUTS}")
    for name in args.backends:
        if name not in te_fuser.attention.backends.BACKENDS:
            parser.error(f"--backends: {name!r} is not one of {tuple(te_fuser.attention.backends.BACKENDS)}")
    for p in args.passes:
        if p not in ("fwd", "fwd+bwd"):
            parser.error(f"--passes: {p!r} is not fwd or fwd+bwd")
    return args


def thd_lengths(seqlen, tokens=TOKENS, seed=0):
    """Mixed sequence lengths between seqlen // 8 and seqlen that add up to tokens."""
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(torch.randint(max(1, seqlen // 8), seqlen + 1, (1,), generator=gen)))
    lengths[-1] -= sum(lengths) - tokens
    return [n for n in lengths if n > 0]


def case_lengths(layout, seqlen):
    """The sequence lengths of a case: TOKENS // seqlen of seqlen (bshd / sbhd) or mixed ones (thd)."""
    return thd_lengths(seqlen) if layout == "thd" else [seqlen] * (TOKENS // seqlen)


def flops(lengths, heads, head_dim, causal, backward):
    return sum(4 * heads * n * n * head_dim for n in lengths) / (2 if causal else 1) * (3.5 if backward else 1)


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


def make_inputs(layout, lengths, heads, head_dim):
    """q, k, v, dout in the user layout, and the module's forward kwargs."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    if layout == "thd":
        shape = (sum(lengths), heads, head_dim)
    else:
        batch, seq = len(lengths), lengths[0]
        shape = (batch, seq, heads, head_dim) if layout == "bshd" else (seq, batch, heads, head_dim)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    kwargs = {}
    if layout == "thd":
        cu = torch.tensor([0] + lengths, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    return (q, k, v), dout.flatten(-2), kwargs


def module_run(layout, heads, head_dim, causal, backend, qkv, dout, kwargs, backward, fp8=False):
    mask = ("padding_causal" if causal else "padding") if layout == "thd" else ("causal" if causal else "no_mask")
    module = te_fuser.DotProductAttention(heads, head_dim, qkv_format=layout, attn_mask_type=mask,
                                          attention_backend=backend)
    leaves = [t.detach().requires_grad_() for t in qkv]
    recipe = te_fuser.recipe.Float8CurrentScaling(fp8_dpa=True)

    def run():
        with te_fuser.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
            out = module(*leaves, **kwargs)
        if backward:
            out.backward(dout)
    return run


def sdpa_run(kind, layout, causal, qkv, dout, kwargs, backward):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if layout == "thd":
        if kind != "flash":
            return None
        q, k, v = (t.detach().requires_grad_(backward) for t in qkv)
        cu, max_len = kwargs["cu_seqlens_q"], kwargs["max_seqlen_q"]

        def run():
            out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0, causal, False)[0]
            if backward:
                torch.autograd.grad(out, (q, k, v), dout.view_as(out))
        return run
    # SDPA takes [B, H, S, D]: views of the same user-layout storage.
    to_bhsd = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t.permute(1, 2, 0, 3))
    q, k, v = (to_bhsd(t.detach().requires_grad_(backward)) for t in qkv)
    d = to_bhsd(dout.view_as(qkv[0]))
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[kind]

    def run():
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            if backward:
                torch.autograd.grad(out, (q, k, v), d)
    return run


def main(argv=None):
    args = parse_args(argv)
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  cuDNN {torch.backends.cudnn.version()}"
          f"  FP8 forward on FP8 tensor cores: {te_fuser.kernels.attention.fp8_tensor_cores('cuda')}")
    header = (f"{'pass':8} {'hdim':>4} {'causal':>6} {'seqlen':>6} {'layout':>6} {'impl':>14} {'ms':>9} "
              f"{'TFLOP/s':>8} {'vs best sdpa':>12} {'peak MiB':>9}")
    print(header)
    print("-" * len(header))
    for pass_name in args.passes:
        backward = pass_name == "fwd+bwd"
        for head_dim in args.head_dims:
            heads = HIDDEN // head_dim
            for causal in (False, True):
                for seqlen in args.seqlens:
                    for layout in args.layouts:
                        run_case(args, pass_name, backward, head_dim, heads, causal, seqlen, layout)


def run_case(args, pass_name, backward, head_dim, heads, causal, seqlen, layout):
    lengths = case_lengths(layout, seqlen)
    qkv, dout, kwargs = make_inputs(layout, lengths, heads, head_dim)
    kernel = [te_fuser.attention.function.to_kernel_layout(t, layout) for t in qkv[:2]]
    lengths_kw = dict(cu_seqlens_q=kwargs["cu_seqlens_q"], cu_seqlens_kv=kwargs["cu_seqlens_kv"]) if kwargs else {}
    auto = te_fuser.kernels.attention.backend_for(*kernel, causal=causal, **lengths_kw).backend
    impls = {f"te:auto={auto}": module_run(layout, heads, head_dim, causal, None, qkv, dout, kwargs, backward)}
    for name in args.backends:
        try:
            te_fuser.kernels.attention.backend_for(*kernel, causal=causal, backend=name, **lengths_kw)
        except ValueError as err:
            print(f"  te:{name}: unavailable ({str(err).split(': ', 1)[-1][:100]})")
            continue
        impls[f"te:{name}"] = module_run(layout, heads, head_dim, causal, name, qkv, dout, kwargs, backward)
    impls["te:fp8"] = module_run(layout, heads, head_dim, causal, None, qkv, dout, kwargs, backward, fp8=True)
    for kind in ("flash", "cudnn"):
        fn = sdpa_run(kind, layout, causal, qkv, dout, kwargs, backward)
        if fn is not None:
            impls[f"sdpa:{kind}"] = fn
    results = {}
    for name, fn in impls.items():
        try:
            results[name] = (median_ms(fn, args.iters), peak_mib(fn))
        except RuntimeError as err:  # a backend that does not cover this case on this device
            print(f"  {name}: failed ({str(err).splitlines()[0][:100]})")
    best_sdpa = min((ms for name, (ms, _) in results.items() if name.startswith("sdpa")), default=math.nan)
    total = flops(lengths, heads, head_dim, causal, backward)
    for name, (ms, mib) in results.items():
        print(f"{pass_name:8} {head_dim:4d} {str(causal):>6} {seqlen:6d} {layout:>6} {name:>14} {ms:9.3f} "
              f"{total / ms / 1e9:8.1f} {best_sdpa / ms:12.2f} {mib:9.1f}")
    del qkv, dout, impls
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
