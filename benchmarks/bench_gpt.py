"""The example GPT's training step: te_fuser against the same architecture in plain PyTorch, in one run.

    python benchmarks/bench_gpt.py [--hidden 512 --layers 2 --heads 8 --ffn 2048 --seq 256 --batch 8]
        [--dtype bf16|fp32] [--iters 10] [--warmup 3] [--threads N] [--quick]

One step = forward, cross-entropy loss, backward, AdamW step (train.py's step with one microbatch),
on one batch of train.py's byte corpus. Rows, all with parameters in --dtype:
  plain PyTorch       PlainGPT below: nn.Linear, nn.LayerNorm, F.scaled_dot_product_attention(is_causal=True),
                      nn.GELU(approximate="tanh"), the [s, b, h] layout of te_fuser/examples/gpt.py
  te_fuser            te_fuser.examples.gpt.GPT, no FP8
  te_fuser FP8        the same under fp8_autocast with train.py's recipe (DelayedScaling, HYBRID)
All three start from the same weights (te_fuser's initialization, copied into PlainGPT).
tests/test_bench_gpt_baseline.py proves PlainGPT computes what te_fuser's GPT computes.
Speedup = plain time / te_fuser time (medians of interleaved steps, benchmarks/bench_linear.py's timer).
Goals of issue 14 (bf16): te_fuser FP8 >= 1.0x plain, te_fuser without FP8 >= 1.3x plain.
On a machine whose cores are busy with other work, torch's OpenMP threads wait on each other and
the rows slow down unevenly (the plain row ran 10x slower at 2 threads than at 1 on a loaded 2-core
machine): compare with --threads 1 there.
"""

import argparse
import os
import platform
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_linear import time_interleaved  # noqa: E402

import te_fuser  # noqa: E402
from te_fuser.examples.corpus import load_tokens, sample_batch  # noqa: E402
from te_fuser.examples.gpt import GPT, GPTConfig  # noqa: E402
from te_fuser.examples.train import make_recipe  # noqa: E402
from te_fuser.kernels import cpu  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GOALS = {"te_fuser": 1.3, "te_fuser FP8": 1.0}  # issue 14, minimum speedup over plain PyTorch in bf16
QUICK = dict(hidden=64, layers=2, heads=4, ffn=256, seq=32, batch=2, iters=5, warmup=2)


