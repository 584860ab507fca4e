"""Validated entry points to the compiled kernels, one module per area."""

from .. import _extension  # noqa: F401  (registers torch.ops.te_fuser)
from . import cpu, fp8, gemm  # noqa: F401
