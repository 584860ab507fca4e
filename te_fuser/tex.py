"""What te_fuser provides of `transformer_engine_torch`, TransformerEngine's compiled module (which TE
code imports as `tex`); te_fuser.compat's alias resolves that name to this module.

Only what te_fuser honours with its own kernels is here; any other name of TE's module (its GEMMs,
userbuffers, multi-tensor kernels, ...) raises an AttributeError under the alias that names it.
"""

import enum

import torch

from .te_dtype import DType


class FP8FwdTensors(enum.IntEnum):
    """TE's names of the forward FP8 slots of a module's scaling state, three per GEMM."""

    GEMM1_INPUT = 0
    GEMM1_WEIGHT = 1
    GEMM1_OUTPUT = 2
    GEMM2_INPUT = 3
    GEMM2_WEIGHT = 4
    GEMM2_OUTPUT = 5
    GEMM3_INPUT = 6
    GEMM3_WEIGHT = 7
    GEMM3_OUTPUT = 8


class FP8BwdTensors(enum.IntEnum):
    """TE's names of the backward FP8 slots, two per GEMM."""

    GRAD_OUTPUT1 = 0
    GRAD_INPUT1 = 1
    GRAD_OUTPUT2 = 2
    GRAD_INPUT2 = 3
    GRAD_OUTPUT3 = 4
    GRAD_INPUT3 = 5


class FP8TensorMeta:
    """TE's holder of one delayed-scaling state's tensors: `scale`, `scale_inv` and `amax_history`
    (history_len, n), each None until assigned."""

    def __init__(self):
        self.scale = None
        self.scale_inv = None
        self.amax_history = None

    def __repr__(self) -> str:
        shapes = {name: None if t is None else tuple(t.shape)
                  for name, t in (("scale", self.scale), ("scale_inv", self.scale_inv),
                                  ("amax_history", self.amax_history))}
        return f"FP8TensorMeta({', '.join(f'{k}={v}' for k, v in shapes.items())})"


__all__ = ["DType", "FP8BwdTensors", "FP8FwdTensors", "FP8TensorMeta"]
