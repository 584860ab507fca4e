"""te_fuser.TransformerLayer: TransformerEngine's TransformerLayer from te_fuser's MultiheadAttention,
LayerNormMLP and norm modules."""

from typing import Callable, Optional, Tuple, Union

import torch

from . import amp
from .attention.masks import check_mask_type
from .attention.multi_head_attention import NORMALIZATIONS, MultiheadAttention, check_unsupported
from .kernels.bias_grad import add_bias
from .module.layernorm import LayerNorm
from .module.layernorm_mlp import LayerNormMLP
from .module.rmsnorm import RMSNorm
from .ops import _tensor_parallel as tp

LAYER_TYPES = ("encoder", "decoder")


class DropPath(torch.nn.Module):
    """Stochastic depth: zeroes whole entries along dim 0 with probability drop_prob, as TransformerEngine."""

    def __init__(self, drop_prob: float = 0.0):
        super().__init__()
        self.drop_prob = float(drop_prob)

    def forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return hidden_state
        keep = 1.0 - self.drop_prob
        shape = (hidden_state.shape[0],) + (1,) * (hidden_state.dim() - 1)
        mask = torch.rand(shape, dtype=hidden_state.dtype, device=hidden_state.device).add_(keep).floor_()
        return hidden_state / keep * mask


