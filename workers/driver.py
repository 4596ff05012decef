"""Job driver: runs GRPO steps over a set of rollout workers and records what each phase took.

Per step: push the policy weights (once per version, through the Ray object store), split the
prompt groups among the workers, gather responses (a failed worker's share is lost, the others'
are kept), score them, recompute log-probabilities with the POLICY, update it, record timings. Workers
whose engine harvests no drafter-training pairs get them from those forwards (workers.learner_pairs).
The Ray actor around it is workers.job_actor.JobDriver, which also records how the run ended.
"""

from __future__ import annotations

import copy
import logging
import time

import ray
import redis as redis_lib
import torch
from ray.exceptions import RayError

from drafter.model.loading import cast_state, encode_text, load_model
from workers.actors import start_worker
from workers.device import job_device, policy_dtype
from workers.engines import unavailable_reason
from workers.errors import WorkerError, one_line
from workers.grpo import group_advantages, grpo_update, response_mask, sequence_logprobs, update_rows
from workers.job_records import JobRecords
from workers.learner_pairs import LearnerPairs, PairShipments, wanted_owners
from workers.pinning import usable_cores
from workers.policy_checkpoint import commit_policy, load_policy, policy_checkpoint_path, stage_policy
from workers.policy_sync import PolicyFiles
from workers.protocol.keys import job_steps_key
from workers.protocol.messages import PhaseRecord, StepRecord
from workers.protocol.states import Phase
from workers.rollout import BUFFER_BYTES, BUFFER_DTYPE
from workers.spec import JobSpec
from workers.step_data import (
    assign,
    length_percentiles,
    rollout_seed,
    shareable_state,
    sum_buckets,
    sum_served,
)
from workers.store import job_stores
from workers.tasks import StepProblems, get_reward
from workers.warm import publish_warm_draft
from workers.worker_start import await_started, cluster_gpus

log = logging.getLogger(__name__)
# a rollout worker lost mid-job is started again at the next step, at most this many times per slot (one that
# keeps dying, e.g. out of memory, would otherwise be restarted every step); beyond it the job runs degraded
MAX_WORKER_RESTARTS = 2
# a worker loads its model in seconds (a vLLM engine on CPU in about a minute), and Ray may take minutes to free a
# GPU (another job ending); one not started after this was not placed (a lost node's GPUs) or hangs: it is dropped
MAX_WORKER_START_S = 300.0


