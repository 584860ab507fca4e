"""te_fuser.router (TE's MoE routing functions) against an independent float64 reference written per token from
the definitions (te_fuser/router.py's docstring): experts chosen, probabilities, scores, the aux loss and the
gradients that reach the logits; bf16 logits; the refusals."""

import math

import pytest
import torch

from te_fuser.router import (fused_compute_score_for_moe_aux_loss, fused_moe_aux_loss,
                             fused_topk_with_score_function)


def distinct_logits(generator, tokens, experts, dtype=torch.float32):
    """Random logits whose scores differ enough that float32 and float64 choose the same experts."""
    ranks = torch.stack([torch.randperm(experts, generator=generator) for _ in range(tokens)]).double()
    return ((ranks + 0.3 * torch.rand(tokens, experts, generator=generator, dtype=torch.float64)) * 0.25
            - experts / 8).to(dtype).requires_grad_()


def reference_route(logits64, topk, pre_softmax, num_groups, group_topk, scaling, score_function, bias):
    """Per token in float64: (dense probs, chosen expert sets), differentiable in logits64."""
    tokens, experts = logits64.shape
    rows, chosen_sets = [], []
    for t in range(tokens):
        row = logits64[t]
        if score_function == "softmax":
            e = torch.exp(row - row.max())
            scores = e / e.sum() if pre_softmax else row
        else:
            scores = 1 / (1 + torch.exp(-row))
        choosing = (scores + bias.double() if bias is not None else scores).detach().tolist()
        allowed = list(range(experts))
        if group_topk:
            size = experts // num_groups
            group_score = [sum(sorted(choosing[g * size:(g + 1) * size], reverse=True)[:topk // group_topk])
                           for g in range(num_groups)]
            best_groups = sorted(range(num_groups), key=lambda g: -group_score[g])[:group_topk]
            allowed = [i for g in best_groups for i in range(g * size, (g + 1) * size)]
        chosen = sorted(allowed, key=lambda i: -choosing[i])[:topk]
        picked = scores[chosen]
        if score_function == "softmax" and not pre_softmax:
            e = torch.exp(picked - picked.max())
            picked = e / e.sum()
        elif score_function == "sigmoid" and topk > 1:
            picked = picked / (picked.sum() + 1e-20)
        if scaling:
            picked = picked * scaling
        dense = torch.zeros(experts, dtype=torch.float64).index_put((torch.tensor(chosen),), picked)
        rows.append(dense)
        chosen_sets.append(set(chosen))
    return torch.stack(rows), chosen_sets


CASES = [  # topk, use_pre_softmax, num_groups, group_topk, scaling_factor, score_function, with_bias
    (4, False, None, None, None, "softmax", False),
    (4, True, None, None, 1.2, "softmax", False),
    (8, False, 8, 4, None, "softmax", False),
    (1, True, None, None, None, "softmax", False),
    (4, False, None, None, None, "sigmoid", False),
    (8, False, 8, 4, 2.5, "sigmoid", True),
    (1, False, None, None, None, "sigmoid", True),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[5]}-k{c[0]}{'-pre' if c[1] else ''}{'-groups' if c[3] else ''}"
                                             f"{'-bias' if c[6] else ''}" for c in CASES])
