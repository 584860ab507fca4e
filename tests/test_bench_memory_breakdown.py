"""benchmarks/memory_breakdown.py counts what a step saves for backward beyond its parameters: a layer that
saves its own (16-bit) weight adds nothing the step does not hold anyway, so those storages are left out of
the count (they made FP8's ratio look better than it was)."""

import importlib.util
from pathlib import Path

import torch

from te_fuser.memory.saved import saved_for_backward

_BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "memory_breakdown.py"
_spec = importlib.util.spec_from_file_location("memory_breakdown", _BENCH)
memory_breakdown = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(memory_breakdown)


def test_parameters_own_storages_are_not_counted_as_saved():
    model = torch.nn.Linear(32, 16, bias=False, dtype=torch.bfloat16)  # saves its input and its weight
    x = torch.randn(8, 32, dtype=torch.bfloat16, requires_grad=True)
    _, saved = saved_for_backward(lambda: model(x))
    kept = memory_breakdown.without_parameters(saved, model)
    weight = model.weight.untyped_storage().data_ptr()
    assert weight in {e.tensor.untyped_storage().data_ptr() for e in saved}  # the control: it was saved
    assert weight not in {e.tensor.untyped_storage().data_ptr() for e in kept}
    assert kept.total_bytes == saved.total_bytes - model.weight.untyped_storage().nbytes() > 0


def test_a_quantized_parameter_counts_every_buffer_it_holds():
    import te_fuser

    with te_fuser.quantized_model_init(enabled=True, recipe=te_fuser.recipe.DelayedScaling()):
        model = te_fuser.Linear(64, 32, params_dtype=torch.bfloat16)
    weight = model.weight
    buffers = [weight._data, weight._scale_inv] + ([weight._transpose] if weight._transpose is not None else [])
    expected = sum(t.untyped_storage().nbytes() for t in buffers) + model.bias.untyped_storage().nbytes()
    counted = memory_breakdown.param_storages(model)
    assert sum(counted.values()) == expected
    assert weight._data.untyped_storage().data_ptr() in counted  # the FP8 bytes, not the wrapper's empty storage