class TransformerLayer(torch.nn.Module):
    """Attention block and MLP, pre-LN by default: TransformerEngine's constructor, submodules
    (self_attention, inter_attention for layer_type="decoder", layernorm_mlp, layernorm for
    output_layernorm) and forward.

    hidden_dropout is applied to each block's output before its residual add, with torch's
    default generator as in TransformerEngine (its attention dropout forks the RNG tracker).
    use_qk_norm / qk_norm_type / qk_norm_eps / qk_norm_before_rope go to MultiheadAttention (its q/k norms).
    Not supported (NotImplementedError naming it): ub_tp_comm_overlap,
    softmax_type other than "vanilla", bottom_right_diagonal=True, and what
    MultiheadAttention / LayerNormMLP do not support.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                 num_gqa_groups: Optional[int] = None, layernorm_epsilon: float = 1e-5, hidden_dropout: float = 0.1,
                 attention_dropout: float = 0.1, init_method: Optional[Callable] = None,
                 output_layer_init_method: Optional[Callable] = None, layer_number: Optional[int] = None,
                 kv_channels: Optional[int] = None, self_attn_mask_type: str = "causal",
                 window_size: Optional[Tuple[int, int]] = None, bottom_right_diagonal: Optional[bool] = None,
                 enc_dec_attn_mask_type: str = "no_mask", enc_dec_bottom_right_diagonal: Optional[bool] = None,
                 enc_dec_window_size: Optional[Tuple[int, int]] = None, tp_group=None, tp_size: int = 1,
                 params_dtype: Optional[torch.dtype] = None, get_rng_state_tracker: Optional[Callable] = None,
                 fuse_wgrad_accumulation: bool = False, seq_length: Optional[int] = None,
                 micro_batch_size: Optional[int] = None, sequence_parallel: bool = False,
                 apply_residual_connection_post_layernorm: bool = False, output_layernorm: bool = False,
                 parallel_attention_mlp: bool = False, layer_type: str = "encoder", drop_path_rate: float = 0.0,
                 set_parallel_mode: bool = False, fuse_qkv_params: bool = False, rotary_pos_interleaved: bool = False,
                 zero_centered_gamma: bool = False, qkv_weight_interleaved: bool = True,
                 ub_tp_comm_overlap: bool = False, ub_overlap_ag: bool = True, ub_overlap_rs: bool = True,
                 ub_overlap_rs_dgrad: bool = False, ub_bulk_dgrad: bool = True, ub_bulk_wgrad: bool = True,
                 bias: bool = True, activation: str = "gelu", activation_params: Optional[dict] = None,
                 normalization: str = "LayerNorm", device: Union[torch.device, str, None] = None,
                 attn_input_format: str = "sbhd", name: Optional[str] = None, use_qk_norm: bool = False,
                 qk_norm_eps: float = 1e-6, qk_norm_type: Optional[str] = None, qk_norm_before_rope: bool = False,
                 softmax_type: str = "vanilla"):
        super().__init__()
        # The ub_* flags only take effect with ub_tp_comm_overlap, as in TransformerEngine.
        del ub_overlap_ag, ub_overlap_rs, ub_overlap_rs_dgrad, ub_bulk_dgrad, ub_bulk_wgrad
        check_unsupported("TransformerLayer", {
            "ub_tp_comm_overlap": ub_tp_comm_overlap, "bottom_right_diagonal": bool(bottom_right_diagonal),
            "enc_dec_bottom_right_diagonal": bool(enc_dec_bottom_right_diagonal)})
        if layer_type not in LAYER_TYPES:
            raise ValueError(f"layer_type must be one of {LAYER_TYPES}, got {layer_type!r}")
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
        if parallel_attention_mlp:
            if layer_type != "encoder":
                raise ValueError(f"parallel_attention_mlp needs layer_type='encoder', got {layer_type!r}")
            if apply_residual_connection_post_layernorm or output_layernorm:
                raise ValueError("parallel_attention_mlp cannot be combined with "
                                 "apply_residual_connection_post_layernorm or output_layernorm")
        if not fuse_qkv_params and fuse_wgrad_accumulation:
            raise ValueError("fuse_wgrad_accumulation=True needs fuse_qkv_params=True (one QKV parameter)")
        for arg, value in (("hidden_dropout", hidden_dropout), ("drop_path_rate", drop_path_rate)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{arg} must lie in [0, 1), got {value}")
        check_mask_type(self_attn_mask_type)
        check_mask_type(enc_dec_attn_mask_type)

        self.hidden_size = hidden_size
        self.self_attn_mask_type = self_attn_mask_type
        self.window_size = window_size
        self.enc_dec_attn_mask_type = enc_dec_attn_mask_type
        self.enc_dec_window_size = enc_dec_window_size
        self.layer_number = layer_number
        self.output_layernorm = bool(output_layernorm)
        self.layer_type = layer_type
        self.apply_residual_connection_post_layernorm = bool(apply_residual_connection_post_layernorm)
        self.parallel_attention_mlp = bool(parallel_attention_mlp)
        self.kv_channels = kv_channels if kv_channels else hidden_size // num_attention_heads
        self.tp_size = tp.world_size(tp_group) if tp_group is not None else int(tp_size)
        self.sequence_parallel = self.tp_size > 1 and bool(sequence_parallel)
        self.seq_length = seq_length
        self.get_rng_state_tracker = get_rng_state_tracker
        self.attn_input_format = attn_input_format
        self.softmax_type = softmax_type
        self.hidden_dropout = float(hidden_dropout)
        self.name = name
        params_dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        if not fuse_qkv_params:
            qkv_weight_interleaved = False

        attention_args = (hidden_size, num_attention_heads, self.kv_channels, attention_dropout, layernorm_epsilon,
                          init_method, output_layer_init_method)
        common = dict(layer_number=layer_number, tp_group=tp_group, tp_size=self.tp_size,
                      num_gqa_groups=num_gqa_groups, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                      get_rng_state_tracker=get_rng_state_tracker, sequence_parallel=self.sequence_parallel,
                      params_dtype=params_dtype, return_layernorm_output=self.apply_residual_connection_post_layernorm,
                      set_parallel_mode=set_parallel_mode, fuse_qkv_params=fuse_qkv_params,
                      zero_centered_gamma=zero_centered_gamma, qkv_weight_interleaved=qkv_weight_interleaved,
                      rotary_pos_interleaved=rotary_pos_interleaved, qkv_format=attn_input_format,
                      seq_length=seq_length, micro_batch_size=micro_batch_size, softmax_type=softmax_type,
                      bias=bias, normalization=normalization, device=device, use_qk_norm=use_qk_norm,
                      qk_norm_type=qk_norm_type, qk_norm_eps=qk_norm_eps, qk_norm_before_rope=qk_norm_before_rope)

        def child_name(sub):
            return f"{name}.{sub}" if name is not None else None

        self.self_attention = MultiheadAttention(
            *attention_args, **common, attn_mask_type=self_attn_mask_type, window_size=window_size,
            input_layernorm=not self.output_layernorm, attention_type="self",
            return_bias=not self.parallel_attention_mlp, name=child_name("self_attention"))
        if layer_type == "decoder":
            self.inter_attention = MultiheadAttention(
                *attention_args, **common, attn_mask_type=enc_dec_attn_mask_type, window_size=enc_dec_window_size,
                input_layernorm=True, attention_type="cross", return_bias=True, name=child_name("inter_attention"))
        self.layernorm_mlp = LayerNormMLP(
            hidden_size, ffn_hidden_size, eps=layernorm_epsilon, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            tp_group=tp_group, tp_size=self.tp_size, get_rng_state_tracker=get_rng_state_tracker,
            init_method=init_method, output_layer_init_method=output_layer_init_method, bias=bias,
            return_bias=not self.parallel_attention_mlp, sequence_parallel=self.sequence_parallel,
            params_dtype=params_dtype, return_layernorm_output=self.apply_residual_connection_post_layernorm,
            seq_length=seq_length, micro_batch_size=micro_batch_size, set_parallel_mode=set_parallel_mode,
            zero_centered_gamma=zero_centered_gamma, activation=activation, activation_params=activation_params,
            normalization=normalization,
            device=device, name=child_name("layernorm_mlp"))
        self.drop_path = DropPath(drop_path_rate) if drop_path_rate > 0.0 else None
        if self.output_layernorm:
            norm = LayerNorm if normalization == "LayerNorm" else RMSNorm
            self.layernorm = norm(hidden_size, eps=layernorm_epsilon, sequence_parallel=self.sequence_parallel,
                                  params_dtype=params_dtype, zero_centered_gamma=zero_centered_gamma, device=device)

    def set_tensor_parallel_group(self, tp_group) -> None:
        for module in self.modules():
            if module is not self and hasattr(module, "set_tensor_parallel_group"):
                module.set_tensor_parallel_group(tp_group)

    def _bias_dropout_add(self, hidden_state, bias, residual, drop_path=None):
        """residual + drop_path(dropout(hidden_state + bias))."""
        if bias is not None and bias.numel() != 0:
            hidden_state = add_bias(hidden_state, bias)
        out = torch.nn.functional.dropout(hidden_state, p=self.hidden_dropout, training=self.training)
        if drop_path is not None:
            out = drop_path(out)
        return residual + out

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, self_attn_mask_type: Optional[str] = None,
                window_size: Optional[Tuple[int, int]] = None, bottom_right_diagonal: Optional[bool] = None,
                encoder_output: Optional[torch.Tensor] = None, enc_dec_attn_mask=None,
                enc_dec_attn_mask_type: Optional[str] = None, enc_dec_window_size: Optional[Tuple[int, int]] = None,
                enc_dec_bottom_right_diagonal: Optional[bool] = None, is_first_microbatch: Optional[bool] = None,
                checkpoint_core_attention: bool = False, inference_params=None, rotary_pos_emb=None,
                core_attention_bias_type: str = "no_bias", core_attention_bias=None, alibi_slopes=None,
                cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                max_seqlen_q: Optional[int] = None, max_seqlen_kv: Optional[int] = None,
                fast_zero_fill: bool = True, pad_between_seqs: Optional[bool] = None) -> torch.Tensor:
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
        self_attn_mask_type = check_mask_type(self_attn_mask_type or self.self_attn_mask_type)
        enc_dec_attn_mask_type = check_mask_type(enc_dec_attn_mask_type or self.enc_dec_attn_mask_type)
        window_size = window_size if window_size is not None else self.window_size
        enc_dec_window_size = enc_dec_window_size if enc_dec_window_size is not None else self.enc_dec_window_size
        if self.layer_type == "decoder" and encoder_output is None:
            raise ValueError("layer_type='decoder' needs encoder_output")

        hidden_states = hidden_states.contiguous()
        if self.sequence_parallel and self.seq_length is not None:
            if hidden_states.shape[0] != self.seq_length // self.tp_size:
                raise ValueError(f"sequence parallelism: hidden_states has {hidden_states.shape[0]} rows in dim 0, "
                                 f"expected seq_length / TP size = {self.seq_length // self.tp_size}")
        hidden_states = amp.cast_input(hidden_states)  # torch.autocast: the residual stream in its dtype too

        attention_outputs = self.self_attention(
            hidden_states, attention_mask=attention_mask, attn_mask_type=self_attn_mask_type,
            window_size=window_size, bottom_right_diagonal=bottom_right_diagonal, inference_params=inference_params,
            is_first_microbatch=is_first_microbatch, checkpoint_core_attention=checkpoint_core_attention,
            rotary_pos_emb=rotary_pos_emb, core_attention_bias_type=core_attention_bias_type,
            core_attention_bias=core_attention_bias, alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_kv=cu_seqlens_kv, cu_seqlens_q_padded=cu_seqlens_q_padded,
            cu_seqlens_kv_padded=cu_seqlens_kv_padded, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
            fast_zero_fill=fast_zero_fill, pad_between_seqs=pad_between_seqs)
        if self.apply_residual_connection_post_layernorm and not self.output_layernorm:
            attention_output, attention_bias, residual = attention_outputs
            hidden_states = self._bias_dropout_add(attention_output, attention_bias, residual, self.drop_path)
        elif not self.parallel_attention_mlp:
            attention_output, attention_bias = attention_outputs
            hidden_states = self._bias_dropout_add(attention_output, attention_bias, hidden_states, self.drop_path)

        if self.layer_type == "decoder":
            inter_outputs = self.inter_attention(
                hidden_states, attention_mask=enc_dec_attn_mask, attn_mask_type=enc_dec_attn_mask_type,
                window_size=enc_dec_window_size, bottom_right_diagonal=enc_dec_bottom_right_diagonal,
                encoder_output=encoder_output, is_first_microbatch=is_first_microbatch,
                checkpoint_core_attention=checkpoint_core_attention, core_attention_bias_type=core_attention_bias_type,
                core_attention_bias=core_attention_bias, alibi_slopes=alibi_slopes, fast_zero_fill=fast_zero_fill)
            if self.apply_residual_connection_post_layernorm:
                attention_output, attention_bias, residual = inter_outputs
            else:
                (attention_output, attention_bias), residual = inter_outputs, hidden_states
            hidden_states = self._bias_dropout_add(attention_output, attention_bias, residual)

        mlp_outputs = self.layernorm_mlp(hidden_states, is_first_microbatch=is_first_microbatch)
        if self.apply_residual_connection_post_layernorm:
            mlp_output, mlp_bias, residual = mlp_outputs
            output = self._bias_dropout_add(mlp_output, mlp_bias, residual, self.drop_path)
        elif self.parallel_attention_mlp:
            # Both blocks read the same input: output = input + dropout(attention + MLP).
            output = self._bias_dropout_add(attention_outputs, mlp_outputs, hidden_states, self.drop_path)
        else:
            mlp_output, mlp_bias = mlp_outputs
            output = self._bias_dropout_add(mlp_output, mlp_bias, hidden_states, self.drop_path)

        if self.output_layernorm:
            output = self.layernorm(output)
        return output
