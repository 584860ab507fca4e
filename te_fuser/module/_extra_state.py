"""A module's `_extra_state` in TransformerEngine's format: the FP8 scaling state of its basic ops.

Modules call get_fp8_extra_state(ops) from get_extra_state() and
set_fp8_extra_state(ops, state, device) from set_extra_state(), with the
module's basic ops in their forward order.

TE's format (transformer_engine/pytorch/module/base.py): a uint8 tensor of
`pickle.dumps(state)`, empty when there is no state (FP8 never ran, or a
stateless recipe such as current scaling), where state holds
  recipe                 the DelayedScaling recipe object
  scale_fwd              float32 (3 * num_gemms,): per GEMM k, input 3k, weight 3k+1, output 3k+2
  amax_history_fwd       float32 (amax_history_len, 3 * num_gemms)
  scale_bwd              float32 (2 * num_gemms,): grad_output 2k, grad_input 2k+1
  amax_history_bwd       float32 (amax_history_len, 2 * num_gemms)
  extra_fp8_variables    dict of plain values (num_gemms, fp8_checkpoint, fp8_max_fwd, fp8_max_bwd)
TE 1.x payloads lack `recipe` (delayed scaling was the only recipe); TE 0.x
stored an io.BytesIO of torch.save. All are read without unpickling code.

An op with FP8 quantizers counts as g GEMMs when it has 2g forward quantizers
(input, weight per GEMM) and g backward ones (grad_output per GEMM). A linear
op's output and grad_input states (fp8_output / fp8_grad, made on first use)
go to TE's slots 3k+2 and 2k+1, and come back from them when those slots hold
a state (a scale other than 1 or a non-zero history); otherwise TE's slots are
written as scale 1 with an empty history.

te_fuser keeps its delayed-scaling histories in TE's layout (the current amax
in row 0, the completed amaxes oldest-to-newest in rows 1..), so columns are
copied as they are.
"""

import io
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..quantization import DelayedScalingState
from ..ops.op import BasicOperation
from ..recipe import DelayedScaling, Format
from ._te_pickle import (PickledFormat, PickledRecipe, TEFormat, TERecipe, UnsafeExtraStateError, safe_loads,
                         te_dumps)

_TE_KEYS = ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")
_FWD_SLOTS, _BWD_SLOTS = 3, 2  # TE's per-GEMM scaling slots
# A linear op's fp8_output / fp8_grad states: (kind, forward?, TE's slot within the GEMM's slots)
_IO_SLOTS = (("output", True, 2), ("grad_input", False, 1))


def _io_columns(gemm: int):
    """(kind, which TE tensors, column) of GEMM `gemm`'s output and grad_input slots."""
    return [(kind, forward, (_FWD_SLOTS if forward else _BWD_SLOTS) * gemm + slot)
            for kind, forward, slot in _IO_SLOTS]


def _fp8_ops(ops: Sequence[BasicOperation]) -> List[Tuple[BasicOperation, int]]:
    """(op, number of GEMMs) for each op that owns FP8 quantizers."""
    found = []
    for op in tuple(ops):
        if not isinstance(op, BasicOperation):
            raise TypeError(f"ops must hold te_fuser BasicOperations, got {type(op).__name__}")
        nf, nb = op.num_forward_quantizers, op.num_backward_quantizers
        if nf + nb == 0:
            continue
        if nf != 2 * nb:
            raise TypeError(f"{type(op).__name__} has {nf} forward and {nb} backward FP8 quantizers; TE's "
                            f"_extra_state layout needs (input, weight) forward and grad_output backward per GEMM")
        found.append((op, nb))
    return found


def _empty() -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


# -- writing ----------------------------------------------------------------------------------
def _te_recipe(recipe: DelayedScaling) -> TERecipe:
    fmt = recipe.fp8_format
    return TERecipe("DelayedScaling", {
        "margin": int(recipe.margin), "fp8_format": TEFormat(fmt.max_fwd, fmt.max_bwd),
        "amax_history_len": int(recipe.amax_history_len), "amax_compute_algo": recipe.amax_compute_algo,
        "scaling_factor_compute_algo": recipe.scaling_factor_compute_algo, "reduce_amax": bool(recipe.reduce_amax),
        "fp8_dpa": bool(recipe.fp8_dpa), "fp8_mha": bool(recipe.fp8_mha)})


def empty_te_slots(recipe: DelayedScaling, num_gemms: int):
    """TE's (scale_fwd, amax_history_fwd, scale_bwd, amax_history_bwd) for `num_gemms` GEMMs as a fresh
    TE module holds them: scales 1, histories 0."""
    length = int(recipe.amax_history_len)
    f32 = dict(dtype=torch.float32)
    return (torch.ones(_FWD_SLOTS * num_gemms, **f32), torch.zeros(length, _FWD_SLOTS * num_gemms, **f32),
            torch.ones(_BWD_SLOTS * num_gemms, **f32), torch.zeros(length, _BWD_SLOTS * num_gemms, **f32))


