"""te_fuser.DotProductAttention: TransformerEngine's module on te_fuser's fused attention kernels."""

import contextlib
import math
from typing import Optional

import torch

from ... import amp
from ...export import is_in_onnx_export_mode
from ...quantization import (DelayedScalingState, FP8GlobalState, canonical_recipe, make_recipe_state,
                             runs_while_tracing)
from ...kernels.validate import FLOAT_DTYPES
from ...ops._fp8_io import dequantized_with_grad
from ..backends import Lengths
from ..backends.selection import check_backend_name, clear_cache
from ..function import FusedAttentionFunction, attention_forward, choose_backend
from ..inference import check_inference_params
from ..kv_cache_attention import cached_attention
from ..torch_attention import torch_attention
from ..masks import check_mask_type, check_window_size, lengths_from_cu_seqlens, padding_lengths
from .fp8_recipe import attention_recipe, dpa_variables, fp8_attention
from .utils import te_view

QKV_FORMATS = ("sbhd", "bshd", "thd")

# TE's record of the last backend choice, with TE's keys. Setting backend_selection_requires_update (TE's
# tests do, after changing NVTE_* variables) makes the next forward forget te_fuser's choices, which are
# then made and logged again; every forward writes TE's view of its choice here. te_fuser's choices are
# kept per problem, so attention_params is only ever what a caller stores.
_attention_backends = {
    "attention_params": None,
    "use_flash_attention": None,
    "flash_attention_backend": None,
    "use_fused_attention": None,
    "fused_attention_backend": None,
    "use_unfused_attention": None,
    "backend_selection_requires_update": False,
}


def _record_choice(backend: str, fp8: bool) -> None:
    keys = ("use_flash_attention", "flash_attention_backend", "use_fused_attention", "fused_attention_backend",
            "use_unfused_attention")
    _attention_backends.update(zip(keys, te_view(backend, fp8)))
ATTENTION_TYPES = ("self", "cross")


def _check_format(qkv_format: str) -> str:
    if qkv_format not in QKV_FORMATS:
        raise NotImplementedError(f"qkv_format={qkv_format!r} is not supported; use one of {', '.join(QKV_FORMATS)}")
    return qkv_format


def _check_no_padding_between(cu_seqlens, cu_seqlens_padded, name: str) -> None:
    """TE's cu_seqlens_*_padded place the packed (thd) sequences with padding between them; te_fuser's
    kernels take sequences back to back, i.e. offsets equal to cu_seqlens (TE's value when there is no
    padding). In bshd / sbhd they place nothing, and are ignored, as in TE."""
    if cu_seqlens_padded is None or cu_seqlens is None:
        return
    if cu_seqlens_padded.shape != cu_seqlens.shape or not torch.equal(cu_seqlens_padded, cu_seqlens):
        raise NotImplementedError(f"{name}_padded differing from {name}: padding between packed sequences "
                                  "(TE's pad_between_seqs) is not supported by te_fuser")


def _distinct(*tensors):
    """The tensors, a repeated one as a view of itself: torch.compile cannot trace an autograd.Function
    given the same tensor twice (self-attention m(x, x, x), one mask or cu_seqlens for q and kv).
    Identity is tested with `is`, which dynamo traces for every tensor (id() fails on tensors made in the
    compiled region, in torch 2.11)."""
    out = []
    for t in tensors:
        if isinstance(t, torch.Tensor) and any(t is seen for seen in out):
            t = t.view_as(t)
        out.append(t)
    return out


def _dropout_seed(device: torch.device):
    """(seed, offset) of one dropout call: the generator's initial seed and an offset drawn from it.

    Drawing the offset advances the generator, so calls differ, torch.manual_seed
    reproduces them, and activation checkpointing (which restores the RNG state)
    recomputes the same mask.
    """
    if device.type == "cuda":
        seed = torch.cuda.initial_seed()
    else:
        seed = torch.initial_seed()
    offset = int(torch.randint(0, 2**62, (1,), device=device).item())
    return seed & (2**63 - 1), offset


