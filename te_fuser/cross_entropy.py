"""parallel_cross_entropy: TransformerEngine's fused, vocabulary-parallel cross-entropy loss.

Each rank of `dist_process_group` holds the logits of its vocabulary shard, (..., V / world size), ranks in
order; the loss is that of the whole vocabulary. The C kernels (te_fuser.kernels.cross_entropy) read the
logits in their own dtype and compute in float32; no float32 copy of the logits is made, forward or
backward. The ranks exchange three float32 numbers per token (two all-reduces), not logits.
"""

import torch

from .kernels import cross_entropy as kernels


def _group_rank_and_size(group):
    if group is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 0, 1
    return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)


def _combine(stats: torch.Tensor, group, world_size: int):
    """(lse, target logit, sum of logits) over the whole vocabulary from each rank's shard statistics."""
    m, d, target_logit, logit_sum = stats.unbind(-1)
    if world_size > 1:
        m_all = m.clone()
        torch.distributed.all_reduce(m_all, op=torch.distributed.ReduceOp.MAX, group=group)
        # exp(-inf - -inf) is NaN: a shard whose logits are all -inf adds nothing.
        rescale = torch.where(m == m_all, torch.ones_like(m), torch.exp(m - m_all))
        sums = torch.stack((d * rescale, target_logit, logit_sum), dim=-1)
        torch.distributed.all_reduce(sums, group=group)
        m, (d, target_logit, logit_sum) = m_all, sums.unbind(-1)
    return m + torch.log(d), target_logit, logit_sum


class CrossEntropyFunction(torch.autograd.Function):
    """The loss per token (float32), or its mean over the tokens not ignored when reduce_loss; saves the
    logits, the targets, each token's log-sum-exp and the count, through save_for_backward only."""

    @staticmethod
    def forward(ctx, logits, target, label_smoothing=0.0, reduce_loss=False, dist_process_group=None,
                ignore_idx=-100, is_cg_capturable=False):
        del is_cg_capturable  # nothing here syncs with the host: the loss is always capturable
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
        if not isinstance(target, torch.Tensor) or target.is_floating_point() or target.is_complex() or \
                target.dtype == torch.bool:
            raise TypeError(f"target must be an integer tensor of class indices, got "
                            f"{target.dtype if isinstance(target, torch.Tensor) else type(target).__name__}")
        rank, world_size = _group_rank_and_size(dist_process_group)
        logits = logits.contiguous()
        target = target.to(torch.int64).contiguous()
        shard = logits.shape[-1]
        vocab_size = shard * world_size
        stats = kernels.stats(logits, target, rank * shard, vocab_size, ignore_idx)
        lse, target_logit, logit_sum = _combine(stats, dist_process_group, world_size)
        loss = lse - (1.0 - label_smoothing) * target_logit
        if label_smoothing > 0:  # only then: a -inf logit makes the sum -inf
            loss = loss - (label_smoothing / vocab_size) * logit_sum
        kept = target != ignore_idx
        loss = torch.where(kept, loss, torch.zeros_like(loss))
        count = kept.sum()
        if reduce_loss:
            loss = loss.sum() / count
        ctx.save_for_backward(logits, target, lse, count)
        ctx.shard = (rank * shard, vocab_size, ignore_idx)
        ctx.smoothing = label_smoothing
        ctx.reduce_loss = reduce_loss
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target, lse, count = ctx.saved_tensors
        if ctx.reduce_loss:
            grad_loss = grad_loss / count
        scale = grad_loss.to(torch.float32).expand(lse.shape).contiguous()
        vocab_start, vocab_size, ignore_idx = ctx.shard
        grad = kernels.backward(logits, target, lse.contiguous(), scale, vocab_start, vocab_size, ignore_idx,
                                ctx.smoothing / vocab_size, 1.0 - ctx.smoothing)
        return grad, None, None, None, None, None, None


def parallel_cross_entropy(inp, target, label_smoothing=0.0, reduce_loss=False, dist_process_group=None,
                           ignore_idx=-100, is_cg_capturable=False):
    """Cross-entropy of logits `inp` (..., V / world size) against `target` (...), TE's signature.

    The loss per token, in float32 and target's shape, or with reduce_loss its mean over the tokens whose
    target is not ignore_idx (F.cross_entropy's 'mean'). label_smoothing as F.cross_entropy's. Targets
    equal to ignore_idx give 0 and no gradient; any other target outside [0, V) is a ValueError on the CPU,
    and on CUDA (where raising would wait for the device) a NaN loss and gradient for that token.
    The gradient has inp's dtype."""
    return CrossEntropyFunction.apply(inp, target, label_smoothing, reduce_loss, dist_process_group, ignore_idx,
                                      is_cg_capturable)


__all__ = ["parallel_cross_entropy"]
