"""Tensor-parallel MultiheadAttention and TransformerLayer (set_parallel_mode=True) on 2 gloo ranks,
with and without sequence parallelism, against the same module in one process holding the full weights.

Each rank holds TransformerEngine's shards: QKV and FC1 column-parallel (rows), proj and FC2
row-parallel (columns), the rest replicated. Outputs and every gradient must match the
single-process module, which the row-parallel all-reduce / reduce-scatter and the column-parallel
all-gather are needed for (one rank's partial sum differs from the full result).
All cases run in one spawn.
"""


import torch
import torch.distributed as dist

from _gloo_ranks import run_cases

import te_fuser
from te_fuser import recipe

from layer_reference import tp_shard_dim

WORLD = 2
SEQ, BATCH, HIDDEN, HEADS, FFN = 16, 2, 64, 4, 128


def _shard(t, dim, rank):
    return t if dim is None else t.chunk(WORLD, dim)[rank]


def _build(kind, **kwargs):
    if kind in ("mha", "ln_mha"):
        return te_fuser.MultiheadAttention(HIDDEN, HEADS, attention_dropout=0.0, num_gqa_groups=2, device="cpu",
                                           input_layernorm=kind == "ln_mha", **kwargs)
    return te_fuser.TransformerLayer(HIDDEN, FFN, HEADS, num_gqa_groups=2, hidden_dropout=0.0,
                                     attention_dropout=0.0, device="cpu", **kwargs)


def _case(rank, kind, fuse_qkv_params, sequence_parallel, fp8):
    group = dist.group.WORLD
    torch.manual_seed(0)
    full = _build(kind, fuse_qkv_params=fuse_qkv_params)
    with torch.no_grad():
        for name, p in full.named_parameters():
            p.add_(torch.randn_like(p) * 0.1)
    tp = _build(kind, fuse_qkv_params=fuse_qkv_params, set_parallel_mode=True, tp_group=group,
                sequence_parallel=sequence_parallel, **({"seq_length": SEQ} if kind == "layer" else {}))
    full_params = dict(full.named_parameters())
    tp_params = dict(tp.named_parameters())
    assert set(full_params) == set(tp_params)
    with torch.no_grad():
        for name, p in tp_params.items():
            p.copy_(_shard(full_params[name], tp_shard_dim(name), rank))

    x = torch.randn(SEQ, BATCH, HIDDEN)
    dy = torch.randn(SEQ, BATCH, HIDDEN)
    # E4M3 gradients too: with E5M2's 2 mantissa bits the FP8 noise would swamp the comparison.
    fp8_recipe = recipe.Float8CurrentScaling(fp8_format=recipe.Format.E4M3, fp8_dpa=True)
    seq_dim = 0 if sequence_parallel else None

    def run(module, inp, grad, with_fp8):
        """(out, input grad, {name: param grad}) of one forward + backward."""
        module.zero_grad(set_to_none=True)
        inp = inp.clone().requires_grad_()
        with te_fuser.fp8_autocast(enabled=with_fp8, fp8_recipe=fp8_recipe, fp8_group=group):
            out = module(inp)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad)
        grads = {}
        for name, p in module.named_parameters():
            grads[name] = p.grad
            if module is tp and sequence_parallel and tp_shard_dim(name) is None:
                # Replicated parameters see only this rank's tokens: partial grads, summed by the framework.
                dist.all_reduce(grads[name], group=group)
        return {"out": out.detach(), "dgrad": inp.grad, **grads}

    expect = run(full, x, dy, False)
    got = run(tp, _shard(x, seq_dim, rank).contiguous(), _shard(dy, seq_dim, rank).contiguous(), fp8)
    shard_dims = {"out": seq_dim, "dgrad": seq_dim, **{n: tp_shard_dim(n) for n in tp_params}}
    if fp8:
        # The FP8 error of the single-process module calibrates the TP module's (each rank casts
        # its own shards with its own scales, so the two differ within FP8 precision).
        full_fp8 = run(full, x, dy, True)
    for name, value in got.items():
        ref = _shard(expect[name], shard_dims[name], rank)
        if fp8:
            rel = ((value - ref).norm() / ref.norm()).item()
            fp8_rel = ((_shard(full_fp8[name], shard_dims[name], rank) - ref).norm() / ref.norm()).item()
            assert rel < 2 * fp8_rel + 0.01, f"{name}: relative error {rel}, single-process FP8 {fp8_rel}"
        else:
            torch.testing.assert_close(value, ref, rtol=2e-5, atol=2e-5, msg=name)


CASES = [  # (module, fuse_qkv_params, sequence_parallel, fp8)
    ("mha", True, False, False),
    ("ln_mha", False, True, False),
    ("ln_mha", True, True, True),
    ("layer", True, False, False),
    ("layer", False, True, False),
    ("layer", True, True, True),
]


def test_tensor_parallel_matches_single_process():
    run_cases([(_case, *case) for case in CASES], world=WORLD)
