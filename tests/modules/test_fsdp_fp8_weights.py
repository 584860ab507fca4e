"""FSDP2 (fully_shard) with FP8 weights (quantized_model_init) on 2 gloo CPU ranks: the shards stay
Float8Tensors, every all-gather moves the FP8 bytes (Float8Tensor.fsdp_pre_all_gather /
fsdp_post_all_gather), half the bytes of the same model in bf16, and outputs and gradients are those
of the unsharded module holding the same FP8 weights (bitwise: the gathered bytes are the same), also
when the weights are requantized with a new scale between steps."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_collectives

import te_fuser
from te_fuser import recipe
from te_fuser.tensor import Float8Tensor
from te_fuser.tensor.utils import cast_master_weights_to_fp8

from _module_checks import spawn

HIDDEN, TOKENS = 64, 32
BF16 = torch.bfloat16
MODULES = {
    "Linear": lambda: te_fuser.Linear(HIDDEN, HIDDEN, params_dtype=BF16, device="cpu"),
    "LayerNormMLP": lambda: te_fuser.LayerNormMLP(HIDDEN, 2 * HIDDEN, params_dtype=BF16, device="cpu"),
}
RECIPES = {"delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling}


def _build(name, fp8_recipe):
    torch.manual_seed(0)  # the same weights on both ranks
    with te_fuser.quantized_model_init(enabled=fp8_recipe is not None, recipe=fp8_recipe):
        module = MODULES[name]()
    with torch.no_grad():  # biases and norm weights off their constant init: every gradient shows
        for p in module.parameters():
            if not isinstance(p, Float8Tensor):
                p.add_(torch.randn_like(p) * 0.1)
    return module


class _GatherLog:
    """Records the bytes of every FSDP2 all-gather output (wraps DefaultAllGather.__call__)."""

    def __init__(self):
        self.bytes = []
        self._real = _fsdp_collectives.DefaultAllGather.__call__

    def __enter__(self):
        log, real = self, self._real

        def call(self, output_tensor, input_tensor, group, async_op=False):
            log.bytes.append(output_tensor.numel() * output_tensor.element_size())
            return real(self, output_tensor, input_tensor, group, async_op)

        _fsdp_collectives.DefaultAllGather.__call__ = call
        return self

    def __exit__(self, *exc):
        _fsdp_collectives.DefaultAllGather.__call__ = self._real


def _sharded(model):
    """(model under fully_shard on all ranks, its mesh)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # FSDP's default mesh is CUDA's wherever a GPU exists
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
    return model, mesh


def _step_matches_the_unsharded_module(rank, model, reference, fp8_recipe, gen, where):
    """One forward and backward of both on this rank's batch: the same output and input gradient, bit
    for bit, and FSDP's reduced gradient shards those of the unsharded module."""
    world = dist.get_world_size()
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(BF16)
    dy = torch.randn(TOKENS, HIDDEN, generator=gen).to(BF16)
    results = []
    for m in (model, reference):
        xi = x.clone().requires_grad_()
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            out = m(xi)
        out.backward(dy)
        results.append((out, xi.grad))
    assert torch.equal(results[0][0], results[1][0]), f"{where}: output"
    assert torch.equal(results[0][1], results[1][1]), f"{where}: input gradient"
    for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
        # FSDP averages the ranks' gradients (in float32) and keeps this rank's rows.
        full = q.grad.float()
        dist.all_reduce(full)
        want = (full / world).to(BF16).chunk(world)[rank]
        assert torch.equal(p.grad._local_tensor, want), f"{where}: {pname} gradient"
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)