class Driver:
    def __init__(self, job_id: str, spec: JobSpec, redis: redis_lib.Redis, redis_url: str, store_dir: str,
                 placement_group=None) -> None:
        self.job_id, self.spec, self.redis = job_id, spec, redis
        self.placement_group = placement_group  # the job's GPUs, placed by the scheduler's queue: worker i in bundle i
        # one clear line now, not a worker's traceback later; the driver holds no GPU: each worker checks its own
        reason = unavailable_reason(spec.engine, needs_gpu=False)
        if reason is not None:
            raise ValueError(reason)
        torch.manual_seed(spec.seed)
        # the learner on the job's device: under Ray the driver asks for no GPU and sees its node's (Ray >= 2.49
        # no longer hides them from actors that asked for none), so it runs beside the rollout workers, whose
        # phases it alternates with (workers.device)
        self.device = job_device(spec.device)
        loaded = load_model(spec.model, device=self.device)
        self.policy, self.tokenizer = loaded.model, loaded.tokenizer
        self.policy_version = 0
        self.num_steps_done = 0
        self.rl_step: int | None = None  # the step under way (None: still starting), and its phase: where it failed
        self.phase: Phase | None = None
        self.reward_fn = get_reward(spec.reward)
        # drawn step by step (a job's every problem up front grew a 100,000-step driver by 52 MB/s, issue 34)
        self.problems = StepProblems(spec.task, spec.seed, spec.num_prompts_per_step, spec.dataset_path)
        self.warm_version = self._publish_warm_draft(redis, store_dir)  # before the workers start: they install it
        self.served = job_stores(redis, store_dir, job_id)[0]
        self.published_up_to = self.served.latest_version() or 0  # versions after it are a step's new ones
        self.worker_ids = [f"w{i}" for i in range(spec.num_workers)]
        self.redis_url, self.store_dir = redis_url, store_dir
        self.restarts: dict[str, int] = {}  # worker id -> times it was started again after it was lost
        self.policy_files = PolicyFiles(store_dir, job_id)  # weight sync to the workers on this node
        self.policy_files.clear()  # any a driver of this job left when it died
        self.lost: list[str] = []  # "w1 at step 3", each loss, for the run's warning
        self.shipments = PairShipments(job_id)  # learner pairs on their way to workers (workers.learner_pairs)
        self.workers = {wid: start_worker(job_id, wid, spec, redis_url, store_dir, i,
                                          placement_group=placement_group) for i, wid in enumerate(self.worker_ids)}
        # wait for them to start (load the model) so that step 0's weight sync times the sync alone; one that
        # failed to start is dropped at that sync, with its error, as a worker lost mid-job would be; one not
        # placed in MAX_WORKER_START_S is killed and the job runs without it (degraded, its warning says)
        failed = self._await_workers(list(self.workers), "start")
        if len(failed) == len(self.workers):  # none is up (the others were not placed): nothing to run on
            why = [f"{wid}: {error}" for wid, error in failed.items()] + self.lost
            raise RuntimeError(f"no rollout worker started: {'; '.join(why)}; the Ray cluster has {cluster_gpus()} "
                               f"GPUs, the job asks {spec.gpus_per_worker:g} per worker")
        # the learner phases (log-probs, update) run here once the rollout has ended: on every core this
        # process may use (Ray starts actors with one thread; the workers pin themselves to their own cores)
        torch.set_num_threads(len(usable_cores()))
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=spec.lr)
        # a frozen copy of the initial policy, only when the KL term is on
        self.ref_model = copy.deepcopy(self.policy).requires_grad_(False) if spec.kl_coef > 0 else None
        self.checkpoint_path = policy_checkpoint_path(store_dir, job_id)
        self.resumed: list[str] = []  # "after step 3 (steps 4..5 redone)", each resume, for the run's warning
        if self.checkpoint_path.is_file():
            self._resume()
        self.records = JobRecords(redis, job_id, store_dir)  # what it writes back if Redis comes back empty

    def _resume(self) -> None:
        """Continue from the policy checkpoint a driver of this job wrote before it died: the policy and its
        optimizer as they were after that step; the step records past it are dropped (those steps run again)."""
        step, self.policy_version = load_policy(self.checkpoint_path, self.policy, self.optimizer)
        recorded = self.redis.llen(job_steps_key(self.job_id))
        self.redis.ltrim(job_steps_key(self.job_id), 0, step)  # keep records 0..step
        self.num_steps_done = step + 1
        redone = f" (steps {step + 1}..{recorded - 1} redone)" if recorded > step + 1 else ""
        self.resumed.append(f"after step {step}{redone}")
        log.warning("job %s: resumed from its policy checkpoint after step %d%s", self.job_id, step, redone)

    def _stage_checkpoint(self, rl_step: int, t: dict) -> bool:
        """Every spec.checkpoint_every steps (not after the last: nothing would resume from it), written beside
        the resume point; the step's record lands before commit_policy makes it the resume point, so a driver
        dying between the two redoes the step instead of skipping its record. Returns whether it wrote one."""
        every = self.spec.checkpoint_every
        if not every or (rl_step + 1) % every or rl_step + 1 >= self.spec.num_steps:
            return False
        t0 = time.perf_counter()
        stage_policy(self.checkpoint_path, self.policy, self.optimizer, rl_step, self.policy_version)
        t["checkpoint"] = time.perf_counter() - t0
        return True

    def _publish_warm_draft(self, redis: redis_lib.Redis, store_dir: str) -> int | None:
        """spec.warm_draft as the served store's first version (None without one, or if the store has
        versions already). ValueError naming warm_draft if it does not load or does not fit the policy."""
        if self.spec.warm_draft is None:
            return None
        served, _ = job_stores(redis, store_dir, self.job_id)
        if served.latest_version() is not None:
            return None
        version = publish_warm_draft(self.spec.warm_draft, served, redis, store_dir, self.policy.cfg, self.spec.draft_k)
        log.info("job %s: warm draft %s published as served v%d", self.job_id, self.spec.warm_draft, version)
        return version

    def run(self) -> None:
        try:
            for rl_step in range(self.num_steps_done, self.spec.num_steps):
                self.step(rl_step)
                self.num_steps_done += 1
            self.shipments.settle()
        finally:
            self.policy_files.clear()

    def set_phase(self, phase: Phase, rl_step: int) -> None:
        self.rl_step, self.phase = rl_step, phase
        self.records.set_phase(PhaseRecord(phase, rl_step, time.time()))  # writes the job back if Redis lost it

    def _drop(self, wid: str, exc: Exception, rl_step: int, failures: list) -> None:
        """A failed worker leaves the job; its GPU share goes to the others until it is restarted
        (_restart_lost, at the next step)."""
        failures.append({"worker": wid, "error": one_line(exc)})
        log.error("job %s step %d: worker %s failed: %s", self.job_id, rl_step, wid, exc)
        self.workers.pop(wid, None)
        self.lost.append(f"{wid} at step {rl_step}")

    def _await_workers(self, wids: list[str], where: str) -> dict[str, str]:
        """Wait for the workers just started in slots `wids` (at `where`: "start" or "step N"), at most
        MAX_WORKER_START_S and less once they fill the cluster's GPUs (workers.worker_start); those not started
        then (not placed: no GPU for them) are killed and leave the job, which runs without them (a slot lost
        at start counts as lost; one started again after a loss was counted then). Returns those whose start
        failed -> why (left in the job: the sync drops them with their error)."""
        started = {wid: self.workers[wid] for wid in wids if wid in self.workers}
        unplaced, failed = await_started(started, len(self.workers) - len(started), MAX_WORKER_START_S,
                                         self.spec.gpus_per_worker)
        for wid in unplaced:
            log.error("job %s at %s: worker %s was not placed (no GPU for it): running without it", self.job_id,
                      where, wid)
            ray.kill(self.workers.pop(wid))
            if where == "start":
                self.lost.append(f"{wid} at start (not placed)")
        return failed

    def _restart_lost(self, rl_step: int) -> None:
        """Start a worker again in each slot whose worker was lost, up to MAX_WORKER_RESTARTS times per slot.
        It loads the model and installs the served draft as any worker does; the step's sync gives it the
        policy. One that fails to start is dropped at that sync, with its error; one Ray cannot place is killed
        (_await_workers) and its slot tried again at the next step, while its restarts last."""
        missing = [wid for wid in self.worker_ids if wid not in self.workers
                   and self.restarts.get(wid, 0) < MAX_WORKER_RESTARTS]
        for wid in missing:
            self.restarts[wid] = self.restarts.get(wid, 0) + 1
            log.warning("job %s step %d: starting worker %s again (restart %d of %d)", self.job_id, rl_step, wid,
                        self.restarts[wid], MAX_WORKER_RESTARTS)
            try:
                self.workers[wid] = start_worker(self.job_id, wid, self.spec, self.redis_url, self.store_dir,
                                                 self.worker_ids.index(wid), placement_group=self.placement_group)
            except ValueError as exc:  # e.g. its name is still held by the dying actor: try again next step
                log.error("job %s step %d: worker %s could not start again: %s", self.job_id, rl_step, wid, exc)
        self._await_workers(missing, f"step {rl_step}")

    def degraded_summary(self) -> str | None:
        """One line for a run that lost its driver (resumed from a checkpoint) or rollout workers, None for a
        clean one: which, when, and whether every slot had its worker back by the end."""
        parts = [f"Redis came back empty {', '.join(self.records.restored)}: the driver wrote the job back (its "
                 f"events and drafter-training state before then are lost)"] if self.records.restored else []
        if self.resumed:
            parts.append(f"driver lost, resumed from its policy checkpoint {'; '.join(self.resumed)}")
        if self.lost:
            down = [wid for wid in self.worker_ids if wid not in self.workers]
            tail = (f"; {', '.join(down)} not running at the end ({self.spec.num_workers - len(down)} of "
                    f"{self.spec.num_workers} workers)" if down else "; each was started again")
            parts.append(f"rollout workers lost: {', '.join(self.lost)}{tail}")
        return "; ".join(parts) or None

    def step(self, rl_step: int) -> StepRecord:
        spec, t, failures = self.spec, {}, []
        problems = self.problems.step(rl_step)
        prompts = [encode_text(self.tokenizer, p.prompt, self.policy.cfg.vocab_size) for p in problems]
        self.set_phase(Phase.SYNC, rl_step)
        t0 = time.perf_counter()
        self.shipments.settle()  # the last step's learner pairs: long added by now
        self._restart_lost(rl_step)
        if self._sync(rl_step, failures, list(self.workers)):  # one died since the last step (idle, or training):
            started = set(self.workers)  # its slot starts again now, for this step's rollout, not a step later
            self._restart_lost(rl_step)
            self._sync(rl_step, failures, [wid for wid in self.workers if wid not in started])
        if not self.workers:
            why = "; ".join(f"{f['worker']}: {f['error']}" for f in failures)
            raise WorkerError(f"every rollout worker failed: {why}" if failures else
                              "no rollout worker left: each was lost and none could start again",
                              list(dict.fromkeys(f["worker"] for f in failures)))  # a slot may fail twice
        t["weight_sync"] = time.perf_counter() - t0

        self.set_phase(Phase.ROLLOUT, rl_step)
        t0 = time.perf_counter()
        stops = [p.stop_strings if self.tokenizer is not None else () for p in problems]  # tokenizer-less: none
        results, worker_s, draft_versions, batches = self._rollout(prompts, rl_step, failures, stops)
        t["rollout"] = time.perf_counter() - t0
        self.set_phase(Phase.UPDATE, rl_step)
        longest = max(worker_s.values(), default=0.0)
        idle = sum(longest - s for s in worker_s.values())

        t0 = time.perf_counter()
        groups = sorted(results)
        rewards = torch.tensor([[self.reward_fn(o["text"] or "", problems[g].answer) for o in results[g]]
                                for g in groups]) if groups else torch.zeros(0, spec.group_size)
        t["reward"] = time.perf_counter() - t0
        stats = self._update(groups, results, rewards, t) if groups else {}
        is_staged = self._stage_checkpoint(rl_step, t)
        outs = [o for v in results.values() for o in v]
        num_tokens = sum(len(o["token_ids"]) for o in outs)
        record = StepRecord(rl_step=rl_step, policy_version=self.policy_version, timings=t, worker_rollout_s=worker_s,
                            idle_worker_s=idle, mean_reward=float(rewards.mean()) if rewards.numel() else 0.0,
                            num_rollouts=len(outs), failures=failures, num_tokens=num_tokens,
                            mean_accepted_length=num_tokens / max(sum(o["num_steps"] for o in outs), 1),
                            draft_versions=draft_versions, grpo=stats,
                            response_lengths=length_percentiles([len(o["token_ids"]) for o in outs]),
                            tail_s=longest - min(worker_s.values(), default=0.0),
                            speculation={wid: b["speculation"] for wid, b in batches.items()},
                            bucket_throughput=sum_buckets(b["bucket_throughput"] for b in batches.values()),
                            reward_std=float(rewards.std(unbiased=False)) if rewards.numel() else 0.0,
                            bucket_served=sum_served(b["bucket_served"] for b in batches.values()),
                            draft_versions_published=self._published_since_last_step())
        self.records.append_step(record)  # the record and the running totals together
        if is_staged:  # only now the resume point: its step's record is in
            commit_policy(self.checkpoint_path)
        return record

    def _published_since_last_step(self) -> list[int]:
        """The served store's versions newer than the last step's record saw (published during this step)."""
        new = [e["version"] for e in self.served.versions() if e["version"] > self.published_up_to]
        self.published_up_to = max([self.published_up_to, *new])
        return new

    def _sync(self, rl_step: int, failures: list, wids: list[str]) -> list[str]:
        """Push the policy's weights to workers `wids` (workers.policy_sync): those on this node map one file
        written here, the others one object-store copy; returns those that failed or were gone, dropped."""
        if not wids:
            return []
        nodes, dropped = self._gather({wid: self.workers[wid].node_id.remote() for wid in wids}, rl_step, failures)
        here = ray.get_runtime_context().get_node_id()
        # in the workers' precision (JobSpec.policy_dtype; auto as this process's device resolves it: a worker whose
        # device resolves it otherwise casts what it loads): a bf16 sync moves half the bytes
        state = cast_state(self.policy.state_dict(),
                           policy_dtype(self.spec.policy_dtype, self.device, self.spec.coupled_sampling))
        sources = {}
        if any(node == here for node in nodes.values()):
            message = self.policy_files.write(state, self.policy_version)
            sources |= {wid: message for wid, node in nodes.items() if node == here}
        if any(node != here for node in nodes.values()):
            weights = ray.put(shareable_state(state))
            sources |= {wid: weights for wid, node in nodes.items() if node != here}
        _, failed = self._gather({wid: self.workers[wid].load_policy.remote(source, self.policy_version)
                                  for wid, source in sources.items()}, rl_step, failures)
        self.policy_files.done()  # every worker has it, or is dropped
        return dropped + failed

    def _gather(self, refs: dict, rl_step: int, failures: list) -> tuple[dict, list[str]]:
        """Each worker's answer (worker id -> result); the workers that raised or are gone are dropped (listed)."""
        answers, dropped = {}, []
        for wid, ref in refs.items():
            try:
                answers[wid] = ray.get(ref)
            except RayError as exc:  # the worker raised (RayTaskError) or is gone
                self._drop(wid, exc, rl_step, failures)
                dropped.append(wid)
        return answers, dropped

    def _rollout(self, prompts: list[list[int]], rl_step: int, failures: list,
                 stops: list[tuple[str, ...]]) -> tuple[dict, dict, dict, dict]:
        """Each worker generates its groups (prompt g's rollouts end at stops[g]); returns (group -> responses,
        worker -> seconds generating, worker -> draft version serving when it finished, worker -> its batch's
        "speculation", "bucket_throughput" and "bucket_served", workers.engine.Completion)."""
        spec, G = self.spec, self.spec.group_size
        futures = {}
        for (wid, w), groups in zip(list(self.workers.items()), assign(len(prompts), len(self.workers))):
            if not groups:
                continue
            ps = [prompts[g] for g in groups for _ in range(G)]
            params = [{"temperature": spec.temperature, "max_new_tokens": spec.max_new_tokens,
                       "seed": rollout_seed(spec, rl_step, g * G + j), "stop_strings": tuple(stops[g]),
                       "coupled": spec.coupled_sampling}
                      for g in groups for j in range(G)]
            futures[w.generate.remote(ps, params, rl_step)] = (wid, groups, time.perf_counter())
        results, worker_s, draft_versions, batches = {}, {}, {}, {}
        pending = list(futures)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            wid, groups, started = futures[done[0]]
            try:
                outs = ray.get(done[0])
            except RayError as exc:  # a dead or failed worker loses its share; the others' responses are kept
                self._drop(wid, exc, rl_step, failures)
                continue
            worker_s[wid] = time.perf_counter() - started
            for o in outs:
                o["worker"] = wid  # where its learner pairs go (workers.learner_pairs)
            draft_versions[wid] = max((o["draft_version"] for o in outs), default=0)
            if outs:  # the same on every completion of the batch
                batches[wid] = {key: outs[0][key] for key in ("speculation", "bucket_throughput", "bucket_served")}
            for i, g in enumerate(groups):
                results[g] = outs[i * G : (i + 1) * G]
        return results, worker_s, draft_versions, batches

    def _update(self, groups: list[int], results: dict, rewards: torch.Tensor, t: dict) -> dict:
        """Advantages, the policy's own log-probs, and the GRPO update(s); returns the last update's stats. For
        workers whose engine does not harvest drafter-training pairs, the same forwards record them
        (workers.learner_pairs), shipped to those workers after the update."""
        t0 = time.perf_counter()
        spec = self.spec
        adv = group_advantages(rewards, spec).flatten()
        outs = [o for g in groups for o in results[g]]
        seqs, plens = [o["prompt_ids"] + o["token_ids"] for o in outs], [len(o["prompt_ids"]) for o in outs]
        owners = wanted_owners(outs)
        pairs = LearnerPairs(self.policy, seqs, plens, owners, BUFFER_DTYPE, BUFFER_BYTES) if any(owners) else None
        if spec.num_updates_per_step == 1:  # on-policy: the update's own forward gives old_logp (ratio 1)
            old_logp, mask = None, response_mask(seqs, plens)
        else:
            with torch.no_grad():
                old_logp, mask = sequence_logprobs(self.policy, seqs, plens, recorder=pairs)
        t["logprob"] = time.perf_counter() - t0
        # the update's first forward records its rows; the rest now, before the update moves the policy
        recorder = pairs if old_logp is None else None
        if pairs is not None:
            t0 = time.perf_counter()
            pairs.fill(self.policy, update_rows(mask, adv, old_logp, spec) if recorder else (), spec.micro_batch_size)
            t["learner_pairs"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.policy.train().requires_grad_(True)
        stats = {}
        for i in range(spec.num_updates_per_step):  # later passes are off-policy: the ratio clips them
            stats = grpo_update(self.policy, self.optimizer, seqs, plens, adv, old_logp, mask, spec, self.ref_model,
                                recorder=recorder if i == 0 else None)
        self.policy.eval().requires_grad_(False)
        t["update"] = time.perf_counter() - t0
        if pairs is not None:  # tagged with the version that generated them
            t0 = time.perf_counter()
            self.shipments.send(self.workers, pairs.messages(self.policy_version))
            t["learner_pairs"] += time.perf_counter() - t0
        self.policy_version += 1
        return stats
