"""Job driver: runs GRPO steps over a set of rollout workers and records what each phase took.

Per step: push the policy weights (once per version, through the Ray object store), split the
prompt groups among the workers, gather responses (a failed worker's share is lost, the others'
are kept), score them, recompute log-probabilities with the POLICY, update it, record timings. Workers
whose engine harvests no drafter-training pairs get them from those forwards (workers.learner_pairs).
The Ray actor around it is workers.actors.JobDriver, which also records how the run ended.
"""

from __future__ import annotations

import copy
import logging
import math
import statistics
import time

import ray
import redis as redis_lib
import torch

from drafter.loading import encode_prompt, load_model
from workers.actors import start_worker
from workers.errors import one_line
from workers.grpo import group_advantages, grpo_update, response_mask, sequence_logprobs, update_rows
from workers.learner_pairs import LearnerPairs, PairShipments, wanted_owners
from workers.pinning import usable_cores
from workers.policy_checkpoint import load_policy, policy_checkpoint_path, save_policy
from workers.protocol import Phase, PhaseRecord, StepRecord, job_phase_key, job_steps_key, job_totals_key
from workers.rollout import BUFFER_BYTES, BUFFER_DTYPE, engine_unavailable_reason
from workers.spec import JobSpec
from workers.store import job_stores
from workers.tasks import get_reward, load_jsonl_dataset, make_task
from workers.warm import publish_warm_draft

log = logging.getLogger(__name__)
# a rollout worker lost mid-job is started again at the next step, at most this many times per slot (one that
# keeps dying, e.g. out of memory, would otherwise be restarted every step); beyond it the job runs degraded
MAX_WORKER_RESTARTS = 2
MAX_PROMPT_BYTES = 48  # a tokenizer-less preset reads this many bytes of a prompt (tests only)


def encode_text(tokenizer, text: str, vocab_size: int) -> list[int]:
    """Chat-encode with the model's tokenizer; a tokenizer-less preset gets bytes folded into its
    vocabulary (tests only: such a model cannot read the task anyway)."""
    if tokenizer is not None:
        return encode_prompt(tokenizer, text)
    return [b % vocab_size for b in text.encode()[:MAX_PROMPT_BYTES]]


def shareable_state(state: dict[str, torch.Tensor]) -> dict:
    """Weights as numpy arrays where the dtype allows: Ray stores them once in the object store and
    every worker on a node maps them without a copy or unpickling (torch tensors would be pickled,
    copied per worker). Exact: the values are the policy's own, no cast. Tied weights (SmolLM2's LM head is
    its embedding) become ONE array under both names, which pickle stores once: 538 MB put per sync instead
    of 651 MB (measured, SmolLM2-135M)."""
    out, seen = {}, {}
    for k, v in state.items():
        v = v.detach().cpu()
        key = (v.data_ptr(), tuple(v.shape), tuple(v.stride()), v.dtype)
        if key not in seen:
            seen[key] = v.numpy() if v.dtype in (torch.float32, torch.float64, torch.float16) else v.clone()
        out[k] = seen[key]
    return out


def assign(num_groups: int, num_workers: int) -> list[list[int]]:
    """Round-robin prompt groups over workers: group g goes to worker g % num_workers."""
    return [list(range(w, num_groups, num_workers)) for w in range(num_workers)]


