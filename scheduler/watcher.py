"""The watcher: reads progress, asks the pure policy, and carries out its decisions through Ray.

Each `tick()`, for every running job with TLT on: build WorkerViews from Redis progress (plus each
worker's buffer size), `decide`; preempt trainers whose GPU is needed (the rollout phase ended, or
the worker got rollouts again); grant leases to idle workers in the long tail; collect finished
leases; and once a round's leases have all come back, merge their copies into a candidate and ask a
worker that did not train on them to score it and the serving draft on its recent rollouts. The
answer is collected by a later tick (scoring takes seconds; a tick never waits for it), and the
candidate is published to the served store only if it is not worse (workers pick it up over pub/sub
and swap it in between decode steps). The decided round's copies are then deleted.

Everything a restarted scheduler needs lives in Redis (job_tlt_key: open leases, unmerged copies,
the candidate under scoring, counters) or on the workers (lease outcomes), so a restart loses no
lease and no draft version; a scoring question lost with the old process is asked again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from dataclasses import asdict, dataclass, field

import ray
from prometheus_client import CollectorRegistry, Histogram

from scheduler.jobs import JobState, JobStore, driver_name
from scheduler.policy import Phase, PolicySettings, WorkerClass, WorkerView, decide, should_publish
from workers.protocol import job_drafts_key, job_phase_key, job_tlt_key, read_progress
from workers.store import DraftStore, job_stores

log = logging.getLogger(__name__)
TICK_S = 0.5  # progress arrives at <= 10/s per worker; leases last seconds to minutes
RPC_TIMEOUT_S = 10.0  # a worker that does not answer control calls within this is treated as gone
PREEMPT_WAIT_S = 5.0  # how long a preemption waits for the trainer to confirm it stopped
EVAL_TIMEOUT_S = 120.0  # scoring two drafts on ~2k recorded tokens: seconds on a CPU
MAX_DECISIONS_KEPT = 1000  # publish decisions kept per job (GET /v1/jobs/{id}/drafts)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class JobTLT:
    """One job's scheduler-side TLT state; persisted in Redis after every change."""

    leases: dict = field(default_factory=dict)  # worker id -> {lease_id, granted_at, deadline_s, parent_version}
    copies: list = field(default_factory=list)  # finished copy versions not merged yet
    trained: list = field(default_factory=list)  # workers that trained in this round (their data is seen)
    reclaimed_worker_s: float = 0.0  # worker-seconds spent training drafters
    num_leases: int = 0
    num_published: int = 0
    num_rejected: int = 0
    published_at: dict = field(default_factory=dict)  # served version -> wall time it was published
    swaps_seen: dict = field(default_factory=dict)  # worker id -> swaps already observed
    scoring: dict | None = None  # the merged candidate of the last round while a worker scores it

    def save(self, redis, job_id: str) -> None:
        redis.hset(job_tlt_key(job_id), mapping={
            "reclaimed_worker_s": self.reclaimed_worker_s, "num_published": self.num_published,
            "num_rejected": self.num_rejected, "num_leases": self.num_leases, "active_leases": len(self.leases),
            "state": json.dumps(asdict(self))})

    @classmethod
    def load(cls, redis, job_id: str) -> JobTLT:
        raw = redis.hget(job_tlt_key(job_id), "state")
        if not raw:
            return cls()
        try:
            return cls(**json.loads(raw))
        except (json.JSONDecodeError, TypeError) as exc:
            log.error("job %s: unreadable TLT state, starting afresh: %s", job_id, exc)
            return cls()


def read_classes(raw: str | None) -> dict[str, str]:
    """The watcher's last worker classes (job_tlt_key field "classes"); {} if none or unreadable."""
    try:
        return json.loads(raw or "{}")
    except json.JSONDecodeError:
        log.error("unreadable worker classes %r", raw[:200])
        return {}


