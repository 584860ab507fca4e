"""CPU offload of the activations saved for backward (TransformerEngine 2.6's get_cpu_offload_context).

Inside the context, every tensor autograd saves goes through a pair of saved-tensor hooks. An activation
of an offloaded layer is copied to pinned host memory on a side stream and its device reference is
dropped; backward brings it back, one layer ahead of the layer that reads it. The sync function, called
on each layer's output, marks the layer boundaries (TE's groups): layers 0 .. num_layers-1 are
offloaded, the last ones stay on the device, and TE's window map spreads the waits for the copies over
the model_layers layers.

Which tensors move (TE moves the tensors its modules mark): a tensor marked by mark_activation_offload,
and every other saved tensor except parameters, views of them, and tensors marked
`activation_offloading = False` (te_fuser's concatenated view of split weight parameters): weights stay
where they are. A quantized tensor (Float8Tensor, the block-scaled kinds) is split by prepare_for_saving
so its bytes move, in a new wrapper: the caller's object keeps its buffers.

The same tensor saved by several ops of a layer moves once. autograd's check that a saved tensor was not
changed in place before backward, which the hooks take over, is kept: backward raises as it would.

Lifetimes: what a saved tensor becomes is a _Saved record that autograd owns. The handler reaches the
records only through weak references, so a record, its host copy and its restored tensor die with the
autograd node: after backward (or when the graph is dropped) the handler holds nothing. A restored
record drops its host copy at once.

Without a CUDA device there is nothing to move (the activations already live in host memory): the
context still runs its hooks, moves nothing, says so once with a warning, and its `moves_tensors` is
False.
"""

import warnings
import weakref
from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch

from .tensor.quantized_tensor import QuantizedTensor, prepare_for_saving, restore_from_saved

__all__ = ["get_cpu_offload_context"]

# True while a CPU-offload context is entered (TE's module flag, read as cpu_offload.CPUOffloadEnabled).
CPUOffloadEnabled = False

_NOTHING_TO_MOVE = ("te_fuser CPU offload: no CUDA device, so the activations already live in host memory; "
                    "the context runs its hooks and moves nothing")
_warned_nothing_to_move = False


def mark_activation_offload(*tensors) -> None:
    """Mark tensors (or a quantized tensor's buffers) as activations to offload, as TE's modules do."""
    for tensor in tensors:
        if tensor is None:
            continue
        if isinstance(tensor, QuantizedTensor):
            parts, _ = prepare_for_saving(tensor.detach())  # the buffers, through a new wrapper
            for part in parts:
                if part is not None:
                    part.activation_offloading = True
        else:
            tensor.activation_offloading = True


def is_cpu_offload_enabled() -> bool:
    """Whether a CPU-offload context is entered."""
    return CPUOffloadEnabled


def is_activation(tensor: torch.Tensor) -> bool:
    """te_fuser's rule for what moves: marked tensors, and every tensor that is not a parameter or a view
    of one (nor marked activation_offloading = False: a view over parameters' bytes such as the fused QKV
    weight)."""
    marked = getattr(tensor, "activation_offloading", None)
    if marked is not None:
        return bool(marked)
    return not isinstance(tensor, torch.nn.Parameter) and not isinstance(tensor._base, torch.nn.Parameter)


class CudaCopier:
    """Moves CUDA tensors to pinned host memory on one side stream and back on another.

    Each direction is ordered after the work the compute stream has queued, and returns an event the
    compute stream waits on before it frees a source (offload) or reads a restored tensor (reload).
    Restored tensors are allocated on the compute stream, which is the stream that reads and frees them.
    """

    def __init__(self):
        self.d2h_stream = torch.cuda.Stream()
        self.h2d_stream = torch.cuda.Stream()

    @staticmethod
    def takes(tensor: torch.Tensor) -> bool:
        return tensor.is_cuda

    def to_host(self, tensors):
        """(pinned host copies, event): the copies are complete once the event has passed."""
        self.d2h_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.d2h_stream):
            hosts = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True).copy_(t, non_blocking=True)
                     for t in tensors]
            return hosts, self.d2h_stream.record_event()

    def to_device(self, hosts, devices):
        """(device tensors, event), allocated on the compute stream, written on the reload stream."""
        out = [torch.empty(h.shape, dtype=h.dtype, device=d) for h, d in zip(hosts, devices)]
        self.h2d_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.h2d_stream):
            for t, h in zip(out, hosts):
                t.copy_(h, non_blocking=True)
            return out, self.h2d_stream.record_event()

    @staticmethod
    def wait(event) -> None:
        torch.cuda.current_stream().wait_event(event)


