"""TE 2.6's attention introspection (`attention.dot_product_attention.utils`), answered by te_fuser's own
backend selection (te_fuser/attention/backends/selection.py).

TE chooses among three backend families; each of te_fuser's backends stands in for one of them, the family
whose NVTE_* switch turns it off:

    TE's family                   NVTE switch         on CUDA                       on the CPU
    FlashAttention                NVTE_FLASH_ATTN     torch's FlashAttention        torch's CPU flash kernel
    FusedAttention                NVTE_FUSED_ATTN     cuDNN, te_fuser's CUDA C      te_fuser's C kernels
    UnfusedDotProductAttention    NVTE_UNFUSED_ATTN   torch math (unfused)          torch math (unfused)

get_attention_backend(params) describes the problem DotProductAttention would meet for those parameters,
on the device TE's tests put tensors on (the current CUDA device, or the CPU without CUDA), and asks the
selection which backends could run it and which one does: DotProductAttention, given the same inputs and
environment, runs that backend. FusedAttention's sub-backend is FP8 for FP8 attention, else
F16_arbitrary_seqlen (te_fuser's fused kernels have no max-512 variant, and take float32 too);
NVTE_FUSED_ATTN_BACKEND, a preference among sub-backends in TE, has nothing to choose between.
"""

import logging
import os
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from ...cpp_extensions.fused_attn import FusedAttnBackend
from ...kernels import cpu
from ...kernels.validate import FLOAT_DTYPES
from ..backends.problem import Problem
from ..backends.selection import choose, te_family
from ..masks import MASK_TYPES, check_window_size
from .fp8_recipe import dpa_variables, fp8_attention

QKV_FORMATS = ("sbhd", "bshd", "thd")


class AttentionLogging:
    """TE's logging setup of attention: NVTE_DEBUG=1 with NVTE_DEBUG_LEVEL=0/1/2 gives WARNING / INFO /
    DEBUG on te_fuser's attention logger ("te_fuser.attention", where each backend choice is logged)."""

    _log_level = int(os.getenv("NVTE_DEBUG", "0")) * int(os.getenv("NVTE_DEBUG_LEVEL", "0"))
    _formatter = logging.Formatter("[%(levelname)-8s | %(name)-19s]: %(message)s")
    _stream_handler = logging.StreamHandler()
    fa_logger = logging.getLogger("te_fuser.attention")
    _is_logging_setup = False

    @staticmethod
    def setup_logging():
        """Turn _log_level (0, 1, 2) into a logging level and give the logger its handler."""
        levels = {0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG}
        level = AttentionLogging._log_level
        AttentionLogging._log_level = levels[level if level in levels else 2]
        AttentionLogging._stream_handler.setFormatter(AttentionLogging._formatter)
        AttentionLogging.fa_logger.setLevel(AttentionLogging._log_level)
        if not AttentionLogging.fa_logger.hasHandlers():
            AttentionLogging.fa_logger.addHandler(AttentionLogging._stream_handler)
        AttentionLogging._is_logging_setup = True


class FlashAttentionUtils:
    """TE's record of the flash-attn package. te_fuser never uses that package (its FlashAttention family is
    torch's own flash kernels), so it reports it not installed: TE's tests that need flash-attn features
    (sliding windows, ALiBi) skip."""

    is_installed = False
    version = None
    v2_plus = v2_1_plus = v2_3_plus = v2_4_plus = v2_4_1_plus = v2_5_plus = v2_5_7_plus = False
    v2_6_0_plus = v2_7_0_plus = False
    v3_is_installed = False
    fa3_version = None
    v3_0_0_beta = False
    use_v3 = False


