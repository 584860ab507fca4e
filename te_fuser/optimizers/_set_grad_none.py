"""TE's deprecated `set_grad_none` constructor argument of FusedAdam and FusedSGD, shared by both."""

from typing import Optional
import warnings


def warn_set_grad_none(optimizer: str, set_grad_none: Optional[bool]) -> None:
    if set_grad_none is not None:
        warnings.warn(f"set_grad_none kwarg in {optimizer} constructor is deprecated. "
                      "Use set_to_none kwarg in zero_grad instead.", DeprecationWarning)


def resolved_set_to_none(optimizer: str, set_grad_none: Optional[bool], set_to_none: Optional[bool]) -> bool:
    """zero_grad's set_to_none: the constructor's set_grad_none when given (a contradicting set_to_none raises
    ValueError, as in TE), else set_to_none, True by default."""
    if set_grad_none is not None:
        if set_to_none is not None and set_to_none != set_grad_none:
            raise ValueError(f"Called zero_grad with set_to_none={set_to_none}, "
                             f"but {optimizer} was initialized with set_grad_none={set_grad_none}")
        return set_grad_none
    return True if set_to_none is None else set_to_none