class StayingCopier:
    """Without a CUDA device: nothing moves."""

    @staticmethod
    def takes(tensor: torch.Tensor) -> bool:
        del tensor
        return False


class _Saved:
    """What autograd keeps for one saved tensor: the tensor itself until its group is offloaded, then its
    host copies, then (in backward) the restored tensor. A quantized tensor is held as its buffers and
    the emptied wrapper they go back into."""

    __slots__ = ("group", "parts", "shell", "devices", "versions", "modified", "moved", "hosts", "offload_event",
                 "reload_event", "restored", "__weakref__")

    def __init__(self, group: int, parts: list, shell):
        self.group, self.parts, self.shell = group, parts, shell
        self.devices = [None if p is None else p.device for p in parts]
        self.versions = [None if p is None else p._version for p in parts]
        self.modified = self.moved = False  # moved: parts are no longer the saved tensors
        self.hosts = self.offload_event = self.reload_event = self.restored = None

    def check_unmodified(self) -> None:
        """Record whether a part was changed in place since it was saved (autograd's version check, which
        the saved-tensor hooks take over)."""
        self.modified = self.modified or any(p is not None and p._version != v
                                             for p, v in zip(self.parts, self.versions))


class OffloadHandler:
    """The interface the saved-tensor hooks talk to (TE's names)."""

    def tensor_push(self, tensor: torch.Tensor, **kwargs) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement tensor_push")

    def tensor_pop(self, tensor_tag: Any, **kwargs) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not implement tensor_pop")