def _fsdp2_fp8_weights(rank, name, recipe_name):
    fp8_recipe = RECIPES[recipe_name]()
    world = dist.get_world_size()
    reference = _build(name, fp8_recipe)
    model, mesh = _sharded(_build(name, fp8_recipe))
    for p in model.parameters():  # each rank keeps its FP8 shard
        local = p._local_tensor
        if isinstance(local, Float8Tensor):
            assert local.fp8_data.dtype == torch.float8_e4m3fn and local.shape[0] * world == p.shape[0]
    gen = torch.Generator().manual_seed(100 + rank)  # data parallel: each rank its own batch
    with _GatherLog() as log:
        for step in range(2):  # the 2nd all-gather writes into the 1st one's storage (out=)
            _step_matches_the_unsharded_module(rank, model, reference, fp8_recipe, gen, f"step {step}")
    fp8_gather_bytes = list(log.bytes)

    bf16 = _build(name, None)
    fully_shard(bf16, mesh=mesh)
    with _GatherLog() as log:
        bf16(torch.randn(TOKENS, HIDDEN, dtype=BF16))
    bf16_gather_bytes = log.bytes[0]
    expected = sum(p.numel() * (1 if isinstance(p._local_tensor, Float8Tensor) else 2) for p in model.parameters())
    # The FP8 model gathers in forward and again in backward (FSDP2 reshards after forward).
    assert fp8_gather_bytes == [expected] * len(fp8_gather_bytes) and len(fp8_gather_bytes) >= 2, fp8_gather_bytes
    assert bf16_gather_bytes == sum(2 * p.numel() for p in bf16.parameters())
    ratio = expected / bf16_gather_bytes
    if rank == 0:
        print(f"{name} {recipe_name}: all-gather bytes FP8 weights {expected}, bf16 {bf16_gather_bytes}, ratio {ratio:.3f}")
    assert ratio <= 0.52, ratio


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("name", list(MODULES))
def test_fsdp2_gathers_fp8_bytes_and_matches_the_unsharded_module(name, recipe_name):
    spawn(_fsdp2_fp8_weights, name, recipe_name)


def _fsdp2_fp8_weights_requantized(rank, name, recipe_name):
    """Between steps the FP8 weights are requantized from float32 masters whose amax grows 3x a step
    (cast_master_weights_to_fp8, an FP8-weight optimizer's write: each rank casts its shard with the
    amax reduced over the FSDP group). FSDP2's later all-gathers land in the first one's storage
    (fsdp_post_all_gather with out=), and each must carry the new scale: every step's output and
    gradients equal those of the unsharded module requantized from the whole masters.

    Planted to check it: fsdp_post_all_gather returning without `out._scale_inv.copy_(scale_inv)`
    (the gathered bytes with the first gather's scale): fails at step 1, for both modules and recipes.
    """
    fp8_recipe = RECIPES[recipe_name]()
    world = dist.get_world_size()
    reference = _build(name, fp8_recipe)
    model, mesh = _sharded(_build(name, fp8_recipe))
    fp8 = [(p, q) for p, q in zip(model.parameters(), reference.parameters()) if isinstance(q, Float8Tensor)]
    gen = torch.Generator().manual_seed(100 + rank)  # data parallel: each rank its own batch
    masters_gen = torch.Generator().manual_seed(7)  # the masters: the same on every rank
    scale_invs = []
    for step in range(3):
        if step:
            masters = [torch.randn(q.shape, generator=masters_gen) * 0.05 * 3 ** step for _, q in fp8]
            cast_master_weights_to_fp8([q for _, q in fp8], masters)
            cast_master_weights_to_fp8([p._local_tensor for p, _ in fp8], [m.chunk(world)[rank] for m in masters],
                                       group=mesh.get_group())
            for p, q in fp8:  # the shards hold the whole weight's scale
                assert torch.equal(p._local_tensor._scale_inv, q._scale_inv)
        scale_invs.append(torch.cat([q._scale_inv for _, q in fp8]))
        _step_matches_the_unsharded_module(rank, model, reference, fp8_recipe, gen, f"step {step}")
    for step in (1, 2):  # every weight's scale changed: a stale one would show in that step
        assert (scale_invs[step] != scale_invs[step - 1]).all(), (step, scale_invs)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("name", list(MODULES))
def test_fsdp2_gathers_the_new_scale_after_a_requantization(name, recipe_name):
    spawn(_fsdp2_fp8_weights_requantized, name, recipe_name)
