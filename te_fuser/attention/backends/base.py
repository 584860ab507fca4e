"""What every attention backend provides: supports, forward and backward, on kernel-layout tensors."""

from typing import Optional, Tuple

import torch

from .problem import Call, Lengths, Problem

NO_DESCALES = (None, None, None)


class Backend:
    """One attention implementation with te_fuser's semantics.

    forward returns (out, lse, state): out [b, s, h, d] in q's dim order, lse in te_fuser's convention
    (float32 natural-log log-sum-exp, [b, h, s], or [h, tokens] when packed; a view of what the kernel's
    backward reads), and state, the tensors the backward needs besides q, k, v, out and lse (the
    library kernels' RNG state), which the autograd Function saves with save_for_backward.
    """

    name: str = ""
    # TE's variable that turns this backend off when set to 0 (NVTE_FLASH_ATTN, ...), or None.
    te_switch: Optional[str] = None

    def supports(self, problem: Problem) -> Tuple[bool, str]:
        raise NotImplementedError

    def complete(self, call: Call, q: torch.Tensor, k: torch.Tensor, lengths: Lengths) -> Call:
        """The call with what this backend needs filled in (the identity unless a backend needs more)."""
        return call

    def forward(self, q, k, v, lengths: Lengths, call: Call, descales=NO_DESCALES, out_dtype=None):
        raise NotImplementedError

    def backward(self, dout, q, k, v, out, lse, state, lengths: Lengths, call: Call, descales=NO_DESCALES):
        raise NotImplementedError


def refuse_unless(*conditions: Tuple[bool, str]) -> Tuple[bool, str]:
    """(False, the first failed condition's reason) or (True, "")."""
    for ok, reason in conditions:
        if not ok:
            return False, reason
    return True, ""
