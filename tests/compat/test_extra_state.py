"""TE's `_extra_state` format: te_fuser reads TE's bytes safely and writes bytes TE's code reads.

The TE side is built here from facts of TE's source: TE pickles a dict with its
recipe object and CPU float32 tensors (scale_fwd (3 per GEMM), amax_history_fwd,
scale_bwd (2 per GEMM), amax_history_bwd, extra_fp8_variables) and views the
bytes as uint8; its delayed-scaling update reduces amax_history (row 0 being
the amax recorded in the current step) with max / most_recent, computes
scale = (fp8_max / amax) / 2^margin (the old scale when amax is 0 or not
finite), then rolls the history up one row and zeroes row 0.
"""

import io
import os
import pickle
import pickletools

import pytest
import torch

import te_fuser
from te_fuser.module._extra_state import get_fp8_extra_state, set_fp8_extra_state
from te_fuser.module._te_pickle import UnsafeExtraStateError, safe_loads
from te_fuser.ops.basic.linear import BasicLinear
from te_fuser.recipe import DelayedScaling, Float8CurrentScaling

E4M3_MAX = 448.0


def te_update(history: torch.Tensor, scale: torch.Tensor, fp8_max: float, margin: int, algo: str) -> None:
    """TE's delayed-scaling update of one scaling group, in place (reference, float32 as TE)."""
    amax = history.max(dim=0).values if algo == "max" else history[0].clone()
    new = torch.full_like(amax, fp8_max).div(amax) / (2 ** margin)  # IEEE division, as TE's fused kernel
    new = torch.where((amax > 0) & torch.isfinite(amax), new, scale)
    new = torch.where(torch.isinf(new), torch.full_like(new, torch.finfo(torch.float32).max), new)
    scale.copy_(new)
    history.copy_(torch.roll(history, -1, 0))
    history[0].zero_()


def te_payload(fake_recipe, state: dict) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


def random_te_state(fake_recipe, generator, length: int, num_gemms: int = 1, margin: int = 0, algo: str = "max"):
    """A TE-format state with random amaxes (some zero) and the scales they imply."""
    def history(cols):
        h = torch.rand(length, cols, generator=generator) * 10
        h[torch.rand(length, cols, generator=generator) < 0.2] = 0.0  # steps where a tensor was all zero
        return h

    return {
        "recipe": fake_recipe.DelayedScaling(margin=margin, fp8_format=fake_recipe.Format.HYBRID,
                                             amax_history_len=length, amax_compute_algo=algo),
        "scale_fwd": torch.rand(3 * num_gemms, generator=generator) * 100 + 1,
        "amax_history_fwd": history(3 * num_gemms),
        "scale_bwd": torch.rand(2 * num_gemms, generator=generator) * 1000 + 1,
        "amax_history_bwd": history(2 * num_gemms),
        "extra_fp8_variables": {"fp8_checkpoint": True, "num_gemms": num_gemms, "fp8_max_fwd": 448,
                                "fp8_max_bwd": 57344},
    }


@pytest.mark.parametrize("algo,margin", [("max", 0), ("most_recent", 1)])
def test_te_state_loads_and_continues_with_te_scales(fake_te, generator, algo, margin):
    length = 4
    state = random_te_state(fake_te, generator, length, margin=margin, algo=algo)
    layer = te_fuser.Linear(32, 32, bias=False, device="cpu")
    layer.load_state_dict({"weight": layer.weight.detach().clone(), "_extra_state": te_payload(fake_te, state)})
    fwd = layer._ops[0]._fp8_states[0]
    assert torch.equal(fwd.scale, state["scale_fwd"][:2])
    assert layer._ops[0]._fp8_recipe == DelayedScaling(margin=margin, amax_history_len=length, amax_compute_algo=algo)

    te_history, te_scale = state["amax_history_fwd"].clone(), state["scale_fwd"].clone()
    recipe = layer._ops[0]._fp8_recipe
    # Inputs of very different sizes, so the window of the max (and its order) matters.
    for factor in (8.0, 0.5, 2.0, 0.125, 0.25, 4.0):
        x = torch.randn(16, 32, generator=generator) * factor
        with torch.no_grad(), te_fuser.fp8_autocast(fp8_recipe=recipe):
            layer(x)
        te_history[0, 0] = torch.maximum(te_history[0, 0], x.abs().max())
        te_history[0, 1] = torch.maximum(te_history[0, 1], layer.weight.detach().abs().max())
        te_update(te_history, te_scale, E4M3_MAX, margin, algo)
        assert torch.equal(fwd.scale, te_scale[:2]), (factor, fwd.scale, te_scale[:2])
        assert torch.equal(fwd.scale_inv, 1.0 / te_scale[:2])


