"""pytest plugin: memory limits as markers, a per-test memory report, and a peak-memory baseline.

Markers (the test body is measured with te_fuser.memory.MemoryTracker, fixtures excluded):
  @pytest.mark.limit_peak_memory("64 MiB", device=None)      peak allocation during the test
  @pytest.mark.limit_retained_memory("1 MiB", device=None)   bytes still allocated at return
device=None checks the CPU and, when available, the current CUDA device, each against
the limit; "cpu", "cuda" or "cuda:N" checks one device.

Options:
  --memory-report               table of every test's peak and retained bytes at the end
                                (without it only tests with markers are measured)
  --memory-baseline=FILE        fail a test whose peak grew more than --memory-tolerance
                                (default 5%; growth under 1 KiB is ignored) over FILE
  --memory-baseline-update      write the measured peaks to FILE instead of comparing

Load with ``-p te_fuser.testing.pytest_plugin``. When registered as a pytest11 entry point,
name the entry point ``te_fuser.testing.pytest_plugin`` too, so that pytest sees one plugin
whether it arrives through the entry point, ``-p`` or ``pytest_plugins``.
Note: CPU measurement uses torch's profiler; a measured test cannot run its own profiler.
"""

import json
import os

import pytest

from te_fuser.memory.sizes import SIZE_FORM, format_bytes, parse_size
from te_fuser.memory.tracker import MemoryTracker

_LIMIT_MARKERS = {
    "limit_peak_memory": "peak_bytes",
    "limit_retained_memory": "retained_bytes",
}
_MARKER_HELP = {
    "limit_peak_memory": "limit_peak_memory(size, device=None): fail when the test's peak torch allocation exceeds size",
    "limit_retained_memory": "limit_retained_memory(size, device=None): fail when the test leaves more than size allocated",
}
_BASELINE_SLACK_BYTES = 1024
_STATE = pytest.StashKey["_MemoryState"]()
_LIMITS = pytest.StashKey[list]()


class _MemoryState:
    def __init__(self, config):
        self.report = config.getoption("memory_report")
        self.baseline_path = config.getoption("memory_baseline")
        self.update = config.getoption("memory_baseline_update")
        self.tolerance = _parse_tolerance(config.getoption("memory_tolerance"))
        if self.update and not self.baseline_path:
            raise pytest.UsageError("--memory-baseline-update needs --memory-baseline=FILE to say where to write")
        self.baseline = {}
        if self.baseline_path and not self.update:
            if not os.path.exists(self.baseline_path):
                raise pytest.UsageError(
                    f"--memory-baseline file {self.baseline_path} does not exist; create it with --memory-baseline-update"
                )
            with open(self.baseline_path) as handle:
                self.baseline = json.load(handle)
        self.measure_all = bool(self.report or self.baseline_path)
        self.results = {}  # nodeid -> {device: DeviceMemory}


def _parse_tolerance(text):
    try:
        value = float(str(text).strip().rstrip("%"))
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):  # negative, NaN or infinite
        raise pytest.UsageError(f"--memory-tolerance must be a percentage like '5%' or '5', got {text!r}")
    return value / 100


def pytest_addoption(parser):
    group = parser.getgroup("te_fuser memory", "torch memory limits and reports (te_fuser.testing.pytest_plugin)")
    group.addoption("--memory-report", action="store_true", help="measure every test and print peak/retained bytes")
    group.addoption("--memory-baseline", metavar="FILE", default=None, help="JSON file of per-test peak bytes to compare with")
    group.addoption(
        "--memory-baseline-update", action="store_true", help="write the measured peaks to --memory-baseline FILE"
    )
    group.addoption("--memory-tolerance", default="5%", help="allowed peak growth over the baseline (default 5%%)")


def pytest_configure(config):
    for text in _MARKER_HELP.values():
        config.addinivalue_line("markers", text)
    config.stash[_STATE] = _MemoryState(config)