@dataclass(eq=True)
class AttentionParams:
    """TE 2.6's description of an attention problem, the input of get_attention_backend (TE's fields and
    defaults). Equality compares fp8_meta by its "recipe" only, as TE's does."""

    qkv_type: Union[type, Any] = torch.Tensor
    qkv_dtype: torch.dtype = torch.bfloat16
    qkv_layout: str = "sbh3d"
    batch_size: int = 1
    num_heads: int = 16
    num_gqa_groups: int = 16
    max_seqlen_q: int = 128
    max_seqlen_kv: int = 128
    head_dim_qk: int = 64
    head_dim_v: int = 64
    attn_mask_type: str = "no_mask"
    window_size: Union[Tuple[int, int], None] = None
    alibi_slopes_shape: Union[torch.Size, List, None] = None
    core_attention_bias_type: str = "no_bias"
    core_attention_bias_shape: str = "1hss"
    core_attention_bias_requires_grad: bool = True
    pad_between_seqs: bool = False
    attention_dropout: float = 0.0
    context_parallel: bool = False
    deterministic: bool = False
    is_training: bool = True
    fp8: bool = False
    fp8_meta: Union[Dict[str, Any], None] = None
    inference_params: Optional[Any] = None

    def __eq__(self, other):
        if not isinstance(other, self.__class__):
            return NotImplemented
        for field in fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if field.name == "fp8_meta":
                mine, theirs = ((m or {}).get("recipe") for m in (mine, theirs))
            if mine != theirs:
                return False
        return True


def check_set_window_size(attn_mask_type: str, window_size: Optional[Tuple[int, int]] = None):
    """window_size made consistent with attn_mask_type, as TE's: causal masks take (-1, 0) or (>= 0, 0)
    (None and (-1, -1) become (-1, 0)); no_mask, padding and arbitrary take (-1, -1) or (>= 0, >= 0)
    ((-1, 0) becomes (-1, -1)). Other windows raise ValueError naming window_size."""
    if "causal" in attn_mask_type:
        if window_size is None or tuple(window_size) == (-1, -1):
            return (-1, 0)
        left, right = window_size
        if right != 0 or left < -1:
            raise ValueError(f"window_size={window_size!r}: attn_mask_type={attn_mask_type!r} takes (-1, 0) "
                             "or (>=0, 0)")
        return window_size
    if attn_mask_type not in ("no_mask", "padding", "arbitrary"):
        raise ValueError(f"attn_mask_type={attn_mask_type!r} is not an attention mask type")
    if window_size is None or tuple(window_size) == (-1, 0):
        return (-1, -1)
    if tuple(window_size) != (-1, -1) and min(window_size) < 0:
        raise ValueError(f"window_size={window_size!r}: attn_mask_type={attn_mask_type!r} takes (-1, -1) "
                         "or (>=0, >=0)")
    return window_size


def _attention_device() -> torch.device:
    """Where TE's attention inputs live: the current CUDA device (as a tensor made there reports it), else
    the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.empty(0, device="cuda").device


def _qkv_format(qkv_layout: str) -> str:
    """The format of q in a TE qkv_layout ("sb3hd" -> "sbhd", "thd_t2hd" -> "thd")."""
    return "".join(c for c in qkv_layout.replace("paged_kv_", "").split("_")[0] if c.isalpha())


def _window_refused(params: AttentionParams) -> bool:
    try:
        check_window_size(params.window_size, params.attn_mask_type)
    except NotImplementedError:
        return True
    return False


def _unsupported(params: AttentionParams) -> Optional[str]:
    """Why te_fuser's DotProductAttention refuses these parameters, or None."""
    reasons = (
        (_qkv_format(params.qkv_layout) not in QKV_FORMATS, f"qkv_layout={params.qkv_layout!r}"),
        (params.qkv_dtype not in FLOAT_DTYPES + (torch.float8_e4m3fn,), f"qkv_dtype={params.qkv_dtype}"),
        (params.head_dim_qk != params.head_dim_v, "different q/k and v head dims"),
        (params.attn_mask_type not in MASK_TYPES + ("arbitrary",), f"attn_mask_type={params.attn_mask_type!r}"),
        (params.attn_mask_type == "arbitrary" and (_fp8_attention(params) or _qkv_format(params.qkv_layout) == "thd"),
         "attn_mask_type='arbitrary' with FP8 attention or the thd format"),
        (params.attn_mask_type in MASK_TYPES and _window_refused(params),
         f"window_size={params.window_size!r} (sliding window)"),
        (params.alibi_slopes_shape is not None or params.core_attention_bias_type != "no_bias",
         f"core_attention_bias_type={params.core_attention_bias_type!r}"),
        (params.pad_between_seqs, "pad_between_seqs"),
        (params.context_parallel, "context parallelism"),
    )
    return next((what for refused, what in reasons if refused), None)


