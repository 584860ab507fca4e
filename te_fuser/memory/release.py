"""release_storage: free a tensor's bytes even while views of it are still referenced.

``tensor.data = torch.empty(0)`` only repoints that one tensor; every view handed out
(e.g. the true-shape view of a padded all-gather buffer, seed 003) still owns the storage.
Resizing the shared UntypedStorage to 0 bytes frees it for all of them at once.

After the release, every tensor on that storage still has its shape but no bytes, and
the storage is poisoned: any read or write through it, or through any view of it, raises
RuntimeError. Torch's own switch for that (``torch._C._set_storage_access_error_msg``)
exists only in CUDA builds; elsewhere te_fuser's one classic-API module
(``te_fuser._storage_poison``, see csrc/README.md) sets the same StorageImpl flag. Only if
that module cannot load (built for another torch) does the guard fall back to refusing
writes; unchecked read kernels would then dereference the released (null) data pointer.
The release is final: the storage cannot be resized back.
"""

import gc

import torch

_RELEASED_MESSAGE = "this tensor's storage was released by te_fuser.memory.release_storage; it must not be used"


def _storage_identity(tensor):
    """Address of the StorageImpl itself (not of its data), or None for tensors without one."""
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _parameters_sharing(tensor, parameters):
    identity = _storage_identity(tensor)
    if parameters is None:
        candidates = (obj for obj in gc.get_objects() if issubclass(type(obj), torch.nn.Parameter))
    else:
        candidates = []
        for item in parameters if isinstance(parameters, (list, tuple, set)) else [parameters]:
            candidates.extend(item.parameters() if isinstance(item, torch.nn.Module) else [item])
    return [p for p in candidates if _storage_identity(p) == identity]


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
    storage = tensor.untyped_storage()
    freed = storage.nbytes()
    if freed == 0:
        return 0  # already released (or empty): nothing to free, and it is poisoned already
    if tensor.device.type == "cuda":
        _protect_from_reuse(tensor, streams)
    storage.resize_(0)
    _poison(tensor)
    return freed


def _poison(tensor):
    set_message = getattr(torch._C, "_set_storage_access_error_msg", None)
    if set_message is not None:
        set_message(tensor, _RELEASED_MESSAGE)
        return
    try:
        from .. import _storage_poison  # noqa: F401  (registers torch.ops.te_fuser.poison_storage)
    except ImportError:
        torch._C._set_throw_on_mutable_data_ptr(tensor)
        return
    torch.ops.te_fuser.poison_storage(tensor, _RELEASED_MESSAGE)
