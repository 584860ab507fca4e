"""Fused element-wise and normalization kernels: validated Python entry points and fake kernels.

The kernels are torch.ops.te_fuser.* (C on CPU, CUDA C on GPU). Tensors are
viewed as (numel / last dim) x (last dim) and must be contiguous.

The activations are TransformerEngine's (transformer_engine/common/util/math.h):
gelu is the tanh approximation (= torch.nn.functional.gelu(x, approximate="tanh")),
qgelu x * sigmoid(1.702 x), srelu relu(x)^2, silu x * sigmoid(x). relu and srelu
give 0 for a NaN input, as TE's fmaxf-based relu does (torch's relu keeps the NaN).
The gated ones (geglu, reglu, qgeglu, sreglu, swiglu) split the last dimension into
halves a, g and return act(a) * g: TE's order, the activation on the first half.

Forward kernels can write FP8 directly: pass `fp8_out=(fp8_dtype, scale, amax)`
and the result holds the FP8 codes of value * scale (a plain FP8 tensor),
while amax <- max(amax, max |value|) in place.
"""

from typing import Optional, Tuple

import torch

from .validate import (
    call_checked,
    check_contiguous,
    check_dtype,
    check_fp8_dtype,
    check_one_device_in_fake,
    check_same_device,
    check_scalar_f32,
)

_ops = torch.ops.te_fuser

# The codes of csrc/ops/activation.h's tf_activation.
ACTIVATIONS = {"none": 0, "gelu": 1, "relu": 2, "qgelu": 3, "srelu": 4, "silu": 5}
# Each gated activation -> the activation applied to the first half.
GATED_ACTIVATIONS = {"geglu": "gelu", "reglu": "relu", "qgeglu": "qgelu", "sreglu": "srelu", "swiglu": "silu"}

Fp8Out = Optional[Tuple[torch.dtype, torch.Tensor, torch.Tensor]]


def _activation_code(activation: str) -> int:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    return ACTIVATIONS[activation]


def _gated_code(activation: str) -> int:
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(GATED_ACTIVATIONS)}, got {activation!r}")
    return ACTIVATIONS[GATED_ACTIVATIONS[activation]]


def _check_input(x, name: str) -> None:
    check_dtype(x, name)
    check_contiguous(x, name)
    if x.dim() < 1:
        raise ValueError(f"{name} must have at least one dimension, got a scalar")


def _check_like(t, name: str, x, x_name: str) -> None:
    _check_input(t, name)
    check_same_device(t, name, x, x_name)
    if t.shape != x.shape:
        raise ValueError(f"{name} must have the shape of {x_name} {tuple(x.shape)}, got {tuple(t.shape)}")


def _check_vector(v, name: str, x, x_name: str = "x") -> None:
    _check_input(v, name)
    check_same_device(v, name, x, x_name)
    if v.dim() != 1 or v.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{name} must be 1-D with {x_name}.shape[-1] = {x.shape[-1]} elements, got shape {tuple(v.shape)}"
        )


def _check_stats(t, name: str, x) -> None:
    check_dtype(t, name, (torch.float32,))
    check_contiguous(t, name)
    check_same_device(t, name, x, "x")
    if t.numel() != x.numel() // max(x.shape[-1], 1) or t.shape != x.shape[:-1]:
        raise ValueError(f"{name} must have shape {tuple(x.shape[:-1])}, got {tuple(t.shape)}")


def _fp8_args(fp8_out: Fp8Out) -> tuple:
    """fp8_out as the kernels' three trailing arguments (Nones without it)."""
    if fp8_out is None:
        return None, None, None
    if not isinstance(fp8_out, tuple) or len(fp8_out) != 3:
        raise TypeError("fp8_out must be a tuple (fp8_dtype, scale, amax)")
    return fp8_out


def _check_fp8_out(fp8_out: Fp8Out, x) -> None:
    if fp8_out is None:
        return
    fp8_dtype, scale, amax = fp8_out
    check_fp8_dtype(fp8_dtype, "fp8_out[0] (fp8_dtype)")
    check_scalar_f32(scale, "fp8_out[1] (scale)", x, "x")
    check_scalar_f32(amax, "fp8_out[2] (amax)", x, "x")


