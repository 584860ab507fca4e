"""MoE routing with TransformerEngine 2.6's API (transformer_engine.pytorch.router).

fused_topk_with_score_function picks each token's top-k experts from its router logits and gives their
probabilities, scattered into a dense (tokens, experts) tensor, with the routing map (bool, same shape):
  softmax, use_pre_softmax:  probs = softmax(logits) at the top-k of softmax(logits);
  softmax, otherwise:        probs = softmax over the top-k logits;
  sigmoid:                   s = sigmoid(logits); the top-k of s + expert_bias (the bias only chooses);
                             probs = s at those experts, divided by their sum + 1e-20 when topk > 1;
  then times scaling_factor when it is given. With group_topk, experts form num_groups equal groups, each
  scored by the sum of its topk / group_topk best scores; only the group_topk best groups are chosen from.
fused_compute_score_for_moe_aux_loss gives the routing map of the top-k scores and all the scores (softmax,
or sigmoid normalized over the row when topk > 1); fused_moe_aux_loss is the load-balancing loss
sum_e(sum_t probs[t, e] * tokens_per_expert[e]) * num_experts * coeff / (topk * total_num_tokens^2).

Everything is computed in float32 and returned in the logits' dtype (TE's kernels do the same); gradients
reach the logits (and the probs, for the loss), not expert_bias or tokens_per_expert, as in TE. These are
torch compositions: the tensors autograd keeps are torch's own saved tensors, released by its backward.
"""

from typing import Optional, Tuple

import torch

__all__ = ["fused_topk_with_score_function", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss"]

_SCORE_FUNCTIONS = ("softmax", "sigmoid")


def _check_logits(logits: torch.Tensor, name: str = "logits") -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() < 2:
        raise ValueError(f"{name} must have at least 2 dimensions (tokens, experts), got shape {tuple(logits.shape)}")
    if logits.dtype == torch.float64:
        raise ValueError(f"{name}: float64 router logits are not supported (TE's kernels take fp32, bf16, fp16)")
    if not logits.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {logits.dtype}")


def _check_topk(topk, experts: int) -> None:
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= experts:
        raise ValueError(f"topk must be an int in [1, {experts}] (the number of experts), got {topk!r}")


def _check_score_function(score_function) -> None:
    if score_function not in _SCORE_FUNCTIONS:
        raise ValueError(f"score_function must be one of {_SCORE_FUNCTIONS}, got {score_function!r}")


def _group_mask(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int) -> torch.Tensor:
    """(tokens, experts) bool: the experts of each token's group_topk best groups, a group scored by the sum
    of its topk // group_topk best scores."""
    tokens, experts = scores.shape
    per_group = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = per_group.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    chosen = group_scores.topk(group_topk, dim=-1).indices
    groups = torch.zeros(tokens, num_groups, dtype=torch.bool, device=scores.device).scatter(1, chosen, True)
    return groups.repeat_interleave(experts // num_groups, dim=1)


def _top(scores: torch.Tensor, topk: int, num_groups: Optional[int], group_topk: Optional[int]):
    """(values, indices) of each row's topk scores, among the chosen groups' experts when group_topk is set."""
    if group_topk:
        scores = scores.masked_fill(~_group_mask(scores, topk, num_groups, group_topk), float("-inf"))
    return scores.topk(topk, dim=-1)


def _check_groups(experts: int, topk: int, num_groups, group_topk) -> None:
    if not group_topk:
        return
    if not (isinstance(num_groups, int) and num_groups > 0 and experts % num_groups == 0):
        raise ValueError(f"num_groups must be a positive int dividing the {experts} experts when group_topk is "
                         f"set, got {num_groups!r}")
    if not (isinstance(group_topk, int) and 0 < group_topk <= num_groups and topk % group_topk == 0):
        raise ValueError(f"group_topk must be an int in [1, num_groups={num_groups}] dividing topk={topk}, got "
                         f"{group_topk!r}")
    if topk // group_topk > experts // num_groups:
        raise ValueError(f"topk / group_topk = {topk // group_topk} experts per group exceeds the "
                         f"{experts // num_groups} experts of a group")


def fused_topk_with_score_function(logits: torch.Tensor, topk: int, use_pre_softmax: bool, num_groups: int,
                                   group_topk: int, scaling_factor: float, score_function: str,
                                   expert_bias: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(probs, routing_map), both (tokens, experts) (the module docstring)."""
    _check_logits(logits)
    shape = logits.shape
    experts = shape[-1]
    _check_topk(topk, experts)
    _check_score_function(score_function)
    _check_groups(experts, topk, num_groups, group_topk)
    if expert_bias is not None and (not isinstance(expert_bias, torch.Tensor) or expert_bias.shape != (experts,)):
        raise ValueError(f"expert_bias must be a tensor of shape ({experts},), got "
                         f"{getattr(expert_bias, 'shape', type(expert_bias).__name__)}")
    x = logits.reshape(-1, experts).float()
    if score_function == "softmax":
        if use_pre_softmax:
            probs, index = _top(torch.softmax(x, dim=-1), topk, num_groups, group_topk)
        else:
            top_logits, index = _top(x, topk, num_groups, group_topk)
            probs = torch.softmax(top_logits, dim=-1)
    else:
        scores = torch.sigmoid(x)
        choosing = scores if expert_bias is None else scores + expert_bias.detach().float()
        _, index = _top(choosing, topk, num_groups, group_topk)
        probs = scores.gather(1, index)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor:
        probs = probs * scaling_factor
    dense = torch.zeros_like(x).scatter(1, index, probs).to(logits.dtype)
    routing_map = torch.zeros(x.shape, dtype=torch.bool, device=x.device).scatter(1, index, True)
    return dense.view(shape), routing_map.view(shape)


def fused_compute_score_for_moe_aux_loss(logits: torch.Tensor, topk: int,
                                         score_function: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(routing_map, scores): the top-k map of the scores and the scores themselves (the module docstring)."""
    _check_logits(logits)
    shape = logits.shape
    experts = shape[-1]
    _check_topk(topk, experts)
    _check_score_function(score_function)
    x = logits.reshape(-1, experts).float()
    if score_function == "softmax":
        scores = torch.softmax(x, dim=-1)
    else:
        scores = torch.sigmoid(x)
        if topk > 1:
            scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    index = scores.topk(topk, dim=-1).indices
    routing_map = torch.zeros(x.shape, dtype=torch.bool, device=x.device).scatter(1, index, True)
    return routing_map.view(shape), scores.to(logits.dtype).view(shape)


def fused_moe_aux_loss(probs: torch.Tensor, tokens_per_expert: torch.Tensor, total_num_tokens: int,
                       num_experts: int, topk: int, coeff: float) -> torch.Tensor:
    """The load-balancing loss (the module docstring), a 0-d tensor of probs' dtype."""
    _check_logits(probs, "probs")
    if tokens_per_expert.shape != (probs.shape[-1],):
        raise ValueError(f"tokens_per_expert must have shape ({probs.shape[-1]},) (one count per expert column of "
                         f"probs), got {tuple(tokens_per_expert.shape)}")
    for name, value in (("total_num_tokens", total_num_tokens), ("num_experts", num_experts), ("topk", topk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    per_expert = probs.reshape(-1, probs.shape[-1]).float().sum(dim=0)
    weighted = (per_expert * tokens_per_expert.detach().float()).sum()
    factor = num_experts * coeff / (topk * float(total_num_tokens) * float(total_num_tokens))
    return (weighted * factor).to(probs.dtype)
