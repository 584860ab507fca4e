"""MoE token permutation with TransformerEngine 2.6's API (transformer_engine.pytorch.permutation).

moe_permute groups tokens by expert; moe_unpermute sends them back, summed (optionally weighted by
merging_probs); moe_sort_chunks_by_index reorders chunks of rows. The row_id_maps are TE's:
  map_type "mask":  routing_map is a (tokens, experts) bool/int mask; row_id_map is int32 (tokens,
                    2 experts + 1): for each token its destination rows (descending), their experts,
                    then their count. Destinations are expert-major, tokens in order within an expert.
  map_type "index": routing_map is (tokens, topk) int32 expert indices; row_id_map is int32
                    (topk * tokens,): entry k * tokens + t is the row of token t's k-th choice.
Rows past num_out_tokens are dropped. The kernels are C (csrc/ops/moe_permute.h), CPU only.
Float8Tensor inputs of the permutations come out as Float8Tensors with the same scale; MXFP8 and
Float8 block-scaled inputs of moe_permute have their scales permuted with their rows.
Every autograd Function keeps tensors for backward only through save_for_backward.
"""

from typing import Optional, Tuple

import torch

from .kernels import moe_permute as _k
from .tensor.float8_blockwise_tensor import Float8BlockwiseQTensor
from .tensor.float8_tensor import Float8Tensor
from .tensor.mxfp8_tensor import MXFP8Tensor
from .tensor.quantized_tensor import QuantizedTensor

__all__ = [
    "moe_permute",
    "moe_permute_with_probs",
    "moe_unpermute",
    "moe_sort_chunks_by_index",
    "moe_sort_chunks_by_index_with_probs",
]


def _check_cpu(t: torch.Tensor, name: str) -> None:
    if t.device.type != "cpu":
        raise NotImplementedError(f"te_fuser's MoE permutation runs on the CPU; {name} is on {t.device}")


def _check_input(inp, name: str = "inp") -> None:
    if not isinstance(inp, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(inp).__name__}")
    if inp.dim() != 2:
        raise ValueError(f"{name} must be 2-D (num_tokens, hidden_size), got shape {tuple(inp.shape)}")
    _check_cpu(inp, name)


