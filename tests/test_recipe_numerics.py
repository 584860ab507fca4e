"""benchmarks/recipe_numerics.py's gradient error: one step of the example GPT under each recipe against
benchmarks/bench_gpt.py's PlainGPT in float64 with the same weights. Without a recipe the two models agree to
float32 rounding (the comparison itself is sound); each recipe's error lies within its format's reach (8-bit
formats: ~2^-4 relative rounding per operand; NVFP4's E2M1: ~2^-2) and above float32's (quantization ran)."""

import importlib.util
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "recipe_numerics.py"
_spec = importlib.util.spec_from_file_location("recipe_numerics", _BENCH)
recipe_numerics = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recipe_numerics)

BOUNDS = {"delayed": 0.2, "current": 0.2, "mxfp8": 0.2, "block": 0.2, "nvfp4": 0.5}


def test_without_a_recipe_the_gradients_are_float64s_to_float32_rounding():
    assert recipe_numerics.gradient_error(None)["relative"] < 1e-5


@pytest.mark.parametrize("recipe", sorted(BOUNDS))
def test_each_recipes_gradient_error_lies_within_its_formats_reach(recipe):
    error = recipe_numerics.gradient_error(recipe)["relative"]
    assert 1e-3 < error < BOUNDS[recipe], error
