"""AllGather, ReduceScatter and AllReduce on 2 gloo ranks: each rank's values and gradients against float64
torch computed from every rank's data, and the ops as the identity in a one-process world."""

import pytest
import torch
import torch.distributed as dist

from _gloo_ranks import run_cases

from te_fuser import ops

WORLD = 2


def _rank_data(rank, shape, salt):
    """A tensor every rank can recompute for any rank."""
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(shape, dtype=torch.float64, generator=g)


def _all_gather(rank, group_kind):
    group = dist.new_group([0, 1]) if group_kind == "subgroup" else None
    op = ops.AllGather(group)
    assert op.process_group_size == WORLD
    x = _rank_data(rank, (3, 4), 1).requires_grad_()
    y = op(x)
    torch.testing.assert_close(y, torch.cat([_rank_data(r, (3, 4), 1) for r in range(WORLD)]), rtol=0, atol=0)
    # The loss sums every rank's y * dy_r: the gradient of this rank's shard sums the ranks' dy rows.
    y.backward(_rank_data(rank, (6, 4), 2))
    want = sum(_rank_data(r, (6, 4), 2) for r in range(WORLD)).chunk(WORLD)[rank]
    torch.testing.assert_close(x.grad, want, rtol=1e-15, atol=1e-15)


def _reduce_scatter(rank):
    op = ops.ReduceScatter()
    x = _rank_data(rank, (4, 5), 3).requires_grad_()
    x_before = x.detach().clone()
    y = op(x)
    torch.testing.assert_close(y, sum(_rank_data(r, (4, 5), 3) for r in range(WORLD)).chunk(WORLD)[rank],
                               rtol=1e-15, atol=1e-15)
    assert torch.equal(x.detach(), x_before)  # gloo's reduce-scatter all-reduces; not into the caller's tensor
    y.backward(_rank_data(rank, (2, 5), 4))
    torch.testing.assert_close(x.grad, torch.cat([_rank_data(r, (2, 5), 4) for r in range(WORLD)]), rtol=0, atol=0)


def _all_reduce(rank):
    op = ops.AllReduce()
    x = _rank_data(rank, (3, 2), 5).requires_grad_()
    x_before = x.detach().clone()
    y = op(x)
    torch.testing.assert_close(y, sum(_rank_data(r, (3, 2), 5) for r in range(WORLD)), rtol=1e-15, atol=1e-15)
    assert torch.equal(x.detach(), x_before)
    dy = torch.randn(3, 2, dtype=torch.float64)
    y.backward(dy)
    assert torch.equal(x.grad, dy)  # TE's semantics: the same gradient on every rank, passed back


def _reduce_scatter_bad_dim(rank):
    with pytest.raises(ValueError, match="must be divisible by the TP size 2"):
        ops.ReduceScatter()(torch.randn(3, 2))


def test_collectives_on_two_gloo_ranks():
    run_cases([(_all_gather, "world"), (_all_gather, "subgroup"), (_reduce_scatter,), (_all_reduce,),
               (_reduce_scatter_bad_dim,)], world=WORLD)


@pytest.mark.parametrize("op_class", [ops.AllGather, ops.AllReduce, ops.ReduceScatter])
def test_one_process_world_is_the_identity(op_class):
    x = torch.randn(4, 3, requires_grad=True)
    op = op_class()
    assert op.process_group_size == 1
    y = op(x)
    assert torch.equal(y, x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("op_class", [ops.AllGather, ops.AllReduce, ops.ReduceScatter])
def test_bad_process_group(op_class):
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
        op_class("world")
