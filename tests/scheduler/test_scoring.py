"""The watcher scores a round's candidate without waiting for the answer inside a tick, decides it
on a later tick, survives a restart in between, and deletes the decided round's copies.

The worker here is a Ray actor that answers `evaluate_drafts` only when the test releases it: what
is under test is the watcher's bookkeeping around a slow call (the real worker's scoring runs in
tests/scheduler/test_watcher.py's end-to-end job)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import ray

from drafter.checkpoint import DraftMeta
from drafter.eagle import EagleHead
from drafter.warmstart import head_config
from scheduler.jobs import JobStore
from scheduler.policy import PolicySettings
from scheduler.watcher import JobTLT, Watcher
from tests.conftest import tiny_model
from workers.protocol import job_drafts_key
from workers.redis_server import PrivateRedis

JOB = "job1"


@ray.remote(num_cpus=0)
class SlowScorer:
    """Answers evaluate_drafts once released, with the accepted lengths it is given (or an error)."""

    def __init__(self) -> None:
        self.released = asyncio.Event()
        self.answer: list[float] | str = []
        self.asked: list[list[dict]] = []

    async def evaluate_drafts(self, drafts: list[dict], k: int, greedy: bool) -> dict:
        self.asked.append(drafts)
        await self.released.wait()
        if isinstance(self.answer, str):
            raise ValueError(self.answer)
        # a calibrated draft is answered at draft temperature 0.6, as a worker whose rollouts preferred it
        return {"accepted_lengths": self.answer[: len(drafts)], "num_tokens": 100,
                "draft_temperatures": [0.6 if d.get("calibrate") else None for d in drafts]}

    async def release(self, answer: list[float] | str) -> None:
        self.answer = answer
        self.released.set()

    async def block(self) -> None:
        self.released.clear()

    async def questions(self) -> list[list[dict]]:
        return self.asked


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


@pytest.fixture
def setup(cluster, tmp_path):
    with PrivateRedis() as server:
        redis = server.client()
        watcher = Watcher(JobStore(redis), str(tmp_path), PolicySettings())
        yield watcher, redis, tmp_path


def add_copies(watcher: Watcher, n: int, parent: int = 0) -> list[int]:
    model = tiny_model()
    _, copies = watcher.stores(JOB)
    out = []
    for i in range(n):
        head = EagleHead(model.cfg)
        out.append(copies.publish(head.state_dict(), DraftMeta(
            version=0, parent_version=parent, policy_version=0, num_steps=3 + i, total_steps=3 + i, num_tokens=10,
            head_config=head_config(head))))
    return out


def decisions(redis) -> list[dict]:
    return [json.loads(r) for r in redis.lrange(job_drafts_key(JOB), 0, -1)]


def wait_decided(watcher: Watcher, st: JobTLT, workers: dict, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while st.scoring is not None and time.monotonic() < deadline:
        watcher._poll_scoring(JOB, st, workers)
        time.sleep(0.05)
    assert st.scoring is None, "the watcher never decided the round"


def test_scoring_is_collected_by_a_later_tick_and_the_round_is_pruned(setup):
    watcher, redis, tmp_path = setup
    scorer = SlowScorer.remote()
    workers = {"w0": scorer, "w1": scorer}
    st = JobTLT(copies=add_copies(watcher, 2), trained=["w1"])
    served, copies = watcher.stores(JOB)
    watcher._start_scoring(JOB, st, workers, ["w0", "w1"], 2)
    assert st.scoring is not None and st.copies == [] and st.trained == []  # the next round starts empty
    candidate = st.scoring["candidate"]
    assert st.scoring["merged"] == [1, 2] and candidate == 3
    assert st.scoring["evaluated_by"] == "w0" and st.scoring["held_out"]  # w1 trained on this round's data
    for _ in range(3):  # the scorer has not answered: polling returns at once and decides nothing
        watcher._poll_scoring(JOB, st, workers)
    assert st.scoring is not None and decisions(redis) == [] and served.latest_version() is None
    ray.get(scorer.release.remote([1.7]))
    wait_decided(watcher, st, workers)
    [d] = decisions(redis)
    assert d["candidate"] == candidate and d["candidate_accepted_length"] == 1.7 and d["published_version"] == 1
    assert d["serving_accepted_length"] is None and "serving_version" not in d
    assert st.num_published == 1 and served.load(1)[1].extra["candidate"] == candidate
    # published at the draft temperature it was scored at; the copies it came from said 1.0
    assert d["candidate_draft_temperature"] == 0.6
    meta = served.load(1)[1]
    assert meta.head_config["eagle"]["draft_temperature"] == 0.6 and meta.extra["draft_temperature"] == 0.6
    # decided: the round's copies and candidate are gone from the copies store, index and files
    assert copies.versions() == [] and not list((tmp_path / JOB / "copies").glob("*.safetensors"))
    assert ray.get(scorer.questions.remote()) == [[{"store": "copies", "version": candidate, "calibrate": True}]]


def test_a_restarted_watcher_asks_again_and_a_worse_candidate_is_not_published(setup):
    watcher, redis, _ = setup
    scorer = SlowScorer.remote()
    workers = {"w0": scorer}
    st = JobTLT(copies=add_copies(watcher, 1))
    watcher._start_scoring(JOB, st, workers, ["w0"], 2)
    ray.get(scorer.release.remote([1.5]))
    wait_decided(watcher, st, workers)  # v1 served, scored 1.5
    ray.get(scorer.block.remote())
    st.copies = add_copies(watcher, 2, parent=1)
    watcher._start_scoring(JOB, st, workers, ["w0"], 2)
    candidate = st.scoring["candidate"]
    st.save(redis, JOB)
    # the scheduler restarts: the question in flight is lost with the old process, the round is not
    restarted = Watcher(JobStore(redis), watcher.store_dir, PolicySettings())
    st2 = JobTLT.load(redis, JOB)
    assert st2.scoring is not None and st2.scoring["candidate"] == candidate
    restarted._poll_scoring(JOB, st2, workers)
    ray.get(scorer.release.remote([1.4, 1.6]))  # the candidate scores below the serving draft
    wait_decided(restarted, st2, workers)
    d = decisions(redis)[-1]
    assert (d["candidate"], d["candidate_accepted_length"], d["serving_accepted_length"]) == (candidate, 1.4, 1.6)
    assert d["published_version"] is None and d["reason"] == "scored worse than the serving draft"
    served, copies = restarted.stores(JOB)
    assert served.latest_version() == 1 and st2.num_rejected == 1 and copies.versions() == []
    asked = ray.get(scorer.questions.remote())
    assert asked[-1] == asked[-2] == [{"store": "copies", "version": candidate, "calibrate": True},
                                      {"store": "served", "version": 1}]


def test_a_failed_or_vanished_scorer_rejects_the_round(setup):
    watcher, redis, _ = setup
    scorer = SlowScorer.remote()
    st = JobTLT(copies=add_copies(watcher, 1))
    watcher._start_scoring(JOB, st, {"w0": scorer}, ["w0"], 2)
    ray.get(scorer.release.remote("no recorded rollouts"))
    wait_decided(watcher, st, {"w0": scorer})
    d = decisions(redis)[-1]
    assert d["published_version"] is None and "no recorded rollouts" in d["reason"] and st.num_rejected == 1
    # after a restart the evaluator is gone: the round is decided unscored, not left hanging
    st.copies = add_copies(watcher, 1)
    watcher._start_scoring(JOB, st, {"w0": scorer}, ["w0"], 2)
    restarted = Watcher(JobStore(redis), watcher.store_dir, PolicySettings())
    restarted._poll_scoring(JOB, st, {"w9": scorer})
    assert st.scoring is None and decisions(redis)[-1]["reason"] == "not scored: evaluator w0 is gone"
    assert watcher.stores(JOB)[1].versions() == [] and watcher.stores(JOB)[0].latest_version() is None


def test_pruning_can_be_turned_off(setup):
    watcher, redis, _ = setup
    watcher.settings = PolicySettings(prune_copies=False)
    scorer = SlowScorer.remote()
    st = JobTLT(copies=add_copies(watcher, 2))
    watcher._start_scoring(JOB, st, {"w0": scorer}, ["w0"], 2)
    ray.get(scorer.release.remote([1.2]))
    wait_decided(watcher, st, {"w0": scorer})
    assert [e["version"] for e in watcher.stores(JOB)[1].versions()] == [1, 2, 3]
