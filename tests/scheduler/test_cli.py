"""The `tlt` client commands against a live scheduler (uvicorn on a free port, real Redis and Ray)."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace

import pytest
import ray
import uvicorn

from scheduler.app import Settings, create_app
from scheduler.cli import RAY_SINGLE_NODE_ENV, build_parser, main
from workers.redis_server import PrivateRedis, free_port


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    with PrivateRedis() as redis_server:
        port = free_port()
        app = create_app(Settings(redis_url=redis_server.url, api_token="tok",
                                  store_dir=str(tmp_path_factory.mktemp("d")), start_ray=False))
        srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=srv.run, daemon=True)
        thread.start()
        while not srv.started:
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
        srv.should_exit = True
        thread.join(timeout=10)
    ray.shutdown()


def test_submit_status_jobs_cancel(server, tmp_path, capsys):
    spec = tmp_path / "job.yaml"
    spec.write_text("model: tiny\nnum_steps: 40\nnum_prompts_per_step: 2\ngroup_size: 2\nmax_new_tokens: 32\n"
                    "num_workers: 2\n")
    assert main(["submit", str(spec), "--url", server, "--token", "tok", "--json"]) == 0
    job_id = json.loads(capsys.readouterr().out)["job_id"]
    assert main(["status", job_id, "--url", server]) == 2  # job details need the token
    assert "HTTP 401" in capsys.readouterr().err
    assert main(["status", job_id, "--url", server, "--token", "tok"]) == 0
    assert f"job {job_id}" in capsys.readouterr().out
    assert main(["jobs", "--url", server, "--token", "tok"]) == 0
    assert job_id in capsys.readouterr().out
    assert main(["cancel", job_id, "--url", server, "--token", "tok"]) == 0
    assert "CANCELLED" in capsys.readouterr().out


def test_clear_errors(server, tmp_path, capsys):
    assert main(["jobs", "--url", "http://127.0.0.1:9"]) == 2
    assert "cannot reach the scheduler" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    assert main(["submit", str(bad), "--url", server, "--token", "tok"]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    spec = tmp_path / "job.json"
    spec.write_text('{"num_steps": 0}')
    assert main(["submit", str(spec), "--url", server, "--token", "tok"]) == 2
    assert "HTTP 422" in capsys.readouterr().err
    assert main(["submit", str(spec), "--url", server, "--token", "wrong"]) == 2
    assert "HTTP 401" in capsys.readouterr().err


def test_serve_names_an_unreachable_redis_or_bad_policy_setting(monkeypatch, capsys):
    # serve sets Ray's single-node switch for its own process and children; set here as serve would, so that
    # monkeypatch removes it after this test: else every later `ray start` of the session (test_multinode's
    # second node) inherits it and refuses to join a cluster
    monkeypatch.setenv(RAY_SINGLE_NODE_ENV, "0")
    monkeypatch.setenv("REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    assert main(["serve", "--port", str(free_port())]) == 2
    assert "cannot reach Redis at redis://127.0.0.1:" in capsys.readouterr().err
    monkeypatch.setenv("TLT_POLICY_MIN_LEASE_S", "soon")
    assert main(["serve", "--port", str(free_port())]) == 2
    assert "TLT_POLICY_MIN_LEASE_S: not a number" in capsys.readouterr().err
    monkeypatch.setenv("TLT_POLICY_MIN_LEASE_S", "-1")
    assert main(["serve", "--port", str(free_port())]) == 2
    assert "min_lease_s" in capsys.readouterr().err


def test_policy_settings_from_the_environment():
    from scheduler.cli import policy_from_env

    s = policy_from_env({"TLT_POLICY_MIN_LEASE_S": "2", "TLT_POLICY_MIN_BUFFER_TOKENS": "128", "OTHER": "x"})
    assert s.min_lease_s == 2.0 and s.min_buffer_tokens == 128 and s.max_lease_s == 600.0
    assert s.prune_copies and not policy_from_env({"TLT_POLICY_PRUNE_COPIES": "false"}).prune_copies
    assert not policy_from_env({"TLT_POLICY_PRUNE_COPIES": "0"}).prune_copies
    with pytest.raises(ValueError, match="TLT_POLICY_PRUNE_COPIES: not a boolean"):
        policy_from_env({"TLT_POLICY_PRUNE_COPIES": "maybe"})


def test_api_token_from_a_mounted_secret_file(tmp_path):
    from scheduler.cli import api_token_from_env

    secret = tmp_path / "token"
    secret.write_text("s3cret\n")
    assert api_token_from_env({"TLT_API_TOKEN_FILE": str(secret)}) == "s3cret"
    assert api_token_from_env({"TLT_API_TOKEN": "env", "TLT_API_TOKEN_FILE": str(secret)}) == "env"
    assert api_token_from_env({}) is None
    with pytest.raises(ValueError, match="TLT_API_TOKEN_FILE: cannot read"):
        api_token_from_env({"TLT_API_TOKEN_FILE": str(tmp_path / "missing")})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        api_token_from_env({"TLT_API_TOKEN_FILE": str(tmp_path / "empty")})


def test_drafter_train_on_a_task_writes_a_loadable_checkpoint(tmp_path, capsys):
    from drafter.draft.head import head_from_state
    from drafter.train.checkpoint import load_draft

    out = tmp_path / "warm"
    assert main(["drafter", "train", "--task", "arithmetic", "--model", "tiny", "--out", str(out),
                 "--num-prompts", "4", "--num-eval-prompts", "2", "--steps", "3", "--max-new-tokens", "8",
                 "--threads", "1"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["task"] == "arithmetic" and report["num_prompts"] == 4 and report["train_steps"] == 3
    assert set(report["acceptance"]) == {"2", "3", "4"}  # held-out prompts of the task were measured
    state, meta = load_draft(report["path"])  # checksum-checked
    assert meta.version == 1 and meta.extra["acceptance"] == report["acceptance"]
    assert head_from_state(meta.head_config, state).policy_cfg.hidden_size == 64


def test_drafter_train_on_a_task_without_out_fills_the_warm_cache_once(tmp_path, capsys, monkeypatch):
    """Without --out, `tlt drafter train --task` is workers.warm.ensure_warm_draft: the draft lands where the demo
    and `tlt bench rl` look (warm_cache_dir, keyed by the recipe the options make), and a second run reuses it."""
    from scheduler.cli_tools import _task_recipe
    from workers.warm import GPU_RECIPE, WARM_REPORT, WarmRecipe, warm_cache_dir

    monkeypatch.setenv("TLT_CACHE_DIR", str(tmp_path))
    argv = ["drafter", "train", "--task", "arithmetic", "--model", "tiny", "--num-prompts", "4",
            "--num-eval-prompts", "2", "--steps", "2", "--max-new-tokens", "8", "--threads", "1"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    recipe = WarmRecipe(num_prompts=4, num_eval_prompts=2, num_steps=2, max_new_tokens=8)
    out = warm_cache_dir("tiny", "arithmetic", recipe)
    assert report["path"] == str(out / "draft-v000001.safetensors") and report["device"] == "cpu"
    assert json.loads((out / WARM_REPORT).read_text()) == report
    built_at = (out / WARM_REPORT).stat().st_mtime_ns
    assert main(argv) == 0  # cached: reused, not built again
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == report
    assert (out / WARM_REPORT).stat().st_mtime_ns == built_at
    # the options at their defaults are WarmRecipe() itself: the demo's build (no options) fills the key it reads
    defaults = build_parser().parse_args(["drafter", "train", "--task", "longtail"])
    assert _task_recipe(defaults) == WarmRecipe()
    # on cuda, the GPU's recipe (a time budget, batch 128, every drafted position), changed by the options given
    on_gpu = build_parser().parse_args(["drafter", "train", "--task", "longtail", "--device", "cuda"])
    assert _task_recipe(on_gpu) == GPU_RECIPE
    on_gpu.unroll = 3
    assert _task_recipe(on_gpu) == replace(GPU_RECIPE, num_unroll=3)
    # --seconds is the recipe's training budget, longer than its default too (it was once only a cap on it), and
    # so part of the cache key
    longer = build_parser().parse_args(["drafter", "train", "--task", "longtail", "--seconds", "1200"])
    assert _task_recipe(longer) == replace(WarmRecipe(), train_seconds=1200.0)
    assert _task_recipe(longer).key("tiny", "arithmetic") != WarmRecipe().key("tiny", "arithmetic")


def test_drafter_train_needs_prompts_or_a_task(tmp_path, capsys):
    assert main(["drafter", "train", "--out", str(tmp_path)]) == 2
    assert "give --prompts FILE or --task NAME" in capsys.readouterr().err
    assert main(["drafter", "train", "--task", "poetry", "--model", "tiny", "--out", str(tmp_path)]) == 2
    assert "--task must be one of" in capsys.readouterr().err
