"""megatron-core 0.16.1's delay_wgrad_compute on te_fuser (through the `transformer_engine` alias): its MLP
from the TE spec, with the flag on its config, gives after backward + MLP.backward_dw() what it gives
without the delay, bitwise, with and without gradient_accumulation_fusion (main_grad)."""

import importlib.metadata

import pytest

MEGATRON_VERSION = "0.16.1"
try:
    _installed = importlib.metadata.version("megatron-core")
except importlib.metadata.PackageNotFoundError:
    _installed = None
if _installed != MEGATRON_VERSION:
    pytest.skip(f"these tests follow megatron-core {MEGATRON_VERSION} (CI: python3 -m pip install --no-deps "
                f"megatron-core=={MEGATRON_VERSION}), found {_installed}", allow_module_level=True)

import _megatron_delay_wgrad as harness  # noqa: E402
from _megatron_gpt import free_port  # noqa: E402


def test_megatron_mlp_backward_dw_matches_the_undelayed_mlp():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=harness.worker, args=(free_port(), results))
    proc.start()
    try:
        out = results.get(timeout=600)
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    assert "error" not in out, out.get("error")
    for fusion, result in out.items():
        assert result["te_bases"] == ["te_fuser.module.layernorm_linear.LayerNormLinear",
                                      "te_fuser.module.linear.Linear"], result["te_bases"]
        assert all(result["dx_equal"]), (fusion, result)
        assert result["changed_by_backward"] == [], (fusion, result)
        assert result["differ"] == [], (fusion, result)
