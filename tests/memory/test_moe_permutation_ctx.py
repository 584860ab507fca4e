"""The MoE permutation Functions keep tensors for backward only through save_for_backward, and nothing
stays on the graph after backward (the seed-000 bug): the graph walk before and after backward, with
bug-on controls that keep a tensor on a ctx."""

import pytest
import torch

from te_fuser import moe_permute, moe_permute_with_probs, moe_sort_chunks_by_index_with_probs, moe_unpermute
from te_fuser import permutation

from _fuser_ctx_walk import allowed_storages, assert_nothing_reachable, reachable_tensors

TOKENS, EXPERTS, HIDDEN = 32, 4, 16


def _moe_step(expert: torch.nn.Module):
    """mask map with probs, chunk sort, index map: every Function of te_fuser.permutation on one graph."""
    torch.manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    probs = torch.rand(TOKENS, EXPERTS, requires_grad=True)
    mask = torch.rand(TOKENS, EXPERTS) < 0.5
    num_out = int(mask.sum())
    out, permuted_probs, row_id_map = moe_permute_with_probs(x, probs * mask, mask, num_out_tokens=num_out)
    half = num_out // 2
    for sizes in ([half, num_out - half], [num_out - half, half]):  # swap the halves, then swap them back
        out, permuted_probs = moe_sort_chunks_by_index_with_probs(out, permuted_probs, torch.tensor(sizes),
                                                                  torch.tensor([1, 0]))
    y = expert(out) * permuted_probs[:, None]
    merged = moe_unpermute(y, row_id_map, probs, restore_shape=x.shape)
    index = torch.randint(0, EXPERTS, (TOKENS, 2), dtype=torch.int32)
    routed, index_map = moe_permute(merged, index, map_type="index")
    back = moe_unpermute(expert(routed), index_map, torch.rand(TOKENS, 2, requires_grad=True), map_type="index")
    return back + moe_unpermute(routed, index_map, map_type="index").view(TOKENS, 2, HIDDEN).sum(1)


def _expert():
    torch.manual_seed(1)
    return torch.nn.Linear(HIDDEN, HIDDEN)


def test_only_saved_tensors_before_and_nothing_after_backward():
    expert = _expert()
    allowed = allowed_storages(expert)
    out = _moe_step(expert)
    assert reachable_tensors(out, allowed)  # the walk sees what the forward saved
    assert reachable_tensors(out, allowed, saved=False) == []
    out.sum().backward()
    assert_nothing_reachable(out, allowed)


@pytest.mark.parametrize("function", ["_UnpermuteMaskMap", "_PermuteIndexMap", "_SortChunks"])
def test_walk_catches_a_tensor_kept_on_the_ctx(function, monkeypatch):
    """Bug-on control: a Function that also keeps its input on the ctx is seen before and after backward."""
    cls = getattr(permutation, function)
    original = cls.forward

    def keeps_input(ctx, inp, *args):
        ctx.kept = inp
        return original(ctx, inp, *args)

    monkeypatch.setattr(cls, "forward", staticmethod(keeps_input))
    expert = _expert()
    allowed = allowed_storages(expert)
    out = _moe_step(expert)
    assert reachable_tensors(out, allowed, saved=False)
    out.sum().backward()
    with pytest.raises(AssertionError, match="still reachable"):
        assert_nothing_reachable(out, allowed)
