"""megatron-core 0.16.1, unchanged from PyPI, trains a GPT built from its TransformerEngine layer spec
on te_fuser (through the `transformer_engine` alias), on CPU with gloo, and matches the same model
built from Megatron's local (pure-torch) spec with the same weights.

CI installs Megatron with `python3 -m pip install --no-deps megatron-core==0.16.1`. The harness
(_megatron_gpt.py) patches only Megatron's own CUDA assumptions, and only for Megatron's callers.
"""

import importlib.metadata
import re

import pytest

MEGATRON_VERSION = "0.16.1"
try:
    _installed = importlib.metadata.version("megatron-core")
except importlib.metadata.PackageNotFoundError:
    _installed = None
if _installed is None:
    pytest.skip(f"megatron-core is not installed (CI runs: python3 -m pip install --no-deps "
                f"megatron-core=={MEGATRON_VERSION})", allow_module_level=True)
if _installed != MEGATRON_VERSION:
    pytest.skip(f"these tests follow megatron-core {MEGATRON_VERSION}, found {_installed}",
                allow_module_level=True)

import _megatron_gpt as harness  # noqa: E402  (after the skip: it is only useful with Megatron)

# One entry per training run; each also trains the local-spec reference on the same weights.
ONE_RANK = {
    "fp32": dict(dtype="fp32"),
    "bf16": dict(dtype="bf16"),
    "rmsnorm": dict(dtype="fp32", normalization="RMSNorm"),
    # Layers built on Megatron's current device (the CPU here) and initialized under the RNG tracker.
    "device_init": dict(dtype="fp32", cpu_init=False),
    "fp8_delayed": dict(dtype="fp32", fp8="delayed"),
    "fp8_tensorwise": dict(dtype="bf16", fp8="tensorwise"),
    "recompute_fp32": dict(dtype="fp32", recompute=True),
    "recompute_fp8_delayed": dict(dtype="fp32", fp8="delayed", recompute=True),
    "recompute_fp8_tensorwise": dict(dtype="bf16", fp8="tensorwise", recompute=True),
    # Dropout: the recompute must replay the forward's RNG states (Megatron's own checkpoint
    # without FP8, te_fuser.distributed.checkpoint with it).
    "dropout": dict(dtype="fp32", hidden_dropout=0.2),
    "recompute_dropout": dict(dtype="fp32", hidden_dropout=0.2, recompute=True),
    "fp8_delayed_dropout": dict(dtype="fp32", fp8="delayed", hidden_dropout=0.2, reference="none"),
    "recompute_fp8_delayed_dropout": dict(dtype="fp32", fp8="delayed", hidden_dropout=0.2, recompute=True,
                                          reference="none"),
    # te_fuser's release switches off: the graph walk must see what is then left behind.
    "te_cross_entropy": dict(dtype="fp32", te_cross_entropy=True),
    # Megatron's --fp8-recipe mxfp8 with --fp8-format e4m3 (TE's advice for MX), and --fp8-recipe blockwise
    # (Float8BlockScaling; this model's hidden size of 64 is a partial 128-block).
    "fp8_mxfp8": dict(dtype="bf16", fp8="mxfp8", fp8_format="e4m3"),
    "fp8_blockwise": dict(dtype="bf16", fp8="blockwise", fp8_format="e4m3"),
    # Megatron's --fp4-format e2m1 --fp4-recipe nvfp4 (its get_fp4_recipe: TE's NVFP4BlockScaling).
    "fp4_nvfp4": dict(dtype="bf16", fp4="nvfp4"),
    "bug_on_fuser": dict(dtype="fp32", bug_on="fuser", reference="none"),
    "bug_on_checkpoint": dict(dtype="fp32", fp8="delayed", recompute=True, bug_on="checkpoint", reference="none"),
}
TWO_RANKS = {
    "fp32": dict(dtype="fp32"),
    "fp8_delayed": dict(dtype="fp32", fp8="delayed"),
    "fp8_tensorwise": dict(dtype="bf16", fp8="tensorwise"),
    "recompute_fp8_delayed": dict(dtype="fp32", fp8="delayed", recompute=True),
    "fp8_mxfp8": dict(dtype="bf16", fp8="mxfp8", fp8_format="e4m3"),
    "fp8_blockwise": dict(dtype="bf16", fp8="blockwise", fp8_format="e4m3"),
    "fp4_nvfp4": dict(dtype="bf16", fp4="nvfp4"),
    # The vocabulary split over the two ranks: TE's parallel_cross_entropy on sharded logits.
    "te_cross_entropy": dict(dtype="fp32", te_cross_entropy=True),
    # Each rank keeps only its chunk of the layer's input until backward (te_fuser's checkpoint).
    "recompute_fp8_delayed_distributed": dict(dtype="fp32", fp8="delayed", recompute=True,
                                              distribute_saved_activations=True),
}

