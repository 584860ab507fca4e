"""Saving mixed tensors and Float8Tensors for backward without keeping them on ctx.

    tensors, objects = prepare_for_saving(x, w_fp8, None)
    ctx.save_for_backward(*tensors)
    ctx.tensor_objects = objects            # shells only: no tensor memory
    ...
    x, w_fp8, _ = restore_from_saved(ctx.tensor_objects, ctx.saved_tensors)
    ctx.tensor_objects = None               # the shells now hold buffers again: drop them

The last line is the fix of TransformerEngine's fuser and FP8-attention leaks:
autograd frees what save_for_backward holds after backward, but a plain ctx
attribute lives as long as the graph node, one iteration too long.
"""

from typing import List, Optional, Sequence, Tuple

import torch

from .float8_tensor import Float8Record, Float8Tensor

# Number of tensors Float8Tensor.prepare_for_saving() hands over.
_FLOAT8_PARTS = 3


def prepare_for_saving(*objs) -> Tuple[List[Optional[torch.Tensor]], List[Optional[Float8Tensor]]]:
    """Split tensors, Float8Tensors and Nones into tensors to save and the shells to keep."""
    tensors: List[Optional[torch.Tensor]] = []
    objects: List[Optional[Float8Tensor]] = []
    for obj in objs:
        if isinstance(obj, Float8Tensor):
            parts, shell = obj.prepare_for_saving()
            tensors.extend(parts)
            objects.append(shell)
        elif obj is None or isinstance(obj, torch.Tensor):
            tensors.append(obj)
            objects.append(None)
        else:
            raise TypeError(f"prepare_for_saving takes tensors, Float8Tensors or None, got {type(obj).__name__}")
    return tensors, objects


def restore_from_saved(objects: Sequence[Optional[Float8Tensor]], saved: Sequence[Optional[torch.Tensor]]) -> list:
    """Inverse of prepare_for_saving: the original objects, in order."""
    needed = sum(1 if shell is None else _FLOAT8_PARTS for shell in objects)
    if needed != len(saved):
        raise RuntimeError(f"restore_from_saved: {len(saved)} saved tensors but the objects use {needed}")
    out = []
    pos = 0
    for shell in objects:
        if shell is None:
            out.append(saved[pos])
            pos += 1
        elif isinstance(shell, Float8Record):  # saved under torch.compile
            out.append(shell.rebuild(list(saved[pos:pos + _FLOAT8_PARTS])))
            pos += _FLOAT8_PARTS
        else:
            shell.restore_from_saved(list(saved[pos:pos + _FLOAT8_PARTS]))
            out.append(shell)
            pos += _FLOAT8_PARTS
    return out
