"""Warm drafts (JobSpec.warm_draft): validation, the fit check, publishing from a file or another job's
store, and a real job (tiny model, local Ray, real Redis) that serves the warm draft from its first rollout."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import ray

from drafter.draft.head import EagleConfig, EagleHead, head_config
from drafter.model.config import PRESETS
from drafter.train.checkpoint import DraftMeta, save_draft
from workers.job_actor import start_driver
from workers.progress import read_json_list, read_progress
from workers.protocol.keys import job_result_key, job_steps_key
from workers.protocol.messages import JobResult, StepRecord
from workers.spec import JobSpec
from workers.store import job_stores
from workers.warm import check_fits, parse_store_ref, publish_warm_draft, task_prompts

TINY = PRESETS["tiny"]


def write_draft(path, policy_cfg=TINY, extra: dict | None = None) -> str:
    """A draft checkpoint for `policy_cfg` as `tlt drafter train` writes one (untrained weights)."""
    head = EagleHead(policy_cfg, EagleConfig())
    meta = DraftMeta(version=1, parent_version=0, policy_version=0, head_config=head_config(head),
                     extra=extra or {"warm_start": True, "acceptance": {"2": 1.8}, "expected_accepted_length_t1": 1.5})
    save_draft(path, head.state_dict(), meta)
    return str(path)


@pytest.mark.parametrize("value", ["draft.safetensors", "store:job1", "store:job1:0", "store:a b:1", ""])
def test_malformed_warm_draft_is_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="warm_draft"):
        JobSpec(warm_draft=value)


def test_warm_draft_accepts_paths_and_store_versions():
    assert JobSpec().warm_draft is None
    assert JobSpec(warm_draft="/models/draft-v000001.safetensors").warm_draft.endswith(".safetensors")
    assert JobSpec(warm_draft="store:3f2a9c:12").warm_draft == "store:3f2a9c:12"
    assert parse_store_ref("store:3f2a9c:12") == ("3f2a9c", 12) and parse_store_ref("./d.safetensors") is None


def test_a_head_for_another_policy_does_not_fit():
    head_cfg = {"policy": dataclasses.replace(TINY, hidden_size=32, head_dim=8).to_dict(), "eagle": {}}
    with pytest.raises(ValueError, match="warm_draft x does not fit the policy: .*hidden size 32"):
        check_fits(head_cfg, TINY, "x")
    head_cfg = {"policy": dataclasses.replace(TINY, vocab_size=128).to_dict(), "eagle": {}}
    with pytest.raises(ValueError, match="vocabulary 128"):
        check_fits(head_cfg, TINY, "x")
    with pytest.raises(ValueError, match="does not describe a head"):
        check_fits({}, TINY, "x")
    # a draft of the layout before EAGLE-3 (its head_config has no format) is refused, not loaded
    with pytest.raises(ValueError, match="warm_draft x is a draft of another layout"):
        check_fits({"policy": TINY.to_dict(), "eagle": {"num_layers": 1}}, TINY, "x")
    fused = head_config(EagleHead(TINY, EagleConfig(aux_layer_ids=(0, 1, 2))))
    deeper = dataclasses.replace(TINY, num_layers=1)
    with pytest.raises(ValueError, match="warm_draft x: aux_layer_ids"):
        check_fits({**fused, "policy": deeper.to_dict()}, deeper, "x")


def test_the_warm_cache_key_names_the_draft_layout(monkeypatch):
    """A warm draft cached in another layout is never found: the key covers DRAFT_FORMAT."""
    import workers.warm as warm

    recipe = warm.WarmRecipe()
    before = recipe.key("m", "arithmetic")
    monkeypatch.setattr(warm, "DRAFT_FORMAT", "eagle3-next")
    assert recipe.key("m", "arithmetic") != before


def test_the_cpu_and_gpu_recipes_train_to_a_time_budget():
    """WarmRecipe() (the CPU's, the demo's cache key and the shipped draft's) trains 4 positions weighed by reach
    for 15 minutes, in bf16 only where the box has it natively (None: the trainer asks fast_bf16); GPU_RECIPE
    (cuda's default) trains every position inference drafts, in float32 (autocast ran slower there), to a budget
    that keeps a warm start within 5 minutes."""
    from drafter.model.config import TrainConfig
    from workers.warm import GPU_RECIPE, WarmRecipe, default_recipe

    assert default_recipe("cpu") == WarmRecipe() and default_recipe("cuda") == GPU_RECIPE
    cpu = WarmRecipe()
    assert cpu.train_config() == TrainConfig(total_steps=cpu.num_steps, num_unroll=4, position_loss="reach",
                                             anneal_to_budget=True, bf16_autocast=None)
    assert cpu.train_seconds == 900.0 and cpu.tail_fraction == 0.75 and cpu.max_new_tokens >= 256
    gpu = GPU_RECIPE.train_config()
    assert (gpu.num_unroll, gpu.position_loss, gpu.anneal_to_budget, gpu.bf16_autocast) == (6, "reach", True, False)
    assert GPU_RECIPE.train_seconds <= 240 and GPU_RECIPE.batch_size >= 128 and GPU_RECIPE.temperature == 1.0


def test_a_recipe_with_a_time_budget_trains_to_it_on_its_prompts_and_the_extra_ones(tmp_path):
    """warm_start_by_recipe (the one recipe of `tlt drafter train` and `tlt bench gpu`): the task's prompts and the
    extra ones are harvested, and a recipe with train_seconds stops there, however many steps it allows."""
    from drafter.model.loading import load_model
    from workers.warm import WarmRecipe, warm_start_by_recipe

    recipe = WarmRecipe(num_prompts=4, num_eval_prompts=0, max_new_tokens=8, num_steps=10**6, train_seconds=1.0,
                        batch_size=8, draft_vocab_size=32)
    report = warm_start_by_recipe(load_model("tiny"), "arithmetic", tmp_path, recipe,
                                  extra_prompts=("Write a poem.", "Count to ten."), progress=lambda msg: None)
    assert report["num_prompts"] == 6 and report["num_harvested_tokens"] > 0
    assert 0 < report["train_steps"] < 10**6 and 1.0 <= report["train_seconds"] < 10
    assert Path(report["path"]).is_file() and report["acceptance"] == {}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_warm_draft_is_harvested_in_the_recipes_policy_dtype_and_trained_in_float32(tmp_path, device, dtype):
    """build_warm_draft loads the policy in recipe.policy_dtype (the precision workers serve it in), harvests and
    evaluates with it there, and trains a float32 head (the optimizer's masters) whatever that precision."""
    import torch

    from drafter.train.checkpoint import load_draft
    from workers.warm import WarmRecipe, build_warm_draft

    recipe = WarmRecipe(num_prompts=4, num_eval_prompts=2, max_new_tokens=8, num_steps=3, train_seconds=None,
                        batch_size=4, draft_vocab_size=32, policy_dtype=dtype)
    report = build_warm_draft("tiny", "arithmetic", tmp_path, device, recipe)
    assert report["policy_dtype"] == dtype and report["device"].startswith(device)
    assert report["train_steps"] == 3 and set(report["acceptance"]) == {"2", "3", "4"}
    state, _ = load_draft(report["path"])
    assert {t.dtype for t in state.values() if t.is_floating_point()} == {torch.float32}
    with pytest.raises(ValueError, match="policy_dtype must be one of auto, float32, bfloat16, got 'half'"):
        build_warm_draft("tiny", "arithmetic", tmp_path, device, dataclasses.replace(recipe, policy_dtype="half"))


def test_publish_from_a_file_and_from_another_jobs_store(redis_client, tmp_path):
    served, _ = job_stores(redis_client, tmp_path, "dst")
    path = write_draft(tmp_path / "draft-v000001.safetensors")
    assert publish_warm_draft(path, served, redis_client, tmp_path, TINY, draft_k=2) == 1
    state, meta = served.load(1)
    assert meta.extra["warm_draft"] == path and meta.extra["accepted_length"] == 1.5  # the lower measurement
    assert meta.parent_version == 0 and meta.head_config["policy"]["hidden_size"] == TINY.hidden_size
    # another job's served version, by reference
    other, _ = job_stores(redis_client, tmp_path, "dst2")
    assert publish_warm_draft("store:dst:1", other, redis_client, tmp_path, TINY, draft_k=2) == 1
    assert other.load(1)[1].extra["warm_draft"] == "store:dst:1"
    with pytest.raises(ValueError, match="warm_draft store:dst:7: version 7 is not in"):
        publish_warm_draft("store:dst:7", other, redis_client, tmp_path, TINY, draft_k=2)
    with pytest.raises(ValueError, match="warm_draft: no such file"):
        publish_warm_draft(str(tmp_path / "missing.safetensors"), other, redis_client, tmp_path, TINY, draft_k=2)
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(Path(path).read_bytes()[:-7])
    with pytest.raises(ValueError, match="warm_draft .*corrupt.safetensors"):
        publish_warm_draft(str(corrupt), other, redis_client, tmp_path, TINY, draft_k=2)


def test_a_shipped_draft_is_the_cached_one_in_bf16_and_is_served_in_float32(redis_client, tmp_path, monkeypatch):
    """ship_warm_draft (`make ship-draft`) copies the draft cached for WarmRecipe() to SHIPPED_DRAFTS in bf16 with
    its report, the recipe and provenance; shipped_warm_draft finds it; a job publishes it in float32, each weight
    its bf16 rounding. Nothing cached: a ValueError that says to build one first."""
    import json

    import torch

    from drafter.train.checkpoint import load_draft
    from workers import warm

    monkeypatch.setenv("TLT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(warm, "SHIPPED_DRAFTS", tmp_path / "shipped")
    with pytest.raises(ValueError, match="no warm draft cached in .*: build it first"):
        warm.ship_warm_draft("tiny", "arithmetic")
    assert warm.shipped_warm_draft("tiny", "arithmetic") is None
    cached = warm.warm_cache_dir("tiny", "arithmetic", warm.WarmRecipe())
    cached.mkdir(parents=True)
    write_draft(cached / "draft-v000001.safetensors")
    (cached / warm.WARM_REPORT).write_text(json.dumps({"acceptance": {"2": 1.8}}))
    path = warm.ship_warm_draft("tiny", "arithmetic")
    assert warm.shipped_warm_draft("tiny", "arithmetic") == path == tmp_path / "shipped/tiny-arithmetic" / path.name
    report = json.loads((path.parent / warm.WARM_REPORT).read_text())
    assert report["acceptance"] == {"2": 1.8} and report["recipe"]["train_seconds"] == warm.WarmRecipe().train_seconds
    assert {"commit", "machine", "date"} <= set(report["shipped"])
    original, _ = load_draft(cached / "draft-v000001.safetensors")
    stored, meta = load_draft(path)
    assert {t.dtype for t in stored.values() if t.is_floating_point()} == {torch.bfloat16}
    served, _ = job_stores(redis_client, tmp_path, "job")
    assert publish_warm_draft(str(path), served, redis_client, tmp_path, TINY, draft_k=2) == 1
    state, _ = served.load(1)
    for name, weight in original.items():
        expected = weight.bfloat16().float() if weight.is_floating_point() else weight
        assert state[name].dtype == expected.dtype and torch.equal(state[name], expected), name


def test_task_prompts_by_name_are_seeded():
    assert task_prompts("arithmetic", 1, 3) == task_prompts("arithmetic", 1, 3)
    assert task_prompts("arithmetic", 1, 3) != task_prompts("arithmetic", 2, 3)
    with pytest.raises(ValueError, match="--task must be one of"):
        task_prompts("poetry", 0, 1)


# ----- a real job -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


def spec(**kw) -> dict:
    return JobSpec(**({"model": "tiny", "num_steps": 1, "num_prompts_per_step": 2, "max_new_tokens": 8,
                       "num_workers": 2, "group_size": 2, "draft_k": 2, "speculation": "always"} | kw))


def run_job(job_id: str, redis_url: str, store_dir, **kw):
    driver = start_driver(job_id, spec(**kw), redis_url, str(store_dir), is_detached=False)
    try:
        return ray.get(driver.run.remote(), timeout=300)
    finally:
        ray.kill(driver)


def test_a_job_with_a_warm_draft_serves_it_from_its_first_rollout(ray_cluster, private_redis, redis_client,
                                                                  tmp_path):
    path = write_draft(tmp_path / "warm.safetensors")
    result = run_job("jw1", private_redis.url, tmp_path, warm_draft=path)
    assert result["ok"], result
    served, _ = job_stores(redis_client, tmp_path, "jw1")
    assert served.latest_version() == 1 and served.entry(1)["extra"]["warm_draft"] == path
    step = StepRecord.from_dict(read_json_list(redis_client, job_steps_key("jw1"))[0])
    assert step.draft_versions == {"w0": 1, "w1": 1}  # every completion of step 0 was drafted by v1
    assert step.num_tokens > 0 and step.mean_accepted_length >= 1.0
    progress = read_progress(redis_client, "jw1")
    assert sorted(p.worker_id for p in progress) == ["w0", "w1"]
    assert all(p.draft_version == 1 and p.num_swaps == 1 and p.last_swap_version == 1 for p in progress)


def test_a_warm_draft_for_another_policy_fails_the_job_with_a_clear_error(ray_cluster, private_redis,
                                                                          redis_client, tmp_path):
    path = write_draft(tmp_path / "big.safetensors", dataclasses.replace(TINY, hidden_size=32, head_dim=8))
    with pytest.raises(ValueError, match="does not fit the policy"):
        run_job("jw2", private_redis.url, tmp_path, warm_draft=path)
    result = JobResult.from_json(redis_client.get(job_result_key("jw2")))
    assert not result.ok and result.steps == 0
    assert result.error == (f"at start: ValueError: warm_draft {path} does not fit the policy: the head was trained "
                            f"for hidden size 32 and vocabulary 64, the policy has 64 and 64")
    assert job_stores(redis_client, tmp_path, "jw2")[0].latest_version() is None  # nothing was published