class PlainBlock(nn.Module):
    """te_fuser/examples/gpt.py's TransformerBlock (no tensor parallelism) in torch.nn."""

    def __init__(self, cfg: GPTConfig, device, dtype):
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, h // cfg.num_heads
        self.norm = nn.LayerNorm(h, eps=1e-5, device=device, dtype=dtype)
        self.qkv = nn.Linear(h, 3 * h, device=device, dtype=dtype)
        self.proj = nn.Linear(h, h, device=device, dtype=dtype)
        self.mlp = nn.Sequential(
            nn.LayerNorm(h, eps=1e-5, device=device, dtype=dtype),
            nn.Linear(h, f, device=device, dtype=dtype),
            nn.GELU(approximate="tanh"),  # TransformerEngine's (and te_fuser's) GELU
            nn.Linear(f, h, device=device, dtype=dtype),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        # Megatron's QKV layout [s, b, heads, (q k v), d], as in gpt.py; SDPA takes [b, heads, s, d].
        qkv = self.qkv(self.norm(x)).view(s, b, self.num_heads, 3, self.head_dim)
        q, k, v = (t.permute(1, 2, 0, 3) for t in qkv.unbind(dim=3))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(o.permute(2, 0, 1, 3).reshape(s, b, h))
        return x + self.mlp(x)


class PlainGPT(nn.Module):
    """te_fuser/examples/gpt.py's GPT in torch.nn: embedding + learned positions, blocks, final norm,
    head tied to the embedding. Input tokens and output logits are [s, b] and [s, b, vocab]."""

    def __init__(self, cfg: GPTConfig, device=None, dtype=torch.float32):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        self.pos = nn.Parameter(torch.zeros(cfg.seq_len, 1, cfg.hidden_size, device=device, dtype=dtype))
        self.blocks = nn.ModuleList(PlainBlock(cfg, device, dtype) for _ in range(cfg.num_layers))
        self.final_norm = nn.LayerNorm(cfg.hidden_size, eps=1e-5, device=device, dtype=dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[0]]
        for block in self.blocks:
            x = block(x)
        return F.linear(self.final_norm(x), self.embed.weight)


# te_fuser's MLP is Sequential(LayerNorm, BasicLinear, Bias, GELU, BasicLinear, Bias); PlainBlock's
# is Sequential(LayerNorm, Linear, GELU, Linear): the only parameter names that differ.
_TE_TO_PLAIN_SUFFIX = {"mlp.2.bias": "mlp.1.bias", "mlp.4.weight": "mlp.3.weight", "mlp.5.bias": "mlp.3.bias"}


def plain_name(te_name: str) -> str:
    """The name in PlainGPT of te_fuser GPT's parameter `te_name`."""
    for te_suffix, plain_suffix in _TE_TO_PLAIN_SUFFIX.items():
        if te_name.endswith(te_suffix):
            return te_name[: -len(te_suffix)] + plain_suffix
    return te_name


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def copy_te_weights(plain: PlainGPT, te_model: GPT) -> None:
    """Copies every parameter of te_fuser's GPT into PlainGPT (raises if the two do not match one to one)."""
    plain_params = dict(plain.named_parameters())
    te_params = {plain_name(n): p for n, p in te_model.named_parameters()}
    if set(te_params) != set(plain_params):
        raise ValueError(f"parameters differ: only in te_fuser's GPT {sorted(set(te_params) - set(plain_params))}, "
                         f"only in PlainGPT {sorted(set(plain_params) - set(te_params))}")
    with torch.no_grad():
        for name, src in te_params.items():
            if plain_params[name].shape != src.shape:
                raise ValueError(f"{name}: PlainGPT has shape {tuple(plain_params[name].shape)}, "
                                 f"te_fuser's GPT {tuple(src.shape)}")
            plain_params[name].copy_(src)


def make_train_step(model, tokens, targets, context):
    """One training step (train.py's AdamW, lr 3e-3, no weight decay); the step's loss is kept in
    `step.loss` (detached) for the sanity print."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)

    def step():
        with context():
            logits = model(tokens)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step.loss = loss.detach()
    return step


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=2048, help="MLP hidden size")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="parameter dtype of every row")
    parser.add_argument("--iters", type=int, default=10, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per row first")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--quick", action="store_true", help=f"tiny shapes, a few seconds: {QUICK}")
    args = parser.parse_args()
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    for key in ("hidden", "layers", "heads", "ffn", "seq", "batch", "iters"):
        if getattr(args, key) < 1:
            parser.error(f"--{key} must be >= 1, got {getattr(args, key)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    device = torch.device("cpu")
    cfg = GPTConfig(seq_len=args.seq, hidden_size=args.hidden, num_heads=args.heads, num_layers=args.layers,
                    ffn_hidden_size=args.ffn)

    torch.manual_seed(args.seed)
    te_model = GPT(cfg, device=device, dtype=dtype)
    te_fp8_model = GPT(cfg, device=device, dtype=dtype)
    te_fp8_model.load_state_dict(te_model.state_dict())
    plain = PlainGPT(cfg, device=device, dtype=dtype)
    if param_count(plain) != param_count(te_model):
        raise SystemExit(f"parameter counts differ: PlainGPT {param_count(plain)}, te_fuser {param_count(te_model)}")
    copy_te_weights(plain, te_model)
    tokens, targets = sample_batch(load_tokens(), args.batch, args.seq, torch.Generator().manual_seed(args.seed))

    print(f"cpu: {cpu_model()} | te_fuser cpu isa: {cpu.current_isa()} (detected {cpu.detected_isa()}) | "
          f"torch {torch.__version__}, threads={torch.get_num_threads()}")
    print(f"GPT hidden={cfg.hidden_size} layers={cfg.num_layers} heads={cfg.num_heads} ffn={cfg.ffn_hidden_size} "
          f"seq={args.seq} batch={args.batch} vocab={cfg.vocab_size} params={param_count(plain):,} "
          f"({args.dtype}); step = forward + backward + AdamW; {args.iters} timed steps after {args.warmup} warm-up")

    plain_ctx = torch.enable_grad
    fp8_recipe = make_recipe(SimpleNamespace(recipe="delayed"))
    fp8_ctx = lambda: te_fuser.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe)  # noqa: E731
    base = f"plain PyTorch {args.dtype}"
    steps = {base: make_train_step(plain, tokens, targets, plain_ctx),
             "te_fuser": make_train_step(te_model, tokens, targets, plain_ctx),
             "te_fuser FP8": make_train_step(te_fp8_model, tokens, targets, fp8_ctx)}
    seconds = time_interleaved(steps, device, args.iters, warmup=args.warmup)

    base_median, base_min = seconds[base]
    tokens_per_step = args.seq * args.batch
    print(f"{'row':<20} {'median ms':>10} {'min ms':>9} {'tok/s':>9} {'speedup':>8} {'(min)':>7} "
          f"{'goal (issue 14)':>16} {'last loss':>10}")
    for name, (median, best) in seconds.items():
        goal = GOALS.get(name) if args.dtype == "bf16" else None  # the goals are set for bf16
        goal_text = "" if goal is None else f">= {goal:.2f}x " + ("met" if base_median / median >= goal else "not met")
        print(f"{name:<20} {median * 1e3:>10.2f} {best * 1e3:>9.2f} {tokens_per_step / median:>9.0f} "
              f"{base_median / median:>7.2f}x {base_min / best:>6.2f}x {goal_text:>16} {steps[name].loss.item():>10.4f}")
    print("speedup = plain PyTorch time / row time (median; (min): from the fastest steps)")


if __name__ == "__main__":
    main()
