"""MultiTensorApply: TE's (apex's) caller of the multi-tensor kernels with a fixed chunk size."""

from typing import Callable


class MultiTensorApply:
    """applier(op, noop_flag_buffer, tensor_lists, *args) runs op(chunk_size, noop_flag_buffer,
    tensor_lists, *args), the calling convention of `transformer_engine_torch.multi_tensor_*`."""

    def __init__(self, chunk_size: int):
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self.chunk_size = chunk_size

    def __call__(self, op: Callable, noop_flag_buffer, tensor_lists, *args):
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


multi_tensor_applier = MultiTensorApply(2048 * 32)

__all__ = ["MultiTensorApply", "multi_tensor_applier"]
