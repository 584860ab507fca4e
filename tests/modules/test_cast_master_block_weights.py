"""cast_master_weights_to_fp8 into block-scaled model weights (quantized_model_init under a block recipe).

Whole masters requantize any format: the weight then holds the recipe's weight quantizer applied to the master
in the weight's nominal dtype (TE casts the master to it first). Shards of the flattened masters (TE's
distributed optimizer) go into Float8BlockScaling's 128x128-block weights, as in TE 2.6: on 2 gloo ranks, with
split points inside blocks, each rank writes its shard's bytes; gathered, the bytes and every rank's scales are
bitwise those of the whole master's cast. The largest magnitude of a block cut by the split sits in rank 1's
part: the bug-on run (no group, so no amax reduction) must differ."""

import pytest
import torch
import torch.distributed as dist

import te_fuser
from te_fuser import recipe
from te_fuser.quantization import BlockScalingState
from te_fuser.tensor import QuantizedTensor
from te_fuser.tensor.utils import cast_master_weights_to_fp8

from _gloo_ranks import run_cases

BF16 = torch.bfloat16
ROWS, COLS = 256, 384
RECIPES = {"mxfp8": recipe.MXFP8BlockScaling, "block": recipe.Float8BlockScaling, "nvfp4": recipe.NVFP4BlockScaling}


def build(recipe_name):
    torch.manual_seed(0)
    with te_fuser.quantized_model_init(recipe=RECIPES[recipe_name]()):
        return te_fuser.Linear(COLS, ROWS, params_dtype=BF16, device="cpu")


def master(seed=3):
    m = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed)) * 0.5
    m[200, 50] = 7.5  # in block (1, 0), which SPLIT cuts: on rank 1's side
    return m


def whole_cast(recipe_name, m):
    quantizer = BlockScalingState(RECIPES[recipe_name](), 2).quantizer(1)
    return quantizer(m.to(BF16))


def _buffers(t):
    return {n: getattr(t, n) for n in t._BUFFERS if getattr(t, n) is not None}


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_a_whole_master_requantizes_the_weight(recipe_name):
    module = build(recipe_name)
    m = master()
    cast_master_weights_to_fp8([module.weight, module.bias], [m, torch.ones(ROWS)])
    want = whole_cast(recipe_name, m)
    for name, b in _buffers(module.weight).items():
        assert torch.equal(b.view(torch.uint8), getattr(want, name).view(torch.uint8)), name
    assert torch.equal(module.bias.detach(), torch.ones(ROWS, dtype=BF16))


@pytest.mark.parametrize("recipe_name", ["mxfp8", "nvfp4"])
def test_shards_into_other_formats_are_refused(recipe_name):
    module = build(recipe_name)
    with pytest.raises(NotImplementedError, match="Float8BlockScaling's 128x128-block weights only"):
        cast_master_weights_to_fp8([module.weight], [master().view(-1)[:1000]], start_offsets=[0])


SPLIT = 128 * COLS + 5 * COLS + 17  # inside row block 1, and inside a row of block (1, 0)


def _sharded_cast(rank, reduce):
    module = build("block")
    w = module.weight
    m = master().view(-1)
    shard = m[:SPLIT] if rank == 0 else m[SPLIT:]
    cast_master_weights_to_fp8([w], [shard], start_offsets=[0 if rank == 0 else SPLIT],
                               group=dist.group.WORLD if reduce else None)
    mine = w._rowwise_data.view(torch.uint8).reshape(-1)
    parts = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(parts, mine)
    scales = [torch.empty_like(w._rowwise_scale_inv) for _ in range(2)]
    dist.all_gather(scales, w._rowwise_scale_inv.contiguous())
    gathered = torch.cat([parts[0][:SPLIT], parts[1][SPLIT:]])
    want = whole_cast("block", master())
    same = (torch.equal(gathered, want._rowwise_data.view(torch.uint8).reshape(-1))
            and all(torch.equal(s, want._rowwise_scale_inv) for s in scales))
    assert same == reduce, f"reduce={reduce}: bytes and scales equal to the whole master's cast: {same}"


@pytest.mark.parametrize("reduce", [True, False], ids=["reduced", "bug_on_no_group"])
def test_shards_cast_with_reduced_block_amaxes_give_the_whole_masters_bytes(reduce):
    run_cases([(_sharded_cast, reduce)])


def test_model_weights_still_train_after_the_cast():
    module = build("block")
    cast_master_weights_to_fp8([module.weight], [master()])
    x = torch.randn(128, COLS, dtype=BF16, requires_grad=True)
    with te_fuser.fp8_autocast(fp8_recipe=recipe.Float8BlockScaling()):
        out = module(x)
    out.float().sum().backward()
    assert isinstance(module.weight, QuantizedTensor) and module.weight.grad is not None
