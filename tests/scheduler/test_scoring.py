"""The watcher's rounds: a round's copies are scored by a worker without a tick waiting for it, the
answer is read from Redis on a later tick (also by a restarted scheduler), a candidate that is not
worse is published by a worker, and the decided round's copies are deleted.

The worker here is a Ray actor under the rollout worker's name that merges the copies for real
(DraftStore) and publishes with the real workers.scoring.Scorer, but answers scoring only when the
test releases it, with the accepted lengths the test gives: what is under test is the watcher's
bookkeeping around slow work (the real worker's scoring runs in test_watcher.py's end-to-end job)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import ray

from drafter.draft.head import EagleHead, head_config
from drafter.train.checkpoint import DraftMeta
from scheduler.jobs import JobStore
from scheduler.policy import PolicySettings
from scheduler.state import JobTLT
from scheduler.watcher import Watcher
from tests.conftest import tiny_model
from workers.protocol.client import connect
from workers.protocol.keys import RAY_NAMESPACE, job_drafts_key, job_scoring_key, worker_actor_name
from workers.protocol.messages import ProgressRecord, ScoringRequest, ScoringResult
from workers.protocol.states import Phase, WorkerState
from workers.redis_server import PrivateRedis
from workers.scoring import Scorer
from workers.spec import JobSpec
from workers.store import job_stores

JOB = "job1"
PREEMPTED = "preempted"  # SlowScorer's answer: stopped for its worker's rollouts
IDLE = {"w0": WorkerState.IDLE, "w1": WorkerState.IDLE}


@ray.remote(num_cpus=0)
class SlowScorer:
    def __init__(self, redis_url: str, store_dir: str, worker_id: str) -> None:
        self.redis, self.worker_id = connect(redis_url), worker_id
        served, self.copies = job_stores(self.redis, store_dir, JOB)
        self.scorer = Scorer(JobSpec(), self.redis, None, None, served, self.copies, None)  # publish_candidate's
        self.released = asyncio.Event()
        self.answer: list[float] | str = []
        self.asked: list[dict] = []

    async def score_round(self, request: dict) -> None:
        self.asked.append(request)
        asyncio.get_running_loop().create_task(self._score(ScoringRequest.from_dict(request)))

    async def _score(self, req: ScoringRequest) -> None:
        await self.released.wait()
        result = ScoringResult(req.round_id, self.worker_id, num_tokens=100)
        if self.answer == PREEMPTED:  # the scorer's rollouts arrived after it merged the copies
            result.candidate = self.copies.merge_and_publish(list(req.copies))
            result.error, result.preempted = "preempted: stopped before the last batch", True
        elif isinstance(self.answer, str):
            result.error = self.answer
        else:  # a calibrated candidate, answered at draft temperature 0.6
            result.candidate = self.copies.merge_and_publish(list(req.copies))
            result.candidate_accepted_length, result.candidate_draft_temperature = self.answer[0], 0.6
            if req.serving_version is not None:
                result.serving_accepted_length = self.answer[1]
        self.redis.set(job_scoring_key(JOB), result.to_json())

    async def publish_candidate(self, candidate: int, draft_temperature: float | None, extra: dict) -> int:
        return self.scorer.publish_candidate(candidate, draft_temperature, extra)

    async def release(self, answer: list[float] | str) -> None:
        self.answer = answer
        self.released.set()

    async def block(self) -> None:
        self.released.clear()

    async def questions(self) -> list[dict]:
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
        scorer = SlowScorer.options(name=worker_actor_name(JOB, "w0"), namespace=RAY_NAMESPACE).remote(
            server.url, str(tmp_path), "w0")
        ray.get(scorer.questions.remote())  # started: a command's timeout measures the answer, not the start-up
        yield watcher, redis, tmp_path, scorer
        ray.kill(scorer)


def live(*worker_ids: str) -> dict[str, ProgressRecord]:
    return {w: ProgressRecord(JOB, w, WorkerState.IDLE, 0, 4, 4, 10, 1.0, 1.0, 0, 0, 0, time.time())
            for w in worker_ids}


def add_copies(tmp_path, redis, n: int, parent: int = 0) -> list[int]:
    model = tiny_model()
    _, copies = job_stores(redis, tmp_path, JOB)
    out = []
    for i in range(n):
        head = EagleHead(model.cfg)
        out.append(copies.publish(head.state_dict(), DraftMeta(
            version=0, parent_version=parent, policy_version=0, num_steps=3 + i, total_steps=3 + i, num_tokens=10,
            head_config=head_config(head), extra={"merge_key": f"parent-{parent}"})))
    return out


def decisions(redis) -> list[dict]:
    return [json.loads(r) for r in redis.lrange(job_drafts_key(JOB), 0, -1)]


def start(watcher: Watcher, st: JobTLT, classes=IDLE) -> None:
    watcher.jobs[JOB] = st
    watcher.rounds.start(JOB, st, classes, Phase.ROLLOUT)


def wait_decided(watcher: Watcher, st: JobTLT, workers: dict, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while st.scoring is not None and time.monotonic() < deadline:
        watcher.commands.poll()
        if st.scoring is not None:
            watcher.rounds.poll(JOB, st, workers)
        time.sleep(0.05)
    assert st.scoring is None, "the watcher never decided the round"


def test_scoring_is_collected_by_a_later_tick_and_the_round_is_pruned(setup):
    watcher, redis, tmp_path, scorer = setup
    st = JobTLT(copies=add_copies(tmp_path, redis, 2), trained=["w1"])
    served, copies = job_stores(redis, tmp_path, JOB)
    start(watcher, st)
    assert st.scoring is not None and st.copies == [] and st.trained == []  # the next round starts empty
    assert st.scoring["merged"] == [1, 2] and st.scoring["round_id"] == f"{JOB}-r1"
    assert st.scoring["evaluated_by"] == "w0" and st.scoring["held_out"]  # w1 trained on this round's data
    for _ in range(3):  # the scorer has not answered: polling returns at once and decides nothing
        watcher.commands.poll()
        watcher.rounds.poll(JOB, st, live("w0", "w1"))
    assert st.scoring is not None and decisions(redis) == [] and served.latest_version() is None
    ray.get(scorer.release.remote([1.7]))
    wait_decided(watcher, st, live("w0", "w1"))
    [d] = decisions(redis)
    assert d["candidate"] == 3 and d["candidate_accepted_length"] == 1.7 and d["published_version"] == 1
    assert d["serving_accepted_length"] is None and d["eval_tokens"] == 100 and d["reason"] is None
    assert "serving_version" not in d and "stage" not in d
    assert st.num_published == 1 and served.load(1)[1].extra["candidate"] == 3
    # published at the draft temperature it was scored at; the copies it came from said 1.0
    assert d["candidate_draft_temperature"] == 0.6
    meta = served.load(1)[1]
    assert meta.head_config["eagle"]["draft_temperature"] == 0.6 and meta.extra["draft_temperature"] == 0.6
    assert meta.extra["accepted_length"] == 1.7 and meta.extra["round_id"] == d["round_id"]
    # decided: the round's copies and candidate are gone from the copies store, index and files
    assert copies.versions() == [] and not list((tmp_path / JOB / "copies").glob("*.safetensors"))
    [asked] = ray.get(scorer.questions.remote())
    # the draft length is not asked for: the scorer scores at its own JobSpec's draft_k
    assert asked == {"round_id": f"{JOB}-r1", "copies": [1, 2], "serving_version": None}


def test_a_worker_that_trained_in_the_round_scores_it_only_once_its_next_rollout_is_in(setup):
    """The only free worker trained in the round: its rollouts are what the copies trained on, so the round waits
    (its copies kept) until the worker's record is of a later step; then it scores, held out."""
    watcher, redis, tmp_path, scorer = setup
    copies = add_copies(tmp_path, redis, 1)
    st = JobTLT(copies=list(copies), trained=["w0"], trained_steps={"w0": 2})
    watcher.jobs[JOB] = st
    only_w0 = {"w0": WorkerState.IDLE}
    assert watcher.rounds.start(JOB, st, only_w0, Phase.ROLLOUT, {"w0": 2}) is None
    assert st.scoring is None and st.copies == copies and st.num_rounds == 0 and decisions(redis) == []
    assert watcher.rounds.start(JOB, st, only_w0, Phase.ROLLOUT) is None  # no records: counted as seen
    assert watcher.rounds.start(JOB, st, only_w0, Phase.ROLLOUT, {"w0": 3}) == "w0"
    assert st.scoring["held_out"] and st.trained == [] and st.trained_steps == {}
    ray.get(scorer.release.remote([1.7]))
    wait_decided(watcher, st, live("w0"))
    assert decisions(redis)[-1]["published_version"] == 1
    # the state, with the steps, survives a restart
    st.trained_steps = {"w1": 4}
    st.save(redis, JOB)
    assert JobTLT.load(redis, JOB).trained_steps == {"w1": 4}


