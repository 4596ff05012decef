"""Job driver: runs GRPO steps over a set of rollout workers and records what each phase took.

Per step: push the policy weights (once per version, through the Ray object store), split the
prompt groups among the workers, gather responses (a failed worker's share is lost, the others'
are kept), score them, recompute log-probabilities with the POLICY, update it, record timings.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from dataclasses import asdict, dataclass, field

import ray
import torch

from drafter.loading import encode_prompt, load_model
from workers.grpo import GRPOConfig, group_advantages, grpo_update, sequence_logprobs
from workers.protocol import job_phase_key, job_result_key, job_steps_key, job_totals_key
from workers.rollout import RolloutWorker, WorkerConfig
from workers.tasks import ArithmeticTask, get_reward, load_jsonl_dataset

log = logging.getLogger(__name__)


@dataclass
class JobConfig:
    job_id: str
    model: str = "tiny"
    task: str = "arithmetic"  # or "dataset" with dataset_path and reward
    dataset_path: str | None = None
    reward: str = "arithmetic"  # a registered reward name; nothing in a job runs user code
    num_steps: int = 2
    num_prompts_per_step: int = 4
    max_new_tokens: int = 32
    temperature: float = 1.0  # on-policy sampling, as RL needs
    num_workers: int = 2
    seed: int = 0
    store_dir: str = "/tmp/tlt-drafts"
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)


@dataclass
class StepRecord:
    rl_step: int
    policy_version: int
    timings: dict  # phase -> seconds: weight_sync, rollout, reward, logprob, update
    worker_rollout_s: dict  # worker id -> seconds it spent generating
    idle_worker_s: float  # sum over workers of the time spent waiting at the barrier
    mean_reward: float
    num_rollouts: int
    failures: list = field(default_factory=list)
    num_tokens: int = 0  # generated this step
    mean_accepted_length: float = 1.0  # tokens per policy forward over the step's rollouts (1.0: plain decoding)
    draft_versions: dict = field(default_factory=dict)  # worker id -> draft version serving when it finished


def encode_text(tokenizer, text: str, vocab_size: int, max_len: int = 48) -> list[int]:
    """Chat-encode with the model's tokenizer; a tokenizer-less preset gets bytes folded into its
    vocabulary (tests only: such a model cannot read the task anyway)."""
    if tokenizer is not None:
        return encode_prompt(tokenizer, text)
    return [b % vocab_size for b in text.encode()[:max_len]]


def shareable_state(state: dict[str, torch.Tensor]) -> dict:
    """Weights as numpy arrays where the dtype allows: Ray stores them once in the object store and
    every worker on a node maps them without a copy or unpickling (torch tensors would be pickled,
    copied per worker). Exact: the values are the policy's own, no cast."""
    out = {}
    for k, v in state.items():
        v = v.detach().cpu()
        out[k] = v.numpy() if v.dtype in (torch.float32, torch.float64, torch.float16) else v.clone()
    return out


def assign(num_groups: int, num_workers: int) -> list[list[int]]:
    """Round-robin prompt groups over workers: group g goes to worker g % num_workers."""
    return [list(range(w, num_groups, num_workers)) for w in range(num_workers)]


