"""Argument checks for the kernel wrappers: clear TypeError/ValueError naming the argument."""

from typing import Callable, Iterable

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d) for d in dtypes)


def check_tensor(value, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if type(value) is torch.Tensor and not value.is_meta and not torch.compiler.is_compiling():
        # A storage freed by te_fuser.memory.release_storage raises its own message here; through the
        # stable ABI the kernels would only report that reading the data pointer failed.
        value.data_ptr()
    return value


def call_checked(check: Callable[[], None], kernel, *args):
    """kernel(*args), where check() raises the TypeError/ValueError that names a bad argument.

    The binding checks every argument itself (a RuntimeError), so check() runs only when the kernel
    refuses its arguments, and then raises in its place: on a small tensor the Python checks cost
    more than the kernel. The fake kernels under torch.compile check nothing: there check() runs
    first.
    """
    if torch.compiler.is_compiling():
        check()
        return kernel(*args)
    try:
        return kernel(*args)
    except RuntimeError:
        check()
        raise


def check_dtype(t: torch.Tensor, name: str, allowed=FLOAT_DTYPES) -> None:
    check_tensor(t, name)
    if t.dtype not in allowed:
        raise TypeError(f"{name} must have dtype in ({_names(allowed)}), got {t.dtype}")


def check_fp8_dtype(dtype, name: str = "fp8_dtype") -> None:
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{name} must be one of ({_names(FP8_DTYPES)}), got {dtype!r}")


def check_float_dtype(dtype, name: str) -> None:
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be one of ({_names(FLOAT_DTYPES)}), got {dtype!r}")


def check_contiguous(t: torch.Tensor, name: str) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")


def check_same_device(t: torch.Tensor, name: str, other: torch.Tensor, other_name: str) -> None:
    if t.device != other.device:
        raise ValueError(
            f"{name} is on {t.device} but {other_name} is on {other.device}; "
            "they must be on the same device"
        )


def check_scalar_f32(t, name: str, like: torch.Tensor, like_name: str) -> None:
    """A float32 tensor of one element on the same device as `like`."""
    check_tensor(t, name)
    if t.dtype != torch.float32 or t.numel() != 1:
        raise TypeError(
            f"{name} must be a float32 tensor with one element, got dtype {t.dtype} "
            f"and shape {tuple(t.shape)}"
        )
    check_same_device(t, name, like, like_name)


def check_divisible(value: int, divisor: int, name: str) -> None:
    if value % divisor:
        raise ValueError(f"{name} must be divisible by {divisor}, got {value}")


def check_one_device_in_fake(**tensors) -> None:
    """The binding's device check, for the fake kernels: a meta tensor among real ones sends the eager
    call to the fake kernel, which then refuses the mix with a RuntimeError as the binding would, and
    the wrapper (call_checked) raises its own message. None entries are skipped."""
    given = [(name, t) for name, t in tensors.items() if t is not None]
    first, t0 = given[0]
    for name, t in given[1:]:
        if t.device != t0.device:
            raise RuntimeError(f"{name} must be on {first}'s device ({t0.device}), got {t.device}")
