"""TransformerEngine's `pytorch.utils` names that client code and TE's tests call: SplitAlongDim, the
device queries (get_device_compute_capability, is_bf16_compatible, is_non_tn_fp8_gemm_supported,
get_cudnn_version), the weight initializers (init_method_normal, scaled_init_method_normal,
init_method_constant, get_default_init_method), attention_mask_func and gpu_autocast_ctx."""

import functools
import math
from typing import Callable, Sequence, Tuple, Union

import torch

from .tensor.float8_tensor import Float8Tensor


def get_device_compute_capability() -> Tuple[int, int]:
    """(major, minor) CUDA compute capability of the current CUDA device, as torch.cuda reports it;
    (0, 0) where torch sees no CUDA device (te_fuser then runs on the CPU, which has none)."""
    if not torch.cuda.is_available():
        return (0, 0)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return (props.major, props.minor)


def is_bf16_compatible() -> bool:
    """Whether te_fuser computes in bfloat16 on its device: a CUDA device of compute capability 8.0 or
    later (TE's check), or the CPU (torch's CPU kernels take bfloat16) where there is no CUDA device."""
    if not torch.cuda.is_available():
        return True
    return get_device_compute_capability()[0] >= 8


def get_cudnn_version() -> Tuple[int, int, int]:
    """The runtime cuDNN version (major, minor, patch) torch is linked with, decoded as TE decodes it
    (before 9.0 the major version counts thousands, from 9.0 ten thousands); (0, 0, 0) without cuDNN.
    te_fuser's own kernels do not use cuDNN: TE's tests use this to skip cuDNN-only cases."""
    encoded = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if not encoded:
        return (0, 0, 0)
    major, rest = divmod(encoded, 1000 if encoded < 90000 else 10000)
    minor, patch = divmod(rest, 100)
    return (major, minor, patch)


def _check_number(name: str, value, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (positive and value <= 0):
        raise ValueError(f"{name} must be a finite{' positive' if positive else ''} number, got {value!r}")
    return float(value)


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """An initializer filling a tensor in place from N(0, sigma^2)."""
    std = _check_number("sigma", sigma)
    return functools.partial(torch.nn.init.normal_, mean=0.0, std=std)


def scaled_init_method_normal(sigma: float, num_layers: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """An initializer filling a tensor in place from N(0, (sigma / sqrt(2 * num_layers))^2): the output
    projections' initialization of GPT-2 / Megatron."""
    sigma = _check_number("sigma", sigma)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers <= 0:
        raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


def init_method_constant(val: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """An initializer filling a tensor in place with `val`."""
    return functools.partial(torch.nn.init.constant_, val=_check_number("val", val))


def get_default_init_method() -> Callable[[torch.Tensor], torch.Tensor]:
    """TE's weight initializer when none is given: N(0, 0.023^2)."""
    return init_method_normal(0.023)


def attention_mask_func(attention_scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """attention_scores with the positions where the boolean attention_mask is True set to -10000, in place
    (TE's / Megatron's unfused-softmax masking); returns attention_scores."""
    if attention_mask.dtype != torch.bool:
        raise TypeError(f"attention_mask must be a bool tensor (True: masked out), got {attention_mask.dtype}")
    return attention_scores.masked_fill_(attention_mask, -10000.0)


# torch.autocast on CUDA with TE's keywords (enabled, dtype, cache_enabled). TE's modules use it to run
# their kernels with autocast off; te_fuser's modules handle autocast themselves (te_fuser.amp).
gpu_autocast_ctx = functools.partial(torch.amp.autocast, device_type="cuda")


def is_non_tn_fp8_gemm_supported() -> bool:
    """Whether FP8 GEMMs take their operands in any layout (TE: Blackwell's). te_fuser's FP8 GEMMs (its C
    GEMM, torch._scaled_mm) take the "TN" layout only, so a Float8Tensor carries its transposed bytes for
    the gradient GEMMs: False on every device."""
    return False


def _sizes(length: int, split_size_or_sections: Union[int, Sequence[int]]) -> list:
    if isinstance(split_size_or_sections, int):
        if split_size_or_sections <= 0:
            raise ValueError(f"split_size_or_sections must be positive, got {split_size_or_sections}")
        full, rest = divmod(length, split_size_or_sections)
        return [split_size_or_sections] * full + ([rest] if rest else [])
    sizes = [int(s) for s in split_size_or_sections]
    if sum(sizes) != length or any(s < 0 for s in sizes):
        raise ValueError(f"split_size_or_sections {sizes} must be non-negative and sum to the dim's size {length}")
    return sizes


class SplitAlongDim(torch.autograd.Function):
    """torch.split along any dim that keeps a Float8Tensor in FP8 (TE's name and arguments).

    A Float8Tensor's parts are Float8Tensors viewing its bytes, with its scale (Float8Tensor's own
    split dequantizes along dims other than 0; the fused QKV projection's FP8 output is split along
    the head dims). A plain tensor is split as torch.split does. The backward concatenates the
    parts' gradients (zeros for parts without one). Saves nothing for backward.
    """

    @staticmethod
    def forward(ctx, mixed_x_layer: torch.Tensor, split_dim: int, split_size_or_sections):
        dim = split_dim % mixed_x_layer.dim()
        sizes = _sizes(mixed_x_layer.shape[dim], split_size_or_sections)
        ctx.dim, ctx.sizes = dim, sizes
        if isinstance(mixed_x_layer, Float8Tensor):
            t = mixed_x_layer._live()
            return tuple(Float8Tensor(part, t._scale_inv, t.fp8_dtype, t.dtype)
                         for part in t._data.split(sizes, dim))
        return mixed_x_layer.split(sizes, dim)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        parts = []
        for grad in grads:
            parts.append(grad.dequantize() if isinstance(grad, Float8Tensor) else grad)
        like = next(g for g in parts if g is not None)
        for i, size in enumerate(ctx.sizes):
            if parts[i] is None:
                shape = list(like.shape)
                shape[ctx.dim] = size
                parts[i] = like.new_zeros(shape)
        return torch.cat(parts, dim=ctx.dim), None, None
