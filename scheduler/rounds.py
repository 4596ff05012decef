"""A round of drafter training, from its finished copies to a publish decision.

Once a round's leases have all come back, `start` picks a scorer and the copies to merge (the pure
policy, over the copies' index entries) and asks the scorer to merge them into a candidate and score
it and the serving draft on its recent rollouts (score_round). Scoring takes seconds, so a tick never
waits for it: `poll` reads the ScoringResult the scorer writes to job_scoring_key, and when the
candidate is not worse asks a worker to publish it (publish_candidate) to the served store, where
the workers pick it up over pub/sub. Every decision is recorded (job_drafts_key). The round under
scoring lives in the job's persisted TLT state, so a restarted scheduler decides it too.
"""

from __future__ import annotations

import logging
import time

from scheduler.commands import COMMAND_TIMEOUT_S, Commands, Reply
from scheduler.policy import CopyView, PolicySettings, choose_scorer, group_copies, should_publish
from scheduler.schemas import PublishDecision
from scheduler.state import JobTLT
from workers.draft_index import DraftIndex, job_draft_dirs
from workers.message import ProtocolError
from workers.protocol.keys import draft_namespaces, job_drafts_key, job_scoring_key
from workers.protocol.messages import ProgressRecord, ScoringRequest, ScoringResult
from workers.protocol.states import Phase, WorkerState

log = logging.getLogger(__name__)
EVAL_TIMEOUT_S = 120.0  # merging a round and scoring two drafts on ~2k recorded tokens: seconds on a CPU
PUBLISH_TIMEOUT_S = 60.0  # loading the candidate and publishing it: a checkpoint read and write
MAX_DECISIONS_KEPT = 1000  # publish decisions kept per job (GET /v1/jobs/{id}/drafts)
SCORING, PUBLISHING = "scoring", "publishing"  # a round's stage while it is undecided