def length_percentiles(lengths: list[int]) -> dict[str, float]:
    """Response lengths in tokens: median, p90, p99 (nearest rank) and max; zeros when there are none."""
    if not lengths:
        return {"median": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    ordered = sorted(lengths)

    def rank(q: float) -> float:
        return float(ordered[max(0, math.ceil(q * len(ordered)) - 1)])

    return {"median": float(statistics.median(ordered)), "p90": rank(0.9), "p99": rank(0.99),
            "max": float(ordered[-1])}


def sum_buckets(per_worker) -> dict[str, list[float]]:
    """{bucket: [tokens, seconds]} summed over the workers' batches."""
    out: dict[str, list[float]] = {}
    for buckets in per_worker:
        for name, (tokens, seconds) in buckets.items():
            acc = out.setdefault(name, [0.0, 0.0])
            acc[0], acc[1] = acc[0] + tokens, acc[1] + seconds
    return out


def rollout_seed(spec: JobSpec, rl_step: int, index: int) -> int:
    """Each rollout's own seed: a job reruns the same, and no two rollouts of a job share one."""
    return spec.seed * 1_000_003 + rl_step * 10_007 + index


class Driver:
    def __init__(self, job_id: str, spec: JobSpec, redis: redis_lib.Redis, redis_url: str, store_dir: str) -> None:
        self.job_id, self.spec, self.redis = job_id, spec, redis
        reason = engine_unavailable_reason(spec.engine)  # one clear line now, not a worker's traceback later
        if reason is not None:
            raise ValueError(reason)
        torch.manual_seed(spec.seed)
        loaded = load_model(spec.model)
        self.policy, self.tokenizer = loaded.model, loaded.tokenizer
        self.policy_version = 0
        self.num_steps_done = 0
        self.reward_fn = get_reward(spec.reward)
        if spec.task == "dataset":
            self.problems = load_jsonl_dataset(spec.dataset_path)
        else:
            self.problems = make_task(spec.task, spec.seed).sample(spec.num_steps * spec.num_prompts_per_step)
        self.warm_version = self._publish_warm_draft(redis, store_dir)  # before the workers start: they install it
        self.worker_ids = [f"w{i}" for i in range(spec.num_workers)]
        self.redis_url, self.store_dir = redis_url, store_dir
        self.restarts: dict[str, int] = {}  # worker id -> times it was started again after it was lost
        self.lost: list[str] = []  # "w1 at step 3", each loss, for the run's warning
        self.shipments = PairShipments(job_id)  # learner pairs on their way to workers (workers.learner_pairs)
        self.workers = {wid: start_worker(job_id, wid, spec, redis_url, store_dir, i)
                        for i, wid in enumerate(self.worker_ids)}
        # wait for them to start (load the model) so that step 0's weight sync times the sync alone; one that
        # failed to start is dropped at that sync, with its error, as a worker lost mid-job would be
        ready = [w.__ray_ready__.remote() for w in self.workers.values()]
        ray.wait(ready, num_returns=len(ready))
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

    def _checkpoint(self, rl_step: int, t: dict) -> None:
        """Every spec.checkpoint_every steps (not after the last: nothing would resume from it)."""
        every = self.spec.checkpoint_every
        if not every or (rl_step + 1) % every or rl_step + 1 >= self.spec.num_steps:
            return
        t0 = time.perf_counter()
        save_policy(self.checkpoint_path, self.policy, self.optimizer, rl_step, self.policy_version)
        t["checkpoint"] = time.perf_counter() - t0

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
        for rl_step in range(self.num_steps_done, self.spec.num_steps):
            self.step(rl_step)
            self.num_steps_done += 1
        self.shipments.settle()

    def set_phase(self, phase: Phase, rl_step: int) -> None:
        self.redis.set(job_phase_key(self.job_id), PhaseRecord(phase, rl_step, time.time()).to_json())

    def _drop(self, wid: str, exc: Exception, rl_step: int, failures: list) -> None:
        """A failed worker leaves the job; its GPU share goes to the others until it is restarted
        (_restart_lost, at the next step)."""
        failures.append({"worker": wid, "error": one_line(exc)})
        log.error("job %s step %d: worker %s failed: %s", self.job_id, rl_step, wid, exc)
        self.workers.pop(wid, None)
        self.lost.append(f"{wid} at step {rl_step}")

    def _restart_lost(self, rl_step: int) -> None:
        """Start a worker again in each slot whose worker was lost, up to MAX_WORKER_RESTARTS times per slot.
        It loads the model and installs the served draft as any worker does; the step's sync gives it the
        policy. One that fails to start is dropped at that sync, with its error."""
        missing = [wid for wid in self.worker_ids if wid not in self.workers
                   and self.restarts.get(wid, 0) < MAX_WORKER_RESTARTS]
        for wid in missing:
            self.restarts[wid] = self.restarts.get(wid, 0) + 1
            log.warning("job %s step %d: starting worker %s again (restart %d of %d)", self.job_id, rl_step, wid,
                        self.restarts[wid], MAX_WORKER_RESTARTS)
            try:
                self.workers[wid] = start_worker(self.job_id, wid, self.spec, self.redis_url, self.store_dir,
                                                 self.worker_ids.index(wid))
            except ValueError as exc:  # e.g. its name is still held by the dying actor: try again next step
                log.error("job %s step %d: worker %s could not start again: %s", self.job_id, rl_step, wid, exc)
        ready = [self.workers[wid].__ray_ready__.remote() for wid in missing if wid in self.workers]
        ray.wait(ready, num_returns=len(ready))

    def degraded_summary(self) -> str | None:
        """One line for a run that lost its driver (resumed from a checkpoint) or rollout workers, None for a
        clean one: which, when, and whether every slot had its worker back by the end."""
        parts = []
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
        n = spec.num_prompts_per_step
        problems = [self.problems[(rl_step * n + i) % len(self.problems)] for i in range(n)]
        prompts = [encode_text(self.tokenizer, p.prompt, self.policy.cfg.vocab_size) for p in problems]
        self.set_phase(Phase.SYNC, rl_step)
        t0 = time.perf_counter()
        self.shipments.settle()  # the last step's learner pairs: long added by now
        self._restart_lost(rl_step)
        self._sync(rl_step, failures)
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
        self._checkpoint(rl_step, t)
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
                            reward_std=float(rewards.std(unbiased=False)) if rewards.numel() else 0.0)
        with self.redis.pipeline(transaction=True) as pipe:  # the record and the running totals together
            pipe.rpush(job_steps_key(self.job_id), record.to_json())
            pipe.hincrbyfloat(job_totals_key(self.job_id), "idle_worker_s", idle)
            pipe.execute()
        return record

    def _sync(self, rl_step: int, failures: list) -> None:
        """Push the policy's weights to every worker (one object-store copy, mapped by each)."""
        weights = ray.put(shareable_state(self.policy.state_dict()))
        refs = {wid: w.load_policy.remote(weights, self.policy_version) for wid, w in self.workers.items()}
        for wid, ref in refs.items():
            try:
                ray.get(ref)
            except Exception as exc:
                self._drop(wid, exc, rl_step, failures)
        if not self.workers:
            raise RuntimeError(f"job {self.job_id}: every rollout worker failed")

    def _rollout(self, prompts: list[list[int]], rl_step: int, failures: list,
                 stops: list[tuple[str, ...]]) -> tuple[dict, dict, dict, dict]:
        """Each worker generates its groups (prompt g's rollouts end at stops[g]); returns (group -> responses,
        worker -> seconds generating, worker -> draft version serving when it finished, worker -> its batch's
        "speculation" and "bucket_throughput", workers.engine.Completion)."""
        spec, G = self.spec, self.spec.group_size
        futures = {}
        for (wid, w), groups in zip(list(self.workers.items()), assign(len(prompts), len(self.workers))):
            if not groups:
                continue
            ps = [prompts[g] for g in groups for _ in range(G)]
            params = [{"temperature": spec.temperature, "max_new_tokens": spec.max_new_tokens,
                       "seed": rollout_seed(spec, rl_step, g * G + j), "stop_strings": tuple(stops[g])}
                      for g in groups for j in range(G)]
            futures[w.generate.remote(ps, params, rl_step)] = (wid, groups, time.perf_counter())
        results, worker_s, draft_versions, batches = {}, {}, {}, {}
        pending = list(futures)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            wid, groups, started = futures[done[0]]
            try:
                outs = ray.get(done[0])
            except Exception as exc:  # a dead worker loses its share; the others' responses are kept
                self._drop(wid, exc, rl_step, failures)
                continue
            worker_s[wid] = time.perf_counter() - started
            for o in outs:
                o["worker"] = wid  # where its learner pairs go (workers.learner_pairs)
            draft_versions[wid] = max((o["draft_version"] for o in outs), default=0)
            if outs:  # the same on every completion of the batch
                batches[wid] = {key: outs[0][key] for key in ("speculation", "bucket_throughput")}
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