def bias_activation(x: torch.Tensor, bias: Optional[torch.Tensor] = None, activation: str = "gelu",
                    fp8_out: Fp8Out = None) -> torch.Tensor:
    """activation(x + bias) in one pass: "none", "gelu" (tanh approximation), "relu", "qgelu", "srelu" or "silu"."""
    def check():
        _check_input(x, "x")
        if bias is not None:
            _check_vector(bias, "bias", x)
        _check_fp8_out(fp8_out, x)

    code = _activation_code(activation)
    if fp8_out is None:
        return call_checked(check, _ops.bias_act_forward, x, bias, code)
    return call_checked(check, _ops.bias_act_forward_fp8, x, bias, code, *_fp8_args(fp8_out))


def activation_bias_backward(grad: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor] = None,
                             activation: str = "gelu", compute_dbias: bool = True, fp8_out: Fp8Out = None):
    """(dx, dbias) of activation(x + bias) from one pass over grad and x; dbias is None when not computed.

    dbias is reduced over rows deterministically (fixed row bands summed in a fixed order).
    """
    def check():
        _check_input(x, "x")
        _check_like(grad, "grad", x, "x")
        if bias is not None:
            _check_vector(bias, "bias", x)
        _check_fp8_out(fp8_out, x)

    dx, dbias = call_checked(check, _ops.act_bias_backward, grad, x, bias, _activation_code(activation),
                             bool(compute_dbias), *_fp8_args(fp8_out))
    return dx, (dbias if compute_dbias else None)


def _check_gated_input(x) -> None:
    _check_input(x, "x")
    if x.shape[-1] % 2:
        raise ValueError(f"x.shape[-1] must be even for a gated activation, got {x.shape[-1]}")


def gated_activation(x: torch.Tensor, activation: str = "swiglu", fp8_out: Fp8Out = None) -> torch.Tensor:
    """act(a) * g with a, g = x.chunk(2, dim=-1): "geglu", "reglu", "qgeglu", "sreglu" or "swiglu"."""
    def check():
        _check_gated_input(x)
        _check_fp8_out(fp8_out, x)

    code = _gated_code(activation)
    if fp8_out is None:
        return call_checked(check, _ops.gated_act_forward, x, code)
    return call_checked(check, _ops.gated_act_forward_fp8, x, code, *_fp8_args(fp8_out))


def gated_activation_backward(grad: torch.Tensor, x: torch.Tensor, activation: str = "swiglu") -> torch.Tensor:
    """Gradient of gated_activation with respect to x."""
    def check():
        _check_gated_input(x)
        _check_input(grad, "grad")
        check_same_device(grad, "grad", x, "x")
        if grad.shape != x.shape[:-1] + (x.shape[-1] // 2,):
            raise ValueError(f"grad must have shape {tuple(x.shape[:-1]) + (x.shape[-1] // 2,)}, "
                             f"got {tuple(grad.shape)}")

    return call_checked(check, _ops.gated_act_backward, grad, x, _gated_code(activation))


def _check_eps(eps) -> float:
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    return float(eps)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, zero_centered_gamma: bool = False,
            fp8_out: Fp8Out = None):
    """(y, rstd): y = x / sqrt(mean(x^2) + eps) * weight; rstd float32 per row, for the backward."""
    def check():
        _check_input(x, "x")
        _check_vector(weight, "weight", x)
        _check_fp8_out(fp8_out, x)

    return call_checked(check, _ops.rmsnorm_forward, x, weight, _check_eps(eps), bool(zero_centered_gamma),
                        *_fp8_args(fp8_out))


def rmsnorm_backward(grad, x, rstd, weight, zero_centered_gamma: bool = False):
    """(dx, dweight) of rmsnorm."""
    def check():
        _check_input(x, "x")
        _check_like(grad, "grad", x, "x")
        _check_stats(rstd, "rstd", x)
        _check_vector(weight, "weight", x)

    return call_checked(check, _ops.rmsnorm_backward, grad, x, rstd, weight, bool(zero_centered_gamma))


def layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5,
              zero_centered_gamma: bool = False, fp8_out: Fp8Out = None):
    """(y, mean, rstd): y = (x - mean) * rstd * weight + bias; mean, rstd float32 per row."""
    def check():
        _check_input(x, "x")
        _check_vector(weight, "weight", x)
        _check_vector(bias, "bias", x)
        if bias.dtype != weight.dtype:
            raise TypeError(f"bias must have weight's dtype {weight.dtype}, got {bias.dtype}")
        _check_fp8_out(fp8_out, x)

    return call_checked(check, _ops.layernorm_forward, x, weight, bias, _check_eps(eps), bool(zero_centered_gamma),
                        *_fp8_args(fp8_out))


def layernorm_backward(grad, x, mean, rstd, weight, zero_centered_gamma: bool = False):
    """(dx, dweight, dbias) of layernorm."""
    def check():
        _check_input(x, "x")
        _check_like(grad, "grad", x, "x")
        _check_stats(mean, "mean", x)
        _check_stats(rstd, "rstd", x)
        _check_vector(weight, "weight", x)

    return call_checked(check, _ops.layernorm_backward, grad, x, mean, rstd, weight, bool(zero_centered_gamma))


def _out_like(x, dtype, fp8_dtype, shape=None):
    return x.new_empty(x.shape if shape is None else shape, dtype=fp8_dtype if fp8_dtype is not None else dtype)


@torch.library.register_fake("te_fuser::bias_act_forward")
def _(x, bias, activation):
    check_one_device_in_fake(x=x, bias=bias)
    return torch.empty_like(x)


@torch.library.register_fake("te_fuser::bias_act_forward_fp8")
def _(x, bias, activation, fp8_dtype, scale, amax):
    check_one_device_in_fake(x=x, bias=bias, scale=scale, amax=amax)
    return torch.empty_like(x, dtype=fp8_dtype)


@torch.library.register_fake("te_fuser::act_bias_backward")
def _(grad, x, bias, activation, compute_dbias, fp8_dtype=None, scale=None, amax=None):
    check_one_device_in_fake(grad=grad, x=x, bias=bias, scale=scale, amax=amax)
    dbias_dtype = bias.dtype if bias is not None else grad.dtype
    return (_out_like(x, grad.dtype, fp8_dtype),
            x.new_empty((x.shape[-1] if compute_dbias else 0,), dtype=dbias_dtype))


@torch.library.register_fake("te_fuser::gated_act_forward")
def _(x, activation):
    return x.new_empty(x.shape[:-1] + (x.shape[-1] // 2,))


@torch.library.register_fake("te_fuser::gated_act_forward_fp8")
def _(x, activation, fp8_dtype, scale, amax):
    check_one_device_in_fake(x=x, scale=scale, amax=amax)
    return x.new_empty(x.shape[:-1] + (x.shape[-1] // 2,), dtype=fp8_dtype)


@torch.library.register_fake("te_fuser::gated_act_backward")
def _(grad, x, activation):
    check_one_device_in_fake(grad=grad, x=x)
    return x.new_empty(x.shape, dtype=grad.dtype)


@torch.library.register_fake("te_fuser::rmsnorm_forward")
def _(x, weight, eps, zero_centered_gamma, fp8_dtype=None, scale=None, amax=None):
    check_one_device_in_fake(x=x, weight=weight, scale=scale, amax=amax)
    return _out_like(x, x.dtype, fp8_dtype), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.register_fake("te_fuser::rmsnorm_backward")
def _(grad, x, rstd, weight, zero_centered_gamma):
    check_one_device_in_fake(grad=grad, x=x, rstd=rstd, weight=weight)
    return x.new_empty(x.shape, dtype=grad.dtype), torch.empty_like(weight)


@torch.library.register_fake("te_fuser::layernorm_forward")
def _(x, weight, bias, eps, zero_centered_gamma, fp8_dtype=None, scale=None, amax=None):
    check_one_device_in_fake(x=x, weight=weight, bias=bias, scale=scale, amax=amax)
    stats = x.shape[:-1]
    return (_out_like(x, x.dtype, fp8_dtype), x.new_empty(stats, dtype=torch.float32),
            x.new_empty(stats, dtype=torch.float32))


@torch.library.register_fake("te_fuser::layernorm_backward")
def _(grad, x, mean, rstd, weight, zero_centered_gamma):
    check_one_device_in_fake(grad=grad, x=x, mean=mean, rstd=rstd, weight=weight)
    return x.new_empty(x.shape, dtype=grad.dtype), torch.empty_like(weight), torch.empty_like(weight)