class Rounds:
    def __init__(self, redis, store_dir: str, commands: Commands, settings: PolicySettings,
                 jobs: dict[str, JobTLT]) -> None:
        self.redis, self.store_dir, self.commands, self.settings = redis, store_dir, commands, settings
        self.jobs = jobs  # the watcher's TLT state of each watched job

    def start(self, job_id: str, st: JobTLT, classes: dict[str, WorkerState], phase: Phase,
              rl_steps: dict[str, int] | None = None) -> str | None:
        """Ask a free worker to merge the round's copies and score the candidate (at the job's draft_k, which the
        worker holds in its spec); returns that worker (None if no round started). `rl_steps`: each worker's
        progress record's rl_step; a worker that trained in the round and has since generated a later step's
        rollouts scores on data the copies never saw (None: every worker that trained counts as seen)."""
        steps = rl_steps or {}
        seen = [w for w in st.trained if steps.get(w, -1) <= st.trained_steps.get(w, -1)]
        scorer, held_out = choose_scorer(classes, phase, seen, leased=st.leases)
        if scorer is None:
            return None  # every worker is busy: score later, without slowing the long tail
        served_ns, copies_ns = draft_namespaces(job_id)
        copies = DraftIndex(self.redis, copies_ns)
        views, missing = [], []
        for v in st.copies:
            try:
                entry = copies.entry(v)
            except ValueError as exc:
                log.error("job %s: copy %d is not in the copies store, left out: %s", job_id, v, exc)
                missing.append(v)
                continue
            views.append(CopyView(v, entry["num_steps"], entry["extra"].get("merge_key")))
        merged, dropped = group_copies(views)
        if dropped:
            log.info("job %s: copies %s cannot be averaged with %s (another parent or draft vocabulary); dropped",
                     job_id, dropped, merged)
        serving = DraftIndex(self.redis, served_ns).latest_version()
        trained, trained_steps = st.trained, st.trained_steps  # kept with the round: a preempted scoring puts them back
        # a new round starts; leases granted meanwhile belong to it
        st.copies, st.trained, st.trained_steps = [], [], {}
        if not merged:
            return None
        st.num_rounds += 1
        round_id = f"{job_id}-r{st.num_rounds}"
        st.scoring = {"stage": SCORING, "round_id": round_id, "merged": merged, "dropped": dropped + missing,
                      "parent_version": serving or 0, "serving_version": serving, "evaluated_by": scorer,
                      "held_out": held_out, "at": time.time(), "trained": trained, "trained_steps": trained_steps}
        log.info("job %s: round %s: %s merges copies %s and scores the candidate", job_id, round_id, scorer, merged)
        self.commands.send(job_id, scorer, "score_round", ScoringRequest(round_id, merged, serving).to_dict(),
                           on_reply=lambda r: self._asked(r, round_id))
        return scorer

    def _round(self, job_id: str, round_id: str) -> tuple[JobTLT | None, dict | None]:
        st = self.jobs.get(job_id)
        if st is None or st.scoring is None or st.scoring["round_id"] != round_id:
            return None, None  # decided already (or the job ended)
        return st, st.scoring

    def _asked(self, reply: Reply, round_id: str) -> None:
        st, record = self._round(reply.job_id, round_id)
        if record is not None and reply.error is not None:
            self.finish(reply.job_id, st, f"not scored: {reply.error}")

    def poll(self, job_id: str, st: JobTLT, live: dict[str, ProgressRecord]) -> None:
        """Move the round on: its ScoringResult arrived, or its scorer is gone or too slow."""
        record = st.scoring
        if record["stage"] == PUBLISHING:
            if not self.commands.is_pending(job_id, record["publisher"], "publish_candidate"):
                self._published_before_restart(job_id, st)
            return
        result = self._result(job_id, record["round_id"])
        scorer = record["evaluated_by"]
        if result is None:
            if scorer not in live or live[scorer].state == WorkerState.FAILED:
                self.finish(job_id, st, f"not scored: evaluator {scorer} is gone")
            elif time.time() - record["at"] > EVAL_TIMEOUT_S:
                self.finish(job_id, st, f"not scored: {scorer} did not answer in {EVAL_TIMEOUT_S:.0f} s")
            return
        elapsed = max(time.time() - record["at"], 0.0)
        # whether the next round fits a tail's rest: a stopped one took longer than it ran, so the estimate grows
        st.last_scoring_s = max(st.last_scoring_s or 0.0, 2 * elapsed) if result.preempted else elapsed
        record.update(candidate=result.candidate, candidate_accepted_length=result.candidate_accepted_length,
                      serving_accepted_length=(result.serving_accepted_length if record["serving_version"] is not None
                                               else None),
                      candidate_draft_temperature=result.candidate_draft_temperature, eval_tokens=result.num_tokens)
        if result.preempted:
            self.requeue(job_id, st, result)
        elif result.error is not None:
            self.finish(job_id, st, f"not scored: {result.error}")
        elif not should_publish(result.candidate_accepted_length, record["serving_accepted_length"], self.settings):
            self.finish(job_id, st, "scored worse than the serving draft")
        else:
            self._publish(job_id, st, live)

    def _result(self, job_id: str, round_id: str) -> ScoringResult | None:
        raw = self.redis.get(job_scoring_key(job_id))
        if raw is None:
            return None
        try:
            result = ScoringResult.from_json(raw)
        except ProtocolError as exc:
            log.error("job %s: unreadable scoring result (%s)", job_id, exc)
            return None
        return result if result.round_id == round_id else None  # an earlier round's answer

    def _publish(self, job_id: str, st: JobTLT, live: dict[str, ProgressRecord]) -> None:
        record = st.scoring
        candidates = [record["evaluated_by"]] + sorted(live)  # the scorer has the candidate at hand
        publisher = next((w for w in candidates if w in live and live[w].state != WorkerState.FAILED), None)
        if publisher is None:
            self.finish(job_id, st, "not published: no live worker to publish it")
            return
        record.update(stage=PUBLISHING, publisher=publisher)
        extra = {"accepted_length": record["candidate_accepted_length"], "candidate": record["candidate"],
                 "serving_accepted_length": record["serving_accepted_length"], "round_id": record["round_id"]}
        round_id = record["round_id"]
        self.commands.send(job_id, publisher, "publish_candidate", record["candidate"],
                           record["candidate_draft_temperature"], extra, timeout_s=PUBLISH_TIMEOUT_S,
                           on_reply=lambda r: self._on_published(r, round_id))

    def _on_published(self, reply: Reply, round_id: str) -> None:
        st, record = self._round(reply.job_id, round_id)
        if record is None:
            return
        if reply.error is not None:
            self.finish(reply.job_id, st, f"not published: {reply.error}")
            return
        self._record_published(reply.job_id, st, int(reply.value))

    def _record_published(self, job_id: str, st: JobTLT, version: int) -> None:
        record = st.scoring
        record["published_version"] = version
        st.num_published += 1
        log.info("job %s: published draft v%d (accepted length %.2f vs serving %s)", job_id, version,
                 record["candidate_accepted_length"], record["serving_accepted_length"])
        self.finish(job_id, st)

    def _published_before_restart(self, job_id: str, st: JobTLT) -> None:
        """The publish answer was lost with the previous scheduler process: the served index says
        whether it happened."""
        record = st.scoring
        served = DraftIndex(self.redis, draft_namespaces(job_id)[0])
        version = next((e["version"] for e in served.versions()
                        if e["extra"].get("round_id") == record["round_id"]), None)
        if version is not None:
            self._record_published(job_id, st, version)
        elif time.time() - record["at"] > EVAL_TIMEOUT_S + PUBLISH_TIMEOUT_S + COMMAND_TIMEOUT_S:
            self.finish(job_id, st, "not published: the answer was lost with a scheduler restart")

    def requeue(self, job_id: str, st: JobTLT, result: ScoringResult) -> None:
        """The scorer's own rollouts arrived while it scored, and it stopped (rollouts come first): nothing is
        decided. The round's copies, and the workers that trained them, go back to be scored by the next free
        worker; its candidate and the copies that could not be merged are deleted."""
        record, st.scoring = st.scoring, None
        st.num_requeued += 1
        st.copies = record["merged"] + st.copies  # before the copies of leases granted since
        st.trained = list(dict.fromkeys(record.get("trained", []) + st.trained))
        st.trained_steps = record.get("trained_steps", {}) | st.trained_steps  # a later lease's step wins
        log.info("job %s: round %s: %s's rollouts arrived while it scored; copies %s wait for the next free worker",
                 job_id, record["round_id"], record["evaluated_by"], record["merged"])
        st.save(self.redis, job_id)
        if self.settings.prune_copies:
            self._prune(job_id, record["dropped"] + [v for v in [result.candidate] if v])

    def finish(self, job_id: str, st: JobTLT, reason: str | None = None) -> None:
        """Record the round's decision and start the next round afresh."""
        record, st.scoring = st.scoring, None
        if record.get("published_version") is None:
            st.num_rejected += 1
            record["reason"] = reason or "not published"
            log.info("job %s: round %s not published: %s", job_id, record["round_id"], record["reason"])
        decision = PublishDecision.model_validate({k: v for k, v in record.items()
                                                   if k in PublishDecision.model_fields})
        self.redis.rpush(job_drafts_key(job_id), decision.model_dump_json())
        self.redis.ltrim(job_drafts_key(job_id), -MAX_DECISIONS_KEPT, -1)
        st.save(self.redis, job_id)  # decided: a restart from here on does not take this round up again
        if self.settings.prune_copies:  # a published candidate lives on in the served store
            self._prune(job_id, record["merged"] + record["dropped"] + [v for v in [record.get("candidate")] if v])

    def _prune(self, job_id: str, versions: list[int]) -> None:
        """Delete the decided round's copies and candidate (a published one lives on in the served store)."""
        removed = DraftIndex(self.redis, draft_namespaces(job_id)[1]).remove(
            sorted(set(versions)), job_draft_dirs(self.store_dir, job_id)[1])
        log.info("job %s: removed copies %s of the decided round", job_id, removed)
