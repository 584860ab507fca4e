"""TransformerEngine's `pytorch.jit` helpers: small elementwise functions (tanh-GELU and its gradient,
L2 normalization, bias-dropout-add) in torch, the decorators TE wraps them with, and their warm-ups.

The `*_fused_` functions are the bare math, wrapped in `jit_fuser`; the names without the trailing
underscore run them with torch.autocast off on their input's device, as TE's do. `jit_fuser` compiles
a function with torch.compile on its first call when NVTE_TORCH_COMPILE is "1": TE's default where a
CUDA device is present; on a CPU-only machine the default is "0" (plain torch: compiling elementwise
functions for the CPU costs more than it saves).
"""

import functools
import os
from typing import Callable, Optional, Tuple

import torch

# TE's constants of the tanh approximation of GELU: sqrt(2/pi), 0.044715, and 3 * 0.044715 * sqrt(2/pi).
_SQRT_2_OVER_PI = 0.79788456
_CUBIC = 0.044715
_CUBIC_DERIVATIVE = 0.1070322243


def lazy_compile(func: Callable) -> Callable:
    """func compiled with torch.compile on its first call (not at import)."""
    compiled = None

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(func)
        return compiled(*args, **kwargs)

    return wrapper


def _compile_enabled() -> bool:
    default = "1" if torch.cuda.is_available() else "0"
    return bool(int(os.getenv("NVTE_TORCH_COMPILE", default)))


jit_fuser = lazy_compile if _compile_enabled() else (lambda func: func)
dropout_fuser = jit_fuser


def no_torch_dynamo(recursive: bool = True) -> Callable[[Callable], Callable]:
    """A decorator keeping TorchDynamo out of a function (and, when recursive, of what it calls)."""
    return lambda func: torch._dynamo.disable(func, recursive=recursive)


def set_jit_fusion_options() -> None:
    """TE sets TorchScript fuser flags here for torch < 2.2; with torch >= 2.2 (te_fuser's) there is nothing to set."""


def _no_autocast(t: torch.Tensor):
    return torch.autocast(device_type=t.device.type, enabled=False)


def _tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    inner = _SQRT_2_OVER_PI * x * (1.0 + _CUBIC * x * x)
    return 0.5 * x * (1.0 + torch.tanh(inner))


def _tanh_gelu_derivative(x: torch.Tensor) -> torch.Tensor:
    t = torch.tanh(_SQRT_2_OVER_PI * x * (1.0 + _CUBIC * x * x))
    d_inner = _SQRT_2_OVER_PI + _CUBIC_DERIVATIVE * x * x
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * d_inner


