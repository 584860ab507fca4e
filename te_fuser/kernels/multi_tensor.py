"""TE's multi-tensor kernels (`transformer_engine_torch.multi_tensor_*`) in torch, with TE's signatures:
`op(chunk_size, noop_flag, tensor_lists, *args)`.

chunk_size is how TE's CUDA launch splits the tensors; the results do not depend on it, and here it
is only checked. noop_flag is TE's int32 overflow flag: set to 1 (never cleared) when a kernel meets a
non-finite value, without a host synchronization. Norms and scales are computed in float32.
"""

from typing import List, Optional, Sequence, Tuple

import torch

_FLOAT32_MAX = torch.finfo(torch.float32).max


def _check(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[Sequence[torch.Tensor]],
           lists: int) -> List[List[torch.Tensor]]:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if not isinstance(noop_flag, torch.Tensor) or noop_flag.numel() != 1 or noop_flag.dtype != torch.int32:
        raise TypeError(f"noop_flag must be a one-element int32 tensor, got {noop_flag!r}")
    tensor_lists = [list(t) for t in tensor_lists]
    if len(tensor_lists) != lists:
        raise ValueError(f"tensor_lists must hold {lists} lists, got {len(tensor_lists)}")
    if any(len(t) != len(tensor_lists[0]) for t in tensor_lists):
        raise ValueError(f"tensor_lists' lists must have the same length, got {[len(t) for t in tensor_lists]}")
    for i, tensors in enumerate(tensor_lists):
        for j, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise TypeError(f"tensor_lists[{i}][{j}] must be a floating-point tensor, got {t!r}")
            if t.numel() != tensor_lists[0][j].numel():
                raise ValueError(f"tensor_lists[{i}][{j}] has {t.numel()} elements, tensor_lists[0][{j}] "
                                 f"{tensor_lists[0][j].numel()}")
    return tensor_lists


def _flag_if(noop_flag: torch.Tensor, bad: torch.Tensor) -> None:
    """noop_flag = 1 where `bad` (a bool scalar tensor) holds, with no host synchronization."""
    noop_flag.copy_(torch.maximum(noop_flag, bad.to(noop_flag.device, torch.int32).reshape(noop_flag.shape)))


def multi_tensor_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, scale: float) -> None:
    """tensor_lists = [inputs, outputs]: each output = its input * scale (in float32, cast to the output's
    dtype); noop_flag set if an input holds Inf or NaN. Outputs may be the inputs."""
    inputs, outputs = _check(chunk_size, noop_flag, tensor_lists, 2)
    bad = torch.zeros((), dtype=torch.bool, device=noop_flag.device)
    for inp, out in zip(inputs, outputs):
        bad = bad | ~torch.isfinite(inp).all().to(bad.device)
        out.copy_((inp.float() * scale).reshape(out.shape))
    _flag_if(noop_flag, bad)


def _norms(tensors: List[torch.Tensor], inv_scale: Optional[torch.Tensor]) -> torch.Tensor:
    if not tensors:
        return torch.zeros(0)
    parts = [t.float() if inv_scale is None else t.float() * inv_scale.float() for t in tensors]
    return torch.stack([torch.linalg.vector_norm(p) for p in parts])


def _l2norm(noop_flag, tensors, inv_scale, per_tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    norms = _norms(tensors, inv_scale)
    total = torch.linalg.vector_norm(norms).reshape(1)
    _flag_if(noop_flag, ~torch.isfinite(norms).all())
    return total, (norms if per_tensor else norms.new_empty(0))


def multi_tensor_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists,
                        per_tensor: Optional[bool] = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """(the L2 norm of all of tensor_lists[0] together, (1,) float32; each tensor's norm, (n,) float32 when
    per_tensor, else empty). noop_flag set if a norm is not finite."""
    (tensors,) = _check(chunk_size, noop_flag, tensor_lists, 1)
    return _l2norm(noop_flag, tensors, None, bool(per_tensor))


def multi_tensor_unscale_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, inv_scale: torch.Tensor,
                                per_tensor: Optional[bool] = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """multi_tensor_l2norm of the tensors multiplied by inv_scale (a one-element tensor: the loss scale's
    inverse), the tensors left as they are."""
    (tensors,) = _check(chunk_size, noop_flag, tensor_lists, 1)
    if not isinstance(inv_scale, torch.Tensor) or inv_scale.numel() != 1:
        raise TypeError(f"inv_scale must be a one-element tensor, got {inv_scale!r}")
    return _l2norm(noop_flag, tensors, inv_scale.reshape(()), bool(per_tensor))


def compute_scale_from_amax(amax: torch.Tensor, max_fp8: float, force_pow_2_scales: bool,
                            epsilon: float) -> torch.Tensor:
    """TE's current-scaling scale of each float32 amax: max_fp8 / max(amax, epsilon); 1 where that amax is
    0, Inf or NaN; float32's max where the quotient overflows; with force_pow_2_scales the power of two at
    or below it (its mantissa bits cleared)."""
    amax = amax.float()
    clamped = torch.where(amax < epsilon, torch.full_like(amax, epsilon), amax)
    degenerate = (clamped == 0) | torch.isinf(clamped) | torch.isnan(clamped)
    scale = torch.full_like(clamped, max_fp8) / torch.where(degenerate, torch.ones_like(clamped), clamped)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, _FLOAT32_MAX), scale)
    if force_pow_2_scales:
        scale = (scale.view(torch.int32) & -8388608).view(torch.float32)  # keep the sign and exponent bits
    return torch.where(degenerate, torch.ones_like(scale), scale)


def multi_tensor_compute_scale_and_scale_inv(chunk_size: int, noop_flag: torch.Tensor, tensor_lists,
                                             max_fp8: float, force_pow_2_scales: bool = False,
                                             epsilon: float = 0.0) -> None:
    """tensor_lists = [amaxes, scales, scale_invs] (float32): each scale = compute_scale_from_amax of its
    amax, elementwise, and scale_inv = 1 / scale."""
    amaxes, scales, scale_invs = _check(chunk_size, noop_flag, tensor_lists, 3)
    if not 0.0 < max_fp8 < float("inf"):
        raise ValueError(f"max_fp8 must be positive and finite, got {max_fp8}")
    if not 0.0 <= epsilon < float("inf"):
        raise ValueError(f"epsilon must be finite and >= 0, got {epsilon}")
    for amax, scale, scale_inv in zip(amaxes, scales, scale_invs):
        value = compute_scale_from_amax(amax, float(max_fp8), bool(force_pow_2_scales), float(epsilon))
        scale.copy_(value.reshape(scale.shape))
        scale_inv.copy_(torch.reciprocal(value).reshape(scale_inv.shape))
