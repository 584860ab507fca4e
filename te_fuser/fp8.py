"""TransformerEngine's `transformer_engine.pytorch.fp8` surface over te_fuser's FP8 state.

FP8GlobalStateManager answers what TE's does from te_fuser's own state
(fp8_state.FP8GlobalState: the fp8_autocast stack and the delayed-scaling
states waiting for their update). What only serves TE's CUDA-graph capture
(its global amax buffers of `fp8_meta` dicts, the skip-weight-update tensor)
has no te_fuser counterpart and raises NotImplementedError naming itself.

FP8 availability: te_fuser runs FP8 on the CPU always (quantization kernels in
C, GEMMs emulated exactly by dequantizing); on CUDA its GEMMs use
torch._scaled_mm, which needs compute capability 8.9 or newer.
"""

from typing import Optional, Tuple

import torch

from . import fp8_weights
from .fp8_state import FP8GlobalState, autocast, fp8_autocast
from .fp8_weights import fp8_model_init, quantized_model_init
from .recipe import DelayedScaling, Recipe


def check_fp8_support() -> Tuple[bool, str]:
    """(available, reason): always on the CPU; on CUDA when the current GPU has compute capability >= 8.9."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            return False, (f"te_fuser's CUDA FP8 GEMMs need compute capability 8.9+, this GPU has {major}.{minor} "
                           "(FP8 on the CPU is always available)")
    return True, ""


def check_mxfp8_support() -> Tuple[bool, str]:
    return False, "te_fuser does not implement MXFP8 (MXFP8BlockScaling)"


def check_fp8_block_scaling_support() -> Tuple[bool, str]:
    return False, "te_fuser does not implement FP8 block scaling (Float8BlockScaling)"


def get_default_fp8_recipe() -> DelayedScaling:
    return DelayedScaling()


def get_fp8_torch_dtype(fp8_recipe, fprop_tensor: bool = True) -> torch.dtype:
    return fp8_recipe.fp8_format.fwd_dtype if fprop_tensor else fp8_recipe.fp8_format.bwd_dtype


def get_fp8_max(fp8_recipe, fprop_tensor: bool = True) -> float:
    return fp8_recipe.fp8_format.max_fwd if fprop_tensor else fp8_recipe.fp8_format.max_bwd


def _cuda_graph_path(name: str):
    raise NotImplementedError(f"FP8GlobalStateManager.{name} serves TE's CUDA-graph capture of FP8 modules, "
                              "which te_fuser does not support")


class QuantizationState:
    """A live view of te_fuser's FP8 state with the field names of TE's `quantization_state`."""

    @property
    def fp8_enabled(self) -> bool:
        return FP8GlobalState.is_enabled()

    @property
    def fp8_calibration(self) -> bool:
        return FP8GlobalState.is_calibrating()

    @property
    def fp8_recipe(self) -> Optional[Recipe]:
        return FP8GlobalState.get_recipe()

    @property
    def fp8_distributed_group(self):
        return FP8GlobalState.get_group()

    @property
    def autocast_depth(self) -> int:
        return len(FP8GlobalState._stack)

    @property
    def is_first_fp8_module(self) -> bool:
        return FP8GlobalState.is_first_module

    @is_first_fp8_module.setter
    def is_first_fp8_module(self, value: bool) -> None:
        FP8GlobalState.is_first_module = bool(value)

    @property
    def fp8_parameters(self) -> bool:
        return fp8_weights.current_init().enabled

    @property
    def high_precision_init_val(self) -> bool:
        return fp8_weights.current_init().preserve_high_precision_init_val

    fp8_graph_capturing = False
    skip_fp8_weight_update_tensor = None


class FP8GlobalStateManager:
    """TE's FP8 global state API, answered from te_fuser's fp8_autocast state."""

    quantization_state = QuantizationState()

    @classmethod
    def reset(cls) -> None:
        """Forget every fp8_autocast context and pending scale update (for tests and restarts)."""
        FP8GlobalState._stack.clear()
        FP8GlobalState._pending.clear()
        FP8GlobalState.is_first_module = False

    @classmethod
    def is_fp8_available(cls) -> Tuple[bool, str]:
        return check_fp8_support()

    @classmethod
    def is_mxfp8_available(cls) -> Tuple[bool, str]:
        return check_mxfp8_support()

    @classmethod
    def is_fp8_block_scaling_available(cls) -> Tuple[bool, str]:
        return check_fp8_block_scaling_support()

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return FP8GlobalState.is_enabled()

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        return FP8GlobalState.is_calibrating()

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        """True inside quantized_model_init(enabled=True): modules built now get FP8 weights."""
        return fp8_weights.current_init().enabled

    @classmethod
    def with_high_precision_init_val(cls) -> bool:
        return fp8_weights.current_init().preserve_high_precision_init_val

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        """True once per outermost fp8_autocast: the first call inside it; later calls give False."""
        first = FP8GlobalState.is_first_module
        FP8GlobalState.is_first_module = False
        return first

    @classmethod
    def get_fp8_recipe(cls):
        """The innermost fp8_autocast's recipe; TE's default DelayedScaling() outside any."""
        recipe = FP8GlobalState.get_recipe()
        return recipe if recipe is not None else get_default_fp8_recipe()

    @classmethod
    def get_fp8_group(cls):
        return FP8GlobalState.get_group()

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        """All-reduce (MAX) the recorded amaxes and update the scales of the delayed-scaling states
        waiting for it, forward (input/weight) or backward (gradient) ones; te_fuser does this itself
        when the outermost fp8_autocast exits."""
        FP8GlobalState.update_pending(forward=bool(forward))

    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, fp8_meta) -> None:
        del fp8_meta
        _cuda_graph_path("add_fp8_tensors_to_global_buffer")

    @classmethod
    def set_skip_fp8_weight_update_tensor(cls, skip: bool) -> None:
        del skip
        _cuda_graph_path("set_skip_fp8_weight_update_tensor")

    @classmethod
    def get_skip_fp8_weight_update_tensor(cls):
        return None  # never set: te_fuser updates weight scales on every step


__all__ = ["FP8GlobalStateManager", "QuantizationState", "autocast", "check_fp8_support", "fp8_autocast",
           "fp8_model_init", "get_default_fp8_recipe", "get_fp8_max", "get_fp8_torch_dtype", "quantized_model_init"]