def te_state_payload(recipe: DelayedScaling, num_gemms: int, scale_fwd, hist_fwd, scale_bwd,
                     hist_bwd) -> torch.Tensor:
    """TE's `_extra_state` bytes (a uint8 tensor) of a delayed-scaling state in TE's slot layout."""
    fmt = recipe.fp8_format
    state = {"recipe": _te_recipe(recipe), "scale_fwd": scale_fwd, "amax_history_fwd": hist_fwd,
             "scale_bwd": scale_bwd, "amax_history_bwd": hist_bwd,
             "extra_fp8_variables": {"fp8_checkpoint": True, "num_gemms": num_gemms,
                                     "fp8_max_fwd": float(fmt.max_fwd), "fp8_max_bwd": float(fmt.max_bwd)}}
    return torch.frombuffer(bytearray(te_dumps(state)), dtype=torch.uint8)


def get_fp8_extra_state(ops: Sequence[BasicOperation]) -> torch.Tensor:
    """TE's `_extra_state` for a module made of `ops`: a uint8 tensor, empty when there is no state."""
    fp8_ops = _fp8_ops(ops)
    if not fp8_ops or any(op._fp8_states is None for op, _ in fp8_ops):
        return _empty()
    recipe = fp8_ops[0][0]._fp8_recipe
    if not isinstance(recipe, DelayedScaling):
        return _empty()  # stateless recipe, as in TE
    num_gemms = sum(g for _, g in fp8_ops)
    scale_fwd, hist_fwd, scale_bwd, hist_bwd = empty_te_slots(recipe, num_gemms)
    gemm = 0
    for op, g in fp8_ops:
        if op._fp8_recipe != recipe:
            raise ValueError("the ops of one module must share one FP8 recipe")
        fwd, bwd = op._fp8_states
        fwd_hist, bwd_hist = fwd.amax_history.cpu(), bwd.amax_history.cpu()
        for k in range(g):
            for role in range(2):  # input, weight
                j, slot = 2 * k + role, _FWD_SLOTS * (gemm + k) + role
                scale_fwd[slot] = fwd.scale[j]
                hist_fwd[:, slot] = fwd_hist[:, j]
            slot = _BWD_SLOTS * (gemm + k)
            scale_bwd[slot] = bwd.scale[k]
            hist_bwd[:, slot] = bwd_hist[:, k]
        io_states = op.__dict__.get("_fp8_io_states", {})
        for kind, forward, column in _io_columns(gemm) if g == 1 else ():
            io = io_states.get(kind)
            if isinstance(io, DelayedScalingState) and io.recipe == recipe:
                scales, hists = (scale_fwd, hist_fwd) if forward else (scale_bwd, hist_bwd)
                scales[column] = io.scale[0]
                hists[:, column] = io.amax_history.cpu()[:, 0]
        gemm += g
    return te_state_payload(recipe, num_gemms, scale_fwd, hist_fwd, scale_bwd, hist_bwd)


# -- reading ----------------------------------------------------------------------------------
def _format_from_maxima(value) -> Format:
    for fmt in Format:
        if (float(fmt.max_fwd), float(fmt.max_bwd)) == tuple(value):
            return fmt
    raise ValueError(f"_extra_state's recipe has an FP8 format with maxima {tuple(value)}, which te_fuser lacks")


def _recipe_from_te(pickled) -> DelayedScaling:
    if pickled is None:  # TE 1.x: delayed scaling with TE's defaults
        return DelayedScaling()
    if not isinstance(pickled, PickledRecipe):
        raise ValueError(f"_extra_state's recipe must be a TE recipe, got {type(pickled).__name__}")
    fields = pickled.fields
    fmt = fields.get("fp8_format", Format.HYBRID)
    kwargs = {name: fields[name] for name in ("margin", "amax_history_len", "amax_compute_algo", "reduce_amax",
                                              "fp8_dpa", "fp8_mha") if name in fields}
    return DelayedScaling(fp8_format=_format_from_maxima(fmt) if isinstance(fmt, PickledFormat) else fmt, **kwargs)


def _decode(state):
    """The payload as a dict (or None when it carries no state)."""
    if isinstance(state, io.BytesIO):
        # TE 0.x: torch.save of the state dict; plain tensors and values only.
        state.seek(0)
        try:
            return torch.load(state, weights_only=True)
        except Exception as exc:  # torch raises UnpicklingError with its own allowlist message
            raise UnsafeExtraStateError(f"refusing to load an io.BytesIO _extra_state: {exc}") from exc
    if state.dtype != torch.uint8 or state.dim() != 1:
        raise ValueError(f"a tensor _extra_state must be TE's 1-D uint8 tensor, got {state.dtype} {tuple(state.shape)}")
    if state.numel() == 0:
        return None
    return safe_loads(state.detach().cpu().numpy().tobytes())


def _check(name: str, tensor, shape) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(shape):
        got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"_extra_state '{name}' must have shape {tuple(shape)} for this module, got {got}")
    return tensor.to(torch.float32)


