"""FSDP2 (fully_shard) with block-scaled quantized weights (quantized_model_init under MXFP8BlockScaling,
Float8BlockScaling, NVFP4BlockScaling) on 2 gloo CPU ranks: the shards stay MXFP8Tensor /
Float8BlockwiseQTensor / NVFP4Tensor, cut between row blocks; every all-gather moves the shards' low-precision
bytes and scales (fsdp_pre_all_gather / fsdp_post_all_gather) and no bf16 copy; outputs and gradients are those
of the unsharded module holding the same weights (bitwise: the gathered weight is the one that was cut), also
after an optimizer step on the shards (a block's requantization needs only the block).

Planted to check it: fsdp_post_all_gather with out= leaving out's buffers as they were (the first gather's
padded scales): the optimizer test fails at step 1 on Linear_narrow, whose gathered MXFP8 scales are padded
copies (the other buffers are views of FSDP's all-gather output, refreshed by the gather itself)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import te_fuser
from te_fuser import recipe
from te_fuser.quantization import BlockScalingState
from te_fuser.tensor import Float8BlockwiseQTensor, MXFP8Tensor, NVFP4Tensor, QuantizedTensor

from _module_checks import spawn
from test_fsdp_fp8_weights import _GatherLog

HIDDEN, TOKENS = 256, 128  # every weight's out_features: whole 128-row blocks on each of 2 ranks
BF16 = torch.bfloat16
MODULES = {
    "Linear": lambda: te_fuser.Linear(HIDDEN, HIDDEN, params_dtype=BF16, device="cpu"),
    "LayerNormMLP": lambda: te_fuser.LayerNormMLP(HIDDEN, 2 * HIDDEN, params_dtype=BF16, device="cpu"),
    # 32 rows a rank: MXFP8's rowwise scales are padded to 128 rows, so the gathered ones are copies
    "Linear_narrow": lambda: te_fuser.Linear(HIDDEN, 64, params_dtype=BF16, device="cpu"),
}
RECIPES = {"mxfp8": recipe.MXFP8BlockScaling, "block": recipe.Float8BlockScaling, "nvfp4": recipe.NVFP4BlockScaling}
TENSOR_CLASS = {"mxfp8": MXFP8Tensor, "block": Float8BlockwiseQTensor, "nvfp4": NVFP4Tensor}
# All-gathered bytes against the same model in bf16: MXFP8 weights hold both usages (1 + 1 bytes an element),
# the 2-D formats their rowwise usage only (1 byte; NVFP4 half a byte), plus scales.
GATHER_RATIO = {"mxfp8": 1.08, "block": 0.52, "nvfp4": 0.3}


def _build(name, recipe_name):
    torch.manual_seed(0)  # the same weights on both ranks
    with te_fuser.quantized_model_init(enabled=recipe_name is not None,
                                       recipe=RECIPES[recipe_name]() if recipe_name else None):
        module = MODULES[name]()
    with torch.no_grad():  # biases and norm weights off their constant init: every gradient shows
        for p in module.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return module


def _buffers(t):
    return {n: getattr(t, n) for n in t._BUFFERS if getattr(t, n) is not None}


def _local_bytes(model):
    return sum(sum(b.nbytes for b in _buffers(p._local_tensor).values()) if isinstance(p._local_tensor, QuantizedTensor)
               else p._local_tensor.nbytes for p in model.parameters())


def _step(rank, model, reference, recipe_name, gen, where):
    """Forward and backward of both on this rank's batch: output and input gradient bitwise equal, and FSDP's
    reduced gradient shards those of the unsharded module (whose gradients become the averaged ones)."""
    world = dist.get_world_size()
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(BF16)
    results = []
    for m in (model, reference):
        torch.manual_seed(rank)  # NVFP4's stochastic rounding of the gradients
        xi = x.clone().requires_grad_()
        with te_fuser.fp8_autocast(fp8_recipe=RECIPES[recipe_name]()):
            out = m(xi)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(rank)).to(BF16))
        results.append((out, xi.grad))
    assert torch.equal(results[0][0], results[1][0]), f"{where}: output"
    assert torch.equal(results[0][1], results[1][1]), f"{where}: input gradient"
    for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
        full = q.grad.float()
        dist.all_reduce(full)
        q.grad = (full / world).to(BF16)  # what FSDP averages (in float32), for the reference's optimizer
        assert torch.equal(p.grad._local_tensor, q.grad.chunk(world)[rank]), f"{where}: {pname} gradient"


def _sharded(model):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
    return model, mesh


def _fsdp2_block_weights(rank, name, recipe_name):
    world = dist.get_world_size()
    reference = _build(name, recipe_name)
    model, mesh = _sharded(_build(name, recipe_name))
    for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
        local = p._local_tensor
        if isinstance(q, QuantizedTensor):  # each rank keeps its rows, the whole's bytes
            assert type(local) is TENSOR_CLASS[recipe_name] and local.shape[0] * world == q.shape[0], pname
            want = q.dequantize().chunk(world)[rank]
            assert torch.equal(local.dequantize(), want), pname
    gen = torch.Generator().manual_seed(100 + rank)  # data parallel: each rank its own batch
    with _GatherLog() as log:
        for step in range(2):  # the 2nd all-gather writes into the 1st one's storage (out=)
            _step(rank, model, reference, recipe_name, gen, f"step {step}")
            model.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
    expected = world * _local_bytes(model)
    assert log.bytes and all(b == expected for b in log.bytes), (log.bytes, expected)
    bf16 = sum(2 * p.numel() for p in model.parameters())
    if rank == 0:
        print(f"{name} {recipe_name}: all-gather bytes {expected}, bf16 {bf16}, ratio {expected / bf16:.3f}")
    assert expected / bf16 <= GATHER_RATIO[recipe_name], expected / bf16


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("name", ["Linear", "LayerNormMLP"])
def test_fsdp2_gathers_block_scaled_bytes_and_matches_the_unsharded_module(name, recipe_name):
    spawn(_fsdp2_block_weights, name, recipe_name)


def _fsdp2_optimizer_steps(rank, name, recipe_name):
    """SGD steps the shards (each requantized from its own rows) and the unsharded module (the whole weight)
    with the same averaged gradients: the next steps' outputs and gradients stay bitwise equal."""
    reference = _build(name, recipe_name)
    model, _ = _sharded(_build(name, recipe_name))
    steps = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.5, foreach=True) for m in (model, reference)]
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(3):
        _step(rank, model, reference, recipe_name, gen, f"step {step}")
        for optimizer in steps:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name, recipe_name", [("LayerNormMLP", "mxfp8"), ("LayerNormMLP", "block"),
                                               ("Linear_narrow", "mxfp8")])