class DotProductAttention(torch.nn.Module):
    """softmax(q k^T * softmax_scale + mask) v, fused, in sbhd / bshd / thd layouts.

    Constructor and forward follow TransformerEngine's DotProductAttention.
    Options te_fuser does not implement raise NotImplementedError naming the
    option. With fp8_autocast and a recipe with fp8_dpa=True, q, k and v are
    quantized to FP8 E4M3 and the kernels consume the FP8 data (fp8_mha=True, as in TE, turns
    this on too). TE's NVTE_DPA_FP8_RECIPE gives the attention another recipe than the linear
    layers' (FP8 attention beside MXFP8 or NVFP4 linears, or "F16"): fp8_recipe.py in this package.
    Float8Tensor q, k, v in E4M3 (fp8_mha: views of the QKV projection's FP8
    output) are used as they are, with their per-tensor scales; outside FP8 attention they are
    dequantized. forward(fp8_output=True) under FP8 attention (and any forward under a recipe
    with fp8_mha=True, as in TE) returns the output as a Float8Tensor, quantized with an O scaling
    slot of its own (delayed scaling: its own amax history; current scaling: the output's amax);
    otherwise it is ignored.

    Backends. Each call runs on one of te_fuser's attention backends, inside one autograd Function
    that saves only through save_for_backward: "te_fuser" (its own kernels: C on the CPU, CUDA C on
    the GPU; the only one for FP8 q/k/v), "cudnn" and "flash" (torch's cuDNN and FlashAttention
    kernels, CUDA), "cpu_flash" (torch's CPU flash-attention kernel) and "unfused" (torch's math ops,
    memory quadratic in the sequence length). By default the fastest backend measured on the device that
    supports the problem runs it (the table in te_fuser/attention/backends/selection.py); one that cannot
    express a case (a padding mask, dropout from a given seed, a head dim, FP8 inputs) is not chosen
    for it. attention_backend (constructor argument and attribute; te_fuser's, TE has none) names one
    backend for this module, else the environment variable TE_FUSER_ATTENTION_BACKEND does; TE's
    NVTE_FLASH_ATTN=0, NVTE_FUSED_ATTN=0 and NVTE_UNFUSED_ATTN=0 take FlashAttention (and torch's CPU
    flash kernel), cuDNN and the unfused path out of the automatic choice. NVTE_DEBUG=1 with
    NVTE_DEBUG_LEVEL=1 or 2 logs the choice (and the reasons for the others).
    te_fuser.kernels.attention.backend_for says which backend a problem gets, and why.
    With dropout, a library kernel draws its mask from torch's generator; the call runs inside
    get_rng_state_tracker().fork() when a tracker is given, as TE's does.

    inference_params (TE's InferenceParams, te_fuser/attention/inference.py): the new k and v of the step
    are written into the cache of this module's layer_number, and the new queries attend to the cached
    and new tokens (attn_mask_type 'padding', or 'padding_causal' aligned to the bottom right, as in TE),
    forward only (te_fuser/attention/kv_cache_attention.py).
    """

    def __init__(self, num_attention_heads: int, kv_channels, num_gqa_groups: Optional[int] = None,
                 attention_dropout: float = 0.0, qkv_format: str = "sbhd", attn_mask_type: str = "causal",
                 window_size=None, sequence_parallel: bool = False, tp_size: int = 1,
                 get_rng_state_tracker=None, tp_group=None, layer_number: Optional[int] = None,
                 attention_type: str = "self", cp_group=None, cp_global_ranks=None, cp_stream=None,
                 cp_comm_type: str = "p2p", softmax_scale: Optional[float] = None,
                 attention_backend: Optional[str] = None):
        super().__init__()
        if isinstance(kv_channels, (tuple, list)):
            if len(kv_channels) != 2 or kv_channels[0] != kv_channels[1]:
                raise NotImplementedError(
                    f"kv_channels={kv_channels!r}: different q/k and v head dims are not supported")
            kv_channels = kv_channels[0]
        if attention_type not in ATTENTION_TYPES:
            raise NotImplementedError(f"attention_type={attention_type!r} is not supported; use 'self' or 'cross'")
        if cp_group is not None or cp_global_ranks is not None or cp_stream is not None:
            raise NotImplementedError("context parallelism (cp_group, cp_global_ranks, cp_stream) is not supported")
        del cp_comm_type, sequence_parallel, tp_group  # the local heads are all this module sees
        num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        for name, value in (("num_attention_heads", num_attention_heads), ("num_gqa_groups", num_gqa_groups),
                            ("kv_channels", kv_channels), ("tp_size", tp_size)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if num_attention_heads % num_gqa_groups:
            raise ValueError(f"num_attention_heads ({num_attention_heads}) must be a multiple of "
                             f"num_gqa_groups ({num_gqa_groups})")
        if num_attention_heads % tp_size or num_gqa_groups % tp_size:
            raise ValueError(f"num_attention_heads and num_gqa_groups must be divisible by tp_size={tp_size}")
        if not 0.0 <= attention_dropout < 1.0:
            raise ValueError(f"attention_dropout must lie in [0, 1), got {attention_dropout}")
        self.num_heads = num_attention_heads // tp_size
        self.num_gqa_groups = num_gqa_groups // tp_size
        self.kv_channels = kv_channels
        self.attention_dropout = float(attention_dropout)
        self.qkv_format = _check_format(qkv_format)
        self.attn_mask_type = check_mask_type(attn_mask_type)
        check_window_size(window_size, attn_mask_type)
        self.window_size = window_size
        self.get_rng_state_tracker = get_rng_state_tracker
        self.layer_number = layer_number
        self.attention_type = attention_type
        self.softmax_scale = 1.0 / math.sqrt(kv_channels) if softmax_scale is None else float(softmax_scale)
        self.attention_backend = attention_backend
        # Scaling state of the q, k, v quantizers, made for the recipe and device in use.
        self._fp8_recipe = None
        self._fp8_device = None
        self._fp8_state = None
        self._fp8_output_state = None  # the O quantizer's (fp8_output), made on first use

    @property
    def attention_backend(self) -> Optional[str]:
        """The backend this module's calls run on (None: chosen per problem)."""
        return self._attention_backend

    @attention_backend.setter
    def attention_backend(self, name: Optional[str]) -> None:
        self._attention_backend = check_backend_name(name, "attention_backend")

    def _check_inputs(self, q, k, v, qkv_format):
        rank = 3 if qkv_format == "thd" else 4
        for name, t in (("query_layer", q), ("key_layer", k), ("value_layer", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype not in FLOAT_DTYPES:
                raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
            if t.dim() != rank:
                raise ValueError(f"{name} must be {rank}-D in qkv_format={qkv_format!r}, got shape {tuple(t.shape)}")
            if t.shape[-1] != self.kv_channels:
                raise ValueError(f"{name} has head dim {t.shape[-1]}, expected kv_channels={self.kv_channels}")
        for name, t in (("key_layer", k), ("value_layer", v)):
            if t.dtype != q.dtype:
                raise TypeError(f"query_layer is {q.dtype} but {name} is {t.dtype}; they must match")
            if t.device != q.device:
                raise ValueError(f"query_layer is on {q.device} but {name} is on {t.device}")
            if t.shape[-2] != self.num_gqa_groups:
                raise ValueError(f"{name} has {t.shape[-2]} heads, expected num_gqa_groups={self.num_gqa_groups}")
        if q.shape[-2] != self.num_heads:
            raise ValueError(f"query_layer has {q.shape[-2]} heads, expected {self.num_heads}")
        if k.shape != v.shape:
            raise ValueError(f"key_layer {tuple(k.shape)} and value_layer {tuple(v.shape)} must have the same shape")
        batch_dim = {"sbhd": 1, "bshd": 0}.get(qkv_format)
        if batch_dim is not None and q.shape[batch_dim] != k.shape[batch_dim]:
            raise ValueError(f"query_layer and key_layer have different batch sizes: {tuple(q.shape)}, {tuple(k.shape)}")

    def _fp8_quantizers(self, device):
        """The q, k, v quantizers when fp8_autocast runs a recipe with fp8_dpa=True (under the attention's
        recipe, fp8_recipe.py), else None."""
        if not FP8GlobalState.is_enabled() or FP8GlobalState.is_calibrating():
            return None
        recipe, variables = canonical_recipe(FP8GlobalState.get_recipe()), dpa_variables()
        if not fp8_attention(recipe, variables):
            return None
        self._ensure_fp8_state(recipe, variables, device)
        return self._fp8_state.quantizers(FP8GlobalState.get_group())

    @runs_while_tracing
    def _ensure_fp8_state(self, autocast_recipe, variables, device) -> None:
        # The attention's recipe is made here, as Python even under torch.compile (fp8_recipe.py).
        recipe = attention_recipe(autocast_recipe, variables)
        if recipe.fp8_format.fwd_dtype != torch.float8_e4m3fn:
            raise NotImplementedError(f"fp8_dpa with fp8_format={recipe.fp8_format.name}: the attention kernels "
                                      "take E4M3 inputs (use Format.E4M3 or Format.HYBRID)")
        if (self._fp8_device != device and self._fp8_recipe == recipe
                and isinstance(self._fp8_state, DelayedScalingState)):
            # A loaded state (kept on the CPU: this module has no parameters), or inputs on a new device.
            self._fp8_state.to(device)
            self._fp8_device = device
        if self._fp8_state is None or self._fp8_recipe != recipe or self._fp8_device != device:
            self._fp8_state = make_recipe_state(recipe, 3, forward=True, device=device)
            self._fp8_recipe, self._fp8_device = recipe, device

    def _fp8_output_quantizer(self, device):
        """The O quantizer of fp8_output (one forward slot, kept apart from the q, k, v state)."""
        self._ensure_fp8_output_state(device)
        return self._fp8_output_state.quantizers(FP8GlobalState.get_group())[0]

    @runs_while_tracing
    def _ensure_fp8_output_state(self, device) -> None:
        state, recipe = self._fp8_output_state, self._fp8_recipe
        if state is None or state.recipe != recipe:
            self._fp8_output_state = make_recipe_state(recipe, 1, forward=True, device=device)
        elif isinstance(state, DelayedScalingState) and state.amax.device != device:
            state.to(device)

    def get_extra_state(self) -> torch.Tensor:
        """TE's `_extra_state`: the q, k, v delayed-scaling state (see te_fuser/attention/extra_state.py)."""
        # Imported here: the TE format lives in te_fuser.module, whose MultiheadAttention imports this module.
        from ..extra_state import dpa_extra_state
        return dpa_extra_state(self._fp8_state, self._fp8_output_state)

    def set_extra_state(self, state) -> None:
        from ..extra_state import load_dpa_extra_state, load_dpa_output_state
        loaded = load_dpa_extra_state(state, torch.device("cpu"))
        if loaded is not None:
            self._fp8_state, self._fp8_recipe, self._fp8_device = loaded, loaded.recipe, torch.device("cpu")
            self._fp8_output_state = load_dpa_output_state(state, torch.device("cpu"))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        own, legacy = prefix + "_extra_state", prefix + "fused_attention._extra_state"
        if legacy in state_dict:
            # TE 1.6 / 1.7 kept this module's FP8 metadata under its fused_attention submodule (TE reads it
            # there when the newer key is absent, and ignores it otherwise).
            if legacy in unexpected_keys:
                unexpected_keys.remove(legacy)
            if own not in state_dict:
                self.set_extra_state(state_dict[legacy])
        if own in missing_keys:
            missing_keys.remove(own)  # checkpoints of TE <= 1.5 and older te_fuser had no attention FP8 state

    def _lengths(self, q, k, qkv_format, mask_type, attention_mask, cu_seqlens_q, cu_seqlens_kv):
        """(cu_seqlens_q, cu_seqlens_kv, seqlens_q, seqlens_kv) for the kernels."""
        if qkv_format == "thd":
            if cu_seqlens_q is None or cu_seqlens_kv is None:
                raise ValueError("qkv_format='thd' needs cu_seqlens_q and cu_seqlens_kv")
            return cu_seqlens_q, cu_seqlens_kv, None, None
        if "padding" not in mask_type:
            return None, None, None, None
        batch_dim, seq_dim = (1, 0) if qkv_format == "sbhd" else (0, 1)
        batch = q.shape[batch_dim]
        if attention_mask is not None:
            lens_q, lens_kv = padding_lengths(attention_mask, batch, q.shape[seq_dim], k.shape[seq_dim],
                                              self.attention_type == "self")
        elif cu_seqlens_q is not None or cu_seqlens_kv is not None:
            if cu_seqlens_q is None or cu_seqlens_kv is None:
                raise ValueError("cu_seqlens_q and cu_seqlens_kv must be given together")
            lens_q = lengths_from_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", batch)
            lens_kv = lengths_from_cu_seqlens(cu_seqlens_kv, "cu_seqlens_kv", batch)
        else:
            lens_q = lens_kv = None
        return None, None, lens_q, lens_kv

    def _onnx_attention(self, q, k, v, qkv_format, mask_type, attention_mask, inference_params):
        """The forward under te_fuser.export.onnx_export(True) (attention/torch_attention.py)."""
        if inference_params is not None:
            raise NotImplementedError("ONNX export of DotProductAttention with inference_params (the KV cache)")
        if self._fp8_quantizers(q.device) is not None:
            raise NotImplementedError("ONNX export of FP8 attention (fp8_dpa)")
        return torch_attention(q, k, v, qkv_format, mask_type, attention_mask, self.softmax_scale,
                               self.attention_type == "self")

    def _arbitrary_mask_attention(self, q, k, v, qkv_format, attention_mask, inference_params, autocast_dtype):
        """attn_mask_type="arbitrary": attention in torch operators (attention/torch_attention.py), as TE runs
        it in its unfused backend; high precision only."""
        if inference_params is not None:
            raise ValueError("inference_params needs attn_mask_type 'padding' or 'padding_causal' (as in TE), "
                             "got 'arbitrary'")
        if self._fp8_quantizers(q.device) is not None:
            raise NotImplementedError("FP8 attention (fp8_dpa) with attn_mask_type 'arbitrary'")
        q, k, v = (dequantized_with_grad(t) for t in (q, k, v))
        dropout_p = self.attention_dropout if self.training else 0.0
        tracker = self.get_rng_state_tracker if dropout_p > 0.0 else None
        with (tracker().fork() if tracker is not None else contextlib.nullcontext(),
              amp.autocast_off(q.device.type, autocast_dtype)):
            return torch_attention(q, k, v, qkv_format, "arbitrary", attention_mask, self.softmax_scale,
                                   self.attention_type == "self", dropout_p)

    def _cached_attention(self, q, k, v, qkv_format, mask_type, inference_params, autocast_dtype):
        """The attention of a KV-cache inference step (te_fuser/attention/kv_cache_attention.py): forward only."""
        check_inference_params(inference_params)
        if self.layer_number is None:
            raise ValueError("inference_params needs DotProductAttention's layer_number (the key of its KV cache)")
        if "padding" not in mask_type:
            raise ValueError(f"inference_params needs attn_mask_type 'padding' or 'padding_causal' (as in TE), "
                             f"got {mask_type!r}")
        if self._fp8_quantizers(q.device) is not None:
            raise NotImplementedError("inference_params with FP8 attention (fp8_dpa / fp8_mha) is not supported")
        with torch.no_grad(), amp.autocast_off(q.device.type, autocast_dtype):
            q, k, v = (dequantized_with_grad(t) for t in (q, k, v))
            return cached_attention(q, k, v, qkv_format, inference_params, self.layer_number, self.softmax_scale,
                                    "causal" in mask_type, self._attention_backend)

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, qkv_format: Optional[str] = None,
                cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                max_seqlen_q: Optional[int] = None, max_seqlen_kv: Optional[int] = None,
                attn_mask_type: Optional[str] = None, window_size=None, checkpoint_core_attention: bool = False,
                core_attention_bias_type: str = "no_bias", core_attention_bias=None, alibi_slopes=None,
                fast_zero_fill: bool = True, inference_params=None, pad_between_seqs: Optional[bool] = None,
                fp8_output: bool = False):
        """Attention output: [s, b, h*d] (sbhd), [b, s, h*d] (bshd) or [t, h*d] (thd)."""
        del fast_zero_fill  # rows outside every sequence are always 0
        unsupported = {
            "checkpoint_core_attention": bool(checkpoint_core_attention),
            "core_attention_bias_type": core_attention_bias_type != "no_bias" or core_attention_bias is not None,
            "alibi_slopes": alibi_slopes is not None,
            "pad_between_seqs": bool(pad_between_seqs),
        }
        for option, used in unsupported.items():
            if used:
                raise NotImplementedError(f"DotProductAttention option {option} is not supported by te_fuser")
        qkv_format = _check_format(qkv_format or self.qkv_format)
        if qkv_format == "thd" and pad_between_seqs is None:
            _check_no_padding_between(cu_seqlens_q, cu_seqlens_q_padded, "cu_seqlens_q")
            _check_no_padding_between(cu_seqlens_kv, cu_seqlens_kv_padded, "cu_seqlens_kv")
        mask_type = check_mask_type(attn_mask_type or self.attn_mask_type)
        check_window_size(window_size if window_size is not None else self.window_size, mask_type)
        self._check_inputs(query_layer, key_layer, value_layer, qkv_format)
        # torch.autocast: q, k and v in its dtype, and the kernels run with autocast off (te_fuser.amp).
        dtype = amp.autocast_dtype(query_layer.device.type)
        if dtype is not None:
            query_layer, key_layer, value_layer = (amp.cast_input(t) for t in (query_layer, key_layer, value_layer))
        if is_in_onnx_export_mode():
            return self._onnx_attention(query_layer, key_layer, value_layer, qkv_format, mask_type, attention_mask,
                                        inference_params)
        if mask_type == "arbitrary":
            return self._arbitrary_mask_attention(query_layer, key_layer, value_layer, qkv_format, attention_mask,
                                                  inference_params, dtype)
        if inference_params is not None:
            out = self._cached_attention(query_layer, key_layer, value_layer, qkv_format, mask_type, inference_params,
                                         dtype)
            return out.reshape(*out.shape[:-2], out.shape[-2] * out.shape[-1])
        cu_q, cu_kv, lens_q, lens_kv = self._lengths(query_layer, key_layer, qkv_format, mask_type,
                                                     attention_mask, cu_seqlens_q, cu_seqlens_kv)

        dropout_p = self.attention_dropout if self.training else 0.0
        quantizers = self._fp8_quantizers(query_layer.device)
        if quantizers is None:  # high-precision attention: FP8 inputs are read as their values
            query_layer, key_layer, value_layer = (dequantized_with_grad(t)
                                                   for t in (query_layer, key_layer, value_layer))
        # TE: under fp8_mha the attention output is FP8 whether or not fp8_output is passed.
        output_quantizer = None
        if quantizers is not None and (fp8_output or self._fp8_recipe.fp8_mha):
            output_quantizer = self._fp8_output_quantizer(query_layer.device)
        causal = "causal" in mask_type
        compiling = torch.compiler.is_compiling()
        if not compiling and _attention_backends["backend_selection_requires_update"]:
            clear_cache()
            _attention_backends["backend_selection_requires_update"] = False
        backend = choose_backend(query_layer, key_layer, qkv_format, Lengths(cu_q, cu_kv, lens_q, lens_kv),
                                 self.softmax_scale, causal, "generator" if dropout_p > 0.0 else "none",
                                 quantizers is not None, self._attention_backend)
        if not compiling:
            _record_choice(backend, quantizers is not None)
        query_layer, key_layer, value_layer, cu_q, cu_kv, lens_q, lens_kv = _distinct(
            query_layer, key_layer, value_layer, cu_q, cu_kv, lens_q, lens_kv)
        tracker = self.get_rng_state_tracker if dropout_p > 0.0 else None
        with (tracker().fork() if tracker is not None else contextlib.nullcontext(),
              amp.autocast_off(query_layer.device.type, dtype)):
            # te_fuser's kernels draw the mask of a (seed, offset) taken from the generator here; the library
            # kernels draw from the generator themselves.
            seed, offset = _dropout_seed(query_layer.device) if dropout_p > 0.0 and backend == "te_fuser" else (0, 0)
            args = (query_layer, key_layer, value_layer, qkv_format, cu_q, cu_kv, lens_q, lens_kv,
                    self.softmax_scale, causal, dropout_p, seed, offset, backend, (max_seqlen_q, max_seqlen_kv),
                    quantizers, output_quantizer)
            if torch.is_grad_enabled():
                out = FusedAttentionFunction.apply(*args)
            else:  # nothing to keep for a backward, and no autograd Function to call
                out = attention_forward(*args, for_backward=False)[0]
        return out.reshape(*out.shape[:-2], out.shape[-2] * out.shape[-1])