def test_te_fuser_state_is_read_by_te_code_and_continues_identically(fake_te, generator):
    torch.manual_seed(generator.initial_seed())
    recipe = DelayedScaling(amax_history_len=3, margin=1)
    layer = te_fuser.Linear(32, 48, device="cpu")
    for factor in (1.0, 4.0, 0.5):
        with te_fuser.fp8_autocast(fp8_recipe=recipe):
            out = layer(torch.randn(16, 32, generator=generator) * factor)
        out.square().sum().backward()
    payload = layer.state_dict()["_extra_state"]
    assert payload.dtype == torch.uint8 and payload.dim() == 1

    # What TE's classifier looks for before it unpickles: TE's recipe global and its tensor keys.
    ops = list(pickletools.genops(payload.numpy().tobytes()))
    strings = [arg for op, arg, _ in ops if isinstance(arg, str)]
    assert "transformer_engine.common.recipe" in strings and "DelayedScaling" in strings

    # TE's set_extra_state: pickle.loads, then copy the tensors into its (3g,), (len, 3g), ... buffers.
    te_state = pickle.loads(payload.numpy().tobytes())
    te_recipe = te_state["recipe"]
    assert isinstance(te_recipe, fake_te.DelayedScaling) and te_recipe.fp8_format is fake_te.Format.HYBRID
    assert (te_recipe.margin, te_recipe.amax_history_len, te_recipe.amax_compute_algo) == (1, 3, "max")
    assert te_state["extra_fp8_variables"]["num_gemms"] == 1
    shapes = {k: tuple(te_state[k].shape) for k in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")}
    assert shapes == {"scale_fwd": (3,), "amax_history_fwd": (3, 3), "scale_bwd": (2,), "amax_history_bwd": (3, 2)}
    fwd, bwd = layer._ops[0]._fp8_states
    assert torch.equal(te_state["scale_fwd"][:2], fwd.scale) and torch.equal(te_state["scale_bwd"][:1], bwd.scale)

    # TE continues from that state as te_fuser does.
    te_history, te_scale = te_state["amax_history_fwd"].clone(), te_state["scale_fwd"].clone()
    for factor in (0.25, 8.0, 1.0, 0.5):
        x = torch.randn(16, 32, generator=generator) * factor
        with torch.no_grad(), te_fuser.fp8_autocast(fp8_recipe=recipe):
            layer(x)
        te_history[0, 0] = torch.maximum(te_history[0, 0], x.abs().max())
        te_history[0, 1] = torch.maximum(te_history[0, 1], layer.weight.detach().abs().max())
        te_update(te_history, te_scale, E4M3_MAX, 1, "max")
        assert torch.equal(fwd.scale, te_scale[:2]), (fwd.scale - te_scale[:2], fwd.amax_history, te_history)


def test_round_trip_continues_training_identically(generator):
    torch.manual_seed(generator.initial_seed())
    recipe = DelayedScaling(amax_history_len=4)
    layer = te_fuser.Linear(32, 32, device="cpu")

    def step(module, x):
        with te_fuser.fp8_autocast(fp8_recipe=recipe):
            out = module(x)
        out.square().sum().backward()
        return out.detach()

    for factor in (1.0, 3.0):
        step(layer, torch.randn(16, 32, generator=generator) * factor)
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    clone = te_fuser.Linear(32, 32, device="cpu")
    clone.load_state_dict(torch.load(buffer, weights_only=True))  # TE's format needs no unsafe load
    for factor in (0.5, 8.0, 1.0):
        x = torch.randn(16, 32, generator=generator) * factor
        assert torch.equal(step(layer, x), step(clone, x))
        for mine, theirs in zip(layer._ops[0]._fp8_states, clone._ops[0]._fp8_states):
            assert torch.equal(mine.scale, theirs.scale) and torch.equal(mine.amax_history, theirs.amax_history)


def test_two_gemm_layout_uses_te_slots():
    # A module of two GEMMs: GEMM k's input/weight scales go to TE's slots 3k / 3k+1, its grad_output to 2k.
    ops = [BasicLinear(32, 32), BasicLinear(32, 16)]
    seq = te_fuser.ops.Sequential(*ops)
    with te_fuser.fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=2)):
        out = seq(torch.randn(16, 32))
    out.sum().backward()
    with te_fuser.fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=2)):
        seq(torch.randn(16, 32) * 4)
    payload = get_fp8_extra_state(ops)
    decoded = safe_loads(payload.numpy().tobytes())
    assert decoded["extra_fp8_variables"]["num_gemms"] == 2
    for k, op in enumerate(ops):
        fwd, bwd = op._fp8_states
        assert torch.equal(decoded["scale_fwd"][3 * k:3 * k + 2], fwd.scale)
        assert decoded["scale_fwd"][3 * k + 2] == 1.0
        assert torch.equal(decoded["scale_bwd"][2 * k:2 * k + 1], bwd.scale)
    copies = [BasicLinear(32, 32), BasicLinear(32, 16)]
    set_fp8_extra_state(copies, payload, torch.device("cpu"))
    for op, copy in zip(ops, copies):
        for a, b in zip(op._fp8_states, copy._fp8_states):
            assert torch.equal(a.scale, b.scale) and torch.equal(a.amax_history, b.amax_history)
    with pytest.raises(ValueError, match="scale_fwd' must have shape \\(3,\\)"):
        set_fp8_extra_state(copies[:1], payload, torch.device("cpu"))


