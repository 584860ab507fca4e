"""Weight gradients computed now or left for later (TransformerEngine's delay_wgrad_compute).

With a WgradQueue on a linear op, its backward computes only the input's gradient and queues the
weight-gradient GEMM with the operands it reads. The queue lives on the op, never on an autograd
ctx; backward_dw() on the module runs the oldest entry, and the entry's operands go with it.
"""

import collections
from typing import Optional

import torch


class WgradQueue:
    """First in, first out: one entry per backward, each a function and the operands it is called with."""

    def __init__(self):
        self._pending = collections.deque()

    def __len__(self) -> int:
        return len(self._pending)

    def put(self, compute, *operands) -> None:
        self._pending.append((compute, operands))

    def run_oldest(self):
        """compute(*operands) of the oldest entry, which is dropped first: its operands are freed
        as soon as compute returns."""
        compute, operands = self._pending.popleft()
        return compute(*operands)


def refuse_delayed_wgrad_while_tracing() -> None:
    """Under torch.compile the backward is traced once: an entry would be queued at trace time only."""
    if torch.compiler.is_compiling():
        raise NotImplementedError("te_fuser does not run delay_wgrad_compute under torch.compile: the traced "
                                  "backward would queue no weight gradient for backward_dw()")


def finish_wgrad(dw: torch.Tensor, weight_dtype: torch.dtype, main_grad_weight: Optional[torch.Tensor],
                 name: str = "weight") -> Optional[torch.Tensor]:
    """dW in the weight's dtype, or, with fuse_wgrad_accumulation (main_grad_weight given), accumulated
    into main_grad_weight.main_grad -- copied into it with overwrite_main_grad -- and None (no .grad, as in TE)."""
    if main_grad_weight is None:
        return dw if dw.dtype == weight_dtype else dw.to(weight_dtype)
    main_grad = getattr(main_grad_weight, "main_grad", None)
    if main_grad is None:
        raise RuntimeError(f"fuse_wgrad_accumulation is on but {name}.main_grad is not set")
    if getattr(main_grad_weight, "overwrite_main_grad", False):
        main_grad.copy_(dw)
    else:
        main_grad.add_(dw)
    main_grad_weight.grad_added_to_main_grad = True
    return None
