"""bench/step_probe.py: the static engine's step cost on random weights, on each device (a tiny model here)."""

from __future__ import annotations

import pytest

from bench.step_probe import KS, probe
from drafter.model.config import ModelConfig


def test_the_probe_times_every_k_against_plain_without_captures_in_the_timed_runs(device):
    cfg = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position=256)
    logged = []
    out = probe(device, (1, 2), 6, cfg, log=logged.append)
    cells = out["torch.bfloat16"]["cells"]
    assert set(cells) == {"b1_T0", "b1_T1", "b2_T0", "b2_T1"} and len(logged) == 2 * 4
    for row in cells.values():
        assert set(row) == set(KS) and row[0]["accepted"] == 1.0
        for k in KS[1:]:
            assert row[k]["cost_vs_plain"] == pytest.approx(row[k]["ms_per_step"] / row[0]["ms_per_step"], abs=2e-3)
            assert row[k]["captures"] == 0 and row[k]["rebuilds"] == 0  # the untimed run met every shape
            assert 1.0 <= row[k]["accepted"] <= k + 1
    assert set(out["torch.float32"]["profile"]) == {"b4_k0", "b4_k2", "b1_k2"}
    with pytest.raises(ValueError, match="new_tokens >= 1"):
        probe(device, (1,), 0, cfg)
