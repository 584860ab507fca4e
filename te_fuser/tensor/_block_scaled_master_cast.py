"""cast_master_weights_to_fp8 for block-scaled model weights (te_fuser.tensor.utils calls it).

A whole master requantizes its weight (any format). A shard of the flattened master (TE's distributed
optimizer) is cast as TE 2.6 casts one: Float8BlockScaling weights in 128x128 blocks only, each block's amax
reduced (max) over the group, so every rank writes its shard's bytes with the scales the whole master gives and
all ranks hold the same scales; the caller then all-gathers the bytes. The master is first cast to the weight's
nominal dtype, as TE does (the values a high-precision weight would have held).
"""

from typing import Optional

import torch

from .float8_blockwise_tensor import BLOCK_LEN, Float8BlockwiseQTensor


def cast_block_scaled(model, shard: Optional[torch.Tensor], offset: int, sharded: bool, group) -> None:
    """Write shard (model's flattened elements from offset; None: none on this rank) into model."""
    whole = shard is not None and shard.numel() == model.numel()
    if not sharded or whole:
        if shard is None:
            raise ValueError(f"a {type(model).__name__} needs its whole master weight on every rank "
                             "without start_offsets")
        model.quantize_(shard.to(model.dtype).reshape(model.shape))
        return
    if not (isinstance(model, Float8BlockwiseQTensor) and model._is_2D_scaled and model.dim() == 2):
        raise NotImplementedError(f"te_fuser casts shards of master weights into Float8BlockScaling's 128x128-block "
                                  f"weights only, as TE 2.6 does, not into a {type(model).__name__} (pass whole "
                                  "master weights, without start_offsets)")
    rows, cols = model.shape
    flat = torch.zeros(rows * cols, dtype=model.dtype, device=model.device)
    inside = torch.zeros(rows * cols, dtype=torch.bool, device=model.device)
    if shard is not None:
        flat[offset: offset + shard.numel()] = shard.to(model.dtype)
        inside[offset: offset + shard.numel()] = True
    values, inside = flat.reshape(rows, cols), inside.reshape(rows, cols)
    amax = _block_amax(values.abs().float())
    if group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=group)
    # Elements of other ranks take the block's amax: the quantizer then finds each block's reduced amax, so its
    # scale and the codes of this rank's elements are those the whole master gives.
    spread = amax.repeat_interleave(BLOCK_LEN, 0)[:rows].repeat_interleave(BLOCK_LEN, 1)[:, :cols]
    cast = model._quantizer.quantize(torch.where(inside, values, spread.to(model.dtype)).contiguous())
    if shard is not None:
        model._rowwise_data.view(-1)[offset: offset + shard.numel()].copy_(
            cast._rowwise_data.reshape(-1)[offset: offset + shard.numel()])
    model._rowwise_scale_inv.copy_(cast._rowwise_scale_inv)
    if model._columnwise_data is not None:  # stale until the bytes of every rank are in (TE drops it too)
        model._columnwise_data = model._columnwise_scale_inv = None
    torch.autograd.graph.increment_version([model._rowwise_data, model._rowwise_scale_inv])


def _block_amax(values: torch.Tensor) -> torch.Tensor:
    """max |value| of each 128x128 block (partial blocks at the edges), float32 (row blocks, col blocks)."""
    rows, cols = values.shape
    padded = values.new_zeros(-(-rows // BLOCK_LEN) * BLOCK_LEN, -(-cols // BLOCK_LEN) * BLOCK_LEN)
    padded[:rows, :cols] = values
    blocks = padded.reshape(padded.shape[0] // BLOCK_LEN, BLOCK_LEN, padded.shape[1] // BLOCK_LEN, BLOCK_LEN)
    return blocks.amax(dim=(1, 3))
