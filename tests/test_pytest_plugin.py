"""The memory pytest plugin, run on small probe test files through pytester."""

import json
import os

import pytest

# Imported here, before pytester's in-process runs snapshot sys.modules: torch cannot be
# imported a second time in one process once a run has dropped it from sys.modules.
import te_fuser.testing.pytest_plugin  # noqa: F401
import torch  # noqa: F401

pytest_plugins = ["pytester"]

# Unrelated third-party plugins are kept out of the inner runs: pytester drops what an inner
# run imported, so each run would import them again.
PLUGIN = ("-p", "te_fuser.testing.pytest_plugin", "-p", "no:hypothesispytest", "-p", "no:benchmark")
# Where this run imports te_fuser from: the source tree, or an installed wheel (.ci/run's ABI matrix).
TE_FUSER_PARENT = os.path.dirname(os.path.dirname(te_fuser.__file__))

# 4 MiB float32 buffers; device="cpu" so that the probes behave the same on GPU machines
PROBES = """
import pytest
import torch

kept = []

@pytest.mark.limit_peak_memory("1 MiB", device="cpu")
def test_peak_over():
    x = torch.ones(1 << 20)
    del x

@pytest.mark.limit_peak_memory("8 MiB", device="cpu")
def test_peak_under():
    x = torch.ones(1 << 20)
    del x

@pytest.mark.limit_peak_memory(5 * 2**20, device="cpu")
def test_peak_int_bytes_under():
    x = torch.ones(1 << 20)
    del x

@pytest.mark.limit_retained_memory("1 MiB", device="cpu")
def test_leaks():
    kept.append(torch.ones(1 << 20))

@pytest.mark.limit_retained_memory("1 MiB", device="cpu")
def test_frees():
    x = torch.ones(1 << 20)
    del x

@pytest.mark.limit_peak_memory("1 KiB")
def test_default_device_over():
    x = torch.ones(1 << 20)
    del x
"""


def test_limits_pass_and_fail(pytester):
    pytester.makepyfile(test_probe=PROBES)
    result = pytester.runpytest(*PLUGIN, "--strict-markers")
    result.assert_outcomes(passed=3, failed=3)
    outcome = {r.nodeid.split("::")[1]: r.outcome for r in result.reprec.getreports("pytest_runtest_logreport") if r.when == "call"}
    assert outcome == {
        "test_peak_over": "failed",
        "test_peak_under": "passed",
        "test_peak_int_bytes_under": "passed",
        "test_leaks": "failed",
        "test_frees": "passed",
        "test_default_device_over": "failed",
    }
    result.stdout.fnmatch_lines(["*limit_peak_memory: cpu peak 4.0 MiB (4194304 bytes) exceeds the limit 1.0 MiB*"])
    result.stdout.fnmatch_lines(["*limit_retained_memory: cpu retained 4.0 MiB*exceeds the limit 1.0 MiB*"])


def test_markers_registered_for_strict_markers(pytester):
    pytester.makepyfile(test_probe=PROBES)
    result = pytester.runpytest(*PLUGIN, "--markers")
    result.stdout.fnmatch_lines(["*limit_peak_memory(size, device=None)*", "*limit_retained_memory(size, device=None)*"])


@pytest.mark.parametrize(
    "marker, message",
    [
        ('limit_peak_memory("64 MeB")', "*bad limit_peak_memory marker*64 MeB*expected @pytest.mark.limit_peak_memory(size*"),
        ('limit_retained_memory("-1 MiB")', "*bad limit_retained_memory marker*"),
        ("limit_peak_memory()", "*bad limit_peak_memory marker (missing size)*"),
        ('limit_peak_memory("1 MiB", device="tpu")', "*bad limit_peak_memory marker (unknown device 'tpu')*"),
    ],
)
def test_bad_marker_is_a_usage_error(pytester, marker, message):
    pytester.makepyfile(
        test_probe=f"""
        import pytest

        @pytest.mark.{marker}
        def test_x():
            pass
        """
    )
    result = pytester.runpytest(*PLUGIN)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_bad_tolerance_and_missing_baseline_are_usage_errors(pytester):
    pytester.makepyfile(test_probe="def test_x():\n    pass\n")
    pytester.runpytest(*PLUGIN, "--memory-baseline=b.json", "--memory-baseline-update").assert_outcomes(passed=1)
    pytester.runpytest(*PLUGIN, "--memory-baseline=b.json", "--memory-tolerance=5%").assert_outcomes(passed=1)
    for bad in ("lots", "nan", "inf", "-5%"):  # NaN would turn the baseline comparison off
        result = pytester.runpytest(*PLUGIN, "--memory-baseline=b.json", f"--memory-tolerance={bad}")
        assert result.ret == pytest.ExitCode.USAGE_ERROR, bad
    result = pytester.runpytest(*PLUGIN, "--memory-baseline=missing.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*missing.json does not exist*--memory-baseline-update*"])


