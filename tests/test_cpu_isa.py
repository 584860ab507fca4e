"""The CPU tier dispatch (te_fuser.kernels.cpu): detection against the kernel's own view of the CPU,
the cap (set_isa, the isa() context manager, TE_FUSER_CPU_ISA) and its errors."""

import os
import platform
import subprocess
import sys

import pytest
import torch

from te_fuser.kernels import cpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _linux_cpu_flags():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def _expected_tier(flags):
    """The tier /proc/cpuinfo implies (Linux lists a flag only when the kernel enables its state)."""
    tier = "portable"
    if {"avx2", "fma", "f16c"} <= flags:
        tier = "avx2"
        if {"avx512f", "avx512bw", "avx512vl"} <= flags:
            tier = "avx512"
            if "avx512_bf16" in flags:
                tier = "avx512_bf16"
                if {"amx_tile", "amx_bf16"} <= flags:
                    tier = "amx"
    return tier


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64",
                    reason="/proc/cpuinfo flags are the reference on x86-64 Linux")
def test_detection_matches_proc_cpuinfo():
    assert cpu.detected_isa() == _expected_tier(_linux_cpu_flags())


def test_available_lists_every_tier_up_to_the_detected_one():
    available = cpu.available_isa()
    assert available == list(cpu.TIERS[: cpu.TIERS.index(cpu.detected_isa()) + 1])
    assert available[0] == "portable"


def test_cap_lowers_the_tier_and_context_manager_restores_it():
    assert cpu.get_cap() is None
    assert cpu.current_isa() == cpu.detected_isa()
    for name in cpu.available_isa():
        with cpu.isa(name):
            assert cpu.current_isa() == name and cpu.get_cap() == name
            # current_isa() answers from Python; the kernels read the C side's tier
            assert cpu.TIERS[torch.ops.te_fuser.cpu_isa_current()] == name
            with cpu.isa("portable"):
                assert cpu.current_isa() == "portable"
            assert cpu.current_isa() == name
        assert cpu.get_cap() is None and cpu.current_isa() == cpu.detected_isa()


def test_context_manager_restores_on_error():
    with pytest.raises(RuntimeError, match="inside"):
        with cpu.isa("portable"):
            raise RuntimeError("inside")
    assert cpu.get_cap() is None


def test_bad_names_raise():
    with pytest.raises(ValueError, match="isa must be one of"):
        cpu.set_isa("sse9")
    unsupported = cpu.TIERS[len(cpu.available_isa()):]
    for name in unsupported:
        with pytest.raises(ValueError, match="not supported by this CPU"):
            cpu.set_isa(name)
    assert cpu.get_cap() is None


def test_raw_op_rejects_out_of_range_caps():
    with pytest.raises(RuntimeError, match="cap must lie in"):
        torch.ops.te_fuser.cpu_isa_set_cap(len(cpu.TIERS))
    with pytest.raises(RuntimeError, match="cap must lie in"):
        torch.ops.te_fuser.cpu_isa_set_cap(-2)


def _run_with_env(value):
    env = dict(os.environ, TE_FUSER_CPU_ISA=value, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = "import te_fuser; from te_fuser.kernels import cpu; print(cpu.current_isa(), cpu.get_cap())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)


def test_environment_variable_sets_the_cap_at_import():
    done = _run_with_env("portable")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["portable", "portable"]


def test_environment_variable_with_a_bad_name_fails_the_import():
    done = _run_with_env("sse9")
    assert done.returncode != 0
    assert "TE_FUSER_CPU_ISA='sse9'" in done.stderr
