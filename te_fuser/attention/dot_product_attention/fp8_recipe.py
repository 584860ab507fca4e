"""The recipe DotProductAttention quantizes under, from the fp8_autocast recipe and TE's NVTE_DPA_FP8_*
variables.

TE lets the linear layers and the attention run different recipes (its "experimental" table in
dot_product_attention.py): NVTE_DPA_FP8_RECIPE names the attention's recipe, and the attention takes
fp8_dpa and fp8_mha from the autocast recipe.

  NVTE_DPA_FP8_RECIPE     attention under
  unset                   the autocast recipe (DelayedScaling or Float8CurrentScaling; for a block-scaled
                          recipe with fp8_dpa, te_fuser asks for the variable: its FP8 attention is per-tensor)
  "F16"                   high precision, whatever fp8_dpa / fp8_mha say
  "DelayedScaling"        DelayedScaling(amax_history_len=NVTE_DPA_FP8DS_AMAX_HISTLEN (1),
                          amax_compute_algo=NVTE_DPA_FP8DS_AMAX_ALGO ("most_recent"),
                          reduce_amax=NVTE_DPA_FP8DS_REDUCE_AMAX ("1")) unless the autocast recipe is one
  "Float8CurrentScaling"  Float8CurrentScaling() unless the autocast recipe is one

The new recipe keeps the autocast recipe's fp8_format, except under NVFP4BlockScaling (whose fp8_format
is its block scales'), where NVTE_DPA_FP8_FORMAT ("HYBRID", "E4M3" or "E5M2"; default "HYBRID") gives it.
TE reads the variables when its module is imported; te_fuser reads them at each FP8 attention call, so a
test or a script may set them after importing te_fuser.
"""

import os
from typing import Tuple

from ...recipe import DelayedScaling, Float8CurrentScaling, Format, MXFP8BlockScaling, NVFP4BlockScaling

RECIPE_VAR = "NVTE_DPA_FP8_RECIPE"
_SWITCHES = ("", "F16", "DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling")
_FORMATS = {"HYBRID": Format.HYBRID, "E4M3": Format.E4M3, "E5M2": Format.E5M2}
# (name, default) of the variables, in the order dpa_variables() returns their values
_VARIABLES = ((RECIPE_VAR, ""), ("NVTE_DPA_FP8_FORMAT", "HYBRID"), ("NVTE_DPA_FP8DS_AMAX_ALGO", "most_recent"),
              ("NVTE_DPA_FP8DS_AMAX_HISTLEN", "1"), ("NVTE_DPA_FP8DS_REDUCE_AMAX", "1"))


def dpa_variables() -> Tuple[str, ...]:
    """The NVTE_DPA_FP8_* values now: strings, which torch.compile hands to code that runs while it traces."""
    return tuple(os.getenv(name, default) for name, default in _VARIABLES)


def fp8_attention(recipe, variables: Tuple[str, ...]) -> bool:
    """Whether the attention quantizes under the autocast recipe `recipe`: fp8_dpa or fp8_mha, and not "F16"."""
    requested = getattr(recipe, "fp8_dpa", False) or getattr(recipe, "fp8_mha", False)
    return bool(requested) and variables[0] != "F16"


def attention_recipe(recipe, variables: Tuple[str, ...]):
    """The recipe of the attention's FP8 quantizers under the autocast recipe `recipe` (fp8_attention(recipe,
    variables) holding), made anew for a switch: equal to the last one while the variables stay, so the
    attention keeps its scaling state."""
    switch, fmt, amax_algo, histlen, reduce_amax = variables
    if switch not in _SWITCHES:
        raise ValueError(f"{RECIPE_VAR}={switch!r}: expected one of "
                         f"{', '.join(repr(s) for s in _SWITCHES[1:])}, or unset")
    name = type(recipe).__name__
    if switch == "" and isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        return recipe
    if switch == "MXFP8BlockScaling" or (switch == "" and isinstance(recipe, MXFP8BlockScaling)):
        raise NotImplementedError(f"MXFP8 attention ({RECIPE_VAR}={switch or 'unset'} under {name} with "
                                  "fp8_dpa) is not implemented by te_fuser: its FP8 attention uses per-tensor "
                                  f"scales; set {RECIPE_VAR} to 'DelayedScaling' or 'Float8CurrentScaling', or "
                                  "'F16' for high-precision attention")
    if switch == "":
        raise NotImplementedError(f"DotProductAttention does not run {name} (fp8_dpa / fp8_mha), as in TE: set "
                                  f"{RECIPE_VAR} to 'DelayedScaling' or 'Float8CurrentScaling' for per-tensor FP8 "
                                  "attention beside the recipe's linear layers, or 'F16'")
    target = DelayedScaling if switch == "DelayedScaling" else Float8CurrentScaling
    if isinstance(recipe, target):
        return recipe
    if isinstance(recipe, NVFP4BlockScaling):
        if fmt not in _FORMATS:
            raise ValueError(f"NVTE_DPA_FP8_FORMAT={fmt!r}: expected one of {', '.join(_FORMATS)}")
        fp8_format = _FORMATS[fmt]
    else:
        fp8_format = recipe.fp8_format
    common = dict(fp8_format=fp8_format, fp8_dpa=recipe.fp8_dpa, fp8_mha=recipe.fp8_mha)
    if target is Float8CurrentScaling:
        return Float8CurrentScaling(**common)
    if amax_algo not in ("most_recent", "max"):
        raise ValueError(f"NVTE_DPA_FP8DS_AMAX_ALGO={amax_algo!r}: expected 'most_recent' or 'max'")
    if not histlen.isdigit() or int(histlen) < 1:
        raise ValueError(f"NVTE_DPA_FP8DS_AMAX_HISTLEN={histlen!r}: expected a positive integer")
    if reduce_amax not in ("0", "1"):
        raise ValueError(f"NVTE_DPA_FP8DS_REDUCE_AMAX={reduce_amax!r}: expected '0' or '1'")
    return DelayedScaling(amax_history_len=int(histlen), amax_compute_algo=amax_algo,
                          reduce_amax=reduce_amax == "1", **common)
