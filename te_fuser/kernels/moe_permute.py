"""MoE token permutation kernels: validated entry points and fake kernels.

torch.ops.te_fuser.moe_* (C on the CPU, csrc/ops/moe_permute.h). A row_id_map is int32, (tokens,
2 experts + 1) for MASK maps and (topk, tokens) for INDEX maps (the layouts are in the header). Data
tensors are 2-D and contiguous; gathers copy elements of any dtype, the weighted sums take float32,
bfloat16 or float16.
"""

from typing import Optional, Tuple

import torch

from .validate import call_checked, check_contiguous, check_dtype, check_same_device, check_tensor

_ops = torch.ops.te_fuser

MASK = 0
INDEX = 1


def _check_2d(t, name: str) -> None:
    check_tensor(t, name)
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    check_contiguous(t, name)


def _check_map(row_id_map, kind: int, tokens: Optional[int] = None) -> None:
    _check_2d(row_id_map, "row_id_map")
    if row_id_map.dtype != torch.int32:
        raise TypeError(f"row_id_map must be int32, got {row_id_map.dtype}")
    if kind == MASK and row_id_map.shape[1] % 2 != 1:
        raise ValueError(f"a mask row_id_map has 2 * num_experts + 1 columns, got {row_id_map.shape[1]}")
    map_tokens = row_id_map.shape[0] if kind == MASK else row_id_map.shape[1]
    if tokens is not None and tokens != map_tokens:
        raise ValueError(f"row_id_map is for {map_tokens} tokens, the input has {tokens}")


def _check_weights(weights, row_id_map, kind: int, name: str) -> None:
    _check_2d(weights, name)
    check_dtype(weights, name)
    width = (row_id_map.shape[1] - 1) // 2 if kind == MASK else row_id_map.shape[0]
    tokens = row_id_map.shape[0] if kind == MASK else row_id_map.shape[1]
    if tuple(weights.shape) != (tokens, width):
        raise ValueError(f"{name} must have shape {(tokens, width)}, got {tuple(weights.shape)}")


def mask_row_id_map(routing_map: torch.Tensor, num_out_tokens: int) -> torch.Tensor:
    """The (tokens, 2 experts + 1) row_id_map of a bool routing mask; rows past num_out_tokens dropped."""

    def check():
        check_tensor(routing_map, "routing_map")
        if routing_map.dim() != 2 or routing_map.dtype != torch.bool:
            raise ValueError(f"routing_map must be a 2-D bool tensor, got {routing_map.dtype} "
                             f"{tuple(routing_map.shape)}")
        if num_out_tokens < 0:
            raise ValueError(f"num_out_tokens must be >= 0, got {num_out_tokens}")

    return call_checked(check, _ops.moe_mask_row_id_map, routing_map, num_out_tokens)


def index_row_id_map(indices: torch.Tensor, num_experts: int, num_out_tokens: int) -> torch.Tensor:
    """The (topk, tokens) row_id_map of (tokens, topk) int32 expert indices."""

    def check():
        _check_2d(indices, "routing_map")
        if indices.dtype != torch.int32:
            raise TypeError(f"routing_map (expert indices) must be int32, got {indices.dtype}")
        if num_out_tokens < 0:
            raise ValueError(f"num_out_tokens must be >= 0, got {num_out_tokens}")
        if not torch.compiler.is_compiling() and indices.numel() and (
                int(indices.min()) < 0 or int(indices.max()) >= num_experts):
            raise ValueError(f"routing_map holds expert indices outside [0, {num_experts})")

    return call_checked(check, _ops.moe_index_row_id_map, indices, num_experts, num_out_tokens)