# Relative loss tolerances against the local spec, per step. fp32: the two specs differ only in the
# order of floating-point sums (fused norm, flash-style attention); seen: ~1e-7. bf16: 8-bit mantissa;
# seen: ~3e-4. FP8 (HYBRID: E4M3 forward, E5M2 gradients) against the unquantized run; seen: ~4e-3.
# NVFP4 (E2M1 values, one mantissa bit) against the unquantized run; seen: 1.3e-2 (one rank), 2.6e-2 (TP=2).
TOL = {"fp32": 1e-6, "bf16": 2e-3, "fp8": 1e-2, "fp4": 5e-2}
# Megatron's own (non-FP8) recompute keeps its RNG states on its ctx after backward
# (tensor_parallel/random.py CheckpointFunction: ctx.rng_states); that ctx is Megatron's, not te_fuser's.
MEGATRON_OWN_CTX = "<CheckpointFunctionBackward>.rng_states"


def _ok(result):
    if "error" in result:
        pytest.fail(result["error"], pytrace=False)
    return result


@pytest.fixture(scope="module")
def one_rank():
    return harness.run_cases(ONE_RANK, world=1)


@pytest.fixture(scope="module")
def two_ranks():
    return harness.run_cases(TWO_RANKS, world=2)


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _assert_graph_clean(result, name):
    left = [entry for entry in result["leftovers"] if MEGATRON_OWN_CTX not in entry[0]]
    assert not left, f"{name}: tensors still reachable after backward:\n" + "\n".join(map(str, left))


@pytest.mark.parametrize("name, norm", [("fp32", "LayerNorm"), ("rmsnorm", "RMSNorm")])
def test_te_spec_is_built_from_te_fuser(one_rank, name, norm):
    classes = _ok(one_rank[name][0])["te_fuser_classes"]
    for cls in ("Linear", "LayerNormLinear", "DotProductAttention", norm):
        assert any(c.endswith("." + cls) for c in classes), (cls, classes)


@pytest.mark.parametrize("name", ["fp32", "bf16", "rmsnorm", "device_init", "recompute_fp32", "dropout",
                                  "recompute_dropout"])
def test_losses_match_local_spec(one_rank, name):
    result = _ok(one_rank[name][0])
    tol = TOL[ONE_RANK[name]["dtype"]]
    assert _rel(result["te"], result["local"]) < tol, (result["te"], result["local"])
    assert result["te"][-1] < result["te"][0]  # it trains
    _assert_graph_clean(result, name)


def test_te_cross_entropy_matches_megatrons_loss(one_rank, two_ranks):
    """Megatron's cross_entropy_fusion_impl="te" runs te_fuser's parallel_cross_entropy (whole vocabulary on
    one rank, half of it on each of two) and trains as Megatron's own vocab-parallel cross-entropy does."""
    for results in (one_rank["te_cross_entropy"], two_ranks["te_cross_entropy"]):
        for result in map(_ok, results):
            assert result["te_cross_entropy_calls"] == len(result["te"]) * harness.MICROBATCHES
            assert _rel(result["te"], result["local"]) < TOL["fp32"], (result["te"], result["local"])
            _assert_graph_clean(result, "te_cross_entropy")
    assert _ok(one_rank["fp32"][0])["te_cross_entropy_calls"] == 0  # Megatron's default: its own loss


@pytest.mark.parametrize("plain", ["fp32", "dropout", "fp8_delayed_dropout"])
def test_recompute_is_exact(one_rank, plain):
    """Full recompute gives bit-identical losses to the run that keeps its activations, dropout
    masks (replayed RNG states) and FP8 scales included."""
    assert _ok(one_rank[f"recompute_{plain}"][0])["te"] == _ok(one_rank[plain][0])["te"]
    if "dropout" in plain:  # the masks matter: without dropout the losses are others
        without = _ok(one_rank[plain.replace("_dropout", "").replace("dropout", "fp32")][0])["te"]
        assert all(abs(x - y) > 1e-4 for x, y in zip(_ok(one_rank[plain][0])["te"], without))