def test_fsdp2_optimizer_steps_on_the_shards_match_the_unsharded_module(name, recipe_name):
    spawn(_fsdp2_optimizer_steps, name, recipe_name)


def _fsdp2_nvfp4_amax_disagreement(rank):
    model, _ = _sharded(_build("Linear", "nvfp4"))
    with torch.no_grad():
        model.weight._local_tensor.mul_(1.0 + rank)  # each shard requantized with its own per-tensor amax
    with pytest.raises(RuntimeError, match="different _amax_rowwise on different ranks"):
        with te_fuser.fp8_autocast(fp8_recipe=recipe.NVFP4BlockScaling()):
            model(torch.randn(TOKENS, HIDDEN, dtype=BF16))


def test_fsdp2_refuses_nvfp4_shards_whose_amaxes_disagree():
    """te_fuser does not reduce NVFP4's per-tensor amax over the FSDP group when a shard is requantized (TE's
    amax reduction): the gather says so instead of reading the other ranks' bytes with this rank's amax."""
    spawn(_fsdp2_nvfp4_amax_disagreement)


def _fsdp2_unaligned_shards(rank):
    with te_fuser.quantized_model_init(recipe=recipe.Float8BlockScaling()):
        module = te_fuser.Linear(HIDDEN, 128, params_dtype=BF16, device="cpu")  # 64 rows a rank: half a block
    with pytest.raises(ValueError, match="between its 128-row blocks"):
        _sharded(module)