@jit_fuser
def bias_gelu_fused_(inp: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu(inp + bias), tanh approximation."""
    return _tanh_gelu(inp + bias)


@jit_fuser
def gelu_fused_(inp: torch.Tensor) -> torch.Tensor:
    """gelu(inp), tanh approximation."""
    return _tanh_gelu(inp)


@jit_fuser
def bgrad_dgelu_fused_(grad_output: torch.Tensor, inp: torch.Tensor,
                       bias: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(bias gradient, input gradient) of gelu(inp + bias): the input gradient summed over dim 0."""
    dgelu = _tanh_gelu_derivative(inp + bias) * grad_output
    return dgelu.sum(dim=0), dgelu


@jit_fuser
def dgelu_fused_(grad_output: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
    """The gradient of gelu(inp) (tanh approximation) given grad_output."""
    return _tanh_gelu_derivative(inp) * grad_output


@jit_fuser
def l2normalization_fused_(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dimension."""
    return x * torch.rsqrt(x.square().sum(dim=-1, keepdim=True) + eps)


@jit_fuser
def l2normalization_fwd_fused_(x: torch.Tensor, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(y, rsqrt_norm): the L2-normalized x and the (..., 1) reciprocal norms the backward takes."""
    rsqrt_norm = torch.rsqrt(x.square().sum(dim=-1, keepdim=True) + eps)
    return x * rsqrt_norm, rsqrt_norm


@jit_fuser
def l2normalization_backward_fused_(grad_output: torch.Tensor, x: torch.Tensor, rsqrt_norm: torch.Tensor,
                                    eps: float) -> torch.Tensor:
    """dx of y = x * r, r = rsqrt(sum(x^2) + eps): r * dy - x * r^3 * sum(x * dy). eps is the forward's (r
    already holds it; kept for TE's signature)."""
    del eps
    return rsqrt_norm * grad_output - x * rsqrt_norm.pow(3) * (x * grad_output).sum(dim=-1, keepdim=True)


def bias_gelu_fused(inp: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """gelu(inp + bias) with autocast off; an absent or empty bias is no bias."""
    with _no_autocast(inp):
        if bias is not None and bias.numel() != 0:
            return bias_gelu_fused_(inp, bias)
        return gelu_fused_(inp)


def bgrad_dgelu_fused(grad_output: torch.Tensor, inp: torch.Tensor,
                      bias: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
    """(bias gradient or None without a bias, input gradient) of gelu(inp + bias), autocast off."""
    with _no_autocast(inp):
        if bias is not None and bias.numel() != 0:
            return bgrad_dgelu_fused_(grad_output, inp, bias)
        return None, dgelu_fused_(grad_output, inp)


def l2normalization_fused(x: torch.Tensor, eps: float) -> torch.Tensor:
    """l2normalization_fused_ with autocast off."""
    with _no_autocast(x):
        return l2normalization_fused_(x, eps)


def l2normalization_fwd_fused(x: torch.Tensor, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """l2normalization_fwd_fused_ with autocast off."""
    with _no_autocast(x):
        return l2normalization_fwd_fused_(x, eps)


def l2normalization_backward_fused(grad_output: torch.Tensor, x: torch.Tensor, rsqrt_norm: torch.Tensor,
                                   eps: float) -> torch.Tensor:
    """l2normalization_backward_fused_ with autocast off."""
    with _no_autocast(x):
        return l2normalization_backward_fused_(grad_output, x, rsqrt_norm, eps)


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, prob: float,
                     training: bool) -> torch.Tensor:
    """residual + dropout(x + bias, prob) (dropout only when training)."""
    return residual + torch.nn.functional.dropout(x + bias, p=prob, training=training)


def get_bias_dropout_add(training: bool) -> Callable:
    """bias_dropout_add(x, bias, residual, prob) with `training` bound."""
    return lambda x, bias, residual, prob: bias_dropout_add(x, bias, residual, prob, training)


@dropout_fuser
def bias_dropout_add_fused_train_(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor,
                                  prob: float) -> torch.Tensor:
    """bias_dropout_add in training mode."""
    return bias_dropout_add(x, bias, residual, prob, True)


def bias_dropout_add_fused_train(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor,
                                 prob: float) -> torch.Tensor:
    """bias_dropout_add in training mode, with grad enabled and autocast off."""
    with torch.enable_grad(), _no_autocast(x):
        return bias_dropout_add_fused_train_(x, bias, residual, prob)


@dropout_fuser
def bias_dropout_add_fused_inference_(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor,
                                      prob: float) -> torch.Tensor:
    """bias_dropout_add in inference mode (no dropout)."""
    return bias_dropout_add(x, bias, residual, prob, False)


def bias_dropout_add_fused_inference(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor,
                                     prob: float) -> torch.Tensor:
    """bias_dropout_add in inference mode, autocast off."""
    with _no_autocast(x):
        return bias_dropout_add_fused_inference_(x, bias, residual, prob)


# -- warm-ups: run each function a few times (compiling it under jit_fuser) and leave the RNG as found ------
def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _check_sizes(**sizes) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


class _RngKept:
    """Saves the device generator's state on entry and restores it on exit (warm-ups draw random inputs)."""

    def __enter__(self):
        self._cuda = torch.cuda.is_available()
        self._state = torch.cuda.get_rng_state() if self._cuda else torch.get_rng_state()

    def __exit__(self, *exc_info):
        (torch.cuda.set_rng_state if self._cuda else torch.set_rng_state)(self._state)


def warmup_jit_bias_dropout_add(hidden_size: int, dtype: torch.dtype, seq_length: int,
                                micro_batch_size: int) -> None:
    """Runs bias_dropout_add_fused_train with the input gradient off and on."""
    _check_sizes(hidden_size=hidden_size, seq_length=seq_length, micro_batch_size=micro_batch_size)
    with _RngKept():
        shape = (seq_length, micro_batch_size, hidden_size)
        inp = torch.rand(shape, dtype=dtype, device=_device())
        residual = torch.rand(shape, dtype=dtype, device=_device(), requires_grad=True)
        bias = torch.rand(hidden_size, dtype=dtype, device=_device(), requires_grad=True)
        for input_grad in (False, True):
            inp.requires_grad_(input_grad)
            for _ in range(5):
                bias_dropout_add_fused_train(inp, bias, residual, 0.1)


def warmup_jit_bias_dropout_add_all_dtypes(hidden_size: int, seq_length: int, micro_batch_size: int) -> None:
    """warmup_jit_bias_dropout_add in float32, bfloat16 and float16."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        warmup_jit_bias_dropout_add(hidden_size, dtype, seq_length, micro_batch_size)


def warmup_jit_bias_gelu(ffn_hidden_size_per_partition: int, dtype: torch.dtype, seq_length: int,
                         micro_batch_size: int) -> None:
    """Runs bias_gelu_fused_ and gelu_fused_ with the input gradient off and on."""
    _check_sizes(ffn_hidden_size_per_partition=ffn_hidden_size_per_partition, seq_length=seq_length,
                 micro_batch_size=micro_batch_size)
    with _RngKept():
        bias = torch.rand(ffn_hidden_size_per_partition, dtype=dtype, device=_device(), requires_grad=True)
        inp = torch.rand((seq_length * micro_batch_size, ffn_hidden_size_per_partition), dtype=dtype,
                         device=_device())
        for input_grad in (False, True):
            inp.requires_grad_(input_grad)
            for _ in range(5):
                bias_gelu_fused_(inp, bias)
                gelu_fused_(inp)


def warmup_jit_bias_gelu_all_dtypes(ffn_hidden_size: int, seq_length: int, micro_batch_size: int) -> None:
    """warmup_jit_bias_gelu in float32, bfloat16 and float16."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        warmup_jit_bias_gelu(ffn_hidden_size, dtype, seq_length, micro_batch_size)


def warmup_jit_l2normalization(hidden_size: int, dtype: torch.dtype, seq_length: int,
                               micro_batch_size: int) -> None:
    """Runs the L2-normalization functions: inference without the input gradient, forward and backward with it."""
    _check_sizes(hidden_size=hidden_size, seq_length=seq_length, micro_batch_size=micro_batch_size)
    eps = 1e-6
    with _RngKept():
        inp = torch.rand((seq_length * micro_batch_size, hidden_size), dtype=dtype, device=_device())
        for input_grad in (False, True):
            inp.requires_grad_(input_grad)
            for _ in range(5):
                if input_grad:
                    out, rsqrt_norm = l2normalization_fwd_fused_(inp, eps)
                    l2normalization_backward_fused_(torch.rand_like(out), inp, rsqrt_norm, eps)
                else:
                    l2normalization_fused_(inp, eps)


def warmup_jit_l2normalization_all_dtypes(hidden_size: int, seq_length: int, micro_batch_size: int) -> None:
    """warmup_jit_l2normalization in float32, bfloat16 and float16."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        warmup_jit_l2normalization(hidden_size, dtype, seq_length, micro_batch_size)