def test_routing_against_float64(case, generator):
    topk, pre, groups, group_topk, scaling, score_function, with_bias = case
    tokens, experts = 37, 32
    logits = distinct_logits(generator, tokens, experts)
    bias = (torch.randn(experts, generator=generator) * 0.3) if with_bias else None
    probs, routing_map = fused_topk_with_score_function(logits, topk, pre, groups, group_topk, scaling,
                                                        score_function, bias)
    logits64 = logits.detach().double().requires_grad_()
    want, chosen = reference_route(logits64, topk, pre, groups, group_topk, scaling, score_function, bias)
    assert routing_map.dtype == torch.bool and probs.dtype == torch.float32
    assert [set(torch.nonzero(r).flatten().tolist()) for r in routing_map] == chosen
    torch.testing.assert_close(probs.double(), want, rtol=2e-6, atol=1e-7)
    weights = torch.randn(tokens, experts, generator=generator)
    (probs * weights).sum().backward()
    (want * weights.double()).sum().backward()
    torch.testing.assert_close(logits.grad.double(), logits64.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize("topk", [1, 3])
def test_scores_for_aux_loss_against_float64(score_function, topk, generator):
    logits = distinct_logits(generator, 29, 16)
    routing_map, scores = fused_compute_score_for_moe_aux_loss(logits, topk, score_function)
    x = logits.detach().double().requires_grad_()
    if score_function == "softmax":
        want = torch.exp(x - x.max(dim=1, keepdim=True).values)
        want = want / want.sum(dim=1, keepdim=True)
    else:
        want = 1 / (1 + torch.exp(-x))
        want = want / (want.sum(dim=1, keepdim=True) + 1e-20) if topk > 1 else want
    torch.testing.assert_close(scores.double(), want, rtol=2e-6, atol=1e-8)
    chosen = [set(sorted(range(16), key=lambda i: -float(r[i]))[:topk]) for r in want.detach()]
    assert [set(torch.nonzero(r).flatten().tolist()) for r in routing_map] == chosen
    weights = torch.randn(29, 16, generator=generator)
    (scores * weights).sum().backward()
    (want * weights.double()).sum().backward()
    torch.testing.assert_close(logits.grad.double(), x.grad, rtol=1e-5, atol=1e-7)


def test_aux_loss_against_float64(generator):
    tokens, experts, topk, coeff = 50, 12, 3, 1e-2
    probs = torch.rand(tokens, experts, generator=generator).requires_grad_()
    counts = torch.randint(0, 40, (experts,), generator=generator)
    loss = fused_moe_aux_loss(probs, counts, tokens * 2, experts, topk, coeff)
    p = probs.detach().double().requires_grad_()
    want = sum(float(counts[e]) * p[:, e].sum() for e in range(experts)) * experts * coeff / (topk * (tokens * 2) ** 2)
    assert loss.shape == () and math.isclose(loss.item(), want.item(), rel_tol=1e-6)
    loss.backward()
    want.backward()
    torch.testing.assert_close(probs.grad.double(), p.grad, rtol=1e-6, atol=1e-12)


def test_bfloat16_logits_give_bfloat16_probs_of_the_float32_computation(generator):
    logits = distinct_logits(generator, 16, 8, torch.bfloat16)
    probs, routing_map = fused_topk_with_score_function(logits, 2, False, None, None, None, "softmax", None)
    ref, ref_map = fused_topk_with_score_function(logits.detach().float(), 2, False, None, None, None, "softmax",
                                                  None)
    assert probs.dtype == torch.bfloat16 and torch.equal(routing_map, ref_map)
    assert torch.equal(probs, ref.to(torch.bfloat16))


def test_refusals():
    logits = torch.randn(4, 8)
    with pytest.raises(ValueError, match="float64"):
        fused_topk_with_score_function(logits.double(), 2, False, None, None, None, "softmax", None)
    with pytest.raises(ValueError, match="topk"):
        fused_topk_with_score_function(logits, 9, False, None, None, None, "softmax", None)
    with pytest.raises(ValueError, match="score_function"):
        fused_compute_score_for_moe_aux_loss(logits, 2, "relu")
    with pytest.raises(ValueError, match="num_groups"):
        fused_topk_with_score_function(logits, 4, False, 3, 2, None, "softmax", None)
    with pytest.raises(ValueError, match="group_topk"):
        fused_topk_with_score_function(logits, 4, False, 4, 3, None, "softmax", None)
    with pytest.raises(ValueError, match="expert_bias"):
        fused_topk_with_score_function(logits, 2, False, None, None, None, "sigmoid", torch.zeros(7))
    with pytest.raises(ValueError, match="tokens_per_expert"):
        fused_moe_aux_loss(logits, torch.ones(7), 4, 8, 2, 0.1)
    with pytest.raises(ValueError, match="total_num_tokens"):
        fused_moe_aux_loss(logits, torch.ones(8), 0, 8, 2, 0.1)