def test_a_restarted_watcher_reads_the_answer_and_a_worse_candidate_is_not_published(setup):
    watcher, redis, tmp_path, scorer = setup
    st = JobTLT(copies=add_copies(tmp_path, redis, 1))
    start(watcher, st)
    ray.get(scorer.release.remote([1.5]))
    wait_decided(watcher, st, live("w0"))  # v1 served, scored 1.5
    ray.get(scorer.block.remote())
    st.copies = add_copies(tmp_path, redis, 2, parent=1)
    start(watcher, st)
    round_id = st.scoring["round_id"]
    st.save(redis, JOB)
    # the scheduler restarts while the worker scores: the answer lands in Redis, the new process reads it
    restarted = Watcher(JobStore(redis), str(tmp_path), PolicySettings())
    st2 = JobTLT.load(redis, JOB)
    assert st2.scoring is not None and st2.scoring["round_id"] == round_id and st2.scoring["serving_version"] == 1
    restarted.jobs[JOB] = st2
    restarted.rounds.poll(JOB, st2, live("w0"))
    assert st2.scoring is not None  # not answered yet
    ray.get(scorer.release.remote([1.4, 1.6]))  # the candidate scores below the serving draft
    wait_decided(restarted, st2, live("w0"))
    d = decisions(redis)[-1]
    assert (d["round_id"], d["candidate_accepted_length"], d["serving_accepted_length"]) == (round_id, 1.4, 1.6)
    assert d["published_version"] is None and d["reason"] == "scored worse than the serving draft"
    served, copies = job_stores(redis, tmp_path, JOB)
    assert served.latest_version() == 1 and st2.num_rejected == 1 and copies.versions() == []
    assert len(ray.get(scorer.questions.remote())) == 2  # asked once per round, not again after the restart


