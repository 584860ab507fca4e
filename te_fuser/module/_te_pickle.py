"""Reading and writing TransformerEngine's pickled `_extra_state` without trusting the bytes.

TE stores a module's FP8 metadata as `pickle.dumps(dict)` viewed as a uint8
tensor: its recipe object (`transformer_engine.common.recipe.DelayedScaling`,
with a `Format` enum inside), CPU float32 tensors, and a dict of plain values.
Unpickling arbitrary bytes runs arbitrary code, so `safe_loads` resolves only
the globals such a payload needs, each to a harmless stand-in:

- TE's recipe classes become `PickledRecipe` records (a class name and the
  attribute dict; nothing of TE's is imported or called);
- TE's `Format` / `_FormatHelper` become the pair of FP8 maxima;
- tensors are rebuilt with torch's own storage decoder under
  `torch.load(weights_only=True)`.

Any other global (a callable `amax_compute_algo`, `os.system`, ...) raises
`UnsafeExtraStateError` naming it. `te_dumps` writes the same layout, with
the recipe under TE's class names, so TE (or any reader of TE's format) loads it.
"""

import collections
import copyreg
import io
import pickle
from typing import Dict, Tuple

import torch
import torch._utils

TE_RECIPE_MODULE = "transformer_engine.common.recipe"
# TE's recipe classes (all of them, so a checkpoint of any recipe can be read and named).
TE_RECIPE_CLASSES = ("DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling", "Float8BlockScaling",
                     "NVFP4BlockScaling", "CustomRecipe", "MMParams", "QParams")


class UnsafeExtraStateError(pickle.UnpicklingError):
    """The serialized `_extra_state` asks for something a FP8-metadata payload never needs."""


class PickledRecipe:
    """A TE recipe object as found in a payload: its class name and attributes, nothing executed."""

    def __init__(self, class_name: str):
        self.class_name = class_name
        self.fields: Dict[str, object] = {}

    def __setstate__(self, state) -> None:
        # Protocol-2 pickles of plain / pydantic dataclasses carry the instance dict
        # (or a (dict, slots) pair).
        if isinstance(state, tuple) and len(state) == 2:
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise UnsafeExtraStateError(f"recipe {self.class_name} has a state of type {type(state).__name__}")
        self.fields.update(state)


def _recipe_class(class_name: str):
    def new(cls=None, *args):
        del cls
        if args:
            raise UnsafeExtraStateError(f"recipe {class_name} is constructed with arguments {args!r}")
        return PickledRecipe(class_name)

    # NEWOBJ calls cls.__new__(cls, *args); the stand-in is a class whose __new__ makes the record.
    return type(class_name, (), {"__new__": staticmethod(new)})


class PickledFormat(tuple):
    """TE's `Format` enum member (or its `_FormatHelper` value): (max_fwd, max_bwd)."""

    def __new__(cls, *value):
        if len(value) == 1 and isinstance(value[0], tuple):
            value = tuple(value[0])
        if len(value) != 2 or not all(isinstance(v, (int, float)) for v in value):
            raise UnsafeExtraStateError(f"Format value must be (max_fwd, max_bwd), got {value!r}")
        return super().__new__(cls, (float(value[0]), float(value[1])))


def _load_storage(data: bytes):
    # torch pickles a storage as torch.save bytes; read them without running pickled code.
    if not isinstance(data, bytes):
        raise UnsafeExtraStateError(f"tensor storage must be bytes, got {type(data).__name__}")
    return torch.load(io.BytesIO(data), weights_only=True)


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                    metadata=None):
    del metadata
    if not isinstance(storage, torch.storage.TypedStorage):
        raise UnsafeExtraStateError(f"tensor storage must be a torch storage, got {type(storage).__name__}")
    if backward_hooks:
        raise UnsafeExtraStateError("a tensor in _extra_state carries backward hooks")
    return torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, False, collections.OrderedDict())


_SAFE_GLOBALS = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch.storage", "_load_from_bytes"): _load_storage,
    ("collections", "OrderedDict"): collections.OrderedDict,
    (TE_RECIPE_MODULE, "Format"): PickledFormat,
    (TE_RECIPE_MODULE, "_FormatHelper"): PickledFormat,
    **{(TE_RECIPE_MODULE, name): _recipe_class(name) for name in TE_RECIPE_CLASSES},
}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        found = _SAFE_GLOBALS.get((module, name))
        if found is None:
            raise UnsafeExtraStateError(
                f"refusing to load _extra_state: it references {module}.{name}, which TE's FP8 metadata never "
                f"contains (loading it could run arbitrary code)")
        return found

    def persistent_load(self, pid):
        raise UnsafeExtraStateError(f"refusing to load _extra_state with a persistent id {pid!r}")


def safe_loads(data: bytes):
    """Unpickle a TE `_extra_state` payload using only the stand-ins above."""
    try:
        return _SafeUnpickler(io.BytesIO(data)).load()
    except UnsafeExtraStateError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, RuntimeError) as exc:
        raise ValueError(f"_extra_state is not TE's pickled FP8 state: {exc}") from exc


# -- writing ----------------------------------------------------------------------------
class _TEObject:
    """Written as an instance of the TE class it stands for (NEWOBJ, then its attribute dict)."""

    def __init__(self, fields: dict):
        self.fields = fields

    def __reduce_ex__(self, protocol):
        return copyreg.__newobj__, (type(self),), self.fields


def TERecipe(class_name: str, fields: dict) -> _TEObject:
    """A recipe to be written under TE's class name, e.g. TERecipe("DelayedScaling", {...})."""
    return _TE_WRITE_CLASSES[class_name](fields)


class TEFormat:
    """A `Format` member written as TE pickles it: Format(_FormatHelper(max_fwd, max_bwd))."""

    def __init__(self, max_fwd: float, max_bwd: float):
        self.value = (max_fwd, max_bwd)

    def __reduce_ex__(self, protocol):
        return _TE_WRITE_CLASSES["Format"], (_FormatHelperOut(*self.value),)


class _FormatHelperOut(tuple):
    def __new__(cls, max_fwd, max_bwd):
        return super().__new__(cls, (max_fwd, max_bwd))

    def __reduce_ex__(self, protocol):
        return copyreg.__newobj__, (type(self), self[0], self[1])


# Classes standing for TE's names when writing; the pickler writes them as TE's globals.
_TE_WRITE_CLASSES = {name: type(f"_TE_{name}", (_TEObject,), {}) for name in ("DelayedScaling", "Format")}
_TE_WRITE_NAMES: Dict[type, Tuple[str, str]] = {cls: (TE_RECIPE_MODULE, name) for name, cls in _TE_WRITE_CLASSES.items()}
_TE_WRITE_NAMES[_FormatHelperOut] = (TE_RECIPE_MODULE, "_FormatHelper")


class _TEPickler(pickle._Pickler):  # the Python pickler: its save_global can be extended
    def save_global(self, obj, name=None):
        ref = _TE_WRITE_NAMES.get(obj)
        if ref is None:
            return super().save_global(obj, name)
        module, qualname = ref
        if self.proto >= 4:
            self.save(module)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode("utf-8"))
        self.memoize(obj)


def te_dumps(obj) -> bytes:
    """Pickle `obj` (TERecipe / TEFormat standing for TE's classes) as TE's pickle.dumps would."""
    buffer = io.BytesIO()
    _TEPickler(buffer, protocol=4).dump(obj)
    return buffer.getvalue()
