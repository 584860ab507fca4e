"""release_storage: free a tensor's bytes even while views of it are still referenced.

``tensor.data = torch.empty(0)`` only repoints that one tensor; every view handed out
(e.g. the true-shape view of a padded all-gather buffer, seed 003) still owns the storage.
Resizing the shared UntypedStorage to 0 bytes frees it for all of them at once.

After the release, every tensor on that storage still has its shape but no bytes:
  * creating a view or indexing (``v[0]``, ``v.t()``, matmul) raises RuntimeError
    ("setStorage: ... out of bounds"); so do ``.tolist()``, ``.item()`` and dtype casts;
  * writes raise RuntimeError: the storage is marked to refuse mutable data access;
  * on CUDA builds that provide ``torch._C._set_storage_access_error_msg`` (what
    torch's cudagraph trees use), every data access raises RuntimeError;
  * on a CPU-only torch some read kernels (``v.sum()``, ``v + 1``) are not checked and
    read at the view's byte offset from the storage's null data pointer: the process
    crashes (SIGSEGV, checked for offsets up to 16 MiB) instead of reading freed memory.
    torch offers no CPU-build switch to make those reads raise. Do not touch released tensors.
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
    else:
        torch._C._set_throw_on_mutable_data_ptr(tensor)
