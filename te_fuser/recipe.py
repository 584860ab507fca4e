"""FP8 recipes, with TransformerEngine's names, fields and defaults so users can switch.

TE's recipes are pydantic dataclasses that silently drop keyword arguments
they do not know. Megatron-LM relies on that: it passes
`override_linear_precision` (a TE 1.x field), `params_dtype` and `device`.
te_fuser accepts exactly those, plus TE 1.x's `interval`, and ignores them;
any other unknown argument is a TypeError naming it.
"""

import enum
from dataclasses import InitVar, dataclass
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
    """

    E4M3 = _FormatHelper(max_fwd=448.0, max_bwd=448.0)
    E5M2 = _FormatHelper(max_fwd=57344.0, max_bwd=57344.0)
    HYBRID = _FormatHelper(max_fwd=448.0, max_bwd=57344.0)

    @property
    def fwd_dtype(self) -> torch.dtype:
        return _FP8_DTYPE_OF_MAX[self.value.max_fwd]

    @property
    def bwd_dtype(self) -> torch.dtype:
        return _FP8_DTYPE_OF_MAX[self.value.max_bwd]

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


class _UnsupportedRecipe(Recipe):
    """A TE recipe te_fuser names (so code that refers to it imports) but does not implement."""

    def __init__(self, *args, **kwargs):
        del args, kwargs
        raise NotImplementedError(f"te_fuser does not implement the {type(self).__name__} FP8 recipe; "
                                  "use DelayedScaling or Float8CurrentScaling")


class Float8BlockScaling(_UnsupportedRecipe):
    """TE's FP8 recipe with 1x128 / 128x128 block scales: not implemented by te_fuser."""


class MXFP8BlockScaling(_UnsupportedRecipe):
    """TE's MXFP8 recipe (32-element blocks, E8M0 scales): not implemented by te_fuser."""


class NVFP4BlockScaling(_UnsupportedRecipe):
    """TE's NVFP4 recipe: not implemented by te_fuser."""


class CustomRecipe(_UnsupportedRecipe):
    """TE's recipe built from user quantizer factories: not implemented by te_fuser."""