def test_fsdp2_refuses_shards_that_cut_a_block():
    spawn(_fsdp2_unaligned_shards)


# -- the cuts and the gather without processes: every layout, both usages ---------------------------------------
class _Mesh:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


QUANTIZERS = {  # both usages: the columnwise buffers run along the rows in three different layouts
    "mxfp8": lambda: recipe_quantizer(recipe.MXFP8BlockScaling()),
    "block2d": lambda: recipe_quantizer(recipe.Float8BlockScaling()),
    "block1d": lambda: recipe_quantizer(recipe.Float8BlockScaling(w_block_scaling_dim=1)),
    "nvfp4_2d": lambda: recipe_quantizer(recipe.NVFP4BlockScaling()),
    "nvfp4_1d": lambda: recipe_quantizer(recipe.NVFP4BlockScaling(disable_2d_quantization=True)),
}


def recipe_quantizer(fp8_recipe):
    """The recipe's weight quantizer, both usages."""
    quantizer = BlockScalingState(fp8_recipe, 2).quantizer(1)
    quantizer.set_usage(rowwise=True, columnwise=True)
    return quantizer


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_shards_and_their_gather_hold_the_wholes_bytes(kind, world, generator):
    """torch.chunk (FSDP2's sharding) cuts between row blocks: each part reads back as the whole's rows (both
    usages); the parts' fsdp_pre_all_gather inputs, concatenated as an all-gather does, give back through
    fsdp_post_all_gather the whole's buffers bit for bit."""
    x = torch.randn(512, 384, generator=generator, dtype=torch.float32) * 3
    x[0, :3] = torch.tensor([0.0, 100.0, -1e-3])
    whole = QUANTIZERS[kind]()(x.to(BF16))
    parts = torch.chunk(whole, world)
    rows = 512 // world
    for i, part in enumerate(parts):
        assert type(part) is type(whole) and part.shape == (rows, 384)
        assert torch.equal(part.dequantize(), whole.dequantize()[i * rows:(i + 1) * rows])
        assert torch.equal(part.columnwise_dequantize(), whole.columnwise_dequantize()[i * rows:(i + 1) * rows])
    sent = [part.fsdp_pre_all_gather(_Mesh(world), whole.shape, None, None, None) for part in parts]
    outputs = [torch.cat([inputs[j].reshape(-1) for inputs, _ in sent]).view(-1, *sent[0][0][j].shape[1:])
               for j in range(len(sent[0][0]))]
    gathered, inner = parts[0].fsdp_post_all_gather(tuple(outputs), sent[0][1], BF16)
    assert type(gathered) is type(whole) and gathered.shape == whole.shape and inner == tuple(outputs)
    for name in whole._BUFFERS:
        mine, want = getattr(gathered, name), getattr(whole, name)
        assert (mine is None) == (want is None), name
        if want is not None:
            assert torch.equal(mine.view(torch.uint8), want.view(torch.uint8)), name


@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_a_flat_view_reads_and_writes_through(kind, generator):
    """view(-1) (FSDP2 keeps one of each shard) holds no bytes: it reads the base's values and writes into it."""
    whole = QUANTIZERS[kind]()(torch.randn(256, 128, generator=generator).to(BF16))
    flat = whole.view(-1)
    assert isinstance(flat, QuantizedTensor) and flat.shape == (256 * 128,)
    assert torch.equal(flat.dequantize(), whole.dequantize().reshape(-1))
    data = whole._rowwise_data
    version = data._version
    values = torch.randn(256 * 128, generator=generator).to(BF16)
    flat.copy_(values)
    want = QUANTIZERS[kind]()(values.reshape(256, 128))
    if not getattr(want._quantizer, "with_rht", False):
        assert torch.equal(whole._rowwise_data.view(torch.uint8), want._rowwise_data.view(torch.uint8))
    assert data._version > version, "the write counts on the base's buffers"


def test_a_cut_inside_a_block_is_refused():
    whole = QUANTIZERS["mxfp8"]()(torch.randn(128, 64).to(BF16))
    with pytest.raises(ValueError, match="between its 32-row blocks"):
        torch.split(whole, [48, 80])
