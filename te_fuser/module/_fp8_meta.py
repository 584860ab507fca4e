"""A module's `fp8_meta`, TransformerEngine's dict of its FP8 state, as a view of te_fuser's.

TE's keys (FP8GlobalStateManager.get_meta_tensor_key): "scaling_fwd" and "scaling_bwd" are the recipe
states of the module's linear op, the very objects te_fuser casts with and updates (delayed scaling:
`scale`, `scale_inv` and `amax_history` in TE's layout; current scaling: the stateless recipe state),
present once FP8 has run; "recipe" is the recipe they follow (TE's default DelayedScaling before).

te_fuser keeps the state per linear op: slots input and weight forward, grad_output backward, per
GEMM (TE reserves three and two). A module with several linear ops (LayerNormMLP) has no single state
per direction, so it has no fp8_meta (AttributeError naming why). The dict is made on each access:
assigning into it changes nothing in the module.
"""

from ..quantization import get_default_fp8_recipe


def fp8_meta_view(module_name: str, ops) -> dict:
    """`fp8_meta` of a module made of `ops` (see the module docstring)."""
    fp8_ops = [op for op in ops if op.num_forward_quantizers + op.num_backward_quantizers > 0]
    if len(fp8_ops) != 1:
        why = "no FP8 GEMM" if not fp8_ops else f"one FP8 scaling state per linear op ({len(fp8_ops)} of them)"
        raise AttributeError(f"te_fuser.{module_name} has {why}, so no fp8_meta (TE's one state per direction)")
    op = fp8_ops[0]
    if op._fp8_states is None:
        return {"recipe": get_default_fp8_recipe()}
    forward, backward = op._fp8_states
    return {"recipe": op._fp8_recipe, "scaling_fwd": forward, "scaling_bwd": backward}