def _plain(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.dequantize() if isinstance(grad, QuantizedTensor) else grad
    return grad.contiguous()


def _zero_probs(ctx, device):
    """The gradient of the probs of an empty input: zeros of their shape (TE hands back the probs)."""
    if ctx.probs_shape is None:
        return None
    shape, dtype = ctx.probs_shape
    return torch.zeros(shape, dtype=dtype, device=device)


# -- FP8: permute the codes (and block scales), keep the scale -----------------------------------
def _fp8_parts(inp):
    """(row bytes to gather, per-row scales to gather or None, rebuild(out, out_scales))."""
    if isinstance(inp, Float8Tensor):
        inp._live()
        scale_inv = inp._scale_inv.clone()

        def rebuild(out, _):
            return Float8Tensor(data=out, fp8_scale_inv=scale_inv, fp8_dtype=inp.fp8_dtype, shape=out.shape,
                                dtype=inp.dtype)

        return inp._data.contiguous(), None, rebuild
    rows = inp.shape[0]
    if isinstance(inp, Float8BlockwiseQTensor) and not inp._is_2D_scaled and inp._rowwise_data is not None:
        scales = inp._rowwise_scale_inv.T.contiguous()[:rows]

        def rebuild(out, out_scales):
            return Float8BlockwiseQTensor(shape=out.shape, dtype=inp.dtype, rowwise_data=out,
                                          rowwise_scale_inv=out_scales.T.contiguous(), fp8_dtype=inp._fp8_dtype,
                                          is_2D_scaled=False)
    elif isinstance(inp, MXFP8Tensor) and inp._rowwise_data is not None:
        scales = inp._rowwise_scale_inv.contiguous()[:rows]

        def rebuild(out, out_scales):
            return MXFP8Tensor(shape=out.shape, dtype=inp.dtype, rowwise_data=out, rowwise_scale_inv=out_scales,
                               fp8_dtype=inp._fp8_dtype)
    else:
        raise TypeError(f"moe_permute takes Float8Tensor, row-wise MXFP8Tensor and 1x128-block "
                        f"Float8BlockwiseQTensor inputs, got {type(inp).__name__}")
    return inp._rowwise_data.contiguous(), scales, rebuild


def _permute_any(inp, row_id_map, kind, num_out, probs=None):
    """permute_rows over a plain or quantized input; returns (output, permuted probs)."""
    if not isinstance(inp, QuantizedTensor):
        return _k.permute_rows(inp.contiguous(), row_id_map, kind, num_out, probs)
    data, scales, rebuild = _fp8_parts(inp)
    out, out_probs = _k.permute_rows(data, row_id_map, kind, num_out, probs)
    out_scales = None if scales is None else _k.permute_rows(scales, row_id_map, kind, num_out)[0]
    return rebuild(out, out_scales), out_probs


def _sort_any(inp, chunk_map, forward: bool):
    if isinstance(inp, Float8Tensor):
        data, _, rebuild = _fp8_parts(inp)
        return rebuild(_k.sort_rows(data, chunk_map, forward), None)
    return _k.sort_rows(_plain(inp), chunk_map, forward)


# -- index map -------------------------------------------------------------------------------
class _PermuteIndexMap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, index, num_out_tokens: int, max_token_num: int):
        del max_token_num  # TE's workspace size hint; nothing to reserve here
        ctx.empty = inp.numel() == 0
        if ctx.empty:
            return inp.detach(), torch.tensor([], device=inp.device)
        _check_cpu(index, "routing_map")
        if index.dim() == 1:
            index = index.unsqueeze(1)
        if index.shape[0] != inp.shape[0]:
            raise ValueError(f"routing_map has {index.shape[0]} rows, inp {inp.shape[0]} tokens")
        tokens, topk = index.shape
        index = index.to(torch.int32).contiguous()
        num_out = num_out_tokens if num_out_tokens > 0 else tokens * topk
        if index.numel() and int(index.min()) < 0:
            raise ValueError("routing_map (map_type 'index') holds a negative expert index")
        experts = int(index.max()) + 1 if index.numel() else 0
        if experts > index.numel():
            # sparse expert ids: renumber them in order (the sort by expert is unchanged) so the kernel's
            # per-expert counters stay as small as the routing
            uniques, inverse = torch.unique(index, return_inverse=True)
            index, experts = inverse.to(torch.int32).contiguous(), uniques.numel()
        row_id_map = _k.index_row_id_map(index, experts, num_out)
        out, _ = _permute_any(inp, row_id_map, _k.INDEX, num_out)
        ctx.save_for_backward(row_id_map)
        flat_map = row_id_map.view(-1)
        ctx.mark_non_differentiable(flat_map)
        return out, flat_map

    @staticmethod
    def backward(ctx, grad, _):
        if ctx.empty:
            return grad, None, None, None
        (row_id_map,) = ctx.saved_tensors
        act_grad = None
        if ctx.needs_input_grad[0]:
            act_grad = _k.unpermute_rows(_plain(grad), row_id_map, _k.INDEX, None, row_id_map.shape[1])
        return act_grad, None, None, None


class _UnpermuteIndexMap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, row_id_map, probs):
        ctx.empty = inp.numel() == 0
        ctx.probs_shape = None if probs is None else (tuple(probs.shape), probs.dtype)
        if ctx.empty:
            return inp.detach()
        if isinstance(inp, QuantizedTensor):
            raise TypeError("moe_unpermute takes a high-precision inp, not a quantized tensor")
        _check_cpu(row_id_map, "row_id_map")
        flat = row_id_map.to(torch.int32).reshape(-1)
        ctx.permuted_rows = inp.shape[0]
        if probs is None:
            row_map = flat.view(1, -1)
            out = _k.unpermute_rows(inp.contiguous(), row_map, _k.INDEX, None, row_map.shape[1])
            ctx.save_for_backward(row_map)
            return out
        _check_cpu(probs, "probs")
        tokens, topk = probs.shape
        if flat.numel() != tokens * topk:
            raise ValueError(f"row_id_map has {flat.numel()} entries, probs {tokens} x {topk}")
        row_map = flat.view(topk, tokens)
        probs32 = probs.detach().to(torch.float32).contiguous()
        inp = inp.contiguous()
        out = _k.unpermute_rows(inp, row_map, _k.INDEX, probs32, tokens)
        ctx.save_for_backward(row_map, inp, probs32)
        return out

    @staticmethod
    def backward(ctx, grad):
        if ctx.empty:
            probs = _zero_probs(ctx, grad.device)
            return grad, None, probs
        grad = _plain(grad)
        if ctx.probs_shape is None:
            (row_map,) = ctx.saved_tensors
            act_grad, _ = _k.permute_rows(grad, row_map, _k.INDEX, ctx.permuted_rows)
            return act_grad, None, None
        row_map, inp, probs32 = ctx.saved_tensors
        act_grad, probs_grad = _k.unpermute_backward(grad, inp, row_map, _k.INDEX, probs32)
        probs_grad = probs_grad.to(ctx.probs_shape[1]) if ctx.needs_input_grad[2] else None
        return act_grad, None, probs_grad


