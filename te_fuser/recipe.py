"""FP8 recipes, with TransformerEngine's names and defaults so users can switch."""

import enum
from dataclasses import dataclass

import torch


class Format(enum.Enum):
    """FP8 formats for the forward and the backward pass.

    E4M3 everywhere, E5M2 everywhere, or HYBRID: E4M3 forward (activations,
    weights) and E5M2 backward (gradients, which need the range).
    """

    E4M3 = (torch.float8_e4m3fn, torch.float8_e4m3fn)
    E5M2 = (torch.float8_e5m2, torch.float8_e5m2)
    HYBRID = (torch.float8_e4m3fn, torch.float8_e5m2)

    @property
    def fwd_dtype(self) -> torch.dtype:
        return self.value[0]

    @property
    def bwd_dtype(self) -> torch.dtype:
        return self.value[1]

    @property
    def max_fwd(self) -> float:
        return torch.finfo(self.fwd_dtype).max

    @property
    def max_bwd(self) -> float:
        return torch.finfo(self.bwd_dtype).max


_AMAX_ALGOS = ("max", "most_recent")


@dataclass(frozen=True)
class DelayedScaling:
    """Per-tensor scales from a history of amaxes recorded in earlier steps.

    scale = (fp8_max / amax) / 2**margin, where amax is the max (or the most
    recent) of the last `amax_history_len` recorded amaxes.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        if not isinstance(self.fp8_format, Format):
            raise TypeError(f"fp8_format must be a te_fuser.recipe.Format, got {self.fp8_format!r}")
        if self.amax_compute_algo not in _AMAX_ALGOS:
            raise ValueError(f"amax_compute_algo must be one of {_AMAX_ALGOS}, got {self.amax_compute_algo!r}")
        if int(self.amax_history_len) < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {self.amax_history_len}")
        if not -126 <= int(self.margin) <= 126:
            raise ValueError(f"margin must lie in [-126, 126], got {self.margin}")

    def delayed(self) -> bool:
        return True


@dataclass(frozen=True)
class Float8CurrentScaling:
    """Per-tensor scales computed from each tensor's own amax just before it is cast."""

    fp8_format: Format = Format.HYBRID
    fp8_dpa: bool = False
    fp8_mha: bool = False
    force_pow_2_scales: bool = False
    amax_epsilon: float = 0.0

    def __post_init__(self):
        if not isinstance(self.fp8_format, Format):
            raise TypeError(f"fp8_format must be a te_fuser.recipe.Format, got {self.fp8_format!r}")
        if self.amax_epsilon < 0:
            raise ValueError(f"amax_epsilon must be >= 0, got {self.amax_epsilon}")

    def delayed(self) -> bool:
        return False
