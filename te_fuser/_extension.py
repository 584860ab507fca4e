"""Loads te_fuser._C, whose import registers the torch.ops.te_fuser kernels."""

import torch  # loads libtorch, which te_fuser._C links against

try:
    from . import _C  # noqa: F401  (imported for its op registrations)
except ImportError as err:  # pragma: no cover - only hit on a broken install
    raise ImportError(
        "te_fuser's compiled extension te_fuser._C is missing or does not load: "
        "build it with `pip install --no-build-isolation -e .` "
        f"(original error: {err})"
    ) from err


def has_cuda_kernels() -> bool:
    """True when this build of te_fuser carries its CUDA kernels."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("te_fuser::fp8_quantize", "CUDA")
