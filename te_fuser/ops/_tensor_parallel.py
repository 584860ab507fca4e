"""The collectives of tensor parallelism, along dim 0 (the sequence dim for sequence parallelism)."""

import torch
import torch.distributed as dist


def world_size(group) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def mark_parallel_param(param: torch.Tensor, partition_dim: int) -> None:
    """Megatron/TransformerEngine attributes of a tensor-parallel (sharded) parameter, which
    frameworks read, e.g. to all-reduce only the replicated parameters' gradients."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = 1


def all_gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    size = world_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * size,) + tuple(x.shape[1:]))
    dist.all_gather(list(out.chunk(size)), x, group=group)
    return out


def reduce_scatter_dim0(x: torch.Tensor, group) -> torch.Tensor:
    size = world_size(group)
    if size == 1:
        return x
    if x.shape[0] % size:
        raise ValueError(f"sequence parallelism: dim 0 ({x.shape[0]}) must be divisible by the TP size {size}")
    x = x.contiguous()
    if dist.get_backend(group) == "nccl":
        out = x.new_empty((x.shape[0] // size,) + tuple(x.shape[1:]))
        dist.reduce_scatter_tensor(out, x, group=group)
        return out
    # gloo has no reduce-scatter: all-reduce, keep this rank's chunk.
    dist.all_reduce(x, group=group)
    return x.chunk(size)[dist.get_rank(group)].contiguous()


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if world_size(group) > 1:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
    return x
