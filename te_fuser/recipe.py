"""FP8 recipes, with TransformerEngine's names, fields and defaults so users can switch.

TE's recipes are pydantic dataclasses that silently drop keyword arguments
they do not know. Megatron-LM relies on that: it passes
`override_linear_precision` (a TE 1.x field), `params_dtype` and `device`.
te_fuser accepts exactly those, plus TE 1.x's `interval`, and ignores them;
any other unknown argument is a TypeError naming it.
"""

import enum
import math
import os
import warnings
from dataclasses import InitVar, dataclass, field
from typing import Callable, NamedTuple, Optional, Union

import torch


class _FormatHelper(NamedTuple):
    """A Format's value, as TE's: the largest finite forward and backward values."""

    max_fwd: float
    max_bwd: float


_FP8_DTYPE_OF_MAX = {448.0: torch.float8_e4m3fn, 57344.0: torch.float8_e5m2}


class Format(enum.Enum):
    """FP8 formats for the forward and the backward pass.

    E4M3 everywhere, E5M2 everywhere, or HYBRID: E4M3 forward (activations,
    weights) and E5M2 backward (gradients, which need the range). Each value is
    TE's (max_fwd, max_bwd) pair; fwd_dtype / bwd_dtype are the torch dtypes.
    E2M1 is NVFP4's 4-bit format (largest value 6), which no torch dtype holds.
    """

    E4M3 = _FormatHelper(max_fwd=448.0, max_bwd=448.0)
    E5M2 = _FormatHelper(max_fwd=57344.0, max_bwd=57344.0)
    HYBRID = _FormatHelper(max_fwd=448.0, max_bwd=57344.0)
    E2M1 = _FormatHelper(max_fwd=6.0, max_bwd=6.0)

    def _dtype(self, fp_max: float) -> torch.dtype:
        if fp_max not in _FP8_DTYPE_OF_MAX:
            raise ValueError(f"{self} has no torch dtype (te_fuser stores E2M1 values two a byte, as uint8)")
        return _FP8_DTYPE_OF_MAX[fp_max]

    @property
    def fwd_dtype(self) -> torch.dtype:
        return self._dtype(self.value.max_fwd)

    @property
    def bwd_dtype(self) -> torch.dtype:
        return self._dtype(self.value.max_bwd)

    @property
    def max_fwd(self) -> float:
        return self.value.max_fwd

    @property
    def max_bwd(self) -> float:
        return self.value.max_bwd


_AMAX_ALGOS = ("max", "most_recent")


class Recipe:
    """Base of the recipes; the class tests TE's code asks of a recipe."""

    @classmethod
    def delayed(cls) -> bool:
        return issubclass(cls, DelayedScaling)

    @classmethod
    def float8_current_scaling(cls) -> bool:
        return issubclass(cls, Float8CurrentScaling)

    @classmethod
    def float8_per_tensor_scaling(cls) -> bool:
        return issubclass(cls, (DelayedScaling, Float8CurrentScaling))

    @classmethod
    def float8_block_scaling(cls) -> bool:
        return issubclass(cls, Float8BlockScaling)

    @classmethod
    def mxfp8(cls) -> bool:
        return issubclass(cls, MXFP8BlockScaling)

    @classmethod
    def nvfp4(cls) -> bool:
        return issubclass(cls, NVFP4BlockScaling)

    @classmethod
    def custom(cls) -> bool:
        return issubclass(cls, CustomRecipe)


def _check_format(fmt) -> None:
    if not isinstance(fmt, Format):
        raise TypeError(f"fp8_format must be a te_fuser.recipe.Format, got {fmt!r}")


@dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Per-tensor scales from a history of amaxes recorded in earlier steps.

    scale = (fp8_max / amax) / 2**margin, where amax is the max (or the most
    recent) of the last `amax_history_len` recorded amaxes.

    As in TE, amax_compute_algo may be a callable `f(amax_history) -> amax`
    (amax_history in TE's layout: row 0 the amax of the step being closed,
    rows 1.. the earlier ones, oldest first), and scaling_factor_compute_algo
    a callable `f(amax, scale, fp8_max, recipe) -> new scale`.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Union[str, Callable] = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    # Accepted and ignored, as TE's pydantic dataclass ignores them.
    override_linear_precision: InitVar[object] = None
    interval: InitVar[object] = None
    params_dtype: InitVar[object] = None
    device: InitVar[object] = None

    def __post_init__(self, override_linear_precision, interval, params_dtype, device):
        del override_linear_precision, interval, params_dtype, device
        _check_format(self.fp8_format)
        if not callable(self.amax_compute_algo) and self.amax_compute_algo not in _AMAX_ALGOS:
            raise ValueError(f"amax_compute_algo must be one of {_AMAX_ALGOS} or a callable, "
                             f"got {self.amax_compute_algo!r}")
        if self.scaling_factor_compute_algo is not None and not callable(self.scaling_factor_compute_algo):
            raise TypeError(f"scaling_factor_compute_algo must be None or a callable, "
                            f"got {self.scaling_factor_compute_algo!r}")
        if int(self.amax_history_len) < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {self.amax_history_len}")
        if not -126 <= int(self.margin) <= 126:
            raise ValueError(f"margin must lie in [-126, 126], got {self.margin}")


@dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """Per-tensor scales computed from each tensor's own amax just before it is cast."""

    fp8_format: Format = Format.HYBRID
    fp8_dpa: bool = False
    fp8_mha: bool = False
    force_pow_2_scales: bool = False
    amax_epsilon: float = 0.0
    override_linear_precision: InitVar[object] = None
    params_dtype: InitVar[object] = None
    device: InitVar[object] = None

    def __post_init__(self, override_linear_precision, params_dtype, device):
        del override_linear_precision, params_dtype, device
        _check_format(self.fp8_format)
        if self.amax_epsilon < 0:
            raise ValueError(f"amax_epsilon must be >= 0, got {self.amax_epsilon}")


