"""te_fuser.MultiheadAttention: TransformerEngine's MultiheadAttention from te_fuser's Linear,
LayerNormLinear and DotProductAttention."""

from typing import Callable, Optional, Tuple, Union

import torch

from .dot_product_attention import DotProductAttention
from .dot_product_attention.fp8_recipe import dpa_variables, fp8_attention
from .inference import check_inference_params
from .kv_cache_rope import apply_step_rotary_pos_emb
from .rope import apply_rotary_pos_emb
from ..distributed import checkpoint as te_checkpoint
from ..tensor.float8_tensor import Float8Tensor
from ..quantization import FP8GlobalState
from ..ops import _tensor_parallel as tp
from ..tensor.quantized_tensor import QuantizedTensor
from ..utils import SplitAlongDim
from ._qk_norm import make_qk_norms
from ..module.layernorm_linear import LayerNormLinear
from ..module.linear import Linear

ATTENTION_TYPES = ("self", "cross")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def check_unsupported(owner: str, options: dict) -> None:
    """NotImplementedError naming the first option set away from its default."""
    for option, used in options.items():
        if used:
            raise NotImplementedError(f"te_fuser.{owner} does not support {option} (only its default)")


def check_heads(num_attention_heads, num_gqa_groups, tp_size) -> None:
    for name, value in (("num_attention_heads", num_attention_heads), ("num_gqa_groups", num_gqa_groups)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if num_attention_heads % num_gqa_groups:
        raise ValueError(f"num_attention_heads ({num_attention_heads}) must be a multiple of "
                         f"num_gqa_groups ({num_gqa_groups})")
    if num_attention_heads % tp_size or num_gqa_groups % tp_size:
        raise ValueError(f"num_attention_heads ({num_attention_heads}) and num_gqa_groups ({num_gqa_groups}) "
                         f"must be divisible by the TP size {tp_size}")


class MultiheadAttention(torch.nn.Module):
    """QKV projection (optionally after a LayerNorm/RMSNorm), fused attention, output projection.

    TransformerEngine's constructor, submodule and parameter names:
      self-attention:  layernorm_qkv (input_layernorm) or qkv, with one fused weight
                       (fuse_qkv_params=True) or query_/key_/value_ weights;
      cross-attention: layernorm_query or query_layer, and key_value (fed encoder_output);
      core_attention (DotProductAttention) and proj.
    The fused QKV weight is laid out as TransformerEngine's: with
    qkv_weight_interleaved=True, per KV group g the rows of its np/ng query heads,
    then its key head, then its value head; otherwise all query heads, all key
    heads, all value heads. So a TransformerEngine checkpoint means the same here.
    set_parallel_mode=True makes the QKV projections column- and proj row-parallel.
    Each linear is one node on the op fuser and the attention one FusedAttentionFunction,
    so every tensor saved for backward is released when backward ends.
    checkpoint_core_attention=True recomputes the attention in backward (te_fuser.distributed.checkpoint).
    Query/key normalization over each head's channels: TE 2.6's use_qk_norm=True (L2, after RoPE; the
    module is `qk_norm`) or later TE's qk_norm_type ("L2Normalization", "RMSNorm" or "LayerNorm", modules
    `q_norm` and `k_norm`, after RoPE unless qk_norm_before_rope=True), with qk_norm_eps.
    inference_params (TE's KV cache): the cache of layer_number is allocated on first use, and RoPE
    rotates each new token at its sequence's cached length plus its index in the step.
    Not supported (NotImplementedError naming it): userbuffer overlap (ub_*),
    softmax_type other than "vanilla", bottom_right_diagonal=True,
    and the DotProductAttention options it lacks. attention_backend (te_fuser's) is passed on to
    DotProductAttention: the backend its attention runs on, None for the automatic choice.
    With a recipe with fp8_mha=True (TE's semantics, without rotary_pos_emb), the QKV
    projections return FP8, q, k and v are FP8 views of those bytes (one scale), the attention
    runs on them without a 16-bit copy and returns FP8, which the output projection's FP8 GEMM
    reads as it is (and gives the attention its gradient in FP8, fp8_grad).
    """

    def __init__(self, hidden_size: int, num_attention_heads: int, kv_channels: Optional[int] = None,
                 attention_dropout: float = 0.1, layernorm_epsilon: float = 1e-5,
                 init_method: Optional[Callable] = None, output_layer_init_method: Optional[Callable] = None,
                 layer_number: Optional[int] = None, attn_mask_type: str = "causal",
                 window_size: Optional[Tuple[int, int]] = None, bottom_right_diagonal: Optional[bool] = None,
                 tp_group=None, tp_size: int = 1, num_gqa_groups: Optional[int] = None,
                 fuse_wgrad_accumulation: bool = False, get_rng_state_tracker: Optional[Callable] = None,
                 sequence_parallel: bool = False, params_dtype: Optional[torch.dtype] = None,
                 return_bias: bool = False, return_layernorm_output: bool = False, input_layernorm: bool = False,
                 attention_type: str = "self", set_parallel_mode: bool = False, fuse_qkv_params: bool = False,
                 zero_centered_gamma: bool = False, qkv_weight_interleaved: bool = True,
                 rotary_pos_interleaved: bool = False, ub_overlap_ag: bool = False, ub_overlap_rs: bool = False,
                 ub_overlap_rs_dgrad: bool = False, ub_bulk_dgrad: bool = False, ub_bulk_wgrad: bool = False,
                 bias: bool = True, normalization: str = "LayerNorm", device: Union[torch.device, str, None] = None,
                 qkv_format: str = "sbhd", name: Optional[str] = None, use_qk_norm: bool = False,
                 qk_norm_eps: float = 1e-6, seq_length: Optional[int] = None, micro_batch_size: Optional[int] = None,
                 qk_norm_type: Optional[str] = None, qk_norm_before_rope: bool = False,
                 softmax_type: str = "vanilla", attention_backend: Optional[str] = None):
        super().__init__()
        check_unsupported("MultiheadAttention", {
            "ub_overlap_ag": ub_overlap_ag, "ub_overlap_rs": ub_overlap_rs,
            "ub_overlap_rs_dgrad": ub_overlap_rs_dgrad, "ub_bulk_dgrad": ub_bulk_dgrad,
            "ub_bulk_wgrad": ub_bulk_wgrad,
            "softmax_type": softmax_type != "vanilla", "bottom_right_diagonal": bool(bottom_right_diagonal)})
        if attention_type not in ATTENTION_TYPES:
            raise ValueError(f"attention_type must be one of {ATTENTION_TYPES}, got {attention_type!r}")
        if input_layernorm and normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
        if not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
        if layer_number is not None and layer_number <= 0:
            raise ValueError(f"layer_number must be a positive int, got {layer_number!r}")
        self.tp_size = tp.world_size(tp_group) if tp_group is not None else int(tp_size)
        num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        check_heads(num_attention_heads, num_gqa_groups, self.tp_size)
        kv_channels = kv_channels if kv_channels else hidden_size // num_attention_heads
        if kv_channels <= 0:
            raise ValueError(f"kv_channels must be positive (hidden_size // num_attention_heads when not given), "
                             f"got {kv_channels}")

        self.hidden_size = hidden_size
        self.qkv_format = qkv_format
        self.attn_mask_type = attn_mask_type
        self.window_size = window_size
        self.layer_number = 1 if layer_number is None else layer_number
        self.input_layernorm = bool(input_layernorm)
        self.attention_type = attention_type
        self.get_rng_state_tracker = get_rng_state_tracker
        self.tp_group = tp_group
        self.return_layernorm_output = bool(return_layernorm_output)
        self.return_bias = bool(return_bias)
        self.params_dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        self.sequence_parallel = self.tp_size > 1 and bool(sequence_parallel)
        self.num_attention_heads = num_attention_heads
        self.num_gqa_groups = num_gqa_groups
        self.num_attention_heads_per_partition = num_attention_heads // self.tp_size
        self.num_gqa_groups_per_partition = num_gqa_groups // self.tp_size
        self.hidden_size_per_attention_head = kv_channels
        self.hidden_size_q = kv_channels * num_attention_heads
        self.hidden_size_kv = kv_channels * num_gqa_groups
        # Without fused QKV parameters, the projection output is [q heads | k heads | v heads].
        self.qkv_weight_interleaved = bool(qkv_weight_interleaved) and bool(fuse_qkv_params)
        self.rotary_pos_interleaved = bool(rotary_pos_interleaved)
        self.softmax_type = softmax_type
        self.name = name

        common = dict(fuse_wgrad_accumulation=fuse_wgrad_accumulation, tp_group=tp_group, tp_size=self.tp_size,
                      get_rng_state_tracker=get_rng_state_tracker, sequence_parallel=sequence_parallel,
                      params_dtype=self.params_dtype, device=device)
        qkv_mode = "column" if set_parallel_mode else None
        norm_kwargs = dict(eps=layernorm_epsilon, return_layernorm_output=self.return_layernorm_output,
                           zero_centered_gamma=zero_centered_gamma, normalization=normalization)

        def projection(in_features, out_features, split, with_norm, sub_name):
            kwargs = dict(init_method=init_method, bias=bias, return_bias=False, parallel_mode=qkv_mode,
                          parameters_split=split, name=f"{name}.{sub_name}" if name is not None else None, **common)
            if with_norm:
                return LayerNormLinear(in_features, out_features, **norm_kwargs, **kwargs)
            return Linear(in_features, out_features, **kwargs)

        if attention_type == "self":
            split = None if fuse_qkv_params else {"query": self.hidden_size_q, "key": self.hidden_size_kv,
                                                  "value": self.hidden_size_kv}
            width = self.hidden_size_q + 2 * self.hidden_size_kv
            if self.input_layernorm:
                self.layernorm_qkv = projection(hidden_size, width, split, True, "layernorm_linear_qkv")
            else:
                self.qkv = projection(hidden_size, width, split, False, "linear_qkv")
        else:
            if self.input_layernorm:
                self.layernorm_query = projection(hidden_size, self.hidden_size_q,
                                                  None if fuse_qkv_params else ("query",), True,
                                                  "layernorm_linear_q")
            else:
                self.query_layer = projection(hidden_size, self.hidden_size_q, None, False, "linear_q")
            self.key_value = projection(hidden_size, 2 * self.hidden_size_kv,
                                        None if fuse_qkv_params else ("key", "value"), False, "linear_kv")

        self.core_attention = DotProductAttention(
            num_attention_heads, kv_channels, num_gqa_groups=num_gqa_groups, attention_dropout=attention_dropout,
            qkv_format=qkv_format, attn_mask_type=attn_mask_type, window_size=window_size,
            tp_size=self.tp_size, get_rng_state_tracker=get_rng_state_tracker, sequence_parallel=sequence_parallel,
            tp_group=tp_group, layer_number=self.layer_number, attention_type=attention_type,
            attention_backend=attention_backend)

        # TE 2.6 names the shared L2 norm qk_norm; later TE has q_norm and k_norm (None without a norm).
        self.q_norm, self.k_norm = make_qk_norms(use_qk_norm, qk_norm_type, qk_norm_eps, kv_channels, seq_length,
                                                 micro_batch_size, self.params_dtype, device)
        if use_qk_norm:
            self.qk_norm = self.q_norm
        self.qk_norm_before_rope = bool(qk_norm_before_rope)

        self.proj = Linear(self.hidden_size_q, hidden_size, init_method=output_layer_init_method, bias=bias,
                           return_bias=return_bias, parallel_mode="row" if set_parallel_mode else None,
                           name=f"{name}.proj" if name is not None else None, **common)

    def set_tensor_parallel_group(self, tp_group) -> None:
        self.tp_group = tp_group
        for child in self.children():
            if hasattr(child, "set_tensor_parallel_group"):
                child.set_tensor_parallel_group(tp_group)

    # -- forward ------------------------------------------------------------------------
    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """[..., heads * head_dim] -> [..., heads, head_dim] (a copy only when the layout needs one)."""
        return x.reshape(*x.shape[:-1], heads, self.hidden_size_per_attention_head)

    @staticmethod
    def _split(x: torch.Tensor, sizes, dim: int):
        """x.split(sizes, dim), in FP8 when x is a Float8Tensor (views of its bytes, one scale)."""
        return SplitAlongDim.apply(x, dim, sizes) if isinstance(x, Float8Tensor) else x.split(sizes, dim=dim)

    def _split_qkv(self, mixed: torch.Tensor):
        """q [..., np, hn], k and v [..., ng, hn] out of the fused projection's output."""
        lead, hn = mixed.shape[:-1], self.hidden_size_per_attention_head
        groups = self.num_gqa_groups_per_partition
        per_group = self.num_attention_heads_per_partition // groups
        if self.qkv_weight_interleaved:
            parts = self._split(mixed.view(*lead, groups, per_group + 2, hn), [per_group, 1, 1], -2)
        else:
            parts = self._split(mixed.view(*lead, per_group + 2, groups, hn), [per_group, 1, 1], -3)
        return tuple(p.reshape(*lead, -1, hn) for p in parts)

    def _split_kv(self, mixed: torch.Tensor):
        lead, hn = mixed.shape[:-1], self.hidden_size_per_attention_head
        groups = self.num_gqa_groups_per_partition
        if self.qkv_weight_interleaved:
            k, v = self._split(mixed.view(*lead, groups, 2 * hn), [hn, hn], -1)
        else:
            k, v = self._split(mixed.view(*lead, 2 * groups, hn), [groups, groups], -2)
        return k.reshape(*lead, groups, hn), v.reshape(*lead, groups, hn)

    def _project(self, module, x, is_first_microbatch, fp8_output):
        """(projection, layernorm output or None)."""
        out = module(x, is_first_microbatch=is_first_microbatch, fp8_output=fp8_output)
        if getattr(module, "return_layernorm_output", False):
            return out
        return out, None

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, encoder_output: Optional[torch.Tensor] = None,
                attn_mask_type: Optional[str] = None, window_size: Optional[Tuple[int, int]] = None,
                bottom_right_diagonal: Optional[bool] = None, is_first_microbatch: Optional[bool] = None,
                checkpoint_core_attention: bool = False, inference_params=None, rotary_pos_emb=None,
                core_attention_bias_type: str = "no_bias", core_attention_bias=None, alibi_slopes=None,
                cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                max_seqlen_q: Optional[int] = None, max_seqlen_kv: Optional[int] = None,
                fast_zero_fill: bool = True, pad_between_seqs: Optional[bool] = None):
        check_unsupported("MultiheadAttention.forward", {"bottom_right_diagonal": bool(bottom_right_diagonal)})
        if inference_params is not None:
            check_inference_params(inference_params)
            if self.layer_number not in inference_params.cache_manager.cache:
                inference_params.allocate_memory(self.layer_number)  # once per layer, as TE's
        # The attention's recipe keeps the autocast recipe's fp8_mha (TE), unless NVTE_DPA_FP8_RECIPE is "F16".
        recipe = FP8GlobalState.get_recipe()
        fp8_mha = (FP8GlobalState.is_enabled() and bool(getattr(recipe, "fp8_mha", False))
                   and fp8_attention(recipe, dpa_variables()))
        # RoPE and the q/k norms are applied in high precision (TE).
        qkv_fp8 = fp8_mha and rotary_pos_emb is None and self.q_norm is None
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
        if self.attention_type == "cross" and not isinstance(encoder_output, torch.Tensor):
            raise ValueError("cross-attention (attention_type='cross') needs encoder_output, a torch.Tensor")

        if self.attention_type == "self":
            module = self.layernorm_qkv if self.input_layernorm else self.qkv
            mixed, layernorm_output = self._project(module, hidden_states, is_first_microbatch, qkv_fp8)
            query, key, value = self._split_qkv(mixed)
        else:
            key, value = self._split_kv(self.key_value(encoder_output, is_first_microbatch=is_first_microbatch,
                                                       fp8_output=qkv_fp8))
            module = self.layernorm_query if self.input_layernorm else self.query_layer
            query, layernorm_output = self._project(module, hidden_states, is_first_microbatch, qkv_fp8)
            query = self._heads(query, self.num_attention_heads_per_partition)

        if self.q_norm is not None and self.qk_norm_before_rope:
            query, key = self.q_norm(query), self.k_norm(key)
        if rotary_pos_emb is not None:
            q_emb, k_emb = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            if inference_params is not None:  # positions continue from each sequence's cached length
                query, key = apply_step_rotary_pos_emb(query, key, q_emb, k_emb, self.qkv_format, inference_params,
                                                       self.rotary_pos_interleaved)
            else:
                query = apply_rotary_pos_emb(query, q_emb, self.qkv_format, interleaved=self.rotary_pos_interleaved,
                                             fused=True, cu_seqlens=cu_seqlens_q)
                key = apply_rotary_pos_emb(key, k_emb, self.qkv_format, interleaved=self.rotary_pos_interleaved,
                                           fused=True, cu_seqlens=cu_seqlens_kv)
        if self.q_norm is not None and not self.qk_norm_before_rope:
            query, key = self.q_norm(query), self.k_norm(key)

        attention_kwargs = dict(
            attention_mask=attention_mask, qkv_format=self.qkv_format, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_kv=cu_seqlens_kv, cu_seqlens_q_padded=cu_seqlens_q_padded,
            cu_seqlens_kv_padded=cu_seqlens_kv_padded, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
            attn_mask_type=attn_mask_type or self.attn_mask_type,
            window_size=window_size if window_size is not None else self.window_size,
            core_attention_bias_type=core_attention_bias_type, core_attention_bias=core_attention_bias,
            alibi_slopes=alibi_slopes, fast_zero_fill=fast_zero_fill, pad_between_seqs=pad_between_seqs,
            fp8_output=fp8_mha, inference_params=inference_params)
        if checkpoint_core_attention:
            # Recomputed in backward from q, k, v, with the forward's RNG (tracker) and FP8 states.
            context = te_checkpoint(self.core_attention, query, key, value, use_reentrant=False,
                                    get_rng_state_tracker=self.get_rng_state_tracker, tp_group=self.tp_group,
                                    **attention_kwargs)
        else:
            context = self.core_attention(query, key, value, **attention_kwargs)

        projection = self.proj(context, is_first_microbatch=is_first_microbatch,
                               fp8_grad=isinstance(context, QuantizedTensor))
        outputs = projection if self.return_bias else (projection,)
        if self.input_layernorm and self.return_layernorm_output:
            outputs = tuple(outputs) + (layernorm_output,)
        return tuple(outputs) if len(outputs) > 1 else outputs[0]
