"""The control plane (API, watcher, metrics, CLI entry point) loads no torch: it decides, workers execute."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_the_scheduler_process_imports_no_torch():
    code = ("import scheduler.app, scheduler.watcher, scheduler.metrics, scheduler.cli, scheduler.demo; import sys; "
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
            "assert not loaded, loaded[:5]")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


def test_the_check_would_catch_torch():
    code = "import scheduler.app, torch; import sys; assert 'torch' not in sys.modules"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "AssertionError" in out.stderr