# -- mask map --------------------------------------------------------------------------------
def _routing_mask(routing_map: torch.Tensor) -> torch.Tensor:
    _check_cpu(routing_map, "routing_map")
    if routing_map.dim() != 2:
        raise ValueError(f"routing_map (map_type 'mask') must be (num_tokens, num_experts), got shape "
                         f"{tuple(routing_map.shape)}")
    return routing_map if routing_map.dtype == torch.bool else routing_map != 0


class _PermuteMaskMap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, routing_map, num_out_tokens: int, probs):
        ctx.empty = inp.numel() == 0
        ctx.probs_shape = None if probs is None else (tuple(probs.shape), probs.dtype)
        if ctx.empty:
            empty = torch.tensor([], device=inp.device)
            return inp.detach(), empty, empty.clone()
        mask = _routing_mask(routing_map)
        if mask.shape[0] != inp.shape[0]:
            raise ValueError(f"routing_map has {mask.shape[0]} rows, inp {inp.shape[0]} tokens")
        num_out = int(mask.sum()) if num_out_tokens is None or num_out_tokens < 0 else int(num_out_tokens)
        row_id_map = _k.mask_row_id_map(mask, num_out)
        if probs is not None:
            _check_cpu(probs, "probs")
            probs = probs.detach().contiguous()
        out, permuted_probs = _permute_any(inp, row_id_map, _k.MASK, num_out, probs)
        ctx.save_for_backward(row_id_map)
        ctx.mark_non_differentiable(row_id_map)
        return out, row_id_map, permuted_probs if probs is not None else None

    @staticmethod
    def backward(ctx, grad, _, probs_grad):
        if ctx.empty:
            probs = _zero_probs(ctx, grad.device)
            return grad, None, None, probs
        (row_id_map,) = ctx.saved_tensors
        if isinstance(grad, QuantizedTensor):
            raise TypeError("the backward of moe_permute takes a high-precision gradient, not a quantized one")
        act_grad = None
        if ctx.needs_input_grad[0]:
            act_grad = _k.unpermute_rows(grad.contiguous(), row_id_map, _k.MASK, None, row_id_map.shape[0])
        unpermuted_probs = None
        if ctx.needs_input_grad[3] and probs_grad is not None:
            unpermuted_probs = _k.unpermute_probs(probs_grad.contiguous(), row_id_map, _k.MASK)
        return act_grad, None, None, unpermuted_probs


class _UnpermuteMaskMap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, row_id_map, merging_probs, restore_shape):
        ctx.empty = inp.numel() == 0
        ctx.probs_shape = None if merging_probs is None else (tuple(merging_probs.shape), merging_probs.dtype)
        if ctx.empty:
            return inp.detach()
        if isinstance(inp, QuantizedTensor):
            raise TypeError("the forward of moe_unpermute takes a high-precision inp, not a quantized tensor")
        _check_cpu(inp, "inp")
        _check_cpu(row_id_map, "row_id_map")
        tokens, hidden = (inp.shape if restore_shape is None else restore_shape)
        if row_id_map.dim() != 2 or row_id_map.shape[0] != tokens:
            raise ValueError(f"row_id_map (shape {tuple(row_id_map.shape)}) is not for the {tokens} tokens of "
                             f"restore_shape {tuple(restore_shape) if restore_shape is not None else None} "
                             f"(None: inp's shape)")
        if hidden != inp.shape[1]:
            raise ValueError(f"restore_shape's hidden size {hidden} is not inp's {inp.shape[1]}")
        inp = inp.contiguous()
        ctx.permuted_rows = inp.shape[0]
        weights = None
        if merging_probs is not None:
            _check_cpu(merging_probs, "merging_probs")
            weights = merging_probs.detach().contiguous()
        out = _k.unpermute_rows(inp, row_id_map, _k.MASK, weights, int(tokens))
        if weights is None:
            ctx.save_for_backward(row_id_map)
        else:
            ctx.save_for_backward(row_id_map, inp, weights)
        return out

    @staticmethod
    def backward(ctx, grad):
        if ctx.empty:
            probs = _zero_probs(ctx, grad.device)
            return grad, None, probs, None
        if ctx.probs_shape is None:
            (row_id_map,) = ctx.saved_tensors
            if isinstance(grad, QuantizedTensor):
                return _permute_any(grad, row_id_map, _k.MASK, ctx.permuted_rows)[0], None, None, None
            act_grad, _ = _k.permute_rows(grad.contiguous(), row_id_map, _k.MASK, ctx.permuted_rows)
            return act_grad, None, None, None
        row_id_map, inp, weights = ctx.saved_tensors
        if isinstance(grad, QuantizedTensor):
            raise TypeError("the backward of moe_unpermute with merging_probs takes a high-precision gradient")
        act_grad, probs_grad = _k.unpermute_backward(grad.contiguous(), inp, row_id_map, _k.MASK, weights)
        return act_grad, None, probs_grad if ctx.needs_input_grad[2] else None, None