class TESlots(NamedTuple):
    """A decoded delayed-scaling `_extra_state` in TE's slot layout (float32, checked shapes)."""
    recipe: DelayedScaling
    scale_fwd: torch.Tensor  # (3 * num_gemms,)
    amax_history_fwd: torch.Tensor  # (amax_history_len, 3 * num_gemms), TE's history layout
    scale_bwd: torch.Tensor  # (2 * num_gemms,)
    amax_history_bwd: torch.Tensor  # (amax_history_len, 2 * num_gemms)


def read_te_state(state, num_gemms: int) -> Optional[TESlots]:
    """TE's `_extra_state` (a uint8 tensor, TE 0.x's io.BytesIO, or None) of a module of `num_gemms` GEMMs,
    decoded with the safe unpickler; None when it holds no scaling state (empty, or a stateless recipe)."""
    if state is None:
        return None
    if not isinstance(state, (torch.Tensor, io.BytesIO)):
        raise TypeError(f"_extra_state must be a uint8 tensor, an io.BytesIO, a dict or None, got {type(state).__name__}")
    payload = _decode(state)
    if payload is None:
        return None
    if not isinstance(payload, dict):
        raise ValueError(f"_extra_state must decode to a dict, got {type(payload).__name__}")
    if num_gemms == 0:
        raise ValueError("_extra_state holds FP8 state but this module has no FP8 GEMM")
    if not all(key in payload for key in _TE_KEYS):
        recipe = payload.get("recipe")
        if isinstance(recipe, PickledRecipe) and recipe.class_name != "DelayedScaling":
            return None  # a stateless recipe: nothing to restore (te_fuser takes the recipe from autocast)
        raise ValueError(f"_extra_state lacks TE's delayed-scaling tensors {[k for k in _TE_KEYS if k not in payload]}")
    recipe = _recipe_from_te(payload.get("recipe"))
    length = payload["amax_history_fwd"].shape[0] if isinstance(payload["amax_history_fwd"], torch.Tensor) else 0
    if length != recipe.amax_history_len:
        recipe = DelayedScaling(**{**{f: getattr(recipe, f) for f in recipe.__dataclass_fields__},
                                   "amax_history_len": length})
    return TESlots(recipe,
                   _check("scale_fwd", payload["scale_fwd"], (_FWD_SLOTS * num_gemms,)),
                   _check("amax_history_fwd", payload["amax_history_fwd"], (length, _FWD_SLOTS * num_gemms)),
                   _check("scale_bwd", payload["scale_bwd"], (_BWD_SLOTS * num_gemms,)),
                   _check("amax_history_bwd", payload["amax_history_bwd"], (length, _BWD_SLOTS * num_gemms)))


def _load_te(fp8_ops, slots: TESlots, device) -> None:
    gemm = 0
    for op, g in fp8_ops:
        fwd_slots = [_FWD_SLOTS * (gemm + k) + role for k in range(g) for role in range(2)]
        bwd_slots = [_BWD_SLOTS * (gemm + k) for k in range(g)]
        op_state = {"recipe": slots.recipe}
        for key, columns, scale, hist in (("forward", fwd_slots, slots.scale_fwd, slots.amax_history_fwd),
                                          ("backward", bwd_slots, slots.scale_bwd, slots.amax_history_bwd)):
            scale_part = scale[columns].clone()
            op_state[key] = {"amax_history": hist[:, columns], "scale": scale_part,
                             "scale_inv": torch.reciprocal(scale_part)}
        op.load_fp8_extra_state(op_state, device)
        for kind, forward, column in _io_columns(gemm) if g == 1 and hasattr(op, "load_fp8_io_state") else ():
            scale, hist = ((slots.scale_fwd, slots.amax_history_fwd) if forward
                           else (slots.scale_bwd, slots.amax_history_bwd))
            if scale[column] != 1 or hist[:, column].any():
                scale_part = scale[column:column + 1].clone()
                op.load_fp8_io_state(kind, {"amax_history": hist[:, column:column + 1], "scale": scale_part,
                                            "scale_inv": torch.reciprocal(scale_part)}, device)
        gemm += g


def set_fp8_extra_state(ops: Sequence[BasicOperation], state, device) -> None:
    """Load TE's `_extra_state` (any of its formats) or an older te_fuser dict state into `ops`."""
    fp8_ops = _fp8_ops(ops)
    if isinstance(state, dict):  # te_fuser before TE's format: one op's dict, or {"ops": [...]}
        states = state["ops"] if "ops" in state else [state]
        if len(states) != len(fp8_ops):
            raise ValueError(f"_extra_state holds the FP8 state of {len(states)} ops, this module has {len(fp8_ops)}")
        for (op, _), op_state in zip(fp8_ops, states):
            op.load_fp8_extra_state(op_state, device)
        return
    slots = read_te_state(state, sum(g for _, g in fp8_ops))
    if slots is not None:
        _load_te(fp8_ops, slots, device)
