"""TransformerEngine's `transformer_engine.pytorch.fp8`: the FP8 global-state names at the path TE 2.x
keeps for them; they live in te_fuser.quantization, as TE's do in its `quantization` module."""

from .quantization import (FP8GlobalStateManager, QuantizationState, _amax_and_scale_update, _default_sf_compute,
                           autocast, check_fp8_block_scaling_support, check_fp8_support, check_mxfp8_support,
                           check_nvfp4_support,
                           fp8_autocast, fp8_model_init, get_default_fp8_recipe, get_fp8_max, get_fp8_torch_dtype,
                           quantized_model_init)

__all__ = ["FP8GlobalStateManager", "QuantizationState", "autocast", "check_fp8_support", "fp8_autocast",
           "fp8_model_init", "get_default_fp8_recipe", "get_fp8_max", "get_fp8_torch_dtype", "quantized_model_init"]
