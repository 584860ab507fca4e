"""Every kind of quantized tensor te_fuser has, for the property tests that must hold for each of them.

A kind makes a quantized tensor from high-precision values and knows, by torch math alone (no te_fuser
kernel), what such a tensor holds:
  observe(t)          its values (float64) and scaling state, read from its buffers;
  expect(t, values)   what writing `values` into t must leave, with the same keys: torch's float8 cast
                      of values * scale, read back with the stored 1 / scale, and the scaling state;
  dequantized(t)      the high-precision tensor (t.dtype) an op on t computes with;
  rescaled(t, values) a tensor of t's format holding values with a scale t does not have (what
                      t.copy_ takes as it is, as loading a checkpoint does).
A block-scaled kind joins every property test by adding its entry to KINDS.
"""

from dataclasses import dataclass
from typing import Callable

import torch

import te_fuser
from te_fuser import recipe
from te_fuser.tensor import Float8CurrentScalingQuantizer, Float8Quantizer


@dataclass(frozen=True)
class QuantizedKind:
    name: str
    make: Callable  # 2-D high-precision values -> a quantized tensor holding them
    observe: Callable
    expect: Callable
    dequantized: Callable
    rescaled: Callable

    def __repr__(self):
        return self.name


# -- Float8Tensor: FP8 bytes, one float32 1/scale, optionally the transposed bytes and a quantizer ----------
def _f8_scale_and_amax(t, values):
    """The scale a write of values into t casts with, and the quantizer's amax after it (None without one)."""
    quantizer = t._quantizer
    amax = values.detach().abs().max().float().reshape(1)
    if quantizer is None:  # the tensor's own scale
        return torch.reciprocal(t._scale_inv), None
    if isinstance(quantizer, Float8CurrentScalingQuantizer):
        assert quantizer.amax_epsilon == 0 and not quantizer.force_pow_2_scales, "reference: plain fp8_max / amax"
        fp8_max = torch.full_like(amax, torch.finfo(t.fp8_dtype).max)  # (a Python float / a tensor would
        usable = (amax > 0) & torch.isfinite(amax)                        # round 1 / amax first)
        return torch.where(usable, fp8_max / amax, torch.ones(1)), amax
    return quantizer.scale.clone(), torch.maximum(quantizer.amax, amax)  # delayed: the recipe's scale


def _f8_expect(t, values):
    scale, amax = _f8_scale_and_amax(t, values)
    limit = torch.finfo(t.fp8_dtype).max
    codes = (values.float() * scale).clamp(-limit, limit).to(t.fp8_dtype)  # torch's cast, saturated like TE
    scale_inv = torch.reciprocal(scale)
    expected = {"values": codes.double() * scale_inv.double(), "scale_inv": scale_inv}
    if t._transpose is not None:
        expected["transpose"] = codes.reshape(-1, codes.shape[-1]).t().double()
    if amax is not None:
        expected["quantizer.scale"], expected["quantizer.amax"] = scale, amax
    return expected


def _f8_observe(t):
    observed = {"values": t.fp8_data.double() * t._scale_inv.double(), "scale_inv": t._scale_inv.clone()}
    if t._transpose is not None:
        observed["transpose"] = t.fp8_data_transpose.double()
    if t._quantizer is not None:
        observed["quantizer.scale"] = t._quantizer.scale.clone()
        observed["quantizer.amax"] = t._quantizer.amax.clone()
    return observed


def _f8_dequantized(t):
    return (t.fp8_data.float() * t._scale_inv).to(t.dtype)


def _f8_rescaled(t, values):
    scale = torch.reciprocal(t._scale_inv) * 0.125
    return Float8Quantizer(scale, torch.zeros(1), t.fp8_dtype)(values.to(t.dtype))


def _f8_tensor(fp8_dtype, scale, dtype, columnwise):
    def make(values):
        quantizer = Float8Quantizer(torch.tensor([scale]), torch.zeros(1), fp8_dtype, columnwise=columnwise)
        return quantizer(values.to(dtype))
    return make


def _f8_weight(fp8_recipe, scale=None):
    """The weight of a te_fuser.Linear built under quantized_model_init: a Parameter with its quantizer."""
    def make(values):
        rows, cols = values.shape
        with te_fuser.quantized_model_init(recipe=fp8_recipe):
            weight = te_fuser.Linear(cols, rows, bias=False, params_dtype=torch.bfloat16, device="cpu").weight
        with torch.no_grad():
            if scale is not None:  # as a delayed-scaling update would have set it
                weight._quantizer.scale.fill_(scale)
            weight.copy_(values)
        return weight
    return make


def _float8(name, make):
    return QuantizedKind(name, make, _f8_observe, _f8_expect, _f8_dequantized, _f8_rescaled)


KINDS = [
    _float8("float8_e4m3", _f8_tensor(torch.float8_e4m3fn, 0.75, torch.float32, columnwise=False)),
    _float8("float8_e5m2_with_transpose", _f8_tensor(torch.float8_e5m2, 4.0, torch.bfloat16, columnwise=True)),
    _float8("fp8_weight_delayed", _f8_weight(recipe.DelayedScaling(), scale=2.0)),
    _float8("fp8_weight_current", _f8_weight(recipe.Float8CurrentScaling())),
]


def random_values(shape, generator, dtype=torch.float32):
    """randn * 3 with edge values: zero, negative zero, a subnormal once scaled, a large one."""
    x = torch.randn(*shape, generator=generator) * 3
    x.view(-1)[:4] = torch.tensor([0.0, -0.0, -1e-4, 40.0])
    return x.to(dtype)


def assert_holds(kind, t, expected, what=""):
    """t holds exactly what kind.expect said (values and every scaling-state entry)."""
    observed = kind.observe(t)
    assert observed.keys() == expected.keys(), (what, observed.keys(), expected.keys())
    for key, want in expected.items():
        got = observed[key]
        assert got.shape == want.shape and torch.equal(got, want), \
            f"{what}: {key} differs in {int((got != want).sum())} of {want.numel()} entries"
