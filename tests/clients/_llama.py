"""A small Llama-style decoder in plain PyTorch, built from a config: what clients that swap
layers for TransformerEngine's (accelerate's convert_model, Lightning's TransformerEnginePrecision)
find in a Hugging Face model -- nn.Linear projections, RMSNorm, rotary attention, a SwiGLU MLP --
without a transformers dependency or a download."""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    # Every Linear dimension and the token count (batch x seq) are multiples of 16, as FP8 GEMMs need.
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Hugging Face's Llama initializes Linear and Embedding weights with normal(0, initializer_range)
    # (0.02 there). Larger here: the logits of a tiny untrained model then depend on its weights, and
    # its first loss tells precisions apart.
    initializer_range: float = 0.1


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary(x, theta: float):
    """Llama's rotate-half RoPE on [batch, heads, seq, head_dim]."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    cos, sin = (torch.cat((f, f), dim=-1).to(x.dtype) for f in (angles.cos(), angles.sin()))
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = c.hidden_size // c.num_attention_heads
        self.theta = c.rope_theta
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotary(q, self.theta), rotary(k, self.theta)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=c.initializer_range)

    def forward(self, input_ids, labels=None):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def batches(config: LlamaConfig, steps: int, batch: int = 2, seq: int = 32, seed: int = 1234):
    """(input_ids, labels) per step; the next token is a fixed permutation of the current one, so a few
    steps lower the loss."""
    g = torch.Generator().manual_seed(seed)
    successor = torch.randperm(config.vocab_size, generator=g)
    out = []
    for _ in range(steps):
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, config.vocab_size, (batch,), generator=g)
        for i in range(seq):
            tokens[:, i + 1] = successor[tokens[:, i]]
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out
