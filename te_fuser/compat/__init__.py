"""An opt-in `transformer_engine` package that resolves to te_fuser.

    import te_fuser.compat
    te_fuser.compat.install_transformer_engine()
    import transformer_engine.pytorch as te          # te_fuser's modules under TE's names

or run a script unchanged: `python -m te_fuser.compat script.py args...`.

Every `transformer_engine.pytorch.X...` module is an alias module forwarding
to te_fuser's `X...` (the names below are renamed where TE's layout differs),
`transformer_engine.common.recipe` is te_fuser.recipe, and `transformer_engine`
itself carries `__version__` (see TE_API_VERSION). TE's compiled module, the
second top-level name `transformer_engine_torch` (`import transformer_engine_torch
as tex`), is te_fuser.tex. Objects are te_fuser's own, so
`transformer_engine.pytorch.Linear is te_fuser.Linear`.

What te_fuser lacks fails loudly: a missing module raises ModuleNotFoundError
and a missing name AttributeError, both saying te_fuser does not provide it
(`from ... import name` turns the latter into Python's ImportError, which
names te_fuser's file). ModuleNotFoundError is what client code such as
Megatron-LM catches around optional TE imports.

While installed, importlib.metadata reports a `transformer-engine` distribution
of version TE_API_VERSION (_metadata.py): clients such as accelerate and
Lightning look for TE there before importing it.

A real TransformerEngine installation is never shadowed: install refuses
(RuntimeError) when `transformer_engine` or `transformer_engine_torch` is
importable from elsewhere, unless force=True, and an installed
`transformer-engine` distribution's metadata is never replaced, not even with
force=True.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

from . import _metadata

# The TE API level te_fuser follows, as transformer_engine.__version__. Megatron-core 0.16.1 gates on
# it: >= 2.6.0dev0 lets it set Linear.save_original_input under non-delayed FP8 recipes and
# >= 2.2 / 2.3 selects the Float8CurrentScaling recipe and the keyword-argument forms te_fuser takes,
# while >= 2.7.0.dev makes `import megatron.core` import transformer_engine.pytorch.router (te_fuser.router
# has it) and turns on the later APIs Megatron gates on 2.7 and up, which te_fuser's tests do not cover.
# So 2.6.0.
TE_API_VERSION = "2.6.0"

_ROOT = "transformer_engine"
# TE's compiled extension: a plain module (no submodules), te_fuser.tex.
_EXTENSION = "transformer_engine_torch"
_TOP_LEVEL = (_ROOT, _EXTENSION)
# The roots: transformer_engine.pytorch.X maps to te_fuser.X, te_fuser's tree being TE's.
_ROOTS = {
    _EXTENSION: "te_fuser.tex",
    "transformer_engine.pytorch": "te_fuser",
    "transformer_engine.common.recipe": "te_fuser.recipe",
}
# Names of TE's modules that are te_fuser objects of another name.
_OVERRIDES = {
    "transformer_engine.pytorch": {"checkpoint": ("te_fuser.distributed", "checkpoint")},
}
# Pure namespaces: packages with no te_fuser counterpart of their own.
_NAMESPACES = ("transformer_engine", "transformer_engine.common")


def _target(alias: str):
    """The te_fuser module name an alias stands for, or None for a namespace."""
    if alias in _NAMESPACES:
        return None
    if alias in _ROOTS:
        return _ROOTS[alias]
    prefix = "transformer_engine.pytorch."
    if alias.startswith(prefix):
        return "te_fuser." + alias[len(prefix):]
    raise ModuleNotFoundError(f"No module named {alias!r}: te_fuser does not provide it", name=alias)


class _AliasModule(types.ModuleType):
    """A `transformer_engine...` module whose names are read from the te_fuser module it stands for."""

    def __init__(self, alias: str, target):
        super().__init__(alias)
        self.__dict__["_te_fuser_target"] = target
        if target is not None:
            self.__file__ = getattr(target, "__file__", None)
            self.__doc__ = target.__doc__
        if alias == _ROOT:
            self.__version__ = TE_API_VERSION

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        override = _OVERRIDES.get(self.__name__, {}).get(name)
        if override is not None:
            return getattr(importlib.import_module(override[0]), override[1])
        target = self.__dict__["_te_fuser_target"]
        if target is not None and hasattr(target, name):
            found = getattr(target, name)
            if isinstance(found, types.ModuleType) and found.__name__ == f"{target.__name__}.{name}":
                return importlib.import_module(f"{self.__name__}.{name}")  # its alias, not te_fuser's module
            return found
        try:  # a submodule not imported yet (TE code reaches te.pytorch.distributed as attributes)
            return importlib.import_module(f"{self.__name__}.{name}")
        except ModuleNotFoundError:
            pass
        raise AttributeError(f"{self.__name__}.{name}: te_fuser does not provide {name!r} "
                             f"(te_fuser's transformer_engine alias, TE API {TE_API_VERSION})")

    def __dir__(self):
        target = self.__dict__["_te_fuser_target"]
        names = set(super().__dir__()) | set(_OVERRIDES.get(self.__name__, {}))
        return sorted(names | set(dir(target))) if target is not None else sorted(names)


class _AliasLoader(importlib.abc.Loader):
    def create_module(self, spec):
        target_name = _target(spec.name)
        target = importlib.import_module(target_name) if target_name is not None else None
        return _AliasModule(spec.name, target)

    def exec_module(self, module):
        del module  # everything is read from the te_fuser module on access


def _aliased(name: str) -> bool:
    return any(name == top or name.startswith(top + ".") for top in _TOP_LEVEL)


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Resolves `transformer_engine` and its submodules, and `transformer_engine_torch`, to te_fuser's modules."""

    def find_spec(self, fullname, path=None, target=None):
        del path, target
        if not _aliased(fullname):
            return None
        if fullname == _EXTENSION:  # a compiled module in TE: not a package
            return importlib.machinery.ModuleSpec(fullname, _AliasLoader(), is_package=False)
        target_name = _target(fullname)
        if target_name is not None and not _exists(target_name):
            raise ModuleNotFoundError(f"No module named {fullname!r}: te_fuser does not provide it "
                                      f"(te_fuser's transformer_engine alias, TE API {TE_API_VERSION})",
                                      name=fullname)
        # Every alias is a package, so this finder (and its message) answers for all submodules.
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(), is_package=True)