def test_a_failed_or_vanished_scorer_rejects_the_round(setup):
    watcher, redis, tmp_path, scorer = setup
    st = JobTLT(copies=add_copies(tmp_path, redis, 1))
    start(watcher, st)
    ray.get(scorer.release.remote("ValueError: worker w0 has no rollouts its own leases did not train on to score "
                                  "drafts on"))
    wait_decided(watcher, st, live("w0"))
    d = decisions(redis)[-1]
    assert d["published_version"] is None and "no rollouts" in d["reason"] and st.num_rejected == 1
    assert d["reason"].startswith("not scored: ")
    # the scorer's progress record is gone (or says FAILED): the round is decided unscored, not left hanging
    ray.get(scorer.block.remote())
    st.copies = add_copies(tmp_path, redis, 1)
    start(watcher, st)
    watcher.rounds.poll(JOB, st, live("w1"))
    assert st.scoring is None and decisions(redis)[-1]["reason"] == "not scored: evaluator w0 is gone"
    # a worker with no actor refuses at once
    st.copies = add_copies(tmp_path, redis, 1)
    start(watcher, st, {"w7": WorkerState.IDLE})
    assert st.scoring is None and decisions(redis)[-1]["reason"].startswith("not scored: worker w7 has no actor")
    served, copies = job_stores(redis, tmp_path, JOB)
    assert copies.versions() == [] and served.latest_version() is None


def test_a_scoring_its_scorers_rollouts_preempted_is_scored_again_later(setup):
    """The scorer's rollouts arrived while it scored (a worker stops scoring for them): nothing is decided, the
    round's copies and the workers that trained them wait for the next free worker, its candidate is deleted."""
    watcher, redis, tmp_path, scorer = setup
    copies = add_copies(tmp_path, redis, 2)
    st = JobTLT(copies=list(copies), trained=["w1"], trained_steps={"w1": 2})
    t0 = time.time()
    start(watcher, st)
    t1 = time.time()
    assert st.copies == [] and st.trained == []
    st.trained_steps = {"w1": 3}  # a lease granted meanwhile
    time.sleep(0.3)
    released = time.time()
    ray.get(scorer.release.remote(PREEMPTED))
    wait_decided(watcher, st, live("w0", "w1"))
    assert decisions(redis) == [] and st.num_rejected == 0 and st.num_rounds == 1 and st.num_requeued == 1
    # it took longer than it ran: the next round is asked for only where twice that time is left
    assert released - t1 <= st.last_scoring_s / 2 <= time.time() - t0
    assert st.copies == copies and st.trained == ["w1"] and st.trained_steps == {"w1": 3}
    _, store = job_stores(redis, tmp_path, JOB)
    assert [e["version"] for e in store.versions()] == copies  # the preempted round's candidate is gone
    assert JobTLT.load(redis, JOB).copies == copies  # saved: a restarted scheduler scores them too
    ray.get(scorer.release.remote([1.7]))
    start(watcher, st, {"w0": WorkerState.IDLE})
    wait_decided(watcher, st, live("w0", "w1"))
    [d] = decisions(redis)
    assert d["merged"] == copies and d["published_version"] == 1 and d["round_id"] == f"{JOB}-r2"


def test_no_free_worker_means_no_round_yet_and_pruning_can_be_turned_off(setup):
    watcher, redis, tmp_path, scorer = setup
    st = JobTLT(copies=add_copies(tmp_path, redis, 2))
    start(watcher, st, {"w0": WorkerState.STRAGGLER, "w1": WorkerState.TRAINING})
    assert st.scoring is None and st.copies == [1, 2]  # kept for a later tick
    watcher.settings = watcher.rounds.settings = PolicySettings(prune_copies=False)
    start(watcher, st)
    ray.get(scorer.release.remote([1.2]))
    wait_decided(watcher, st, live("w0"))
    assert [e["version"] for e in job_stores(redis, tmp_path, JOB)[1].versions()] == [1, 2, 3]
