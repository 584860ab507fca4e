"""Tensor-parallel te_fuser.Linear on 2 gloo ranks against a single-process Linear holding the full weight."""

import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import te_fuser
from te_fuser import recipe

WORLD = 2
SEQ, BATCH, IN, OUT = 32, 2, 32, 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    if parallel_mode == "column":
        expect_out = expect_out.chunk(WORLD, 2)[rank]
    if sequence_parallel and parallel_mode == "row":
        expect_out = expect_out.chunk(WORLD, 0)[rank]
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
            # within FP8 precision only (E4M3 2^-4, E5M2 2^-3 relative per element).
            rel = (got - expect).norm() / expect.norm()
            assert rel < 0.1, f"{name}: relative error {rel}"
        else:
            torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5, msg=name)


def _amax_reduction_case(rank):
    """Delayed scaling under fp8_group: each rank's input amax differs, the reduced history does not."""
    group = dist.group.WORLD
    torch.manual_seed(rank)
    layer = te_fuser.Linear(IN, OUT, parallel_mode="row", tp_group=group, device="cpu")
    x = torch.randn(SEQ, BATCH, IN // WORLD) * (rank + 1)
    with te_fuser.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=4), fp8_group=group):
        layer(x)
    history = layer._ops[0]._fp8_states[0].amax_history[0].clone()
    gathered = [torch.empty_like(history) for _ in range(WORLD)]
    dist.all_gather(gathered, history, group=group)
    assert torch.equal(gathered[0], gathered[1]), gathered
    local = torch.tensor([x.abs().max().item()])
    dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    assert history[0].item() == local.item()  # the input amax, reduced with MAX


def _worker(rank, port, cases, errors):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        for case in cases:
            try:
                _case(rank, *case) if case != "amax_reduction" else _amax_reduction_case(rank)
            except Exception:  # reported to the parent, which fails the test
                errors.put((rank, case, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


CASES = [(mode, sp, fp8) for mode in ("column", "row") for sp in (False, True) for fp8 in (False, True)]
CASES.append("amax_reduction")


def test_tensor_parallel_matches_single_process():
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    mp.start_processes(_worker, args=(_free_port(), CASES, errors), nprocs=WORLD, join=True,
                       start_method="spawn")
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not failures, "\n".join(f"rank {r} case {c}:\n{tb}" for r, c, tb in failures)


def test_column_parallel_shapes_and_errors():
    layer = te_fuser.Linear(IN, OUT, parallel_mode="column", tp_size=2, device="cpu")
    assert layer.weight.shape == (OUT // 2, IN) and layer.bias.shape == (OUT // 2,)
    layer = te_fuser.Linear(IN, OUT, parallel_mode="row", tp_size=2, device="cpu")
    assert layer.weight.shape == (OUT, IN // 2) and layer.bias.shape == (OUT,)
    with pytest.raises(ValueError, match="divisible by the TP size"):
        te_fuser.Linear(IN, OUT - 1, parallel_mode="column", tp_size=2, device="cpu")
