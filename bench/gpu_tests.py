"""`tlt bench gpu` (h): the CUDA test set, run in a subprocess and counted.

The set is the test paths listed in tests/cuda_tests.txt (one per line, '#' starts a comment), run as
`python3 -m pytest -q -k cuda -p no:cacheprovider PATHS` with a junit XML report, which is read for the
counts. `python3 -m bench.gpu_tests --junit FILE` runs it alone (`make gpu-check` does, then hands the
report to the bench, so the set runs once).
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from bench.record import ROOT

TESTS_LIST = ROOT / "tests" / "cuda_tests.txt"


def read_test_paths(path: Path = TESTS_LIST) -> list[str]:
    """The test paths a list file names; ValueError if it is missing, empty, or names a path that is not there."""
    if not path.is_file():
        raise ValueError(f"{path}: no such file (the CUDA test set: one test path per line)")
    paths = [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()]
    paths = [p for p in paths if p]
    if not paths:
        raise ValueError(f"{path} lists no test paths")
    missing = [p for p in paths if not (path.parent.parent / p.split("::", 1)[0]).exists()]
    if missing:
        raise ValueError(f"{path} lists paths that do not exist: {', '.join(missing)}")
    return paths


def junit_counts(path: str | Path) -> dict:
    """{passed, failed, skipped, tests} from a pytest junit XML report (errors count as failed)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        raise ValueError(f"{path}: not a readable junit XML report ({exc})") from None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    if not suites:
        raise ValueError(f"{path}: no <testsuite> in the report")
    total = failed = skipped = 0
    for s in suites:
        total += int(s.get("tests", 0))
        failed += int(s.get("failures", 0)) + int(s.get("errors", 0))
        skipped += int(s.get("skipped", 0))
    return {"passed": total - failed - skipped, "failed": failed, "skipped": skipped, "tests": total}


def run_cuda_tests(junit: str | Path, timeout_s: float = 600.0, list_file: Path = TESTS_LIST,
                   python: str = sys.executable) -> dict:
    """Run the set (pytest's output goes to stderr) and count it. {"passed", "failed", "skipped", "tests",
    "seconds", "returncode", "paths"}; a run that timed out has failed None and a note."""
    paths = read_test_paths(list_file)
    cmd = [python, "-m", "pytest", "-q", "-k", "cuda", "-p", "no:cacheprovider", f"--junitxml={junit}", *paths]
    start = time.perf_counter()
    try:
        err = sys.stderr.fileno()  # pytest's output on our stderr: stdout is the JSON's
    except (AttributeError, io.UnsupportedOperation):
        err = None
    try:
        proc = subprocess.run(cmd, cwd=list_file.parent.parent, stdout=err, stderr=err, timeout=timeout_s,
                              check=False)
    except subprocess.TimeoutExpired:
        return {"passed": None, "failed": None, "paths": paths, "note": f"timed out after {timeout_s:.0f} s"}
    seconds = round(time.perf_counter() - start, 1)
    if proc.returncode == 5:  # pytest: no test was collected (-k cuda selected none)
        return {"passed": 0, "failed": 0, "skipped": 0, "tests": 0, "seconds": seconds, "returncode": 5,
                "paths": paths, "note": "no test matched -k cuda"}
    if not Path(junit).is_file():
        return {"passed": None, "failed": None, "seconds": seconds, "returncode": proc.returncode, "paths": paths,
                "note": f"pytest exited {proc.returncode} without a report (a usage or collection error?)"}
    return {**junit_counts(junit), "seconds": seconds, "returncode": proc.returncode, "paths": paths}


def cuda_tests(device: str, skip: bool, junit: str | None, timeout_s: float) -> dict:
    """(h) as the bench reports it: not run on a CPU, skipped on request, read from a report, or run now."""
    if device != "cuda":
        return {"passed": None, "failed": None, "note": "not run: --device cpu (the CUDA test set needs a GPU)"}
    if skip:
        return {"passed": None, "failed": None, "note": "skipped (--skip-tests)"}
    if junit is not None:
        return {**junit_counts(junit), "report": str(junit), "note": "read from a run already made"}
    with tempfile.TemporaryDirectory(prefix="tlt-cuda-tests-") as tmp:
        return run_cuda_tests(Path(tmp) / "junit.xml", timeout_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.gpu_tests", description=__doc__.split("\n\n")[0])
    p.add_argument("--junit", required=True, help="where the junit XML report goes")
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    try:
        counts = run_cuda_tests(args.junit, args.timeout)
    except ValueError as exc:
        print(f"bench.gpu_tests: error: {exc}", file=sys.stderr)
        return 2
    print(f"CUDA tests: {counts.get('passed')} passed, {counts.get('failed')} failed, {counts.get('skipped')} "
          f"skipped ({counts.get('note', 'paths: ' + ' '.join(counts['paths']))})", file=sys.stderr)
    return 0 if counts.get("failed") == 0 and counts.get("passed") else 1


if __name__ == "__main__":
    sys.exit(main())
