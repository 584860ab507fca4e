"""A module's `_extra_state`: the FP8 scaling state of the basic ops it is made of.

Modules call get_fp8_extra_state(ops) from get_extra_state() and
set_fp8_extra_state(ops, state, device) from set_extra_state(), with the
module's basic ops in their forward order.
"""

from typing import Sequence

import torch

from ..ops.op import BasicOperation


def _fp8_ops(ops: Sequence[BasicOperation]):
    """The ops that own FP8 quantizers (only those carry scaling state)."""
    ops = tuple(ops)
    for op in ops:
        if not isinstance(op, BasicOperation):
            raise TypeError(f"ops must hold te_fuser BasicOperations, got {type(op).__name__}")
    return [op for op in ops if op.num_forward_quantizers + op.num_backward_quantizers > 0]


def get_fp8_extra_state(ops: Sequence[BasicOperation]):
    """The FP8 state of `ops`: None before FP8 ran; the op's dict for one FP8 op, else {"ops": [...]}."""
    fp8_ops = _fp8_ops(ops)
    states = [op.fp8_extra_state() for op in fp8_ops]
    if all(s is None for s in states):
        return None
    if len(states) == 1:
        return states[0]
    return {"ops": states}


def set_fp8_extra_state(ops: Sequence[BasicOperation], state, device) -> None:
    """Load what get_fp8_extra_state gave (or None / an empty tensor: no FP8 state) into `ops`."""
    fp8_ops = _fp8_ops(ops)
    if state is None:
        return
    if isinstance(state, torch.Tensor):
        # TransformerEngine serializes its FP8 state into a byte tensor; an empty one means none.
        if state.numel() == 0:
            return
        raise ValueError("te_fuser cannot load TransformerEngine's serialized FP8 state; "
                         "load the checkpoint without '_extra_state' (strict=False) to start fresh scales")
    if not isinstance(state, dict):
        raise TypeError(f"_extra_state must be a dict, a uint8 tensor or None, got {type(state).__name__}")
    states = state["ops"] if "ops" in state else [state]
    if len(states) != len(fp8_ops):
        raise ValueError(f"_extra_state holds the FP8 state of {len(states)} ops, this module has {len(fp8_ops)}")
    for op, op_state in zip(fp8_ops, states):
        op.load_fp8_extra_state(op_state, device)
