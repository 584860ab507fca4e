"""For the kernel wrappers that check their arguments only after the binding refused them
(te_fuser.kernels.validate.call_checked): each case they name must be a refusal of the binding too."""

import pytest


def assert_refused_then_named(wrapper, raw, error, message):
    """The raw op raises the binding's RuntimeError, and the wrapper the error that names the argument."""
    with pytest.raises(RuntimeError):  # the binding's own check, which sends the wrapper to its checks
        raw()
    with pytest.raises(error, match=message):
        wrapper()