# -- chunk sort ------------------------------------------------------------------------------
class _SortChunks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, split_sizes, sorted_index, probs):
        ctx.empty = inp.numel() == 0
        if ctx.empty:
            return inp.detach(), probs.detach() if probs is not None else None
        _check_cpu(split_sizes, "split_sizes")
        _check_cpu(sorted_index, "sorted_index")
        chunk_map = _k.chunk_sort_map(split_sizes.to(torch.int64).contiguous(),
                                      sorted_index.to(torch.int64).contiguous(), inp.shape[0])
        out = _sort_any(inp, chunk_map, True)
        permuted_probs = None
        if probs is not None:
            _check_cpu(probs, "probs")
            permuted_probs = _k.sort_rows(probs.detach().contiguous(), chunk_map, True)
        ctx.save_for_backward(chunk_map)
        return out, permuted_probs

    @staticmethod
    def backward(ctx, grad, probs_grad):
        if ctx.empty:
            return grad, None, None, probs_grad
        (chunk_map,) = ctx.saved_tensors
        act_grad = _sort_any(grad, chunk_map, False) if ctx.needs_input_grad[0] else None
        back_probs = None
        if ctx.needs_input_grad[3] and probs_grad is not None:
            back_probs = _k.sort_rows(probs_grad.contiguous(), chunk_map, False)
        return act_grad, None, None, back_probs


# -- TE's functions --------------------------------------------------------------------------
def moe_permute(inp: torch.Tensor, routing_map: torch.Tensor, num_out_tokens: int = -1, max_token_num: int = -1,
                map_type: str = "mask") -> Tuple[torch.Tensor, torch.Tensor]:
    """Group the rows of inp (num_tokens, hidden) by expert; returns (permuted, row_id_map).

    routing_map: (num_tokens, num_experts) mask for map_type "mask", (num_tokens, topk) int32 expert
    indices for "index". num_out_tokens: the rows kept (-1: all). max_token_num: TE's workspace hint.
    """
    _check_input(inp)
    if map_type == "index":
        return _PermuteIndexMap.apply(inp, routing_map, num_out_tokens, max_token_num)
    if map_type == "mask":
        out, row_id_map, _ = _PermuteMaskMap.apply(inp, routing_map, num_out_tokens, None)
        return out, row_id_map
    raise ValueError(f"map_type must be 'mask' or 'index', got {map_type!r}")


def moe_permute_with_probs(inp: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                           num_out_tokens: int = -1) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_permute (mask map) that also permutes probs (num_tokens, num_experts); returns
    (permuted, permuted_probs, row_id_map). A slot whose prob is zero gets a zero row (padding)."""
    _check_input(inp)
    out, row_id_map, permuted_probs = _PermuteMaskMap.apply(inp, routing_map, num_out_tokens, probs)
    return out, permuted_probs, row_id_map


def moe_unpermute(inp: torch.Tensor, row_id_map: torch.Tensor, merging_probs: Optional[torch.Tensor] = None,
                  restore_shape: Optional[torch.Size] = None, map_type: str = "mask",
                  probs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Send permuted rows back to their tokens and sum them, weighted by merging_probs when given
    (float32 sums). restore_shape: the (num_tokens, hidden) of the output (mask map). probs: the
    former name of merging_probs."""
    if probs is not None:
        if merging_probs is not None:
            raise ValueError("both merging_probs and probs are given; probs is the deprecated name of merging_probs")
        merging_probs = probs
    _check_input(inp)
    if map_type == "index":
        return _UnpermuteIndexMap.apply(inp, row_id_map, merging_probs)
    if map_type == "mask":
        return _UnpermuteMaskMap.apply(inp, row_id_map, merging_probs, restore_shape)
    raise ValueError(f"map_type must be 'mask' or 'index', got {map_type!r}")


def moe_sort_chunks_by_index(inp: torch.Tensor, split_sizes: torch.Tensor, sorted_index: torch.Tensor) -> torch.Tensor:
    """Split inp's rows into chunks of split_sizes and concatenate them in the order sorted_index."""
    _check_input(inp)
    out, _ = _SortChunks.apply(inp, split_sizes, sorted_index, None)
    return out


def moe_sort_chunks_by_index_with_probs(inp: torch.Tensor, probs: torch.Tensor, split_sizes: torch.Tensor,
                                        sorted_index: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """moe_sort_chunks_by_index that also reorders probs (num_tokens,)."""
    _check_input(inp)
    return _SortChunks.apply(inp, split_sizes, sorted_index, probs)