def test_memory_report_lists_every_test(pytester):
    pytester.makepyfile(
        test_probe="""
        import torch

        def test_small():
            x = torch.ones(1 << 10)
            del x

        def test_big():
            x = torch.ones(1 << 20)
            del x
        """
    )
    result = pytester.runpytest(*PLUGIN, "--memory-report")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        ["*torch memory per test*", "test_probe.py::test_small *cpu*4.0 KiB*0 B", "test_probe.py::test_big *cpu*4.0 MiB*0 B"]
    )


def _baseline_probe(numel):
    return f"""
import torch

def test_grows():
    x = torch.ones({numel})
    del x

def test_steady():
    x = torch.ones(1 << 16)
    del x
"""


def test_baseline_regression_is_caught(pytester):
    pytester.makepyfile(test_probe=_baseline_probe(1 << 16))
    result = pytester.runpytest(*PLUGIN, "--memory-baseline=base.json", "--memory-baseline-update")
    result.assert_outcomes(passed=2)
    stored = json.loads((pytester.path / "base.json").read_text())
    assert stored["test_probe.py::test_grows"]["cpu"] == 4 * (1 << 16)

    # 3% more stays inside the default 5% tolerance
    pytester.makepyfile(test_probe=_baseline_probe((1 << 16) * 103 // 100))
    pytester.runpytest(*PLUGIN, "--memory-baseline=base.json").assert_outcomes(passed=2)

    pytester.makepyfile(test_probe=_baseline_probe(1 << 17))
    result = pytester.runpytest(*PLUGIN, "--memory-baseline=base.json")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*memory baseline: cpu peak 512.0 KiB (524288 bytes) grew over the baseline 256.0 KiB*"])
    # a looser tolerance accepts the same growth
    pytester.runpytest(*PLUGIN, "--memory-baseline=base.json", "--memory-tolerance=150%").assert_outcomes(passed=2)


def test_unmarked_tests_are_not_measured_without_options(pytester):
    pytester.makepyfile(
        test_probe="""
        import torch

        def test_profiler_is_free_to_use():
            with torch.profiler.profile(profile_memory=True):
                torch.ones(8)
        """
    )
    pytester.runpytest(*PLUGIN).assert_outcomes(passed=1)


def test_loading_through_entry_point_and_p_twice(pytester):
    # a fake installed distribution registering the plugin as a pytest11 entry point
    dist = pytester.path / "site" / "te_fuser_plugin_probe-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: te_fuser_plugin_probe\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(
        "[pytest11]\nte_fuser.testing.pytest_plugin = te_fuser.testing.pytest_plugin\n"
    )
    pytester.makepyfile(
        test_probe="""
        import pytest
        import torch

        pytest_plugins = ["te_fuser.testing.pytest_plugin"]

        @pytest.mark.limit_peak_memory("1 MiB", device="cpu")
        def test_over():
            torch.ones(1 << 20)
        """
    )
    env_path = os.pathsep.join([str(pytester.path / "site"), TE_FUSER_PARENT, os.environ.get("PYTHONPATH", "")])
    pytester._monkeypatch.setenv("PYTHONPATH", env_path)
    pytester._monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    result = pytester.runpytest_subprocess(*PLUGIN, "--strict-markers")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*limit_peak_memory: cpu peak 4.0 MiB*"])
