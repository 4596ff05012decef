"""What the scheduler imports of the data plane loads no torch (checked in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_actors_index_spec_engines_protocol_and_progress_import_without_torch():
    code = ("import sys, workers.actors, workers.job_actor, workers.draft_index, workers.spec, workers.engines\n"
            "import workers.protocol.keys, workers.protocol.messages, workers.protocol.client, workers.progress\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith(('torch', 'drafter')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
