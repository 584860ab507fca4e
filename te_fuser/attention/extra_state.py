"""DotProductAttention's `_extra_state` in TransformerEngine's format.

TE's DotProductAttention is a TE base module that runs with num_gemms=3, so its
`_extra_state` holds 9 forward and 6 backward scaling slots (layout in
te_fuser/module/_extra_state.py). TE's FP8 attention uses forward slot 2 for
q, k and v together (one "QKV" scale, one amax: the max over the three
tensors), forward slot 3 for O and 8 for the softmax output S, backward slot 0
for dQKV, 3 for dO and 5 for dP; the other slots stay unused.

te_fuser quantizes q, k and v with one delayed-scaling state of three columns,
O (fp8_output / fp8_mha) with a state of one column, and keeps S and all
gradients in high precision. So:
- writing: the QKV slot gets min(scale_q, scale_k, scale_v) (the one that
  overflows none of the three) and the elementwise max of their histories (the
  amax TE would have recorded for the three together, so TE's next update
  computes their joint scale). q, k and v's own scales and histories go to
  forward slots 0, 1 and 4, which TE's attention never reads; the other slots
  are written as a fresh TE module holds them (scale 1, history 0).
- reading: when slots 0, 1, 4 hold a q, k, v triple consistent with the QKV
  slot (what te_fuser wrote), q, k and v get them back exactly; otherwise (TE's
  state, or one TE has trained on since) q, k and v each start from the QKV
  slot's scale and history. The O slot comes back as the O state when it holds
  one (a scale other than 1 or a non-zero history). The S, dQKV, dO and dP slots
  are dropped.
"""

from typing import Optional

import torch

from ..quantization import DelayedScalingState
from ..module._extra_state import empty_te_slots, read_te_state, te_state_payload

DPA_NUM_GEMMS = 3  # TE's DotProductAttention runs prepare_forward(num_gemms=3)
QKV_SLOT = 2  # TE's META_QKV: FP8FwdTensors.GEMM1_OUTPUT
PER_TENSOR_SLOTS = [0, 1, 4]  # GEMM1_INPUT, GEMM1_WEIGHT, GEMM2_WEIGHT: unused by TE's attention
_QKV = 3  # te_fuser's quantizers: q, k, v
O_SLOT = 3  # TE's META_O: FP8FwdTensors.GEMM2_INPUT


def dpa_extra_state(state, output_state=None) -> torch.Tensor:
    """TE's `_extra_state` of a DotProductAttention whose q, k, v scaling state is `state` (None before
    fp8_dpa ran) and O state `output_state` (None before an FP8 output): a uint8 tensor, empty without
    a delayed-scaling state (as TE for stateless recipes)."""
    if not isinstance(state, DelayedScalingState):
        return torch.empty(0, dtype=torch.uint8)
    scale_fwd, hist_fwd, scale_bwd, hist_bwd = empty_te_slots(state.recipe, DPA_NUM_GEMMS)
    scale, history = state.scale.detach().cpu(), state.amax_history.cpu()
    scale_fwd[QKV_SLOT] = scale.min()
    hist_fwd[:, QKV_SLOT] = history.amax(dim=1)
    scale_fwd[PER_TENSOR_SLOTS] = scale
    hist_fwd[:, PER_TENSOR_SLOTS] = history
    if isinstance(output_state, DelayedScalingState) and output_state.recipe == state.recipe:
        scale_fwd[O_SLOT] = output_state.scale[0]
        hist_fwd[:, O_SLOT] = output_state.amax_history.cpu()[:, 0]
    return te_state_payload(state.recipe, DPA_NUM_GEMMS, scale_fwd, hist_fwd, scale_bwd, hist_bwd)


def _is_qkv_triple(scale, history, qkv_scale, qkv_history) -> bool:
    """Whether per-tensor slots hold what dpa_extra_state wrote for the QKV slot beside them (TE leaves
    them at scale 1, history 0, and once TE has trained on, the QKV slot no longer matches them)."""
    written = bool((scale != 1).any()) or bool(history.any())
    return written and torch.equal(scale.min(), qkv_scale) and torch.equal(history.amax(dim=1), qkv_history)


def load_dpa_extra_state(payload, device) -> Optional[DelayedScalingState]:
    """The q, k, v scaling state held by TE's DotProductAttention `_extra_state` (a uint8 tensor, TE 0.x's
    io.BytesIO, or None); None when it holds no delayed-scaling state."""
    if isinstance(payload, dict):
        raise TypeError("DotProductAttention's _extra_state must be TE's uint8 tensor, an io.BytesIO or None, "
                        "got a dict")
    slots = read_te_state(payload, DPA_NUM_GEMMS)
    if slots is None:
        return None
    scale, history = slots.scale_fwd[PER_TENSOR_SLOTS], slots.amax_history_fwd[:, PER_TENSOR_SLOTS]
    if not _is_qkv_triple(scale, history, slots.scale_fwd[QKV_SLOT], slots.amax_history_fwd[:, QKV_SLOT]):
        scale = slots.scale_fwd[QKV_SLOT].repeat(_QKV)
        history = slots.amax_history_fwd[:, QKV_SLOT:QKV_SLOT + 1].repeat(1, _QKV)
    state = DelayedScalingState(slots.recipe, _QKV, forward=True, device=device)
    state.load_state_dict({"amax_history": history, "scale": scale, "scale_inv": torch.reciprocal(scale)})
    return state


def load_dpa_output_state(payload, device) -> Optional[DelayedScalingState]:
    """The O scaling state held by TE's DotProductAttention `_extra_state`, or None when its O slot
    holds none (scale 1, empty history) or there is no delayed-scaling state."""
    slots = read_te_state(payload, DPA_NUM_GEMMS) if not isinstance(payload, dict) else None
    if slots is None:
        return None
    scale, history = slots.scale_fwd[O_SLOT:O_SLOT + 1].clone(), slots.amax_history_fwd[:, O_SLOT:O_SLOT + 1]
    if scale.item() == 1 and not history.any():
        return None
    state = DelayedScalingState(slots.recipe, 1, forward=True, device=device)
    state.load_state_dict({"amax_history": history, "scale": scale, "scale_inv": torch.reciprocal(scale)})
    return state
