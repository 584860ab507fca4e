"""A Llama-3-8B transformer layer's training step: te_fuser against plain PyTorch (and torchao), one run.

    python benchmarks/bench_layer_step.py [--device cuda] [--batch 1] [--seq 4096] [--iters 10]
        [--recipes none,delayed,current] [--compile] [--torchao] [--graphed] [--smoke]

The layer (Llama-3-8B's shapes by default): hidden 4096, 32 heads in 8 KV groups (head dim 128), SwiGLU
FFN of 14336, RMSNorm before each block, RoPE on q and k, causal attention, no biases, no dropout, bf16
parameters, [b, s, h] activations. One step = forward, a loss, backward; the optimizer step is not timed.

Rows, all from the same weights:
  plain PyTorch       PlainLlamaLayer below: nn.RMSNorm, nn.Linear, F.scaled_dot_product_attention (its own
                      choice of backend: cuDNN or FlashAttention on an H100), F.silu
  te_fuser            te_fuser.TransformerLayer(normalization="RMSNorm", activation="swiglu", num_gqa_groups=8)
  te_fuser FP8 ...    the same under te_fuser.autocast with DelayedScaling / Float8CurrentScaling
  torchao float8      plain PyTorch through torchao.float8.convert_to_float8_training (tensorwise) and
                      torch.compile, when torchao imports (it is not a te_fuser dependency)
  ... compiled        with --compile, the te_fuser rows under torch.compile too
  ... graphed         with --graphed, the te_fuser rows on a copy of the layer made by
                      te_fuser.make_graphed_callables (CUDA graphs of forward and backward; on the CPU the
                      callable runs eagerly). Their peak leaves out the graphs' pool, allocated at capture.

Before timing, the te_fuser layer's loss and input gradient are compared with the plain layer's (the same
model: both must agree to bf16 rounding), and after a step te_fuser's audit checks that no autograd ctx
still holds a tensor. Each row prints its median step time, its speedup over plain PyTorch bf16, and on a
GPU its peak memory over the step and that peak's ratio to plain PyTorch's.
--smoke runs a tiny layer on the CPU (the script's own check; no figures from it mean anything).
"""

import argparse
import contextlib
import copy
import sys
import os

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_linear import time_interleaved  # noqa: E402

import te_fuser  # noqa: E402
from te_fuser.memory import MemoryTracker, audit_autograd  # noqa: E402
from te_fuser.quantization import recipe_state_tensors  # noqa: E402
from te_fuser.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402

SMOKE = dict(hidden=128, heads=4, groups=2, ffn=320, seq=32, batch=2, iters=2, warmup=1)
RECIPES = {"delayed": DelayedScaling, "current": Float8CurrentScaling}