@pytest.mark.parametrize("name", ["fp8_delayed", "fp8_tensorwise", "recompute_fp8_delayed",
                                  "recompute_fp8_tensorwise"])
def test_fp8_losses_near_local_spec(one_rank, name):
    result = _ok(one_rank[name][0])
    assert _rel(result["te"], result["local"]) < TOL["fp8"], (result["te"], result["local"])
    # FP8 really ran: the losses are not those of the unquantized model.
    assert all(abs(x - y) > 1e-6 for x, y in zip(result["te"], result["local"])), (result["te"], result["local"])
    # Megatron sets save_original_input on the attention projections under current scaling.
    assert result["proj_save_original_input"] == [name.endswith("tensorwise")] * harness.LAYERS
    _assert_graph_clean(result, name)


@pytest.mark.parametrize("name", ["fp8_mxfp8", "fp8_blockwise", "fp4_nvfp4"])
def test_block_scaled_recipe_trains_near_local_spec(one_rank, two_ranks, name):
    """Megatron's --fp8-recipe mxfp8 / blockwise (its get_fp8_recipe: TE's MXFP8BlockScaling /
    Float8BlockScaling) and --fp4-recipe nvfp4 (its get_fp4_recipe: NVFP4BlockScaling) train the TE-spec GPT
    on te_fuser's block-scaled tensors, on one rank and with TP=2, near the unquantized local spec, with a
    clean graph."""
    tol = TOL["fp4" if name.startswith("fp4") else "fp8"]
    for result in map(_ok, one_rank[name] + two_ranks[name]):
        assert _rel(result["te"], result["local"]) < tol, (result["te"], result["local"])
        assert all(abs(x - y) > 1e-6 for x, y in zip(result["te"], result["local"]))  # the recipe really ran
        assert result["te"][-1] < result["te"][0]
        _assert_graph_clean(result, name)


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_recompute_matches_fp8(one_rank, recipe):
    """Recompute under FP8 reuses the forward's scales: the same losses as without recompute."""
    plain = _ok(one_rank[f"fp8_{recipe}"][0])["te"]
    recomputed = _ok(one_rank[f"recompute_fp8_{recipe}"][0])["te"]
    assert recomputed == plain


@pytest.mark.parametrize("switch, node", [("fuser", "_FuserFunctionBackward"),
                                          ("checkpoint", "_ReentrantCheckpointBackward")])
def test_walk_catches_ctx_left_on_bug(one_rank, switch, node):
    """Control: with a te_fuser release switch off, the same walk finds what that node keeps."""
    leftovers = _ok(one_rank[f"bug_on_{switch}"][0])["leftovers"]
    holders = {re.findall(r"<(\w+)>", path)[-1] for path, _, _ in leftovers}
    assert node in holders, leftovers


@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_tensor_parallel_two_ranks(two_ranks, name):
    ranks = [_ok(r) for r in two_ranks[name]]
    assert ranks[0]["te"] == ranks[1]["te"] and ranks[0]["local"] == ranks[1]["local"]
    result = ranks[0]
    fp8, fp4 = TWO_RANKS[name].get("fp8"), TWO_RANKS[name].get("fp4")
    tol = TOL["fp4"] if fp4 else TOL["fp8"] if fp8 else TOL[TWO_RANKS[name]["dtype"]]
    assert _rel(result["te"], result["local"]) < tol, (result["te"], result["local"])
    if fp8 or fp4:
        assert all(abs(x - y) > 1e-6 for x, y in zip(result["te"], result["local"]))
    for r in ranks:
        _assert_graph_clean(r, name)


@pytest.mark.parametrize("name", ["recompute_fp8_delayed", "recompute_fp8_delayed_distributed"])
def test_tensor_parallel_recompute_is_exact(two_ranks, name):
    assert _ok(two_ranks[name][0])["te"] == _ok(two_ranks["fp8_delayed"][0])["te"]


def test_tensor_parallel_matches_one_rank(one_rank, two_ranks):
    """Megatron's CPU initialization splits the same full weights: TP=2 trains the same model."""
    one, two = _ok(one_rank["fp32"][0]), _ok(two_ranks["fp32"][0])
    assert _rel(two["local"], one["local"]) < TOL["fp32"]
    assert _rel(two["te"], one["te"]) < TOL["fp32"]