def permute_rows(inp: torch.Tensor, row_id_map: torch.Tensor, kind: int, num_out_tokens: int,
                 probs: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """out[dst] = inp[token] per slot (rows past the map's zero); with probs also their permutation,
    and a zero row where a slot's prob is zero."""

    def check():
        _check_2d(inp, "input")
        _check_map(row_id_map, kind, inp.shape[0])
        check_same_device(row_id_map, "row_id_map", inp, "input")
        if probs is not None:
            _check_weights(probs, row_id_map, kind, "probs")
            check_same_device(probs, "probs", inp, "input")

    return call_checked(check, _ops.moe_permute_rows, inp, row_id_map, kind, num_out_tokens, probs)


def unpermute_rows(inp: torch.Tensor, row_id_map: torch.Tensor, kind: int, weights: Optional[torch.Tensor],
                   num_tokens: int) -> torch.Tensor:
    """out[t] = sum over t's slots of inp[dst] * weight, float32 in slot order (see the header)."""

    def check():
        _check_2d(inp, "input")
        check_dtype(inp, "input")
        _check_map(row_id_map, kind, num_tokens)
        check_same_device(row_id_map, "row_id_map", inp, "input")
        if weights is not None:
            _check_weights(weights, row_id_map, kind, "merging_probs")
            check_same_device(weights, "merging_probs", inp, "input")

    return call_checked(check, _ops.moe_unpermute_rows, inp, row_id_map, kind, weights, num_tokens)


def unpermute_backward(grad: torch.Tensor, fwd_input: torch.Tensor, row_id_map: torch.Tensor, kind: int,
                       weights: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(act_grad, weights_grad) of unpermute_rows with weights."""

    def check():
        _check_2d(grad, "grad")
        check_dtype(grad, "grad")
        _check_2d(fwd_input, "fwd_input")
        if fwd_input.dtype != grad.dtype:
            raise TypeError(f"fwd_input must have grad's dtype {grad.dtype}, got {fwd_input.dtype}")
        _check_map(row_id_map, kind, grad.shape[0])
        _check_weights(weights, row_id_map, kind, "merging_probs")

    return call_checked(check, _ops.moe_unpermute_backward, grad, fwd_input, row_id_map, kind, weights)


def unpermute_probs(permuted_probs: torch.Tensor, row_id_map: torch.Tensor, kind: int) -> torch.Tensor:
    """(tokens, width) with each slot's permuted prob at its column, zero elsewhere."""

    def check():
        check_tensor(permuted_probs, "permuted_probs")
        if permuted_probs.dim() != 1:
            raise ValueError(f"permuted_probs must be 1-D, got shape {tuple(permuted_probs.shape)}")
        check_contiguous(permuted_probs, "permuted_probs")
        _check_map(row_id_map, kind)

    return call_checked(check, _ops.moe_unpermute_probs, permuted_probs, row_id_map, kind)


def chunk_sort_map(split_sizes: torch.Tensor, sorted_index: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """int32 destination row of each of num_tokens rows when chunks are reordered by sorted_index."""

    def check():
        for t, name in ((split_sizes, "split_sizes"), (sorted_index, "sorted_index")):
            check_tensor(t, name)
            if t.dim() != 1 or t.dtype != torch.int64:
                raise ValueError(f"{name} must be a 1-D int64 tensor, got {t.dtype} {tuple(t.shape)}")
        if sorted_index.numel() != split_sizes.numel():
            raise ValueError(f"sorted_index has {sorted_index.numel()} entries, split_sizes {split_sizes.numel()}")
        if not torch.compiler.is_compiling():
            if sorted(sorted_index.tolist()) != list(range(split_sizes.numel())):
                raise ValueError(f"sorted_index must be a permutation of [0, {split_sizes.numel()})")
            if int(split_sizes.min()) < 0 or int(split_sizes.sum()) != num_tokens:
                raise ValueError(f"split_sizes must be >= 0 and add up to the {num_tokens} tokens, got "
                                 f"{split_sizes.tolist()}")

    return call_checked(check, _ops.moe_chunk_sort_map, split_sizes, sorted_index, num_tokens)


def sort_rows(inp: torch.Tensor, chunk_map: torch.Tensor, forward: bool) -> torch.Tensor:
    """forward: out[map[t]] = inp[t]; backward: out[t] = inp[map[t]]. inp is 1-D or 2-D."""

    def check():
        check_tensor(inp, "input")
        if inp.dim() not in (1, 2):
            raise ValueError(f"input must be 1-D or 2-D, got shape {tuple(inp.shape)}")
        check_contiguous(inp, "input")
        if chunk_map.numel() != inp.shape[0]:
            raise ValueError(f"the chunk map has {chunk_map.numel()} rows, input {inp.shape[0]}")

    return call_checked(check, _ops.moe_sort_rows, inp, chunk_map, bool(forward))


@torch.library.register_fake("te_fuser::moe_mask_row_id_map")
def _mask_map_fake(routing_map, num_out_tokens):
    del num_out_tokens
    return routing_map.new_empty((routing_map.shape[0], 2 * routing_map.shape[1] + 1), dtype=torch.int32)


@torch.library.register_fake("te_fuser::moe_index_row_id_map")
def _index_map_fake(indices, num_experts, num_out_tokens):
    del num_experts, num_out_tokens
    return indices.new_empty((indices.shape[1], indices.shape[0]), dtype=torch.int32)


@torch.library.register_fake("te_fuser::moe_permute_rows")
def _permute_fake(inp, row_id_map, map_kind, num_out_tokens, probs):
    del row_id_map, map_kind
    out_probs = inp.new_empty((num_out_tokens if probs is not None else 0,),
                              dtype=probs.dtype if probs is not None else torch.float32)
    return inp.new_empty((num_out_tokens, inp.shape[1])), out_probs


@torch.library.register_fake("te_fuser::moe_unpermute_rows")
def _unpermute_fake(inp, row_id_map, map_kind, merging_probs, num_tokens):
    del row_id_map, map_kind, merging_probs
    return inp.new_empty((num_tokens, inp.shape[1]))


@torch.library.register_fake("te_fuser::moe_unpermute_backward")
def _unpermute_backward_fake(grad, fwd_input, row_id_map, map_kind, merging_probs):
    del row_id_map, map_kind
    return grad.new_empty((fwd_input.shape[0], grad.shape[1])), torch.empty_like(merging_probs)


@torch.library.register_fake("te_fuser::moe_unpermute_probs")
def _unpermute_probs_fake(permuted_probs, row_id_map, map_kind):
    if map_kind == MASK:
        shape = (row_id_map.shape[0], (row_id_map.shape[1] - 1) // 2)
    else:
        shape = (row_id_map.shape[1], row_id_map.shape[0])
    return permuted_probs.new_empty(shape)


@torch.library.register_fake("te_fuser::moe_chunk_sort_map")
def _chunk_map_fake(split_sizes, sorted_index, num_tokens):
    del sorted_index
    return split_sizes.new_empty((num_tokens,), dtype=torch.int32)


@torch.library.register_fake("te_fuser::moe_sort_rows")
def _sort_rows_fake(inp, chunk_map, forward):
    del chunk_map, forward
    return torch.empty_like(inp)
