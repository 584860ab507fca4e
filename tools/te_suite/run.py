"""Run TransformerEngine's own PyTorch tests against te_fuser on the CPU, and count the results per file.

    python tools/te_suite/run.py --te PATH/TO/TransformerEngine [--tag v2.6] [--sample 120] [--files ...]

PATH is a git clone of https://github.com/NVIDIA/TransformerEngine (TE's tests are read from it at the tag,
never copied into te_fuser). Each test file runs in its own pytest process, with the
`transformer_engine` alias and the CUDA-to-CPU shim of cuda_shim.py, in strict mode: a file whose import
fails counts as one collection error, as a user would see it. --sample N runs at most N tests of a file,
spread evenly over its collected tests (the order pytest collects them in). The per-file table is printed
as markdown and written with the raw counts to --out (default build/te_suite).
"""

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def export_tests(te_repo: Path, tag: str, into: Path) -> Path:
    """tests/pytorch of te_repo at tag, extracted under `into`."""
    archive = into / "tests.tar"
    with open(archive, "wb") as out:
        subprocess.run(["git", "-C", str(te_repo), "archive", tag, "tests/pytorch"], stdout=out, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / "tests" / "pytorch"


def test_files(tests: Path, only):
    files = sorted(tests.glob("test_*.py")) + sorted((tests / "attention").glob("test_*.py"))
    if only:
        files = [f for f in files if f.name in only or str(f.relative_to(tests)) in only]
    return files


# The variables TE's own CI (qa/L0_pytorch_unittest/test.sh at v2.6) runs a file with; test_cpu_offloading.py
# asserts NVTE_FLASH_ATTN=0 at import.
FILE_ENV = {
    "test_numerics.py": {"PYTORCH_JIT": "0", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"},
    "test_cuda_graphs.py": {"PYTORCH_JIT": "0", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"},
    "test_cpu_offloading.py": {"NVTE_FLASH_ATTN": "0"},
}


def _env(tests: Path, directory: Path, path: Path = None) -> dict:
    env = dict(os.environ)
    if path is not None:
        env.update(FILE_ENV.get(str(path.relative_to(tests)), {}))
    paths = [str(HERE), str(directory), str(tests), str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    env.setdefault("NVTE_TORCH_COMPILE", "0")
    return env


def sampled_ids(path: Path, tests: Path, sample: int, timeout: int):
    """At most `sample` test ids of the file, evenly spread; None to run the whole file."""
    if not sample:
        return None
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "cuda_shim", "--collect-only", "-q", str(path)],
                          cwd=path.parent, env=_env(tests, path.parent, path), capture_output=True, text=True,
                          timeout=timeout)
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    if len(ids) <= sample:
        return None
    step = len(ids) / sample
    return [ids[int(i * step)] for i in range(sample)]


def _pytest(path: Path, tests: Path, report: Path, targets, timeout: int) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "pytest", "-p", "cuda_shim", "-q", "-p", "no:cacheprovider",
            f"--junitxml={report}"] + targets
    return subprocess.run(args, cwd=path.parent, env=_env(tests, path.parent, path), capture_output=True, text=True,
                          timeout=timeout)


def _count(report: Path, counts: dict) -> None:
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        kind = "failed" if "failure" in kinds else "errors" if "error" in kinds else (
            "skipped" if "skipped" in kinds else "passed")
        counts[kind] += 1


def run_file(path: Path, tests: Path, out: Path, sample: int, timeout: int) -> dict:
    report = out / (str(path.relative_to(tests)).replace("/", "__") + ".xml")
    ids = sampled_ids(path, tests, sample, timeout)
    report.unlink(missing_ok=True)
    try:
        proc = _pytest(path, tests, report, ids if ids else [str(path)], timeout)
    except subprocess.TimeoutExpired:
        return {"file": str(path.relative_to(tests)), "timeout": True}
    tail = proc.stdout[-4000:]
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    if report.exists():
        _count(report, counts)
    elif ids and proc.returncode < 0:
        # A test killed the process (an abort in native code): each sampled test alone, a crash a failure.
        tail += f"\nthe run died (signal {-proc.returncode}); each test was run alone:\n"
        single = out / (report.stem + ".single.xml")
        for test_id in ids:
            single.unlink(missing_ok=True)
            alone = _pytest(path, tests, single, [test_id], timeout)
            if single.exists():
                _count(single, counts)
            else:
                counts["failed"] += 1
                tail += f"{test_id}: died (signal {-alone.returncode})\n"
        single.unlink(missing_ok=True)
    (out / (report.stem + ".log")).write_text(tail)
    return {"file": str(path.relative_to(tests)), "sampled": bool(ids), **counts}


def markdown(rows) -> str:
    lines = ["| file | passed | failed | errors | skipped |", "| --- | --- | --- | --- | --- |"]
    totals = dict.fromkeys(("passed", "failed", "errors", "skipped"), 0)
    for row in rows:
        if row.get("timeout"):
            lines.append(f"| `{row['file']}` | timed out | | | |")
            continue
        name = f"`{row['file']}`" + (" (sampled)" if row["sampled"] else "")
        lines.append(f"| {name} | {row['passed']} | {row['failed']} | {row['errors']} | {row['skipped']} |")
        for key in totals:
            totals[key] += row[key]
    lines.append(f"| total | {totals['passed']} | {totals['failed']} | {totals['errors']} | {totals['skipped']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--te", type=Path, required=True, help="a git clone of NVIDIA/TransformerEngine")
    parser.add_argument("--tag", default="v2.6", help="the TE tag whose tests run (te_fuser declares 2.6)")
    parser.add_argument("--sample", type=int, default=0, help="run at most this many tests per file (0: all)")
    parser.add_argument("--files", nargs="*", help="file names (e.g. test_numerics.py attention/test_kv_cache.py)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per file")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "te_suite")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="te_suite_") as tmp:
        tests = export_tests(args.te, args.tag, Path(tmp))
        rows = []
        for path in test_files(tests, args.files):
            rows.append(run_file(path, tests, args.out, args.sample, args.timeout))
            print(json.dumps(rows[-1]), flush=True)
    table = markdown(rows)
    (args.out / "summary.md").write_text(table + "\n")
    (args.out / "summary.json").write_text(json.dumps(rows, indent=1))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