def _exists(module_name: str) -> bool:
    try:
        return importlib.util.find_spec(module_name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


_FINDER = _AliasFinder()
_DISTRIBUTIONS = _metadata.DistributionFinder(TE_API_VERSION)


def _real_te_location():
    """Where an installed `transformer_engine` (or its `transformer_engine_torch`) would be imported from, or None."""
    if is_installed():
        return None
    for name in _TOP_LEVEL:
        module = sys.modules.get(name)
        if module is not None:
            return getattr(module, "__file__", None) or repr(module)
        spec = importlib.machinery.PathFinder.find_spec(name)
        if spec is not None:
            return spec.origin or str(list(spec.submodule_search_locations or []))
    return None


def is_installed() -> bool:
    return _FINDER in sys.meta_path


def install_transformer_engine(force: bool = False) -> None:
    """Make `import transformer_engine` resolve to te_fuser (idempotent), and importlib.metadata
    report a `transformer-engine` distribution unless one is installed.

    Raises RuntimeError if a real TransformerEngine is importable (or imported), unless
    force=True, which then removes the imported TE modules and puts te_fuser first.
    """
    if is_installed():
        return
    real = _real_te_location()
    if real is not None and not force:
        raise RuntimeError(f"a TransformerEngine installation is importable ({real}); te_fuser will not shadow "
                           "it. Pass force=True to use te_fuser under the transformer_engine name anyway.")
    _drop_transformer_engine_modules()
    sys.meta_path.insert(0, _FINDER)
    if _metadata.installed_distribution() is None:
        sys.meta_path.insert(0, _DISTRIBUTIONS)


def uninstall_transformer_engine() -> None:
    """Undo install_transformer_engine(): remove the finder and the alias modules."""
    for finder in (_FINDER, _DISTRIBUTIONS):
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
    _drop_transformer_engine_modules()


def _drop_transformer_engine_modules() -> None:
    for name in [n for n in sys.modules if _aliased(n)]:
        del sys.modules[name]
    importlib.invalidate_caches()


__all__ = ["TE_API_VERSION", "install_transformer_engine", "is_installed", "uninstall_transformer_engine"]
