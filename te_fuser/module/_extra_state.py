"""A module's `_extra_state`: the FP8 recipe state of its ops, in one object.

Interim format (to be replaced by TransformerEngine's serialized format): a
list with one entry per op that has FP8 quantizers, in the fuser's order, or
None when no op has run under FP8 yet.
"""

from typing import Sequence

import torch


def _quantized_ops(ops: Sequence) -> list:
    return [op for op in ops if op.num_forward_quantizers + op.num_backward_quantizers > 0]


def get_fp8_extra_state(ops: Sequence):
    states = [op.fp8_extra_state() for op in _quantized_ops(ops)]
    return states if any(s is not None for s in states) else None


def set_fp8_extra_state(ops: Sequence, state, device) -> None:
    if state is None:
        return
    if isinstance(state, torch.Tensor):
        # TransformerEngine serializes its FP8 state into a byte tensor; an empty one means none.
        if state.numel() == 0:
            return
        raise ValueError("te_fuser cannot load TransformerEngine's serialized FP8 state yet; "
                         "load the checkpoint without '_extra_state' (strict=False) to start fresh scales")
    if isinstance(state, dict):  # one op's state, as te_fuser.Linear saved it before
        state = [state]
    ops = _quantized_ops(ops)
    if not isinstance(state, (list, tuple)) or len(state) != len(ops):
        raise ValueError(f"_extra_state holds FP8 state for {len(state) if isinstance(state, (list, tuple)) else '?'}"
                         f" ops, the module has {len(ops)} ops with FP8 quantizers")
    for op, op_state in zip(ops, state):
        op.load_fp8_extra_state(op_state, device)
