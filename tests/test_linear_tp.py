"""Tensor-parallel te_fuser.Linear on 2 gloo ranks against a single-process Linear holding the full weight."""


import pytest
import torch
import torch.distributed as dist

from _gloo_ranks import run_cases

import te_fuser
from te_fuser import ops, recipe

WORLD = 2
SEQ, BATCH, IN, OUT = 32, 2, 32, 64


def _case(rank, parallel_mode, sequence_parallel, fp8):
    torch.manual_seed(0)
    full = te_fuser.Linear(IN, OUT, device="cpu")
    with torch.no_grad():
        full.bias.normal_()
    x = torch.randn(SEQ, BATCH, IN, requires_grad=True)
    dy = torch.randn(SEQ, BATCH, OUT)

    group = dist.group.WORLD
    tp = te_fuser.Linear(IN, OUT, parallel_mode=parallel_mode, sequence_parallel=sequence_parallel,
                         tp_group=group, device="cpu")
    with torch.no_grad():
        if parallel_mode == "column":
            tp.weight.copy_(full.weight.chunk(WORLD, 0)[rank])
            tp.bias.copy_(full.bias.chunk(WORLD, 0)[rank])
        else:
            tp.weight.copy_(full.weight.chunk(WORLD, 1)[rank])
            tp.bias.copy_(full.bias)

    # Input of this rank: the sequence shard with SP, the feature shard for row mode.
    x_local = x.detach()
    if sequence_parallel and parallel_mode == "column":
        x_local = x_local.chunk(WORLD, 0)[rank]
    if parallel_mode == "row":
        x_local = x_local.chunk(WORLD, 2)[rank]
    x_local = x_local.contiguous().requires_grad_()

    # Gradient of this rank's output.
    dy_local = dy
    if parallel_mode == "column":
        dy_local = dy_local.chunk(WORLD, 2)[rank]
    if sequence_parallel and parallel_mode == "row":
        dy_local = dy_local.chunk(WORLD, 0)[rank]
    dy_local = dy_local.contiguous()

    def run(module, inp, grad):
        if fp8:
            with te_fuser.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling(), fp8_group=group):
                out = module(inp)
        else:
            out = module(inp)
        out.backward(grad)
        return out.detach()

    out_full = run(full, x, dy)
    out_tp = run(tp, x_local, dy_local)

    expect_out = out_full
    gemm_out = out_full - full.bias.detach()  # what the row-parallel all-reduce sums, without the bias
    if parallel_mode == "column":
        expect_out, gemm_out = expect_out.chunk(WORLD, 2)[rank], gemm_out.chunk(WORLD, 2)[rank]
    if sequence_parallel and parallel_mode == "row":
        expect_out, gemm_out = expect_out.chunk(WORLD, 0)[rank], gemm_out.chunk(WORLD, 0)[rank]
    expect_dx = x.grad
    if sequence_parallel and parallel_mode == "column":
        expect_dx = expect_dx.chunk(WORLD, 0)[rank]
    if parallel_mode == "row":
        expect_dx = expect_dx.chunk(WORLD, 2)[rank]
    if parallel_mode == "column":
        expect_dw, expect_db = full.weight.grad.chunk(WORLD, 0)[rank], full.bias.grad.chunk(WORLD, 0)[rank]
    else:
        expect_dw, expect_db = full.weight.grad.chunk(WORLD, 1)[rank], full.bias.grad
    if sequence_parallel and parallel_mode == "row":
        # Each rank saw only its sequence shard: the replicated bias' grad is partial and
        # marked for the framework's all-reduce, as in TransformerEngine/Megatron.
        assert tp.bias.sequence_parallel is True
        dist.all_reduce(tp.bias.grad, group=group)
    pairs = [(out_tp, expect_out), (x_local.grad, expect_dx), (tp.weight.grad, expect_dw), (tp.bias.grad, expect_db)]
    for name, (got, expect) in zip(("out", "dgrad", "wgrad", "bgrad"), pairs):
        if fp8:
            # Each rank casts its shard with its own current scale, so the results agree
            # within FP8 precision only (E4M3 2^-4, E5M2 2^-3 relative per element). The output's
            # error is taken relative to its GEMM part: relative to an output dominated by an
            # N(0,1) bias, a missing all-reduce would stay under the bound.
            rel = (got - expect).norm() / (gemm_out if name == "out" else expect).norm()
            assert rel < 0.1, f"{name}: relative error {rel}"
        else:
            torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5, msg=name)