def rope_angles(seq: int, head_dim: int, device, base: float = 500000.0) -> torch.Tensor:
    """Llama's rotary angles, [s, 1, 1, head_dim] (TE's layout: each frequency twice, halves not interleaved)."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32, device=device), inv_freq)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]


def apply_rope(t: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """t [b, s, heads, d] rotated by angles [s, 1, 1, d]: t cos + rotate_half(t) sin."""
    cos, sin = (f(angles).transpose(0, 1).to(t.dtype) for f in (torch.cos, torch.sin))
    t1, t2 = t.chunk(2, dim=-1)
    return t * cos + torch.cat((-t2, t1), dim=-1) * sin


class PlainLlamaLayer(nn.Module):
    """The same layer in torch.nn, with te_fuser's layer's weights copied in."""

    def __init__(self, te_layer, heads: int, groups: int):
        super().__init__()
        attn, mlp = te_layer.self_attention.layernorm_qkv, te_layer.layernorm_mlp
        self.heads, self.groups = heads, groups
        hidden = attn.layer_norm_weight.shape[0]
        self.head_dim = hidden // heads
        kw = dict(device=attn.layer_norm_weight.device, dtype=attn.layer_norm_weight.dtype)
        self.attn_norm = nn.RMSNorm(hidden, eps=attn.eps, **kw)
        self.q = nn.Linear(hidden, heads * self.head_dim, bias=False, **kw)
        self.k = nn.Linear(hidden, groups * self.head_dim, bias=False, **kw)
        self.v = nn.Linear(hidden, groups * self.head_dim, bias=False, **kw)
        self.o = nn.Linear(heads * self.head_dim, hidden, bias=False, **kw)
        self.mlp_norm = nn.RMSNorm(hidden, eps=mlp.eps, **kw)
        self.fc1 = nn.Linear(hidden, mlp.fc1_weight.shape[0], bias=False, **kw)
        self.fc2 = nn.Linear(mlp.fc2_weight.shape[1], hidden, bias=False, **kw)
        with torch.no_grad():
            for mine, theirs in ((self.attn_norm.weight, attn.layer_norm_weight), (self.q.weight, attn.query_weight),
                                 (self.k.weight, attn.key_weight), (self.v.weight, attn.value_weight),
                                 (self.o.weight, te_layer.self_attention.proj.weight),
                                 (self.mlp_norm.weight, mlp.layer_norm_weight), (self.fc1.weight, mlp.fc1_weight),
                                 (self.fc2.weight, mlp.fc2_weight)):
                mine.copy_(theirs)

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        y = self.attn_norm(x)
        q = apply_rope(self.q(y).view(b, s, self.heads, self.head_dim), angles)
        k = apply_rope(self.k(y).view(b, s, self.groups, self.head_dim), angles)
        v = self.v(y).view(b, s, self.groups, self.head_dim)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=True)
        x = x + self.o(o.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.fc1(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(gate) * up)


def make_te_layer(args, device, dtype):
    return te_fuser.TransformerLayer(
        args.hidden, args.ffn, args.heads, num_gqa_groups=args.groups, hidden_dropout=0.0, attention_dropout=0.0,
        self_attn_mask_type="causal", normalization="RMSNorm", activation="swiglu", bias=False,
        attn_input_format="bshd", params_dtype=dtype, device=device)


def step_fn(forward, x, grad):
    """One forward + backward; returns the closure the timer calls."""
    def step():
        x.grad = None
        forward(x).backward(grad)
    return step


def check_same_model(te_forward, plain_forward, x, grad) -> str:
    """Loss <out, grad> and dL/dx of both layers: they must agree to bf16 rounding over the layer."""
    results = []
    for forward in (te_forward, plain_forward):
        x.grad = None
        out = forward(x)
        out.backward(grad)
        results.append(((out.float() * grad.float()).sum().item(), x.grad.float().clone()))
    (loss_te, dx_te), (loss_plain, dx_plain) = results
    scale = abs(loss_plain) + grad.float().abs().sum().item() * 1e-2
    dx_err = ((dx_te - dx_plain).norm() / dx_plain.norm()).item()
    if abs(loss_te - loss_plain) > 0.05 * scale or dx_err > 0.05:
        raise SystemExit(f"te_fuser's layer and the plain one differ: loss {loss_te} vs {loss_plain}, "
                         f"dx relative error {dx_err:.3g}")
    return f"same model: loss {loss_te:.6g} vs plain {loss_plain:.6g}, dx relative error {dx_err:.2e}"


def ctx_bytes_after_backward(forward, x, grad) -> int:
    out = forward(x)
    out.backward(grad)
    # The FP8 scaling state persists across steps; torch.compile's node keeps what it read of it on its ctx.
    return audit_autograd(out, persistent=recipe_state_tensors()).total_bytes


def peak_bytes(step, device) -> int:
    if device.type != "cuda":
        return 0
    with MemoryTracker(device=device) as mem:
        step()
    return mem.peak_bytes


def torchao_forward(plain_layer, angles):
    """torchao float8 (tensorwise) on a copy of the plain layer, compiled, or (None, why not)."""
    try:
        import copy
        from torchao.float8 import convert_to_float8_training
    except ImportError as exc:
        return None, f"torchao not importable ({exc})"
    layer = convert_to_float8_training(copy.deepcopy(plain_layer))
    compiled = torch.compile(layer)
    return (lambda x: compiled(x, angles)), "torchao float8 tensorwise, torch.compile"


def graphed_forward(recipe_name, te_layer, x, angles):
    """The step's forward on a copy of te_layer graphed for recipe_name (make_graphed_callables replaces the
    copy's forward; x and angles are its sample arguments, so a call copies nothing in)."""
    fp8 = recipe_name != "none"
    layer = te_fuser.make_graphed_callables(copy.deepcopy(te_layer), (x,), sample_kwargs={"rotary_pos_emb": angles},
                                            fp8_enabled=fp8, fp8_recipe=RECIPES[recipe_name]() if fp8 else None)
    return lambda inp: layer(inp, rotary_pos_emb=angles)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--recipes", default="none,delayed,current",
                        help="te_fuser rows: none (bf16) and FP8 recipes, comma-separated")
    parser.add_argument("--compile", action="store_true", help="also the te_fuser rows under torch.compile")
    parser.add_argument("--torchao", action="store_true", help="also torchao's float8 training (if importable)")
    parser.add_argument("--graphed", action="store_true",
                        help="also the te_fuser rows graphed with te_fuser.make_graphed_callables")
    parser.add_argument("--smoke", action="store_true", help="a tiny layer on the CPU: checks the script only")
    args = parser.parse_args()
    if args.smoke:
        args.device = "cpu"
        for name, value in SMOKE.items():
            setattr(args, name, value)
    device, dtype = torch.device(args.device), torch.bfloat16
    recipes = [r for r in args.recipes.split(",") if r]
    unknown = [r for r in recipes if r != "none" and r not in RECIPES]
    if unknown:
        parser.error(f"--recipes: unknown {unknown}; choose from none, {', '.join(RECIPES)}")

    torch.manual_seed(0)
    te_layer = make_te_layer(args, device, dtype)
    plain = PlainLlamaLayer(te_layer, args.heads, args.groups)
    angles = rope_angles(args.seq, args.hidden // args.heads, device)
    x = torch.randn(args.batch, args.seq, args.hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x) / (args.batch * args.seq * args.hidden) ** 0.5

    def te_forward(recipe_name, module):
        fp8 = recipe_name != "none"
        recipe = RECIPES[recipe_name]() if fp8 else None

        def forward(inp):
            with te_fuser.autocast(enabled=fp8, recipe=recipe) if fp8 else contextlib.nullcontext():
                return module(inp, rotary_pos_emb=angles)
        return forward

    def plain_forward(inp):
        return plain(inp, angles)

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"torch {torch.__version__}, {where}; layer h={args.hidden} heads={args.heads}/{args.groups} "
          f"ffn={args.ffn} s={args.seq} b={args.batch}, bf16")
    print(check_same_model(te_forward("none", te_layer), plain_forward, x, grad))

    forwards = {"plain PyTorch bf16": plain_forward}
    for name in recipes:
        forwards["te_fuser" + ("" if name == "none" else f" FP8 {name}")] = te_forward(name, te_layer)
        if args.compile:
            compiled = torch.compile(te_layer)
            forwards["te_fuser" + ("" if name == "none" else f" FP8 {name}") + " compiled"] = te_forward(name, compiled)
        if args.graphed:
            forwards["te_fuser" + ("" if name == "none" else f" FP8 {name}") + " graphed"] = graphed_forward(
                name, te_layer, x, angles)
    if args.graphed and "none" in recipes:
        print("graphed: " + check_same_model(forwards["te_fuser graphed"], plain_forward, x, grad))
    if args.torchao:
        forward, why = torchao_forward(plain, angles)
        if forward is None:
            print(f"torchao float8: not run: {why}")
        else:
            forwards["torchao float8"] = forward

    for name, forward in list(forwards.items()):
        try:
            left = ctx_bytes_after_backward(forward, x, grad)
        except Exception as exc:  # a compiled row that does not compile: say so, time the others
            if "compiled" not in name and "torchao" not in name:
                raise
            print(f"{name}: not run: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            del forwards[name]
            continue
        print(f"{name}: {left} bytes left on autograd ctxs after backward")
        if left and name.startswith("te_fuser"):
            raise SystemExit(f"{name} left {left} bytes on a ctx after backward")
    steps = {name: step_fn(forward, x, grad) for name, forward in forwards.items()}
    times = time_interleaved(steps, device, args.iters, warmup=args.warmup)
    peaks = {name: peak_bytes(step, device) for name, step in steps.items()}
    base_time, base_peak = times["plain PyTorch bf16"][0], peaks["plain PyTorch bf16"]
    print(f"{'row':34s} {'ms/step':>9s} {'speedup':>8s} {'peak MiB':>9s} {'peak ratio':>10s}")
    for name, (median, _) in times.items():
        peak = f"{peaks[name] / 2**20:9.0f} {peaks[name] / base_peak:10.2f}" if base_peak else f"{'n/a':>9s} {'':>10s}"
        print(f"{name:34s} {median * 1e3:9.2f} {base_time / median:7.2f}x {peak}")


if __name__ == "__main__":
    main()
