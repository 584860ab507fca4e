"""release_storage: free a tensor's bytes even while views of it are still referenced.

``tensor.data = torch.empty(0)`` only repoints that one tensor; every view handed out
(e.g. the true-shape view of a padded all-gather buffer, seed 003) still owns the storage.
Resizing the shared UntypedStorage to 0 bytes frees it for all of them at once.

After the release the StorageImpl itself (shared by the tensor and all its views) holds a
null data pointer and is poisoned: every access to its data, for reading or writing, raises
RuntimeError naming release_storage, on CPU and CUDA tensors alike, so no kernel ever runs
on the null pointer. The storage keeps the byte size it had (``nbytes()`` still answers,
with the size before the release, as torch does for the CUDA-graph outputs it invalidates),
so taking a view (``t[3]``, ``t.t()``) only builds metadata and succeeds; the first read or
write through it raises. The release is final: resizing the storage raises too.

The poison is a flag on the StorageImpl, set by:
- torch's own ``torch._C._set_storage_data_ptr_access_error_msg`` where torch binds it
  (CUDA builds of torch; pure Python, so it holds for any torch version);
- else (CPU builds) te_fuser's one classic-API module, ``te_fuser._storage_poison``, which
  is used only under the exact torch it was built against (see csrc/README.md). Under any
  other CPU build nothing can set the flag: te_fuser warns at import, and release_storage
  raises before freeing anything.
"""

import gc
import os
import warnings

import torch

_RELEASED_MESSAGE = "this tensor's storage was released by te_fuser.memory.release_storage; it must not be used"
# Written by setup.py next to te_fuser._storage_poison: the torch that module was built against.
_CLASSIC_TORCH_FILE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "_storage_poison_torch.txt")


def running_torch() -> str:
    """The running torch, as setup.py records the one _storage_poison is built against."""
    return f"{torch.__version__} {torch.version.git_version}"


def _classic_module_torch():
    try:
        with open(_CLASSIC_TORCH_FILE) as handle:
            return handle.read().strip()
    except OSError:
        return None


def has_storage_functions() -> bool:
    """Whether the running torch has the functions release_storage frees a storage with."""
    return all(hasattr(torch._C, name) for name in ("_construct_storage_from_data_pointer", "StorageBase")) and \
        hasattr(torch._C.StorageBase, "_swap_data_ptr_")


def guard_mechanism():
    """(name, None) of the mechanism that poisons released storages here, or (None, why not)."""
    if not has_storage_functions():
        return None, f"torch {torch.__version__} lacks the storage functions release_storage needs"
    if hasattr(torch._C, "_set_storage_data_ptr_access_error_msg"):
        return "torch._C._set_storage_data_ptr_access_error_msg", None
    built_for = _classic_module_torch()
    if built_for == running_torch():
        return "te_fuser._storage_poison", None
    return None, (
        f"this CPU build of torch ({torch.__version__}) cannot mark a storage as released from Python, and "
        f"te_fuser._storage_poison was built against {built_for or 'an unknown torch'}, not this one "
        "(it uses torch's unstable C++ API); rebuild te_fuser against this torch "
        "(pip install --no-build-isolation te_fuser from source) to use release_storage"
    )


def _poisoner(mechanism):
    """poison(storage, tensor), resolved before anything is freed."""
    if mechanism == "te_fuser._storage_poison":
        from .. import _storage_poison  # noqa: F401  (registers torch.ops.te_fuser.poison_storage)

        return lambda storage, tensor: torch.ops.te_fuser.poison_storage(tensor, _RELEASED_MESSAGE)
    return lambda storage, tensor: torch._C._set_storage_data_ptr_access_error_msg(storage._cdata, _RELEASED_MESSAGE)


def _is_released(storage):
    try:
        storage.data_ptr()
    except RuntimeError:
        return True  # poisoned already (by release_storage, or by torch for a CUDA graph's output)
    return False


def _storage_identity(tensor):
    """Address of the StorageImpl itself (not of its data), or None for tensors without one."""
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _holders(tensor):
    """The plain tensors that hold tensor's bytes: itself, or the inner tensors of a wrapper subclass
    (a Float8Tensor's FP8 data, transpose and scale), which owns no storage of its own."""
    if not hasattr(type(tensor), "__tensor_flatten__"):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [inner for name in names for inner in _holders(getattr(tensor, name))]