def answers(refs: dict, timeout_s: float, what: str):
    """Yield each ref of `refs` (ref -> who was asked) as its answer arrives; after `timeout_s`
    without a new one, log who did not answer and stop."""
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=timeout_s)
        if not ready:
            log.warning("%s: no answer from %s", what, [refs[r] for r in pending])
            return
        yield ready[0]


def mergeable(copies: DraftStore, versions: list[int]) -> tuple[list[int], list[int]]:
    """Split copies into the largest group (by training steps) that can be averaged, and the rest.
    Copies average only with the same parent, head shape and integer tensors: two first leases on
    different workers each pick a draft vocabulary from their own rollouts."""
    groups: dict[tuple, list[int]] = {}
    steps: dict[int, int] = {}
    for v in versions:
        state, meta = copies.load(v)
        ints = tuple((k, hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest())
                     for k, t in sorted(state.items()) if not t.is_floating_point())
        groups.setdefault((meta.parent_version, json.dumps(meta.head_config, sort_keys=True), ints), []).append(v)
        steps[v] = meta.num_steps
    best = max(groups.values(), key=lambda g: (sum(steps[v] for v in g), len(g)))
    return best, [v for v in versions if v not in best]


class Metrics:
    """Latency histograms the watcher observes (the rest of /metrics is read from Redis)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        kw = {"registry": registry, "buckets": LATENCY_BUCKETS, "labelnames": ["job"]}
        self.dispatch = Histogram("tlt_dispatch_latency_seconds", "Lease decision to the worker accepting it", **kw)
        self.preempt = Histogram("tlt_preemption_latency_seconds", "Stop signal to the trainer having stopped", **kw)
        self.swap = Histogram("tlt_swap_latency_seconds", "Draft publish to a worker serving it", **kw)


class Watcher:
    def __init__(self, store: JobStore, store_dir: str, settings: PolicySettings | None = None,
                 tick_s: float = TICK_S, metrics: Metrics | None = None) -> None:
        self.store, self.store_dir, self.tick_s = store, store_dir, tick_s
        self.settings = settings or PolicySettings()
        self.metrics = metrics or Metrics(CollectorRegistry())
        self.jobs: dict[str, JobTLT] = {}
        self._scoring: dict[str, tuple] = {}  # job -> (evaluate_drafts ref, monotonic time asked)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> threading.Thread:
        self._thread = threading.Thread(target=self._loop, daemon=True, name="tlt-watcher")
        self._thread.start()
        return self._thread

    def stop(self, join_s: float = 0.0) -> None:
        """Stop ticking; with join_s, wait that long for a tick under way to finish."""
        self._stop.set()
        if join_s and self._thread is not None:
            self._thread.join(join_s)

    def _loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.tick()
            except Exception:  # one bad tick must not stop watching
                log.exception("watcher tick failed")

    def _state(self, job_id: str) -> JobTLT:
        if job_id not in self.jobs:  # first sight, or after a restart: pick up where Redis says
            self.jobs[job_id] = JobTLT.load(self.store.redis, job_id)
        return self.jobs[job_id]

    def tick(self) -> None:
        running = set()
        for job in self.store.list():
            if job["state"] == JobState.RUNNING.value and job["spec"].get("tlt", True):
                running.add(job["job_id"])
                try:
                    self.watch_job(job["job_id"], job["spec"])
                except Exception:
                    log.exception("job %s: watcher step failed", job["job_id"])
        for job_id in set(self.jobs) - running:  # ended: its workers are gone with its driver
            st = self.jobs.pop(job_id)
            self._scoring.pop(job_id, None)
            if st.leases or st.copies or st.scoring:
                log.info("job %s ended with %d open leases, %d unmerged copies and %s under scoring (kept in the "
                         "copies store)", job_id, len(st.leases), len(st.copies),
                         f"candidate {st.scoring['candidate']}" if st.scoring else "no candidate")
                st.leases, st.copies, st.scoring = {}, [], None
                st.save(self.store.redis, job_id)

    def stores(self, job_id: str) -> tuple[DraftStore, DraftStore]:
        return job_stores(self.store.redis, f"{self.store_dir}/{job_id}", job_id)

    def watch_job(self, job_id: str, spec: dict) -> None:
        redis = self.store.redis
        raw = redis.get(job_phase_key(job_id))
        if raw is None:
            return
        phase_info = json.loads(raw)
        try:
            driver = ray.get_actor(driver_name(job_id))
            workers = ray.get(driver.worker_map.remote(), timeout=RPC_TIMEOUT_S)
        except Exception:
            return  # not started yet, or gone: the launcher records how it ended
        st = self._state(job_id)
        status = self._statuses(workers)
        self._observe_swaps(job_id, st, status)
        self._collect(job_id, st, workers)
        views = [WorkerView(r.worker_id, r.state.value, r.num_finished, r.num_total, r.timestamp,
                            status[r.worker_id].get("buffer_tokens", 0))
                 for r in read_progress(redis, job_id) if r.worker_id in status]
        phase = Phase.ROLLOUT if phase_info["phase"] == "ROLLOUT" else Phase.UPDATE
        served, _ = self.stores(job_id)
        now = time.time()
        decision = decide(views, now, phase, now - phase_info["since"], served.latest_version() or 0,
                          self.settings, leased=frozenset(st.leases))
        redis.hset(job_tlt_key(job_id), mapping={"classes": json.dumps(decision.classes),
                                                 "long_tail": int(decision.long_tail)})
        if decision.preempt:
            self._preempt(job_id, {w: workers[w] for w in decision.preempt if w in workers})
        scorer = st.scoring["evaluated_by"] if st.scoring else None
        grants = [g for g in decision.grants if g.worker_id != scorer]  # the scorer's GPU is busy scoring
        if grants:
            self._grant(job_id, st, workers, grants)
        if st.scoring is not None:
            self._poll_scoring(job_id, st, workers)
        elif not st.leases and st.copies:
            idle = [w for w, c in decision.classes.items() if c == WorkerClass.IDLE and w in workers]
            if phase == Phase.UPDATE:
                idle = list(workers)  # nothing generates: every worker is free to score drafts
            self._start_scoring(job_id, st, workers, idle, int(spec.get("draft_k", 2)))
        st.save(redis, job_id)

    # ----- the steps of a tick ------------------------------------------------------------------
    @staticmethod
    def _statuses(workers: dict) -> dict[str, dict]:
        refs = {wid: w.status.remote() for wid, w in workers.items()}
        out = {}
        for wid, ref in refs.items():
            try:
                out[wid] = ray.get(ref, timeout=RPC_TIMEOUT_S)
            except Exception as exc:
                log.info("worker %s: no status (starting, or busy): %s", wid, exc)
        return out

    def _observe_swaps(self, job_id: str, st: JobTLT, status: dict) -> None:
        for wid, s in status.items():
            swaps = s.get("swap_times", [])
            for version, began_at in swaps[st.swaps_seen.get(wid, 0):]:
                published_at = st.published_at.get(str(version))
                if published_at is not None:
                    self.metrics.swap.labels(job_id).observe(max(began_at - published_at, 0.0))
            st.swaps_seen[wid] = len(swaps)

    def _preempt(self, job_id: str, targets: dict) -> None:
        start = time.perf_counter()
        refs = {w.stop_training.remote(PREEMPT_WAIT_S): wid for wid, w in targets.items()}
        for ref in answers(refs, PREEMPT_WAIT_S + RPC_TIMEOUT_S, f"job {job_id}: preemption"):
            try:
                if ray.get(ref):
                    self.metrics.preempt.labels(job_id).observe(time.perf_counter() - start)
                    log.info("job %s: preempted the trainer on %s", job_id, refs[ref])
            except Exception as exc:
                log.warning("job %s: preempting %s failed: %s", job_id, refs[ref], exc)

    def _grant(self, job_id: str, st: JobTLT, workers: dict, grants: list) -> None:
        start = time.perf_counter()
        refs = {}
        for lease in grants:
            body = {"lease_id": f"{job_id}-{lease.worker_id}-{st.num_leases}", "parent_version": lease.parent_version,
                    "deadline_s": lease.deadline_s}
            st.num_leases += 1
            refs[workers[lease.worker_id].start_lease.remote(body)] = (lease.worker_id, body)
        for ref in answers(refs, RPC_TIMEOUT_S, f"job {job_id}: lease offers"):
            wid, body = refs[ref]
            try:
                ray.get(ref)
            except Exception as exc:
                log.warning("job %s: %s refused a lease: %s", job_id, wid, exc)
                continue
            self.metrics.dispatch.labels(job_id).observe(time.perf_counter() - start)
            st.leases[wid] = {**body, "granted_at": time.time()}
            log.info("job %s: lease %s to %s for %.1f s on v%d", job_id, body["lease_id"], wid, body["deadline_s"],
                     body["parent_version"])

    def _collect(self, job_id: str, st: JobTLT, workers: dict) -> None:
        refs = {}
        for wid, lease in list(st.leases.items()):
            if wid not in workers:
                log.warning("job %s: worker %s is gone; its lease %s is lost", job_id, wid, lease["lease_id"])
                del st.leases[wid]
                continue
            refs[wid] = workers[wid].lease_result.remote(lease["lease_id"])
        for wid, ref in refs.items():
            lease = st.leases[wid]
            try:
                outcome = ray.get(ref, timeout=RPC_TIMEOUT_S)
            except Exception as exc:
                log.warning("job %s: lease %s on %s: no answer (%s); dropped", job_id, lease["lease_id"], wid, exc)
                del st.leases[wid]
                continue
            if outcome is not None and outcome["state"] == "running":
                continue
            del st.leases[wid]
            if outcome is None:
                log.warning("job %s: %s does not know lease %s (restarted?)", job_id, wid, lease["lease_id"])
            elif outcome["state"] == "failed":
                log.error("job %s: lease %s on %s failed: %s", job_id, lease["lease_id"], wid, outcome["error"])
            else:
                result = outcome["result"]
                st.reclaimed_worker_s += float(result["seconds"])
                if wid not in st.trained:
                    st.trained.append(wid)
                if result["version"] is not None:
                    st.copies.append(int(result["version"]))
                log.info("job %s: lease %s on %s done: %d steps in %.1f s -> copy %s", job_id, lease["lease_id"], wid,
                         result["steps"], result["seconds"], result["version"])

    def _start_scoring(self, job_id: str, st: JobTLT, workers: dict, free: list[str], k: int) -> None:
        """Merge the round's copies into a candidate and ask a free worker that did not train on them
        to score it and the serving draft on its recent rollouts. The answer is collected by a later
        tick (_poll_scoring): scoring takes seconds, and the tick must keep preempting and granting."""
        held_out = [w for w in free if w not in st.trained] or free
        if not held_out:
            return  # every worker is generating: score later, without slowing the long tail
        evaluator = held_out[0]
        served, copies = self.stores(job_id)
        merged, dropped = mergeable(copies, st.copies)
        if dropped:
            log.info("job %s: copies %s cannot be averaged with %s (another parent or draft vocabulary); dropped",
                     job_id, dropped, merged)
        candidate = copies.merge_and_publish(merged)
        serving = served.latest_version()
        st.scoring = {"candidate": candidate, "merged": merged, "dropped": dropped, "parent_version": serving or 0,
                      "serving_version": serving, "k": k, "evaluated_by": evaluator,
                      "held_out": evaluator not in st.trained, "at": time.time(),
                      "candidate_accepted_length": None, "serving_accepted_length": None, "published_version": None}
        st.copies, st.trained = [], []  # a new round starts; leases granted meanwhile belong to it
        self._ask_score(job_id, st, workers)

    def _ask_score(self, job_id: str, st: JobTLT, workers: dict) -> None:
        record = st.scoring
        # the candidate is scored, and published, at its best draft temperature on the scorer's rollouts
        drafts = [{"store": "copies", "version": record["candidate"], "calibrate": True}]
        if record["serving_version"] is not None:
            drafts.append({"store": "served", "version": record["serving_version"]})
        self._scoring[job_id] = (workers[record["evaluated_by"]].evaluate_drafts.remote(drafts, record["k"], False),
                                 time.monotonic())

    def _poll_scoring(self, job_id: str, st: JobTLT, workers: dict) -> None:
        """Decide the round under scoring once its evaluator answered (or failed, or timed out)."""
        record = st.scoring
        if job_id not in self._scoring:  # a restarted scheduler: the question was lost, ask again
            if record["evaluated_by"] not in workers:
                self._decide(job_id, st, f"not scored: evaluator {record['evaluated_by']} is gone")
                return
            self._ask_score(job_id, st, workers)
        ref, asked_at = self._scoring[job_id]
        if not ray.wait([ref], timeout=0)[0]:
            if time.monotonic() - asked_at > EVAL_TIMEOUT_S:
                try:
                    ray.cancel(ref)
                except Exception as exc:  # the answer is dropped either way
                    log.info("job %s: cancelling the scoring call failed: %s", job_id, exc)
                self._decide(job_id, st, f"not scored: {record['evaluated_by']} did not answer in "
                                         f"{EVAL_TIMEOUT_S:.0f} s")
            return
        try:
            ev = ray.get(ref)
        except Exception as exc:
            cause = getattr(exc, "cause", None) or exc  # a worker's own error, not Ray's traceback around it
            self._decide(job_id, st, f"not scored: {type(cause).__name__}: {cause}"[:500])
            return
        record["candidate_accepted_length"] = ev["accepted_lengths"][0]
        record["serving_accepted_length"] = ev["accepted_lengths"][1] if record["serving_version"] is not None else None
        record["candidate_draft_temperature"] = ev.get("draft_temperatures", [None])[0]
        record["eval_tokens"] = ev["num_tokens"]
        self._decide(job_id, st)

    def _decide(self, job_id: str, st: JobTLT, failure: str | None = None) -> None:
        """Publish the scored candidate to the served store if it accepts no fewer tokens per step than
        the serving draft; record the decision; delete the round's copies and candidate file."""
        record, st.scoring = st.scoring, None
        self._scoring.pop(job_id, None)
        served, copies = self.stores(job_id)
        if failure is not None:
            record["reason"] = failure
        candidate = record["candidate"]
        if record["candidate_accepted_length"] is not None and should_publish(
                record["candidate_accepted_length"], record["serving_accepted_length"], self.settings):
            state, meta = copies.load(candidate)
            tau = record.get("candidate_draft_temperature")
            if tau is not None:  # served at the temperature it was scored at
                meta.head_config["eagle"]["draft_temperature"] = tau
            meta.extra.update(accepted_length=record["candidate_accepted_length"],
                              draft_temperature=meta.head_config["eagle"].get("draft_temperature"),
                              serving_accepted_length=record["serving_accepted_length"], candidate=candidate)
            version = served.publish(state, meta)
            record["published_version"] = version
            st.published_at[str(version)] = time.time()
            st.num_published += 1
            log.info("job %s: published draft v%d (accepted length %.2f vs serving %s)", job_id, version,
                     record["candidate_accepted_length"], record["serving_accepted_length"])
        else:
            st.num_rejected += 1
            record.setdefault("reason", "scored worse than the serving draft")
            log.info("job %s: candidate %d not published: %s", job_id, candidate, record["reason"])
        for asked in ("serving_version", "k"):  # the question's, not the decision's
            record.pop(asked)
        redis = self.store.redis
        redis.rpush(job_drafts_key(job_id), json.dumps(record))
        redis.ltrim(job_drafts_key(job_id), -MAX_DECISIONS_KEPT, -1)
        st.save(redis, job_id)  # decided: a restart from here on does not score this round again
        if self.settings.prune_copies:  # decided: a published candidate lives on in the served store
            pruned = copies.remove(record["merged"] + record["dropped"] + [candidate])
            log.info("job %s: removed copies %s of the decided round", job_id, pruned)
