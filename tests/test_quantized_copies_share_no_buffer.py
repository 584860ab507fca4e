"""A copy never aliases the original's buffers: clone, copy.deepcopy and a torch.save / torch.load round
trip through BytesIO, of every quantized tensor kind (_quantized_kinds.KINDS), whole and of its parts.

Two checks each. No storage the copy reaches overlaps one the original reaches: every buffer, found by a
generic walk of their attributes (tests/_reachable.py) and compared by address range, not only _data's
address. And behaviourally: requantizing the original in place (copy_ of new values; copy_ of a tensor
with another scale, as loading a checkpoint does) leaves the copy holding exactly what it held, and
requantizing the copy leaves the original. A clone shares the original's quantizer (the recipe's scaling
state, as TE's clone does); a deepcopy and a loaded copy share nothing.

Planted in te_fuser/float8_tensor.py and seen failing (then reverted):
- clone shares the scale: `scale_inv=t._scale_inv.clone()` dropped from _clone's call of _like. Every
  clone case fails both checks (original._scale_inv and copy._scale_inv share a storage; the copy's
  values and scale_inv change with the original's).
- deepcopy shares the scale: `self._scale_inv.clone()` -> `self._scale_inv` in __deepcopy__. Every
  deepcopy case fails both checks.
- deepcopy shares the quantizer: `copy.deepcopy(self._quantizer, memo)` -> `self._quantizer` in
  __deepcopy__. The deepcopy cases of the FP8 weights (the kinds with a quantizer) fail both checks:
  original._quantizer.scale/amax are the copy's, and the copy's quantizer.amax follows the
  original's requantization.
"""

import copy
import io

import pytest
import torch

from te_fuser.tensor import Quantizer

from _quantized_kinds import KINDS, random_values
from _reachable import shared_storages

ROWS, COLS = 12, 16


def _saved_and_loaded(t):
    buffer = io.BytesIO()
    torch.save(t, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


COPIES = {"clone": torch.Tensor.clone, "deepcopy": copy.deepcopy, "torch.save/load": _saved_and_loaded}
PARTS = {"whole": lambda t: t, "rows": lambda t: t[2:5], "split": lambda t: t.split(4)[1],
         "columns": lambda t: t[:, 3:9]}


def _state(kind, t, how):
    """What a copy made by `how` owns: for a clone, all but the quantizer it shares with the original."""
    return {key: value for key, value in kind.observe(t).items()
            if not (how == "clone" and key.startswith("quantizer."))}


def _requantize(kind, t, generator):
    """Two in-place requantizations: new values (current scaling picks a new scale), then a tensor of
    another scale (bytes and scale copied as they are)."""
    with torch.no_grad():
        for write in (lambda: t.copy_(random_values(t.shape, generator) * 4),
                      lambda: t.copy_(kind.rescaled(t, random_values(t.shape, generator)))):
            before = kind.observe(t)["values"]
            write()
            assert not torch.equal(kind.observe(t)["values"], before), "the requantization must change t"


def _unchanged(before, after, what):
    assert before.keys() == after.keys()
    changed = [key for key in before if not torch.equal(before[key], after[key])]
    assert not changed, f"{what} changed: {changed}"


@pytest.mark.parametrize("part", list(PARTS))
@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_a_copy_shares_no_buffer_with_its_original(kind, how, part, generator):
    whole = kind.make(random_values((ROWS, COLS), generator))
    with torch.no_grad():
        original = PARTS[part](whole)
    duplicate = COPIES[how](original)
    assert type(duplicate) is type(original) and duplicate.shape == original.shape
    assert torch.equal(duplicate.dequantize(), original.dequantize())

    shared = shared_storages((whole, original), duplicate, skip=(Quantizer,) if how == "clone" else ())
    assert not shared, f"{how} of {part} shares storages: {shared}"

    held = _state(kind, duplicate, how)
    _requantize(kind, whole, generator)
    _unchanged(held, _state(kind, duplicate, how), f"the {how} after the original was requantized")

    held = _state(kind, whole, how)
    _requantize(kind, duplicate, generator)
    _unchanged(held, _state(kind, whole, how), f"the original after its {how} was requantized")
