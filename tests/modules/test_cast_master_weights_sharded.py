"""cast_master_weights_to_fp8 with sharded masters (TE's distributed-optimizer form), on 2 gloo ranks.

Each rank steps one shard of each flattened master (uneven split points; one weight lives wholly on
one rank, so the other passes None). After the cast, the ranks all-gather their written bytes, as
the distributed optimizer's parameter all-gather does, and every FP8 weight must equal, byte for
byte and scale for scale, the weight cast from the whole master in one process. The largest
magnitude sits in rank 1's shard, so a rank that cast with its own shard's amax is caught: the
bug-on run (no group, so no amax reduction) must differ.
"""

import pytest
import torch
import torch.distributed as dist

import te_fuser
from te_fuser import recipe
from te_fuser.tensor.float8_tensor import Float8Tensor
from te_fuser.tensor.utils import cast_master_weights_to_fp8

from _gloo_ranks import run_cases

IN, HIDDEN = 64, 96
BF16 = torch.bfloat16
RECIPES = {"delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling}


def build(recipe_name):
    torch.manual_seed(0)
    with te_fuser.quantized_model_init(recipe=RECIPES[recipe_name]()):
        return te_fuser.LayerNormMLP(IN, HIDDEN, params_dtype=BF16, device="cpu")


def masters_of(module, seed):
    """Whole float32 masters, the same on every rank; the amax of each FP8 weight near its end."""
    gen = torch.Generator().manual_seed(seed)
    masters = []
    for p in module.parameters():
        m = torch.randn(p.shape, generator=gen) * 0.5
        if isinstance(p, Float8Tensor):
            m.view(-1)[-3] = 5.0 + float(torch.rand((), generator=gen))
            m.view(-1)[:3] = torch.tensor([0.0, -0.0, 1e-6])  # zeros and a value below E4M3's subnormals
        masters.append(m)
    return masters


def shards_for(rank, module, masters):
    """(this rank's shards, their start offsets): each flattened master split 3:4 between the ranks, except
    the last FP8 weight, which lives on rank 1 only."""
    shards, offsets = [], []
    params = list(module.parameters())
    last_fp8 = max(i for i, p in enumerate(params) if isinstance(p, Float8Tensor))
    for i, (p, m) in enumerate(zip(params, masters)):
        flat = m.reshape(-1)
        if i == last_fp8:
            shards.append(flat if rank == 1 else None)
            offsets.append(0)
            continue
        cut = 3 * flat.numel() // 7
        shards.append(flat[:cut] if rank == 0 else flat[cut:])
        offsets.append(0 if rank == 0 else cut)
    return shards, offsets


def gathered_bytes(module, shards, offsets):
    """Every FP8 weight's bytes with each rank's written shard (the distributed optimizer's gather)."""
    out = []
    for p, shard, offset in zip(module.parameters(), shards, offsets):
        if not isinstance(p, Float8Tensor):
            continue
        mine = None if shard is None else (offset, p._data.view(-1).view(torch.uint8)[offset: offset + shard.numel()])
        pieces = [None] * dist.get_world_size()
        dist.all_gather_object(pieces, mine)
        full = torch.zeros(p.numel(), dtype=torch.uint8)
        for piece in pieces:
            if piece is not None:
                full[piece[0]: piece[0] + piece[1].numel()] = piece[1]
        out.append(full)
    return out


def reference(recipe_name, masters):
    module = build(recipe_name)
    cast_master_weights_to_fp8(list(module.parameters()), masters)
    return module


def _check_sharded_cast(rank, recipe_name, seed, reduce_amax):
    module = build(recipe_name)
    masters = masters_of(module, seed)
    shards, offsets = shards_for(rank, module, masters)
    params = list(module.parameters())
    cast_master_weights_to_fp8(params, shards, offsets, group=dist.group.WORLD if reduce_amax else None)
    ref = reference(recipe_name, masters)
    same = []
    for (p, r, got) in zip([p for p in params if isinstance(p, Float8Tensor)],
                           [p for p in ref.parameters() if isinstance(p, Float8Tensor)],
                           gathered_bytes(module, shards, offsets)):
        same.append(torch.equal(got, r._data.view(-1).view(torch.uint8))
                    and torch.equal(p._scale_inv, r._scale_inv)
                    and torch.equal(p._quantizer.amax, r._quantizer.amax))
    if reduce_amax:
        assert all(same), f"rank {rank}: FP8 weights differ from the whole-master cast: {same}"
        for p, r, shard, offset in zip(params, ref.parameters(), shards, offsets):
            if shard is not None and not isinstance(p, Float8Tensor):  # high precision: the shard copied in
                assert torch.equal(p.detach().view(-1)[offset: offset + shard.numel()],
                                   r.detach().view(-1)[offset: offset + shard.numel()])
    elif rank == 0:  # its shards miss the amax: a cast without the reduction must be caught
        assert not all(same), "the check did not catch a cast with a per-rank amax"


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
def test_sharded_masters_match_the_whole_master_cast(recipe_name, generator):
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
    run_cases([(_check_sharded_cast, recipe_name, seed, True), (_check_sharded_cast, recipe_name, seed, False)])


def test_bad_shards_are_rejected():
    module = build("current")
    weight = module.fc1_weight
    with pytest.raises(ValueError, match=r"start_offsets\[0\]=.* does not fit"):
        cast_master_weights_to_fp8([weight], [torch.zeros(8)], [weight.numel() - 4])
    with pytest.raises(ValueError, match=r"start_offsets\[0\]=-1"):
        cast_master_weights_to_fp8([weight], [torch.zeros(8)], [-1])
    with pytest.raises(ValueError, match="start_offsets has 2 entries"):
        cast_master_weights_to_fp8([weight], [torch.zeros(8)], [0, 0])
    with pytest.raises(ValueError, match="pass start_offsets"):
        cast_master_weights_to_fp8([weight], [torch.zeros(8)])