class AsyncDoubleBufferGroupOffloadHandler(OffloadHandler):
    """Offloads the tensors saved by layers 0 .. num_offload_group-1 and reloads them ahead of use.

    A layer's saved tensors start for the host at the layer's commit (the sync function's forward). Group
    k's copies are waited for, and its device references dropped, at the commit of layer window[k]
    (TE's window map over num_model_group layers); in backward group k is reloaded at layer window[k]'s
    commit and waited for before layer k's backward. A tensor asked for before its group was reloaded
    is reloaded on the spot (or, when its group's window never came, read from its device copy).

    copier: what moves tensors (CudaCopier; the tests give one that records the moves on the CPU).
    """

    def __init__(self, num_offload_group: int, num_model_group: int,
                 tensor_need_offloading_checker: Callable[[torch.Tensor], bool] = is_activation,
                 double_buffering: bool = False, debug: bool = False, *, copier=None):
        del debug
        if double_buffering:
            raise NotImplementedError("te_fuser's CPU offload does not implement double_buffering: restored "
                                      "tensors are fresh allocations from the caching allocator")
        self.num_offload_group = num_offload_group
        self.num_layers = num_model_group
        self.tensor_need_offloading_checker = tensor_need_offloading_checker
        self.copier = copier if copier is not None else (CudaCopier() if torch.cuda.is_available()
                                                         else StayingCopier())
        self.layer_window_map = _window_map(num_offload_group, num_model_group)
        self.current_group = 0
        # group -> weak references to its records; a group's entry goes once it is offloaded / reloaded.
        self._to_offload = {}
        self._seen = {}  # group -> {what identifies a saved tensor: its record}, until the group's commit
        self._offloading = {}
        self._to_reload = {}
        self._reloading = {}

    # -- the hooks ------------------------------------------------------------------------------
    def tensor_push(self, tensor: torch.Tensor, **kwargs) -> Any:
        del kwargs
        group = self.current_group
        if (group >= self.num_offload_group or not self.copier.takes(tensor)
                or not self.tensor_need_offloading_checker(tensor)):
            return tensor
        if isinstance(tensor, QuantizedTensor):
            parts, shells = prepare_for_saving(tensor.detach())  # a new wrapper: the caller's keeps its buffers
            record = _Saved(group, parts, shells[0])
        else:
            # The same tensor saved by several ops of the layer (unchanged since) moves once.
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape, tensor.stride(),
                   tensor.dtype, tensor._version)
            seen = self._seen.setdefault(group, {})
            record = seen[key]() if key in seen else None
            if record is not None:
                return record
            record = _Saved(group, [tensor], None)
            seen[key] = weakref.ref(record)
        self._to_offload.setdefault(group, []).append(weakref.ref(record))
        return record

    def tensor_pop(self, tensor_tag: Any, **kwargs) -> torch.Tensor:
        del kwargs
        if not isinstance(tensor_tag, _Saved):
            return tensor_tag
        record = tensor_tag
        if record.restored is None:
            if not record.moved:
                record.check_unmodified()
            if record.modified:
                raise RuntimeError("one of the variables needed for gradient computation has been modified by "
                                   "an inplace operation: a tensor saved under CPU offload changed after it was "
                                   "saved")
            if record.hosts is not None:
                if record.moved:  # offloaded, and its group was not prefetched
                    self._reload([record])
                else:  # its group's offload was never waited for: the device copy is still here
                    record.hosts = None
            if record.reload_event is not None:
                self.copier.wait(record.reload_event)
            parts = record.parts
            record.restored = parts[0] if record.shell is None else restore_from_saved([record.shell], parts)[0]
            record.parts = record.shell = record.hosts = record.reload_event = None
        return record.restored

    # -- layer boundaries -------------------------------------------------------------------------
    def on_group_commit_forward(self) -> None:
        layer = self.current_group
        self._seen.pop(layer, None)
        records = _alive(self._to_offload.pop(layer, []))
        if records:
            self._offload(records)
            self._offloading[layer] = [weakref.ref(r) for r in records]
        for group in [g for g, window in self.layer_window_map.items() if window == layer]:
            self._finish_offload(group)
        self.current_group += 1

    def on_group_commit_backward(self) -> None:
        self.current_group -= 1
        if self.current_group < 0:
            raise RuntimeError("CPU offload: more layer commits in backward than in forward")
        layer = self.current_group
        for group in [g for g, window in self.layer_window_map.items() if window == layer]:
            records = _alive(self._to_reload.pop(group, []))
            if records:
                self._reload(records)
                self._reloading[group] = [weakref.ref(r) for r in records]
        for record in _alive(self._reloading.pop(layer, [])):
            self.copier.wait(record.reload_event)
            record.reload_event = None

    def _offload(self, records) -> None:
        for r in records:
            r.check_unmodified()
        tensors = [p for r in records for p in r.parts if p is not None]
        hosts, event = self.copier.to_host(tensors)
        it = iter(hosts)
        for r in records:
            r.hosts = [None if p is None else next(it) for p in r.parts]
            r.offload_event = event

    def _finish_offload(self, group: int) -> None:
        """Wait for group's copies and drop its device references."""
        records = _alive(self._offloading.pop(group, []))
        for r in records:
            if r.offload_event is not None:
                self.copier.wait(r.offload_event)
            r.offload_event = None
            r.check_unmodified()  # a later layer may have written into it while it was copied
            r.parts, r.moved = [None] * len(r.parts), True
        if records:
            self._to_reload[group] = [weakref.ref(r) for r in records]

    def _reload(self, records) -> None:
        for r in records:
            if r.offload_event is not None:  # reloaded before its offload was waited for
                self.copier.wait(r.offload_event)
                r.offload_event = None
        pairs = [(h, d) for r in records for h, d in zip(r.hosts, r.devices) if h is not None]
        tensors, event = self.copier.to_device([h for h, _ in pairs], [d for _, d in pairs])
        it = iter(tensors)
        for r in records:
            r.parts = [None if h is None else next(it) for h in r.hosts]
            r.hosts = None  # the copy holds the pinned buffer until it has run
            r.reload_event = event


def _alive(refs) -> list:
    return [r for r in (ref() for ref in refs) if r is not None]


def _window_map(num_offload_group: int, num_model_group: int) -> dict:
    """TE's map from an offloaded group to the layer whose commit waits for its copies (and reloads it in
    backward): the offloaded groups spread evenly over the model's layers."""
    windows, extra = {}, 0
    per_group, remainder = divmod(num_model_group, num_offload_group) if num_offload_group else (0, 0)
    for i in range(num_offload_group):
        windows[i] = per_group * (i + 1) - 1
        if i < remainder:
            extra = i + 1
        windows[i] += extra
    return windows