@dataclass(frozen=True)
class QParams:
    """Quantization parameters of one tensor role (TE's QParams): power_2_scale rounds each block's
    scale down to a power of two; amax_epsilon floors each block's amax. The NVFP4 fields are
    accepted and unused by the FP8 recipes, as in TE."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False

    def __post_init__(self):
        if not 0.0 <= self.amax_epsilon < math.inf:
            raise ValueError(f"amax_epsilon must be finite and >= 0, got {self.amax_epsilon}")


@dataclass(frozen=True)
class MMParams:
    """GEMM options (TE's MMParams). te_fuser's block-scaled CPU GEMM always accumulates each K block
    apart before adding it (split accumulation), so use_split_accumulator must stay True."""

    use_split_accumulator: bool = True


def _check_backward_override(value) -> None:
    if value is not None:
        raise NotImplementedError(f"te_fuser does not implement backward_override={value!r} (TE's "
                                  "'high_precision' / 'dequantized' backward); leave it None")


def _check_not_e5m2(fmt) -> None:
    _check_format(fmt)
    if fmt == Format.E2M1:
        raise ValueError("fp8_format=Format.E2M1 is NVFP4's format: use the NVFP4BlockScaling recipe")
    if fmt == Format.E5M2:
        raise ValueError("fp8_format=Format.E5M2: pure E5M2 training is not supported (as in TE); "
                         "use Format.E4M3 or Format.HYBRID")


@dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8: every 32 consecutive values along a GEMM's reduction dimension share an E8M0 (power of
    two) scale, rounded up from the block's amax as TE's kernels do (docs/block_scaling.md). A tensor
    and its transpose are both quantized from the high-precision values."""

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None
    enable_2d_quantization: bool = False
    params_dtype: InitVar[object] = None
    device: InitVar[object] = None

    def __post_init__(self, params_dtype, device):
        del params_dtype, device
        _check_not_e5m2(self.fp8_format)
        _check_backward_override(self.backward_override)
        if self.enable_2d_quantization:
            raise NotImplementedError("te_fuser does not implement MXFP8BlockScaling(enable_2d_quantization=True) "
                                      "(32x32 weight blocks)")
        _check_no_fp8_mha(self)
        if self.fp8_format == Format.HYBRID:
            warnings.warn("MXFP8BlockScaling(fp8_format=Format.HYBRID) casts gradients to E5M2 in 32-element "
                          "blocks, which TE users have reported to diverge; TE's default is Format.E4M3",
                          UserWarning, stacklevel=3)


def _check_no_fp8_mha(recipe) -> None:
    """fp8_dpa under a block-scaled recipe runs the attention in per-tensor FP8 when NVTE_DPA_FP8_RECIPE says
    which (te_fuser/attention/dot_product_attention/fp8_recipe.py); fp8_mha would also hand the projections
    per-tensor FP8 tensors in place of the recipe's own."""
    if recipe.fp8_mha:
        raise NotImplementedError(f"{type(recipe).__name__}(fp8_mha=True) is not supported by te_fuser: the QKV and "
                                  "output projections would exchange per-tensor FP8 tensors with the attention; "
                                  "use fp8_dpa=True (FP8 attention between the recipe's linear layers, with "
                                  "NVTE_DPA_FP8_RECIPE)")


# TE reads NVTE_FP8_BLOCK_SCALING_FP32_SCALES when the recipe module is imported.
_FP32_BLOCK_SCALES = os.getenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0") == "1"
_BLOCK_QPARAMS = QParams(power_2_scale=not _FP32_BLOCK_SCALES, amax_epsilon=0.0)
_SPLIT_ACCUMULATION = MMParams()


@dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """FP8 with float32 scales per block: 1x128 tiles for activations and gradients, 128x128 blocks for
    weights (by default), each scale from its block's amax (docs/block_scaling.md). Scales are powers
    of two unless NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 at import (TE's default) or the QParams say so.

    Unlike TE, where they are class attributes that the constructor ignores, fp8_quant_fwd_inp /
    fp8_quant_fwd_weight / fp8_quant_bwd_grad can be passed; their defaults are TE's."""

    use_f32_scales: bool = _FP32_BLOCK_SCALES
    fp8_format: Format = Format.E4M3
    # (default factories: dynamo, tracing a recipe made in a compiled function, takes no frozen dataclass as an
    # argument's default)
    fp8_quant_fwd_inp: QParams = field(default_factory=lambda: _BLOCK_QPARAMS)
    fp8_quant_fwd_weight: QParams = field(default_factory=lambda: _BLOCK_QPARAMS)
    fp8_quant_bwd_grad: QParams = field(default_factory=lambda: _BLOCK_QPARAMS)
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = field(default_factory=lambda: _SPLIT_ACCUMULATION)
    fp8_gemm_dgrad: MMParams = field(default_factory=lambda: _SPLIT_ACCUMULATION)
    fp8_gemm_wgrad: MMParams = field(default_factory=lambda: _SPLIT_ACCUMULATION)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None
    override_linear_precision: InitVar[object] = None
    params_dtype: InitVar[object] = None
    device: InitVar[object] = None

    def __post_init__(self, override_linear_precision, params_dtype, device):
        del override_linear_precision, params_dtype, device
        _check_not_e5m2(self.fp8_format)
        _check_backward_override(self.backward_override)
        dims = {"x_block_scaling_dim": self.x_block_scaling_dim, "w_block_scaling_dim": self.w_block_scaling_dim,
                "grad_block_scaling_dim": self.grad_block_scaling_dim}
        for name, dim in dims.items():
            if dim not in (1, 2):
                raise ValueError(f"{name} must be 1 or 2 (1x128 or 128x128 blocks), got {dim!r}")
        for a, b in (("x", "w"), ("x", "grad"), ("w", "grad")):
            if dims[f"{a}_block_scaling_dim"] == 2 and dims[f"{b}_block_scaling_dim"] == 2:
                raise ValueError(f"{a}_block_scaling_dim and {b}_block_scaling_dim are both 2: a GEMM of two "
                                 "128x128-scaled operands is not supported (as in TE)")
        for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
            if not isinstance(getattr(self, name), QParams):
                raise TypeError(f"{name} must be a te_fuser.recipe.QParams, got {getattr(self, name)!r}")
        for name in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
            params = getattr(self, name)
            if not isinstance(params, MMParams) or not params.use_split_accumulator:
                raise ValueError(f"{name} must be MMParams(use_split_accumulator=True): block scaling needs "
                                 "split accumulation (as in TE)")
        if self.fp8_dpa or self.fp8_mha:
            raise ValueError("FP8 attention (fp8_dpa / fp8_mha) is not supported for Float8BlockScaling (as in TE)")


@dataclass(frozen=True)
class CustomRecipe(Recipe):
    """Quantizers from a user factory, one per tensor role (TE 2.9's CustomRecipe).

    qfactory(role) returns a te_fuser quantizer for each role a linear op quantizes: forward
    "linear_input", "linear_weight" (and "linear_output" for fp8_output), backward "linear_grad_output"
    (and "linear_grad_input" for fp8_grad). Each role is a str (TE 2.9's contract) that also carries
    later TE's QuantizerRole fields: module_type "linear", tensor_type ("input", "weight", "output",
    "grad_output", "grad_input") and name "". The GEMM follows the kinds of quantizers returned:
    Float8Quantizer / Float8CurrentScalingQuantizer (per-tensor FP8), MXFP8Quantizer,
    Float8BlockQuantizer or NVFP4Quantizer, the same kind for every role of a linear op.

    fp8_format is read by nothing that quantizes (the factory decides); HYBRID is later TE's default."""

    qfactory: Callable
    fp8_format: Format = Format.HYBRID
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        if not callable(self.qfactory):
            raise TypeError(f"qfactory must be a callable role -> quantizer, got {self.qfactory!r}")
        _check_format(self.fp8_format)
        if self.fp8_dpa or self.fp8_mha:
            raise NotImplementedError("te_fuser's FP8 attention (fp8_dpa / fp8_mha) runs under DelayedScaling "
                                      "and Float8CurrentScaling only, not CustomRecipe")


# TE reads these when the recipe module is imported.
_NVFP4_DISABLE_RHT = os.getenv("NVTE_NVFP4_DISABLE_RHT", "0") == "1"
_NVFP4_DISABLE_SR = os.getenv("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING", "0") == "1"
_NVFP4_DISABLE_2D = os.getenv("NVTE_NVFP4_DISABLE_2D_QUANTIZATION", "0") == "1"


@dataclass(frozen=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 values in blocks of 16 along a GEMM's reduction dimension, each block with an E4M3
    scale, under a float32 per-tensor scale from the tensor's amax (docs/block_scaling.md). A tensor and
    its transpose are both quantized from the high-precision values.

    As in TE, by default weights take 16x16 blocks (disable_2d_quantization turns that off), the
    weight-gradient GEMM's operands (the input's and the gradient's columnwise data) take the random
    Hadamard transform (disable_rht), and gradients are stochastically rounded
    (disable_stochastic_rounding). fp4_quant_fwd_inp / fp4_quant_fwd_weight / fp4_quant_bwd_grad are
    the QParams derived from those flags, as TE's __post_init__ sets them."""

    disable_rht: bool = _NVFP4_DISABLE_RHT
    disable_stochastic_rounding: bool = _NVFP4_DISABLE_SR
    disable_2d_quantization: bool = _NVFP4_DISABLE_2D
    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None
    fp4_quant_fwd_inp: QParams = field(init=False)
    fp4_quant_fwd_weight: QParams = field(init=False)
    fp4_quant_bwd_grad: QParams = field(init=False)
    params_dtype: InitVar[object] = None
    device: InitVar[object] = None

    def __post_init__(self, params_dtype, device):
        del params_dtype, device
        if self.fp4_format != Format.E2M1:
            raise ValueError(f"fp4_format must be Format.E2M1 (NVFP4's values), got {self.fp4_format!r}")
        if self.fp8_format != Format.E4M3:
            raise ValueError(f"fp8_format must be Format.E4M3 (NVFP4's block scales), got {self.fp8_format!r}")
        _check_backward_override(self.backward_override)
        _check_no_fp8_mha(self)
        rht, sr, two_d = not self.disable_rht, not self.disable_stochastic_rounding, not self.disable_2d_quantization
        object.__setattr__(self, "fp4_quant_fwd_inp", QParams(random_hadamard_transform=rht))
        object.__setattr__(self, "fp4_quant_fwd_weight", QParams(fp4_2d_quantization=two_d))
        object.__setattr__(self, "fp4_quant_bwd_grad", QParams(random_hadamard_transform=rht, stochastic_rounding=sr))