def _parse_marker(item, mark):
    """(attribute, limit bytes, device) of one marker; UsageError naming the marker otherwise."""
    expected = f"expected @pytest.mark.{mark.name}(size, device=None|'cpu'|'cuda'|'cuda:N') with size {SIZE_FORM}"
    try:
        kwargs = dict(mark.kwargs)
        if len(mark.args) > 2 or set(kwargs) - {"size", "device"}:
            raise ValueError("unexpected arguments")
        args = dict(zip(("size", "device"), mark.args))
        if set(args) & set(kwargs):
            raise ValueError("an argument given twice")
        args.update(kwargs)
        if "size" not in args:
            raise ValueError("missing size")
        limit = parse_size(args["size"])
        device = args.get("device")
        if device is not None and not (
            device == "cpu" or device == "cuda" or (isinstance(device, str) and device.startswith("cuda:") and device[5:].isdigit())
        ):
            raise ValueError(f"unknown device {device!r}")
    except (ValueError, TypeError) as err:
        raise pytest.UsageError(f"{item.nodeid}: bad {mark.name} marker ({err}); {expected}") from None
    return _LIMIT_MARKERS[mark.name], limit, device


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        item.stash[_LIMITS] = [
            (mark.name, *_parse_marker(item, mark))
            for name in _LIMIT_MARKERS
            for mark in item.iter_markers(name)
        ]


def _tracked_devices(limits):
    devices = [device for _, _, _, device in limits]
    if not devices or None in devices:
        return None
    return sorted(set(devices))


def _violations(nodeid, limits, measured, state):
    problems = []
    for name, attribute, limit, device in limits:
        for result in measured.values():
            if device is None or result.device == device or (device == "cuda" and result.device.startswith("cuda")):
                value = getattr(result, attribute)
                if value > limit:
                    problems.append(
                        f"{name}: {result.device} {attribute.replace('_bytes', '')} {format_bytes(value)} "
                        f"({value} bytes) exceeds the limit {format_bytes(limit)} ({limit} bytes)"
                    )
    if state.baseline and not state.update:
        for device, old_peak in state.baseline.get(nodeid, {}).items():
            if device in measured:
                peak = measured[device].peak_bytes
                if peak > old_peak * (1 + state.tolerance) and peak - old_peak > _BASELINE_SLACK_BYTES:
                    problems.append(
                        f"memory baseline: {device} peak {format_bytes(peak)} ({peak} bytes) grew over the "
                        f"baseline {format_bytes(old_peak)} ({old_peak} bytes) by more than {state.tolerance:.0%}"
                    )
    return problems


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    state = item.config.stash[_STATE]
    limits = item.stash.get(_LIMITS, [])
    if not limits and not state.measure_all:
        return (yield)
    try:
        tracker = MemoryTracker(_tracked_devices(limits)).__enter__()
    except ValueError as err:
        pytest.fail(f"memory markers of {item.nodeid}: {err}", pytrace=False)
    try:
        result = yield
    finally:
        tracker.__exit__(None, None, None)
        state.results[item.nodeid] = dict(tracker.devices)
    problems = _violations(item.nodeid, limits, tracker.devices, state)
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)
    return result


def pytest_sessionfinish(session):
    state = session.config.stash.get(_STATE, None)
    if state is None or not state.update:
        return
    stored = {}
    if os.path.exists(state.baseline_path):
        with open(state.baseline_path) as handle:
            stored = json.load(handle)
    for nodeid, measured in state.results.items():
        stored[nodeid] = {device: result.peak_bytes for device, result in measured.items()}
    with open(state.baseline_path, "w") as handle:
        json.dump(stored, handle, indent=1, sort_keys=True)
        handle.write("\n")


def pytest_terminal_summary(terminalreporter, config):
    state = config.stash.get(_STATE, None)
    if state is None or not state.report:
        return
    terminalreporter.section("torch memory per test (peak / retained, relative to the test's start)")
    width = max((len(nodeid) for nodeid in state.results), default=4)
    terminalreporter.write_line(f"{'test':<{width}}  {'device':<7} {'peak':>11} {'retained':>11}")
    for nodeid, measured in state.results.items():
        for device, result in measured.items():
            terminalreporter.write_line(
                f"{nodeid:<{width}}  {device:<7} {format_bytes(result.peak_bytes):>11} "
                f"{format_bytes(result.retained_bytes):>11}"
            )
