"""TransformerEngine's `pytorch.constants` dtype maps: TE_DType (torch dtype -> DType) and
TE_DType_To_Torch (DType -> torch dtype)."""

from .te_dtype import TE_DTYPE, TORCH_DTYPE

TE_DType = dict(TE_DTYPE)
TE_DType_To_Torch = dict(TORCH_DTYPE)

__all__ = ["TE_DType", "TE_DType_To_Torch"]
