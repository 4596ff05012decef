"""Where a measured result goes: docs/bench/NAME.json, with what it was measured on.

The one writer of those files: every `tlt bench NAME` (through the registry, bench/cli.py) and `tlt simulate`
write their result here with the git commit, the machine (CPU model, cores, memory) and the date, so
docs/benchmarks.md can cite a committed file. Standard library only: `python3 -m bench.gpu` runs it on a GPU
node that has none of the control plane's packages.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout
BENCH_DIR = ROOT / "docs" / "bench"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    mem_gib = None
    with contextlib.suppress(ValueError, OSError, AttributeError):
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return {"cpu_model": cpu_model(), "num_cores": os.cpu_count(), "memory_gib": mem_gib,
            "platform": platform.platform()}


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def provenance() -> dict:
    return {"commit": git_commit(), "machine": machine(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


def finite(value):
    """`value` with every NaN or infinity replaced by None (JSON has neither), recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def write_result(name: str, result: dict, directory: Path | None = None, accelerator: str | None = None) -> Path:
    """Add the provenance to `result` (in place) and write it to docs/bench/NAME.json. accelerator: the GPU (or
    other card) the run measured, named first in `machine`."""
    if not name or not all(c.isalnum() or c in "-_" for c in name):
        raise ValueError(f"bench name must be letters, digits, '-' or '_', got {name!r}")
    result.update(provenance())
    if accelerator is not None:
        result["machine"] = {"gpu": accelerator, **result["machine"]}
    directory = directory or BENCH_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(finite(result), indent=1, allow_nan=False) + "\n")
    tmp.replace(path)
    return path
