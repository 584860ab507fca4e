"""ops.Sequential as a list of modules (torch.nn.Sequential's and TE's): indexing, slices that are
Sequentials, and replaced or deleted modules that the next forward runs (its fused groups rebuilt).

Reference: the same modules applied one after another in float64."""

import torch

import te_fuser.ops as ops


def test_indexing_and_slices():
    modules = [ops.Identity(), ops.ConstantScale(2.0), torch.nn.Identity(), ops.Identity()]
    model = ops.Sequential(*modules)
    assert len(model) == 4 and list(model) == modules
    assert all(model[i] is m and model[i - 4] is m for i, m in enumerate(modules))
    subset = model[1:-1]
    assert isinstance(subset, ops.Sequential) and list(subset) == modules[1:-1]


def test_replaced_and_deleted_modules_run(generator):
    x = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    model = ops.Sequential(ops.ConstantScale(2.0), ops.ConstantScale(3.0), torch.nn.Tanh(), ops.ConstantScale(5.0))
    torch.testing.assert_close(model(x), torch.tanh(x * 6.0) * 5.0)
    model[1] = ops.ConstantScale(-0.5)
    torch.testing.assert_close(model(x), torch.tanh(x * -1.0) * 5.0)
    del model[2]  # the two scales around the tanh now fuse into one chain
    assert [type(m).__name__ for m in model] == ["ConstantScale", "ConstantScale", "ConstantScale"]
    assert [name for name, _ in model.named_children()] == ["0", "1", "2"]
    torch.testing.assert_close(model(x), x * -5.0)
    torch.testing.assert_close(model[1:](x), x * -2.5)


def test_list_methods(generator):
    x = torch.randn(3, 4, generator=generator, dtype=torch.float64)
    scales = [ops.ConstantScale(float(k)) for k in (2, 3, 5, 7)]
    model = ops.Sequential(scales[0]).extend([torch.nn.Tanh(), scales[1]])
    torch.testing.assert_close(model(x), torch.tanh(x * 2) * 3)
    model.insert(1, scales[2])
    assert list(model) == [scales[0], scales[2], model[2], scales[1]]
    torch.testing.assert_close(model(x), torch.tanh(x * 10) * 3)
    assert model.pop(1) is scales[2] and len(model) == 3
    added = model + ops.Sequential(scales[3])
    assert isinstance(added, ops.Sequential) and len(added) == 4 and len(model) == 3
    torch.testing.assert_close(added(x), torch.tanh(x * 2) * 21)
    model += [scales[3]]
    assert list(model) == list(added)
    assert [name for name, _ in model.named_children()] == ["0", "1", "2", "3"]