@ray.remote(num_cpus=0)
class JobDriver:
    def __init__(self, cfg: JobConfig, redis_url: str) -> None:
        import redis

        self.cfg, self.redis_url = cfg, redis_url
        self.redis = redis.Redis.from_url(redis_url)
        torch.manual_seed(cfg.seed)
        loaded = load_model(cfg.model)
        self.policy, self.tokenizer = loaded.model, loaded.tokenizer
        self.policy_version = 0
        self.reward_fn = get_reward(cfg.reward)
        if cfg.task == "arithmetic":
            self.problems = ArithmeticTask(cfg.seed).sample(cfg.num_steps * cfg.num_prompts_per_step)
        elif cfg.task == "dataset":
            self.problems = load_jsonl_dataset(cfg.dataset_path)
        else:
            raise ValueError(f"task must be 'arithmetic' or 'dataset', got {cfg.task!r}")
        self.workers = [
            RolloutWorker.options(num_gpus=1, name=None).remote(
                cfg.job_id, f"w{i}", cfg.worker, redis_url, cfg.store_dir, cfg.job_id)
            for i in range(cfg.num_workers)]
        self.worker_ids = [f"w{i}" for i in range(cfg.num_workers)]
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=cfg.grpo.lr)
        # a frozen copy of the initial policy, only when the KL term is on
        self.ref_model = copy.deepcopy(self.policy).requires_grad_(False) if cfg.grpo.kl_coef > 0 else None
        self.records: list[StepRecord] = []
        self._outcome: dict | None = None
        self._finished = threading.Event()

    def _drop(self, w, wid: str, exc: Exception, rl_step: int, failures: list) -> None:
        failures.append({"worker": wid, "error": f"{type(exc).__name__}: {exc}"[:500]})
        log.error("job %s step %d: worker %s failed: %s", self.cfg.job_id, rl_step, wid, exc)
        i = self.worker_ids.index(wid)
        del self.workers[i], self.worker_ids[i]

    def set_phase(self, phase: str, rl_step: int) -> None:
        self.redis.set(job_phase_key(self.cfg.job_id), json.dumps({"phase": phase, "rl_step": rl_step,
                                                                   "since": time.time()}))

    def worker_map(self) -> dict:
        """Live workers by id (answers while `run` is busy: the driver is created with max_concurrency > 1)."""
        return dict(zip(self.worker_ids, self.workers))

    def worker_handles(self) -> list:
        return self.workers

    def run(self) -> list[dict]:
        """Every RL step; the outcome also goes to Redis (job_result_key) and to `wait` callers."""
        try:
            for step in range(self.cfg.num_steps):
                self.records.append(self.step(step))
        except BaseException as exc:
            self._outcome = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000], "finished_at": time.time()}
            raise
        else:
            self._outcome = {"ok": True, "steps": len(self.records), "finished_at": time.time()}
            return [asdict(r) for r in self.records]
        finally:
            self.set_phase("DONE", len(self.records))
            try:
                self.redis.set(job_result_key(self.cfg.job_id), json.dumps(self._outcome))
            finally:
                self._finished.set()

    def wait(self, timeout_s: float | None = None) -> dict | None:
        """Block until `run` ends (a scheduler that restarted reattaches with this); its outcome
        {ok, steps | error}, or None if still running after timeout_s."""
        return self._outcome if self._finished.wait(timeout_s) else None

    def step(self, rl_step: int) -> StepRecord:
        cfg, t = self.cfg, {}
        n = cfg.num_prompts_per_step
        problems = [self.problems[(rl_step * n + i) % len(self.problems)] for i in range(n)]
        prompts = [encode_text(self.tokenizer, p.prompt, self.policy.cfg.vocab_size) for p in problems]
        self.set_phase("SYNC", rl_step)
        t0 = time.perf_counter()
        weights = ray.put(shareable_state(self.policy.state_dict()))
        failures = []
        syncs = [(w, wid, w.load_policy.remote(weights, self.policy_version))
                 for w, wid in zip(self.workers, self.worker_ids)]
        for w, wid, ref in syncs:
            try:
                ray.get(ref)
            except Exception as exc:  # a dead worker leaves the job; its GPU share goes to the others
                self._drop(w, wid, exc, rl_step, failures)
        if not self.workers:
            raise RuntimeError(f"job {cfg.job_id}: every rollout worker failed")
        t["weight_sync"] = time.perf_counter() - t0

        self.set_phase("ROLLOUT", rl_step)
        t0 = time.perf_counter()
        G = cfg.grpo.group_size
        futures, shares = {}, assign(n, len(self.workers))
        for w, wid, groups in zip(self.workers, self.worker_ids, shares):
            if not groups:
                continue
            ps = [prompts[g] for g in groups for _ in range(G)]
            params = [{"temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens,
                       "seed": cfg.seed * 1_000_003 + rl_step * 10_007 + g * G + j} for g in groups for j in range(G)]
            futures[w.generate.remote(ps, params, rl_step)] = (w, wid, groups, time.perf_counter())
        results, worker_s, draft_versions = {}, {}, {}
        pending = list(futures)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ref = done[0]
            w, wid, groups, started = futures[ref]
            try:
                outs = ray.get(ref)
            except Exception as exc:  # a dead worker loses its share; the others' responses are kept
                self._drop(w, wid, exc, rl_step, failures)
                continue
            worker_s[wid] = time.perf_counter() - started
            draft_versions[wid] = max((o.get("draft_version", 0) for o in outs), default=0)
            for i, g in enumerate(groups):
                results[g] = outs[i * G : (i + 1) * G]
        t["rollout"] = time.perf_counter() - t0
        self.set_phase("UPDATE", rl_step)
        longest = max(worker_s.values(), default=0.0)
        idle = sum(longest - s for s in worker_s.values())

        t0 = time.perf_counter()
        groups = sorted(results)
        rewards = torch.tensor([[self.reward_fn(o["text"] or "", problems[g].answer) for o in results[g]]
                                for g in groups]) if groups else torch.zeros(0, G)
        t["reward"] = time.perf_counter() - t0
        stats = {}
        if groups:
            t0 = time.perf_counter()
            adv = group_advantages(rewards, cfg.grpo.normalize_std).flatten()
            seqs = [o["prompt_ids"] + o["token_ids"] for g in groups for o in results[g]]
            plens = [len(o["prompt_ids"]) for g in groups for o in results[g]]
            with torch.no_grad():
                old_logp, mask = sequence_logprobs(self.policy, seqs, plens)
            t["logprob"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            self.policy.train().requires_grad_(True)
            for _ in range(cfg.grpo.num_updates_per_step):  # later passes are off-policy: the ratio clips them
                stats = grpo_update(self.policy, self.optimizer, seqs, plens, adv, old_logp, mask, cfg.grpo,
                                    self.ref_model)
            self.policy.eval().requires_grad_(False)
            self.policy_version += 1
            t["update"] = time.perf_counter() - t0
        outs = [o for v in results.values() for o in v]
        record = StepRecord(rl_step, self.policy_version, t, worker_s, idle,
                            float(rewards.mean()) if rewards.numel() else 0.0, len(outs), failures,
                            num_tokens=sum(len(o["token_ids"]) for o in outs),
                            mean_accepted_length=sum(len(o["token_ids"]) for o in outs)
                            / max(sum(o["num_steps"] for o in outs), 1),
                            draft_versions=draft_versions)
        with self.redis.pipeline(transaction=True) as pipe:  # the record and the running totals together
            pipe.rpush(job_steps_key(cfg.job_id), json.dumps({**asdict(record), "grpo": stats}))
            pipe.hincrbyfloat(job_totals_key(cfg.job_id), "idle_worker_s", idle)
            pipe.execute()
        return record
