"""The demo's closing claim (pure logic): a rollout speed-up only when the drafter paid and beyond the noise."""

from __future__ import annotations

from scheduler.demo import rollout_verdict, tail_k_line


def test_a_speed_up_the_drafter_caused_and_larger_than_the_noise_is_claimed():
    lines = rollout_verdict([30.0, 31.0], [20.0, 21.0], [1.8, 1.9])
    assert "rollout speed-up 1.49x" in lines[-1]


def test_a_shorter_rollout_the_tails_rate_does_not_show_is_not_claimed_and_a_slower_one_is_called_so():
    # the rollout is 30% shorter, but the tail decoded at 0.86x plain's rate: the samples were shorter
    lines = rollout_verdict([30.0, 31.0], [20.0, 21.0], [1.4, 1.4], tail_rate_ratio=0.86)
    assert "not the drafter's doing" in lines[-1] and "0.86x" in lines[-1] and "no speed-up is claimed" in lines[-1]
    assert "rollout speed-up 1.49x" in rollout_verdict([30.0, 31.0], [20.0, 21.0], [1.4, 1.4], 1.2)[-1]
    slower = rollout_verdict([20.0, 21.0], [30.0, 31.0], [1.4, 1.4], 0.8)[-1]
    assert "rollout slow-down: TLT on took 1.49x as long" in slower and "speed-up" not in slower
    # longer samples, not the drafter: the tail decoded faster, so no slow-down is claimed either
    longer = rollout_verdict([20.0, 21.0], [30.0, 31.0], [1.4, 1.4], 1.02)[-1]
    assert "not the drafter's doing" in longer and "1.02x" in longer and "no slow-down is claimed" in longer


def test_no_speed_up_when_the_drafter_never_paid():
    lines = rollout_verdict([30.0, 31.0], [20.0, 21.0], [1.0, 1.01])
    assert "never paid" in lines[-1] and "speed-up" not in lines[-1]


def test_no_speed_up_within_the_noise():
    # the off job's steps spread 40%; a 10% difference is within it
    lines = rollout_verdict([25.0, 37.5], [28.0, 28.8], [1.6, 1.7])
    assert "within run-to-run noise" in lines[-1] and "no speed-up is claimed" in lines[-1]


def test_one_step_gives_no_noise_estimate_and_no_claim():
    assert "no speed-up is claimed" in rollout_verdict([30.0], [15.0], [2.0])[-1]
    assert rollout_verdict([], [], []) == ["rollout: no timings to compare"]


def test_the_demo_reads_the_warm_draft_workers_warm_caches_then_the_shipped_one(tmp_path, monkeypatch, capsys):
    """The demo's warm draft is workers.warm's: the one cached under warm_cache_dir for the default recipe (as
    `tlt drafter train --task` writes it) first, else the one the checkout ships (SHIPPED_DRAFTS), else None
    (and no build unless asked for), naming where it looked. A draft without its report is not whole."""
    import json

    from scheduler.demo import ensure_warm_draft
    from workers import warm

    monkeypatch.setenv("TLT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(warm, "SHIPPED_DRAFTS", tmp_path / "shipped")
    monkeypatch.delenv("TLT_DEMO_BUILD_WARM_DRAFT", raising=False)
    out = warm.warm_cache_dir("smollm2-135m", "longtail", warm.WarmRecipe())
    shipped = tmp_path / "shipped" / "smollm2-135m-longtail"
    assert ensure_warm_draft("smollm2-135m", "longtail") is None
    assert f"none cached in {out} and none shipped" in capsys.readouterr().out
    for folder, acceptance in ((shipped, [1.7, 1.8, 1.9]), (out, [1.8, 1.9, 2.0])):
        folder.mkdir(parents=True)
        (folder / "draft-v000001.safetensors").write_bytes(b"")
        assert ensure_warm_draft("smollm2-135m", "longtail") == (  # no report: not whole (the shipped one stands)
            None if folder == shipped else str(shipped / "draft-v000001.safetensors"))
        capsys.readouterr()
        (folder / warm.WARM_REPORT).write_text(json.dumps({"acceptance": dict(zip("234", acceptance))}))
        assert ensure_warm_draft("smollm2-135m", "longtail") == str(folder / "draft-v000001.safetensors")
        said = capsys.readouterr().out
        assert f"k=2,3,4 on held-out longtail prompts: {', '.join(f'{a:.2f}' for a in acceptance)}" in said


def test_the_tail_line_gives_each_draft_lengths_rate_per_tail_bucket_and_leaves_the_bulk_out():
    steps = [{"bucket_served": {"1": {"0": [10, 10, 10, 1.0], "2": [30, 10, 10, 1.5]},
                                "3-4": {"1": [40, 8, 32, 2.0]}, "9-16": {"0": [100, 10, 100, 2.0]}}}]
    line = tail_k_line(steps)
    assert "1: k=0 10.0 (10), k=2 20.0 (10); 3-4: k=1 20.0 (8):" in line and "9-16" not in line
    assert tail_k_line([{"bucket_served": {"9-16": {"0": [100, 10, 100, 2.0]}}}]) is None
    assert tail_k_line([{"bucket_served": {"1": {"2": [30, 10, 10]}}}]) is None  # no seconds kept: no rate
