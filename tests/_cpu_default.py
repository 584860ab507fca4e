"""The suite's modules go to the CPU unless a test names a device.

te_fuser follows TE: a module built without device= goes to the current CUDA device where there is one.
Most tests are CPU tests that build modules that way and feed them CPU tensors, so on a GPU machine they
would mix devices. conftest.py applies this to every test (test_default_device_follows_te opts out), and the
processes the distributed tests spawn apply it themselves.
"""

import torch

from te_fuser.module import _linear_base


def build_modules_on_cpu(setattr_=setattr) -> None:
    setattr_(_linear_base, "default_device", lambda: torch.device("cpu"))