def _fp8_attention(params: AttentionParams) -> bool:
    recipe = (params.fp8_meta or {}).get("recipe") if params.fp8 else None
    return fp8_attention(recipe, dpa_variables())


def problem_of(params: AttentionParams, device: Optional[torch.device] = None) -> Problem:
    """The te_fuser Problem DotProductAttention meets for these parameters (on `device`, by default where
    TE's inputs live)."""
    device = _attention_device() if device is None else torch.device(device)
    if _qkv_format(params.qkv_layout) == "thd":
        layout, square = "packed", False
    elif "padding" in params.attn_mask_type or params.inference_params is not None:  # a KV-cache step: padded
        layout, square = "padded", False
    else:
        layout, square = "dense", params.max_seqlen_q == params.max_seqlen_kv
    fp8 = _fp8_attention(params)
    dtype = torch.float8_e4m3fn if fp8 else params.qkv_dtype
    capability = tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None
    q_numel = params.batch_size * params.max_seqlen_q * params.num_heads * params.head_dim_qk
    k_numel = params.batch_size * params.max_seqlen_kv * params.num_gqa_groups * params.head_dim_qk
    return Problem(
        device.type, capability, cpu.current_isa() if device.type == "cpu" else None, dtype,
        int(params.head_dim_qk), params.num_gqa_groups != params.num_heads, layout,
        "causal" in params.attn_mask_type, square, params.max_seqlen_kv == 1,
        "generator" if params.attention_dropout > 0.0 and params.is_training else "none", True,
        q_numel == 0 or k_numel == 0,
        bool(params.deterministic) or torch.are_deterministic_algorithms_enabled())


def get_attention_backend(attention_params: AttentionParams = None):
    """TE 2.6's answer for these parameters, from te_fuser's selection under the current environment:
    (use_flash_attention, flash_attention_backend, use_fused_attention, fused_attention_backend,
    use_unfused_attention, available_backends), available_backends being [flash, fused, unfused], the
    families one of whose backends could run the problem. flash_attention_backend names te_fuser's backend
    ("flash" or "cpu_flash") when FlashAttention is chosen; fused_attention_backend is a FusedAttnBackend
    value when FusedAttention is chosen. Parameters te_fuser's DotProductAttention refuses (see
    _unsupported) leave every family unavailable."""
    params = AttentionParams() if attention_params is None else attention_params
    logger = AttentionLogging.fa_logger
    refused = _unsupported(params)
    if refused is not None:
        logger.debug("No backend: te_fuser's DotProductAttention does not support %s", refused)
        return False, None, False, None, False, [False, False, False]
    if params.attn_mask_type == "arbitrary":  # torch operators (attention/torch_attention.py): TE's unfused family
        return False, None, False, None, True, [False, False, True]
    problem = problem_of(params)
    try:
        choice = choose(problem)
    except RuntimeError as error:  # no backend can run it under the current environment
        logger.debug("No backend: %s", error)
        return False, None, False, None, False, [False, False, False]
    families = {te_family(name) for name in choice.runnable}
    available = [family in families
                 for family in ("FlashAttention", "FusedAttention", "UnfusedDotProductAttention")]
    return te_view(choice.backend, problem.dtype == torch.float8_e4m3fn) + (available,)


def te_view(backend: str, fp8: bool):
    """TE's (use_flash_attention, flash_attention_backend, use_fused_attention, fused_attention_backend,
    use_unfused_attention) for a call te_fuser runs on `backend` (fp8: on FP8 q, k, v)."""
    family = te_family(backend)
    use_flash, use_fused = family == "FlashAttention", family == "FusedAttention"
    fused_backend = FusedAttnBackend["FP8" if fp8 else "F16_arbitrary_seqlen"] if use_fused else None
    return use_flash, backend if use_flash else None, use_fused, fused_backend, family == "UnfusedDotProductAttention"


__all__ = ["AttentionLogging", "AttentionParams", "FlashAttentionUtils", "check_set_window_size",
           "get_attention_backend"]
