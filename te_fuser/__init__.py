from . import _extension  # noqa: F401