def _ops_mlp_case(rank, sequence_parallel):
    """LayerNorm -> column BasicLinear -> Bias -> GELU -> row BasicLinear -> Bias, as in a
    Megatron MLP, against the same chain in one process."""
    group = dist.group.WORLD
    torch.manual_seed(0)
    hidden, ffn = IN, 2 * IN

    def chain(mode_col, mode_row, tp_bias):
        return ops.Sequential(ops.LayerNorm(hidden), ops.BasicLinear(hidden, ffn, tensor_parallel_mode=mode_col,
                                                                     tensor_parallel_group=group,
                                                                     sequence_parallel=sequence_parallel),
                              ops.Bias(ffn, tensor_parallel=tp_bias, tensor_parallel_group=group), ops.GELU(),
                              ops.BasicLinear(ffn, hidden, tensor_parallel_mode=mode_row, tensor_parallel_group=group,
                                              sequence_parallel=sequence_parallel),
                              ops.Bias(hidden))

    full = chain(None, None, False)
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0, 0.3)
    sharded = chain("column", "row", True)
    with torch.no_grad():
        sharded[0].weight.copy_(full[0].weight), sharded[0].bias.copy_(full[0].bias)
        sharded[1].weight.copy_(full[1].weight.chunk(WORLD, 0)[rank])
        sharded[2].bias.copy_(full[2].bias.chunk(WORLD, 0)[rank])
        sharded[4].weight.copy_(full[4].weight.chunk(WORLD, 1)[rank])
        sharded[5].bias.copy_(full[5].bias)
    x = torch.randn(SEQ, BATCH, hidden, requires_grad=True)
    dy = torch.randn(SEQ, BATCH, hidden)
    out = full(x)
    out.backward(dy)
    x_local = (x.detach().chunk(WORLD, 0)[rank] if sequence_parallel else x.detach()).contiguous().requires_grad_()
    dy_local = dy.chunk(WORLD, 0)[rank].contiguous() if sequence_parallel else dy
    out_local = sharded(x_local)
    out_local.backward(dy_local)
    expect = out.detach().chunk(WORLD, 0)[rank] if sequence_parallel else out.detach()
    expect_dx = x.grad.chunk(WORLD, 0)[rank] if sequence_parallel else x.grad
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_local.detach(), expect, **tol)
    torch.testing.assert_close(x_local.grad, expect_dx, **tol)
    torch.testing.assert_close(sharded[1].weight.grad, full[1].weight.grad.chunk(WORLD, 0)[rank], **tol)
    torch.testing.assert_close(sharded[2].bias.grad, full[2].bias.grad.chunk(WORLD, 0)[rank], **tol)
    torch.testing.assert_close(sharded[4].weight.grad, full[4].weight.grad.chunk(WORLD, 1)[rank], **tol)
    if sequence_parallel:  # replicated parameters: partial gradients, summed by the framework
        for p in (sharded[0].weight, sharded[0].bias, sharded[5].bias):
            dist.all_reduce(p.grad, group=group)
    torch.testing.assert_close(sharded[0].weight.grad, full[0].weight.grad, **tol)
    torch.testing.assert_close(sharded[5].bias.grad, full[5].bias.grad, **tol)


def _amax_reduction_case(rank):
    """Delayed scaling under fp8_group: each rank's input amax differs, the reduced history does not."""
    group = dist.group.WORLD
    torch.manual_seed(rank)
    layer = te_fuser.Linear(IN, OUT, parallel_mode="row", tp_group=group, device="cpu")
    x = torch.randn(SEQ, BATCH, IN // WORLD) * (rank + 1)
    with te_fuser.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=4), fp8_group=group):
        layer(x)
    history = layer._ops[0]._fp8_states[0].amax_history[-1].clone()
    gathered = [torch.empty_like(history) for _ in range(WORLD)]
    dist.all_gather(gathered, history, group=group)
    assert torch.equal(gathered[0], gathered[1]), gathered
    local = torch.tensor([x.abs().max().item()])
    dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    assert history[0].item() == local.item()  # the input amax, reduced with MAX


CASES = [(_case, mode, sp, fp8) for mode in ("column", "row") for sp in (False, True) for fp8 in (False, True)]
CASES += [(_amax_reduction_case,), (_ops_mlp_case, False), (_ops_mlp_case, True)]


def test_tensor_parallel_matches_single_process():
    run_cases(CASES, world=WORLD)


def test_column_parallel_shapes_and_errors():
    layer = te_fuser.Linear(IN, OUT, parallel_mode="column", tp_size=2, device="cpu")
    assert layer.weight.shape == (OUT // 2, IN) and layer.bias.shape == (OUT // 2,)
    # Megatron/TE tensor-parallel attributes, which frameworks use to sync replicated grads.
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 0
    assert layer.bias.tensor_model_parallel and layer.bias.partition_dim == 0
    layer = te_fuser.Linear(IN, OUT, parallel_mode="row", tp_size=2, device="cpu")
    assert layer.weight.shape == (OUT, IN // 2) and layer.bias.shape == (OUT,)
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 1
    assert not layer.bias.tensor_model_parallel
    assert not te_fuser.Linear(IN, OUT, device="cpu").weight.tensor_model_parallel
    bias = ops.Bias(OUT, tensor_parallel=True, tensor_parallel_size=2)
    assert bias.bias.shape == (OUT // 2,) and bias.bias.tensor_model_parallel
    linear = ops.BasicLinear(IN, OUT, tensor_parallel_mode="row", tensor_parallel_size=2)
    assert linear.weight.shape == (OUT, IN // 2) and linear.weight.partition_dim == 1
    with pytest.raises(ValueError, match="divisible by the TP size"):
        te_fuser.Linear(IN, OUT - 1, parallel_mode="column", tp_size=2, device="cpu")