class _RunsCode:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_malicious_payloads_are_refused(fake_te, tmp_path, generator):
    layer = te_fuser.Linear(32, 32, device="cpu")
    marker = tmp_path / "pwned"
    evil = te_payload(fake_te, {"recipe": fake_te.DelayedScaling(), "scale_fwd": _RunsCode(marker)})
    with pytest.raises(UnsafeExtraStateError, match=r"references (posix|os)\.system"):
        layer.set_extra_state(evil)
    assert not marker.exists()

    # A callable recipe field is code too: refused, naming it.
    state = random_te_state(fake_te, generator, 2)
    state["recipe"].amax_compute_algo = te_update
    with pytest.raises(UnsafeExtraStateError, match="te_update"):
        layer.set_extra_state(te_payload(fake_te, state))

    # A tensor whose storage bytes hide a pickle that runs code: torch's weights_only reader refuses it.
    class EvilStorage:
        def __reduce__(self):
            return __import__("torch").storage._load_from_bytes, (pickle.dumps(_RunsCode(marker)),)

    with pytest.raises(Exception, match="Weights only load failed|weights_only|Unsupported"):
        layer.set_extra_state(te_payload(fake_te, {"scale_fwd": EvilStorage()}))
    assert not marker.exists()

    # TE 0.x's io.BytesIO format goes through torch.load(weights_only=True).
    buffer = io.BytesIO()
    torch.save({"scale_fwd": _RunsCode(marker)}, buffer)
    with pytest.raises(UnsafeExtraStateError, match="io.BytesIO"):
        layer.set_extra_state(buffer)
    assert not marker.exists()


def test_older_formats_load(fake_te, generator):
    layer = te_fuser.Linear(32, 32, device="cpu")
    # TE 1.x: no recipe (delayed scaling with TE's defaults), scale_inv saved too.
    state = random_te_state(fake_te, generator, 5)
    del state["recipe"]
    state["scale_inv_fwd"] = 1.0 / state["scale_fwd"]
    layer.set_extra_state(te_payload(fake_te, state))
    assert layer._ops[0]._fp8_recipe == DelayedScaling(amax_history_len=5)
    assert torch.equal(layer._ops[0]._fp8_states[1].scale, state["scale_bwd"][:1])
    # TE 0.x: torch.save into an io.BytesIO.
    buffer = io.BytesIO()
    torch.save(random_te_state(fake_te, generator, 2) | {"recipe": None}, buffer)
    layer.set_extra_state(buffer)
    assert layer._ops[0]._fp8_states[0].amax_history.shape == (2, 2)
    # te_fuser before TE's format: the op's dict.
    other = te_fuser.Linear(32, 32, device="cpu")
    with te_fuser.fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=3)):
        other(torch.randn(16, 32) * 3)
    old = other._ops[0].fp8_extra_state()
    layer.set_extra_state(old)
    assert torch.equal(layer._ops[0]._fp8_states[0].scale, other._ops[0]._fp8_states[0].scale)
    layer.set_extra_state({"ops": [old]})
    with pytest.raises(ValueError, match="2 ops, this module has 1"):
        layer.set_extra_state({"ops": [old, old]})


def test_no_state_and_stateless_recipes_write_an_empty_tensor():
    layer = te_fuser.Linear(32, 32, device="cpu")
    assert layer.get_extra_state().numel() == 0 and layer.get_extra_state().dtype == torch.uint8
    with te_fuser.fp8_autocast(fp8_recipe=Float8CurrentScaling()):
        layer(torch.randn(16, 32))
    assert layer.get_extra_state().numel() == 0
    layer.set_extra_state(torch.empty(0, dtype=torch.uint8))
    with pytest.raises(ValueError, match="not TE's pickled FP8 state"):
        layer.set_extra_state(torch.tensor([1, 2, 3], dtype=torch.uint8))
    with pytest.raises(TypeError, match="_extra_state must be"):
        layer.set_extra_state([1, 2])
