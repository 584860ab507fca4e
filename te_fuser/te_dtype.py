"""TransformerEngine's `DType` enum (`transformer_engine_torch.DType`) and its torch counterparts.

TE's tensors and quantizers name their formats with DType; te_fuser's kernels take torch dtypes.
Quantizers and Float8Tensor accept either, and report DType where TE does (`_fp8_dtype`, a
quantizer's `dtype`).
"""

import enum

import torch


class DType(enum.Enum):
    """TE's data types, with TE's numbers (transformer_engine.h's NVTEDType); the members TE 2.6
    exposes to Python. kFloat8E4M3 is OCP E4M3 (torch.float8_e4m3fn), kFloat8E5M2 is E5M2, kFloat4E2M1
    NVFP4's E2M1."""

    kByte = 0
    kInt32 = 2
    kFloat32 = 4
    kFloat16 = 5
    kBFloat16 = 6
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8
    kFloat4E2M1 = 10  # NVFP4's values, two a byte (no torch dtype: te_fuser stores them as uint8)

    def __int__(self) -> int:
        return self.value

    __index__ = __int__


TORCH_DTYPE = {
    DType.kByte: torch.uint8,
    DType.kInt32: torch.int32,
    DType.kFloat32: torch.float32,
    DType.kFloat16: torch.float16,
    DType.kBFloat16: torch.bfloat16,
    DType.kFloat8E4M3: torch.float8_e4m3fn,
    DType.kFloat8E5M2: torch.float8_e5m2,
}
TE_DTYPE = {torch_dtype: te_dtype for te_dtype, torch_dtype in TORCH_DTYPE.items()}
FP8_TE_DTYPES = (DType.kFloat8E4M3, DType.kFloat8E5M2)


def fp8_torch_dtype(value, name: str = "fp8_dtype") -> torch.dtype:
    """The torch float8 dtype of `value`: a DType FP8 member or torch.float8_e4m3fn / float8_e5m2."""
    if isinstance(value, DType):
        value = TORCH_DTYPE[value]
    if value not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"{name} must be DType.kFloat8E4M3 / kFloat8E5M2 or torch.float8_e4m3fn / "
                         f"torch.float8_e5m2, got {value!r}")
    return value


def te_dtype(torch_dtype: torch.dtype) -> DType:
    """The DType of a torch dtype TE names (ValueError for one it does not)."""
    try:
        return TE_DTYPE[torch_dtype]
    except (KeyError, TypeError):
        raise ValueError(f"TransformerEngine's DType has no member for {torch_dtype!r}") from None
