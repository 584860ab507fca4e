"""Attention backends: te_fuser's kernels, cuDNN, FlashAttention, torch's CPU flash kernel and the unfused
math path, each behind supports / forward / backward, and the selection among them (selection.py)."""

from .problem import Call, Lengths, Problem, describe
from .selection import BACKENDS, ENV_BACKEND, PREFERENCES, Choice, choose, clear_cache

__all__ = ["BACKENDS", "ENV_BACKEND", "PREFERENCES", "Call", "Choice", "Lengths", "Problem", "choose",
           "clear_cache", "describe"]