def _parameters_sharing(tensor, parameters):
    identities = {_storage_identity(t) for t in _holders(tensor)} - {None}
    if parameters is None:
        # Parameter's isinstance also sees subclass parameters (FP8 weights); it runs only on tensors.
        candidates = (obj for obj in gc.get_objects()
                      if issubclass(type(obj), torch.Tensor) and isinstance(obj, torch.nn.Parameter))
    else:
        items = [parameters] if isinstance(parameters, (torch.Tensor, torch.nn.Module)) else parameters
        try:
            items = list(items)
        except TypeError:
            raise TypeError("parameters must be an nn.Parameter, an nn.Module, or an iterable of them, "
                            f"got {type(parameters).__name__}") from None
        candidates = []
        for item in items:
            if isinstance(item, torch.nn.Module):
                candidates.extend(item.parameters())
            elif isinstance(item, torch.Tensor):
                candidates.append(item)
            else:
                raise TypeError(f"parameters must hold nn.Parameters or nn.Modules, got a {type(item).__name__}")
    return [p for p in candidates if any(_storage_identity(h) in identities for h in _holders(p))]


def _protect_from_reuse(tensor, streams):
    """CUDA: keep the caching allocator from handing the block out while streams still use it."""
    for stream in [torch.cuda.current_stream(tensor.device), *streams]:
        tensor.record_stream(stream)


def release_storage(tensor, *, streams=(), parameters=None, allow_parameter=False):
    """Free ``tensor``'s whole underlying storage (all views of it included); returns the bytes freed.

    streams: CUDA streams other than the current one that read or wrote the storage and
        may still be running. Each one, and the current stream, is recorded on the block
        (``Tensor.record_stream``), so the caching allocator reuses the memory only after
        the work queued on them so far has finished; the host never blocks. Work queued on
        an unlisted stream without record_stream is not protected.
    parameters: nn.Parameters or nn.Modules whose storages must not be released. When
        None, all live nn.Parameters are found through ``gc`` (thorough but costs a pass
        over all Python objects; pass the model to make it cheap).
    allow_parameter: release even when the storage belongs to an nn.Parameter.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"release_storage expects a torch.Tensor, got {type(tensor).__name__}")
    if not allow_parameter:
        if isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter):
            raise ValueError(
                "release_storage refuses to free an nn.Parameter's storage (or a view of one); "
                "pass allow_parameter=True if that is really meant"
            )
        shared = _parameters_sharing(tensor, parameters)
        if shared:
            raise ValueError(
                f"release_storage refuses to free a storage shared with an nn.Parameter of shape "
                f"{tuple(shared[0].shape)}; pass allow_parameter=True if that is really meant"
            )
    if streams and tensor.device.type != "cuda":
        raise ValueError(f"streams only apply to CUDA tensors, got a tensor on {tensor.device}")
    mechanism, why_not = guard_mechanism()
    if mechanism is None:
        raise RuntimeError(f"release_storage is unavailable: {why_not}")
    poison = _poisoner(mechanism)
    return sum(_release_one(holder, streams, poison) for holder in _holders(tensor))


def _release_one(tensor, streams, poison):
    storage = tensor.untyped_storage()
    freed = storage.nbytes()
    if freed == 0 or _is_released(storage):
        return 0  # empty, or released already: nothing to free
    if tensor.device.type == "cuda":
        _protect_from_reuse(tensor, streams)
    storage.resize_(0)
    # A null data pointer with the old byte size: views keep passing torch's bounds checks,
    # so every use reaches the data-pointer access, which the poison turns into the error.
    storage._swap_data_ptr_(torch._C._construct_storage_from_data_pointer(0, storage.device, freed))
    poison(storage, tensor)
    return freed


_mechanism, _why_not = guard_mechanism()
if _mechanism is None:
    warnings.warn(f"te_fuser.memory.release_storage will raise: {_why_not}", RuntimeWarning, stacklevel=2)
