from . import _extension  # noqa: F401
from . import memory  # noqa: F401
