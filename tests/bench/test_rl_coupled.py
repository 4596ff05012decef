"""`tlt bench rl --coupled` end to end on real jobs (private Redis, local Ray, the scheduler app; the tiny preset):
with coupled sampling (drafter.decode.coupled) the plain, frozen-draft and TLT arms generate the same rollouts at
every step, hot swaps and GRPO updates included, so their ratios compare speed on identical work."""

from __future__ import annotations

import json
import tempfile

from bench.cli import main
from workers.device import policy_dtype


def test_coupled_arms_generate_the_same_rollouts_at_every_step(tmp_path, monkeypatch):
    monkeypatch.setenv("TLT_CACHE_DIR", str(tmp_path / "cache"))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the bench's job stores go
    assert main(["rl", "--size", "smallest", "--coupled", "--steps", "2", "--out-dir", str(tmp_path), "--json"]) == 0
    result = json.loads((tmp_path / "rl.json").read_text())
    assert not list(scratch.glob("tlt-bench-rl-*"))  # the jobs' stores (hundreds of MB at full size) are gone
    config = result["config"]
    # auto, as coupled jobs resolve it: bf16 only where a verify's logits are plain decoding's to the bit
    assert config["coupled_sampling"] is True and config["policy_dtype"] == "auto"
    assert config["policy_dtype_served"] == str(policy_dtype("auto", "cpu", coupled=True)).removeprefix("torch.")
    assert result["paired_steps"] == {"paired": 2, "steps": 2}, result["steps"]
    tokens = {arm: [s["response_lengths"] for s in runs[0]] for arm, runs in result["steps"].items()}
    assert tokens["plain"] == tokens["frozen"] == tokens["tlt"]
    # the draft arms drafted, and had drafts accepted (else pairing would be plain decoding's, trivially)
    for arm in ("frozen", "tlt"):
        steps = result["steps"][arm][0]
        assert any(int(k) > 0 for s in steps for by_k in s["k_served_by_bucket"].values() for k in by_k), steps
        assert max(s["accepted_length"] for s in steps) > 1.0, steps
