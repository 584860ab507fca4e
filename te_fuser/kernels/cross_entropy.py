"""Cross-entropy kernels over a vocabulary shard: validated entry points and fake kernels.

torch.ops.te_fuser.cross_entropy_stats / cross_entropy_backward (C on the CPU, csrc/ops/cross_entropy.h; CUDA C
on the GPU, csrc/cuda/ops/cross_entropy.cu).
logits are (..., vocab shard), contiguous, float32 / bfloat16 / float16; target (...) int64.
"""

import torch

from .validate import call_checked, check_contiguous, check_dtype, check_same_device, check_tensor

_ops = torch.ops.te_fuser


def _check(logits, target, vocab_start: int, vocab_size: int) -> None:
    check_dtype(logits, "logits")
    check_contiguous(logits, "logits")
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dimension (the vocabulary), got a scalar")
    check_tensor(target, "target")
    if target.dtype != torch.int64:
        raise TypeError(f"target must be an int64 tensor, got {target.dtype}")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"target must have logits' shape without its last dimension, "
                         f"{tuple(logits.shape[:-1])}, got {tuple(target.shape)}")
    check_contiguous(target, "target")
    check_same_device(target, "target", logits, "logits")
    shard = logits.shape[-1]
    if not 0 <= vocab_start <= vocab_size - shard:
        raise ValueError(f"the vocabulary shard [{vocab_start}, {vocab_start + shard}) must lie in "
                         f"[0, vocab_size = {vocab_size})")


def _check_targets(logits, target, vocab_start: int, vocab_size: int, ignore_index: int) -> None:
    _check(logits, target, vocab_start, vocab_size)
    if torch.compiler.is_compiling():  # the values are not known while tracing (the kernel checks them)
        return
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab_size))
    if bool(bad.any()):
        raise ValueError(f"target holds {target[bad][0].item()}: every target must be in [0, vocab_size = "
                         f"{vocab_size}) or equal to ignore_index ({ignore_index})")


def stats(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, vocab_size: int,
          ignore_index: int) -> torch.Tensor:
    """(..., 4) float32 per row of this shard: max, sum of exp(x - max), the target's logit when it lies in
    the shard (else 0), and the sum of the logits (csrc/ops/cross_entropy.h)."""
    return call_checked(lambda: _check_targets(logits, target, vocab_start, vocab_size, ignore_index),
                        _ops.cross_entropy_stats, logits, target, vocab_start, vocab_size, ignore_index)


def backward(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor, vocab_start: int,
             vocab_size: int, ignore_index: int, smoothing: float, on_target: float) -> torch.Tensor:
    """dlogits = scale * (softmax - smoothing - on_target at the target), 0 on ignored rows, in logits' dtype."""
    return call_checked(lambda: _check_targets(logits, target, vocab_start, vocab_size, ignore_index),
                        _ops.cross_entropy_backward, logits, target, lse, scale, vocab_start, vocab_size,
                        ignore_index, float(smoothing), float(on_target))


@torch.library.register_fake("te_fuser::cross_entropy_stats")
def _stats_fake(logits, target, vocab_start, vocab_size, ignore_index):
    del target, vocab_start, vocab_size, ignore_index
    return logits.new_empty((*logits.shape[:-1], 4), dtype=torch.float32)


@torch.library.register_fake("te_fuser::cross_entropy_backward")
def _backward_fake(logits, target, lse, scale, vocab_start, vocab_size, ignore_index, smoothing, on_target):
    del target, lse, scale, vocab_start, vocab_size, ignore_index, smoothing, on_target
    return torch.empty_like(logits)