class CpuOffloadSavedTensorHook:
    """A context manager that runs on_save_for_backward / on_get_saved_tensor as autograd's saved-tensor
    hooks, and sets CPUOffloadEnabled while entered."""

    def __init__(self) -> None:
        self.inside_context = False
        self._hooks = None
        self._previous = False

    def __enter__(self):
        global CPUOffloadEnabled
        self._previous, CPUOffloadEnabled = CPUOffloadEnabled, True
        self.inside_context = True
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.on_save_for_backward, self.on_get_saved_tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *args: Any):
        global CPUOffloadEnabled
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(*args)
        CPUOffloadEnabled = self._previous
        self.inside_context = False
        return False

    def on_save_for_backward(self, tensor: torch.Tensor) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement on_save_for_backward")

    def on_get_saved_tensor(self, saved_state: Any) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not implement on_get_saved_tensor")


class CpuOffloadHookWithOffloadHandler(CpuOffloadSavedTensorHook):
    """The saved-tensor hooks of an offload handler. moves_tensors: whether its handler can move anything
    (False without a CUDA device)."""

    def __init__(self, offload_handler: OffloadHandler, handler_extra_kwargs: Optional[dict] = None,
                 debug: bool = False) -> None:
        del debug
        super().__init__()
        self.offload_handler = offload_handler
        self.handler_extra_kwargs = handler_extra_kwargs or {}
        self.moves_tensors = not isinstance(getattr(offload_handler, "copier", None), StayingCopier)

    def on_save_for_backward(self, tensor: torch.Tensor) -> Any:
        return self.offload_handler.tensor_push(tensor, **self.handler_extra_kwargs)

    def on_get_saved_tensor(self, saved_state: Any) -> torch.Tensor:
        return self.offload_handler.tensor_pop(saved_state, **self.handler_extra_kwargs)


class GroupCommitFunction(torch.autograd.Function):
    """Identity on a layer's output that marks the layer boundary: a commit in forward and in backward."""

    @staticmethod
    def forward(ctx, tensor, cpu_offload_handler):
        cpu_offload_handler.on_group_commit_forward()
        ctx.cpu_offload_handler = cpu_offload_handler
        return tensor

    @staticmethod
    def backward(ctx, grad_output):
        handler, ctx.cpu_offload_handler = ctx.cpu_offload_handler, None
        handler.on_group_commit_backward()
        return grad_output, None


def group_prefetch_offload_commit(tensor: torch.Tensor, cpu_offload_handler) -> torch.Tensor:
    """Commit a layer boundary; without a graph to run backward through (no grad) nothing is committed."""
    if not (torch.is_grad_enabled() and tensor.requires_grad):
        return tensor
    return GroupCommitFunction.apply(tensor, cpu_offload_handler)


def get_cpu_offload_context(enabled: bool = False, num_layers: int = 1, model_layers: int = 1,
                            offload_activations: bool = True, offload_weights: bool = False,
                            double_buffering: bool = False):
    """(context, sync function): run each layer's forward inside the context and pass its output through
    the sync function (TE 2.6's signature). Layers 0 .. num_layers-1 of the model_layers layers run under
    it have their activations moved to host memory until backward needs them. Not enabled: nullcontext()
    and a sync function that commits nothing. offload_weights is deprecated in TE and has no effect."""
    if not offload_weights and not offload_activations:
        raise ValueError("get_cpu_offload_context: neither offload_activations nor offload_weights is set: "
                         "nothing to offload")
    for name, value in (("num_layers", num_layers), ("model_layers", model_layers)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"get_cpu_offload_context: {name} must be an int >= 0, got {value!r}")
    if num_layers > model_layers:
        raise ValueError(f"get_cpu_offload_context: num_layers ({num_layers}) exceeds model_layers ({model_layers})")
    if offload_weights:
        warnings.warn("Offloading weights is deprecated. Using offload_weights=True does not have any effect.",
                      DeprecationWarning, stacklevel=2)
        if not offload_activations:
            return nullcontext(), lambda tensor: tensor
    if not enabled:
        return nullcontext(), lambda tensor: tensor
    if not torch.cuda.is_available():
        global _warned_nothing_to_move
        if not _warned_nothing_to_move:
            _warned_nothing_to_move = True
            warnings.warn(_NOTHING_TO_MOVE, UserWarning, stacklevel=2)
    handler = AsyncDoubleBufferGroupOffloadHandler(num_layers, model_layers, double_buffering=double_buffering)
    return (CpuOffloadHookWithOffloadHandler(handler),
            lambda tensor: group_prefetch_offload_commit(tensor, handler))
