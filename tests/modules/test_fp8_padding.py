"""Fp8Padding / Fp8Unpadding: each grouped-GEMM row split padded with zero rows to the quantization
alignment and back, against an independent row-by-row reference, with autograd; the alignment taken
from the FP8 recipe (get_align_size_for_quantization); nothing kept on the graph."""

import pytest
import torch

import te_fuser
from te_fuser.module import fp8_padding
from te_fuser.quantization import get_align_size_for_quantization
from te_fuser.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                             NVFP4BlockScaling)

from _fuser_ctx_walk import reachable_tensors


def reference_padded(x: torch.Tensor, splits, align: int) -> torch.Tensor:
    """Row by row: group i's rows, then zero rows up to the next multiple of align."""
    rows = []
    start = 0
    for m in splits:
        rows += [x[start + r] for r in range(m)]
        rows += [torch.zeros_like(x[0])] * ((align - m % align) % align)
        start += m
    return torch.stack(rows) if rows else x[:0]


def edge_input(rows: int, features: int) -> torch.Tensor:
    x = torch.randn(rows, features, dtype=torch.float64)
    if rows:
        x[0, 0], x[-1, -1] = float("inf"), -0.0
    return x


@pytest.mark.parametrize("splits,align", [([5, 16, 0, 1], 16), ([3, 3, 3], 8), ([7, 2], 3), ([0, 33], 32),
                                          ([1], 128)])
def test_pad_and_unpad_against_row_reference(splits, align):
    x = edge_input(sum(splits), 6)
    padded, padded_splits = te_fuser.Fp8Padding(len(splits), align)(x, splits)
    expected = reference_padded(x, splits, align)
    assert padded_splits == [-(-m // align) * align for m in splits]
    assert padded.shape == expected.shape and sum(padded_splits) == expected.shape[0]
    assert torch.equal(padded, expected)
    assert torch.equal(te_fuser.Fp8Unpadding(len(splits), align)(padded, splits), x)


def test_leading_dims_are_rows():
    x = torch.randn(3, 4, 5)
    padded, _ = te_fuser.Fp8Padding(2, 4)(x, [5, 7])
    assert torch.equal(padded, reference_padded(x.reshape(12, 5), [5, 7], 4))


def test_gradients_against_float64_gradcheck():
    splits = [3, 0, 5]
    x = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
    pad, unpad = te_fuser.Fp8Padding(3, 4), te_fuser.Fp8Unpadding(3, 4)
    assert torch.autograd.gradcheck(lambda t: pad(t, splits)[0], (x,))
    y = torch.randn(12, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: unpad(t, splits), (y,))
    # The padding rows' gradients are dropped: the input gradient is the matching rows of dy.
    dy = torch.randn(12, 3, dtype=torch.float64)
    pad(x, splits)[0].backward(dy)
    assert torch.equal(x.grad, torch.cat([dy[0:3], dy[4:9]]))


def test_aligned_splits_pass_the_input_through():
    x = torch.randn(2, 16, 4)
    padded, splits = te_fuser.Fp8Padding(2)(x, [16, 16])
    assert padded is x and splits == [16, 16]
    assert te_fuser.Fp8Unpadding(2)(x, [16, 16]) is x


@pytest.mark.parametrize("recipe,align", [(DelayedScaling(), 16), (Float8CurrentScaling(), 16),
                                          (Float8BlockScaling(), 16), (MXFP8BlockScaling(), 32),
                                          (NVFP4BlockScaling(), 128)])
def test_align_size_follows_the_recipe(recipe, align):
    assert get_align_size_for_quantization(recipe) == align
    pad, unpad = te_fuser.Fp8Padding(1), te_fuser.Fp8Unpadding(1)
    with te_fuser.fp8_autocast(enabled=True, fp8_recipe=recipe):
        padded, splits = pad(torch.randn(1, 2), [1])
        unpad(padded, [1])
    assert pad.align_size == unpad.align_size == align and splits == [align]


def test_default_align_size_outside_autocast_is_the_default_recipe():
    pad = te_fuser.Fp8Padding(1)
    pad(torch.randn(3, 2), [3])
    assert pad.align_size == 16


def test_bad_arguments_name_them():
    with pytest.raises(ValueError, match="num_gemms"):
        te_fuser.Fp8Padding(0)
    with pytest.raises(ValueError, match="align_size"):
        te_fuser.Fp8Unpadding(2, align_size=True)
    with pytest.raises(ValueError, match="align_size"):
        te_fuser.Fp8Padding(2, align_size=-16)
    pad, unpad = te_fuser.Fp8Padding(2, 4), te_fuser.Fp8Unpadding(2, 4)
    with pytest.raises(ValueError, match="m_splits has 3 entries, expected num_gemms = 2"):
        pad(torch.randn(6, 2), [1, 2, 3])
    with pytest.raises(ValueError, match="m_splits must be non-negative"):
        pad(torch.randn(6, 2), [8, -2])
    with pytest.raises(TypeError, match="m_splits"):
        pad(torch.randn(6, 2), ["a", 2])
    with pytest.raises(ValueError, match="inp has 6 rows .* m_splits sums to 5"):
        pad(torch.randn(6, 2), [2, 3])
    with pytest.raises(ValueError, match="inp has 6 rows .* padded m_splits sums to 8"):
        unpad(torch.randn(6, 2), [2, 3])
    with pytest.raises(TypeError, match="recipe"):
        get_align_size_for_quantization("mxfp8")


_PAD_ROWS = fp8_padding._PadRows


class _PadKeepingInput(_PAD_ROWS):
    """Bug-on control: a padding that keeps its input on the ctx."""

    @staticmethod
    def forward(ctx, x, splits, padded):
        ctx.kept = x
        return _PAD_ROWS.forward(ctx, x, splits, padded)


@pytest.mark.parametrize("function", [_PAD_ROWS, _PadKeepingInput])
def test_graph_holds_no_tensor(function, monkeypatch):
    """Padding and unpadding save no tensor (the splits are ints): their nodes reach nothing, before backward
    and after. The control keeping its input on the ctx is found by the same walk."""
    monkeypatch.setattr(fp8_padding, "_PadRows", function)
    x = torch.randn(5, 4, requires_grad=True)
    padded, _ = te_fuser.Fp8Padding(1, 8)(x.clone(), [5])
    out = te_fuser.Fp8Unpadding(1, 8)(padded, [5])
    found_before = reachable_tensors(out, allowed=set())
    out.sum().backward()
    found_after = reachable_tensors(out, allowed=set())
    if function is _PadKeepingInput:
        assert any(".kept" in path for path, _ in found_before) and any(".kept" in p for p, _ in found_after)
    else:
        assert found_before == [] and found_after == []
