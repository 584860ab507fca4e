"""A small GPT in Megatron-LM's style, built from te_fuser layers.

Swapping `import te_fuser as te` for `import transformer_engine.pytorch as te`
is the only change needed to run it on TransformerEngine: it uses only names
and arguments both libraries share.

Per block (activations are [s, b, h], Megatron's layout):
  x = x + proj(attention(qkv(norm(x))))     column-parallel QKV, row-parallel projection
  x = x + mlp(x)                            op fuser: norm, linear + bias + GELU, linear + bias
"""

from dataclasses import dataclass

import torch

import te_fuser as te


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    hidden_size: int = 128
    num_heads: int = 4
    num_layers: int = 2
    ffn_hidden_size: int = 512

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}")


@dataclass(frozen=True)
class Parallel:
    """Tensor parallelism of the blocks: the group, its size, and sequence parallelism."""

    tp_group: object = None
    tp_size: int = 1
    sequence_parallel: bool = False


class TransformerBlock(torch.nn.Module):
    def __init__(self, cfg: GPTConfig, par: Parallel, device, dtype):
        super().__init__()
        if cfg.num_heads % par.tp_size:
            raise ValueError(f"num_heads={cfg.num_heads} must be divisible by the tensor-parallel size {par.tp_size}")
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        self.local_heads = cfg.num_heads // par.tp_size
        self.head_dim = h // cfg.num_heads
        tp = dict(tp_group=par.tp_group, tp_size=par.tp_size, sequence_parallel=par.sequence_parallel,
                  params_dtype=dtype, device=device)
        self.norm = te.ops.LayerNorm(h, device=device, dtype=dtype)
        self.qkv = te.Linear(h, 3 * h, parallel_mode="column", **tp)
        self.attention = te.DotProductAttention(cfg.num_heads, self.head_dim, qkv_format="sbhd",
                                                attn_mask_type="causal", tp_size=par.tp_size,
                                                tp_group=par.tp_group, sequence_parallel=par.sequence_parallel)
        self.proj = te.Linear(h, h, parallel_mode="row", **tp)
        mlp_tp = dict(tensor_parallel_group=par.tp_group, sequence_parallel=par.sequence_parallel,
                      device=device, dtype=dtype)
        self.mlp = te.ops.Sequential(
            te.ops.LayerNorm(h, device=device, dtype=dtype),
            te.ops.BasicLinear(h, f, tensor_parallel_mode="column" if par.tp_size > 1 else None, **mlp_tp),
            te.ops.Bias(f, tensor_parallel=par.tp_size > 1, tensor_parallel_group=par.tp_group,
                        device=device, dtype=dtype),
            te.ops.GELU(),
            te.ops.BasicLinear(f, h, tensor_parallel_mode="row" if par.tp_size > 1 else None, **mlp_tp),
            te.ops.Bias(h, device=device, dtype=dtype),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under a recipe with fp8_mha=True (and fp8_dpa=True) the QKV projection returns FP8, q, k and v
        # are FP8 views of its bytes (SplitAlongDim keeps FP8), the attention returns FP8 (TE's rule
        # under fp8_mha) and proj's FP8 GEMM reads it as it is, handing the attention an FP8 gradient.
        manager = te.fp8.FP8GlobalStateManager
        fp8_mha = manager.is_fp8_enabled() and manager.get_fp8_recipe().fp8_mha
        qkv = self.qkv(self.norm(x), fp8_output=fp8_mha)
        s, b = qkv.shape[0], qkv.shape[1]
        # Megatron's QKV layout [s, b, heads, (q k v), d]: a column split keeps whole heads per rank.
        qkv = qkv.view(s, b, self.local_heads, 3, self.head_dim)
        if isinstance(qkv, te.tensor.QuantizedTensor):  # FP8 views of the projection's bytes
            q, k, v = (t.view(s, b, self.local_heads, self.head_dim)
                       for t in te.utils.SplitAlongDim.apply(qkv, 3, [1, 1, 1]))
        else:  # torch's own views and backward: SplitAlongDim's autograd Function would only cost its calls
            q, k, v = qkv.unbind(3)
        context = self.attention(q, k, v)
        x = x + self.proj(context, fp8_grad=isinstance(context, te.tensor.QuantizedTensor))
        return x + self.mlp(x)


class GPT(torch.nn.Module):
    """Byte-level GPT: embedding, blocks, final norm, output head. Input tokens are [s, b], logits
    [s, b, vocab]. The head reads the token embedding's weight (tied, as in GPT-2 and Megatron's default
    share_embeddings_and_output_weights). It starts from N(0, 1/hidden_size), so that the head's first
    logits have unit scale."""

    def __init__(self, cfg: GPTConfig, par: Parallel = Parallel(), device=None, dtype=torch.float32,
                 checkpoint_blocks: bool = False):
        super().__init__()
        self.cfg, self.par, self.checkpoint_blocks = cfg, par, checkpoint_blocks
        self.embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        torch.nn.init.normal_(self.embed.weight, std=cfg.hidden_size**-0.5)
        self.pos = torch.nn.Parameter(torch.randn(cfg.seq_len, 1, cfg.hidden_size, device=device, dtype=dtype) * 0.02)
        self.blocks = torch.nn.ModuleList(TransformerBlock(cfg, par, device, dtype) for _ in range(cfg.num_layers))
        self.final_norm = te.ops.LayerNorm(cfg.hidden_size, device=device, dtype=dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[0]]
        if self.par.sequence_parallel and self.par.tp_size > 1:
            x = scatter_sequence(x, self.par.tp_group)
        for block in self.blocks:
            x = te.checkpoint(block, x) if self.checkpoint_blocks and self.training else block(x)
        return torch.nn.functional.linear(self.final_norm(x), self.embed.weight)


def scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's contiguous slice of the sequence dimension (dim 0)."""
    size, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    if x.shape[0] % size:
        raise ValueError(f"sequence length {x.shape[0]} must be divisible by the tensor-parallel size {size}")
    return x.chunk(size, dim=0)[rank].contiguous()
