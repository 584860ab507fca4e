"""Which GEMM an op's quantized tensors go through, told by the kinds of its quantizers rather than by the
recipe's class: a CustomRecipe's factory returns quantizers of any kind, one per role."""

from typing import Optional, Sequence, Tuple

from ..tensor.float8_blockwise_tensor import Float8BlockQuantizer
from ..tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer
from ..tensor.mxfp8_tensor import MXFP8Quantizer
from ..tensor.nvfp4_tensor import NVFP4Quantizer
from .block_gemm import FP8_BLOCK, MXFP8_BLOCK, NVFP4_BLOCK

PER_TENSOR = None  # the K block of te_fuser's per-tensor FP8 GEMM: none
_KINDS = ((Float8Quantizer, PER_TENSOR), (Float8CurrentScalingQuantizer, PER_TENSOR), (MXFP8Quantizer, MXFP8_BLOCK),
          (Float8BlockQuantizer, FP8_BLOCK), (NVFP4Quantizer, NVFP4_BLOCK))


def quantizer_block(role: str, quantizer) -> Optional[int]:
    """The K block of the GEMM that takes quantizer's tensors (PER_TENSOR for per-tensor FP8); a TypeError
    naming the role for a quantizer no te_fuser GEMM takes."""
    for kind, block in _KINDS:
        if isinstance(quantizer, kind):
            return block
    raise TypeError(f"no te_fuser GEMM takes the tensors of {type(quantizer).__name__} (role {role}); use "
                    f"one of {', '.join(kind.__name__ for kind, _ in _KINDS)}")


def gemm_block(owner: str, quantizers: Sequence[Tuple[str, object]]) -> Optional[int]:
    """The K block of the one GEMM kind that takes the tensors of all (role, quantizer) pairs: None for
    per-tensor FP8 (Float8Quantizer, Float8CurrentScalingQuantizer), else the block-scaled GEMM's block
    (MXFP8Quantizer 32, Float8BlockQuantizer 128, NVFP4Quantizer 16). A ValueError naming each role and
    quantizer type when no one GEMM takes them together."""
    blocks = {quantizer_block(role, quantizer) for role, quantizer in quantizers}
    if len(blocks) > 1:
        got = ", ".join(f"{role}: {type(quantizer).__name__}" for role, quantizer in quantizers)
        raise ValueError(f"{owner}'s quantizers are of kinds no one GEMM takes together ({got}): the input, "
                         "weight and gradient of a GEMM must all be per-tensor FP8 (Float8Quantizer, "
                         "Float8CurrentScalingQuantizer), or all MXFP8Quantizer, all Float8BlockQuantizer or "
                         "all NVFP4Quantizer")
    return blocks.pop()


def require_per_tensor(owner: str, states) -> None:
    """NotImplementedError naming the role and type of a block-scaled quantizer in CustomRecipeStates
    `states`, for an op that runs per-tensor FP8 only."""
    for state in states:
        for i, role in enumerate(state.roles):
            if quantizer_block(role, state.quantizer(i)) is not PER_TENSOR:
                raise NotImplementedError(f"te_fuser's {owner} runs per-tensor FP8 quantizers only (Float8Quantizer, "
                                          f"Float8CurrentScalingQuantizer); CustomRecipe's qfactory returned "
                                          f"{type(state.quantizer(i)).__name__} for role {role}")
