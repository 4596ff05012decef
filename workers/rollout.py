"""Rollout worker: the engine, its harvested buffer and its copy of the drafter, on one GPU.

`RolloutRunner` is the plain-Python worker (testable without Ray); `RolloutWorker` is the Ray actor
that wraps it. The actor is async: `generate` and `train_drafter` run in worker threads, so
`status`, `stop_training` and `swap_draft` answer while it generates or trains.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import warnings
from dataclasses import dataclass

import numpy as np
import ray
import torch

from drafter.buffer import RolloutBuffer
from drafter.checkpoint import DraftMeta
from drafter.config import TrainConfig
from drafter.eagle import EagleDrafter
from drafter.engine import Engine, Request
from drafter.evaluate import calibrate_draft_temperature, expected_accepted_length
from drafter.loading import load_model
from drafter.sampling import SamplingParams
from drafter.train import DraftTrainer
from drafter.warmstart import head_config, head_from_state, new_head
from workers.progress import ProgressReporter
from workers.protocol import ProgressRecord, WorkerState
from workers.store import DraftStore, job_stores

log = logging.getLogger(__name__)
MAX_LEASES_KEPT = 64  # finished lease outcomes kept for collection (a scheduler collects within seconds)
EVAL_TOKENS = 2048  # recorded pairs a publish decision is scored on: ~1 s of a SmolLM2 forward on CPU


@dataclass
class WorkerConfig:
    model: str = "tiny"
    k: int = 3  # draft length when speculating
    draft_vocab_size: int | None = 8192
    # precision the draft head serves in (drafter.eagle.serving_precision): "auto" is bf16 where the policy
    # is float32 and the device has bf16 units (drafting is bound by reading the head's weights); "int8"
    # (CPU-only) serves int8 weights
    draft_dtype: str | None = "auto"
    # draft tree widths (drafter.tree): "3,2" offers three candidates at the first draft position and two
    # at the second, while at most four rollouts are live (the tail); "" drafts a chain, the default: on
    # the CPU boxes measured a tree accepted more tokens per step but cost more time (docs/benchmarks.md)
    draft_tree: str = ""
    buffer_bytes: int = 256 << 20  # harvested (token, hidden) pairs kept for drafter training
    num_threads: int = 1  # torch threads per worker: several workers share a CPU box
    tlt: bool = True  # speculative decoding with the trained drafter, and harvesting for it
    # speculate only with a draft whose accepted length, measured when it was published, reaches this:
    # below it drafting and verifying k tokens cost more than they save (0: always speculate)
    min_accepted_length: float = 0.0
    train: TrainConfig | None = None


class RolloutRunner:
    """One worker's state and work; every public method is safe to call from another thread."""

    def __init__(self, job_id: str, worker_id: str, cfg: WorkerConfig, redis, store_dir: str,
                 namespace: str) -> None:
        self.job_id, self.worker_id, self.cfg = job_id, worker_id, cfg
        torch.set_num_threads(cfg.num_threads)
        loaded = load_model(cfg.model)
        self.policy, self.tokenizer = loaded.model, loaded.tokenizer
        self.engine = Engine(self.policy, self.tokenizer)
        self.redis = redis
        self.served, self.copies = job_stores(redis, store_dir, namespace)
        self.reporter = ProgressReporter(redis, job_id, worker_id)
        self.buffer = RolloutBuffer(max_bytes=cfg.buffer_bytes)
        self.drafter = EagleDrafter(self.policy, new_head(self.policy, None, cfg.draft_vocab_size), cfg.draft_dtype,
                                    tree=cfg.draft_tree)
        self.drafter.version = 0
        self.draft_accepted_length = 0.0  # of the newest version loaded, as measured when it was published
        self.policy_version = 0
        self.rl_step = 0
        self.state = WorkerState.IDLE
        self.progress = {"num_running": 0, "num_finished": 0, "num_total": 0, "num_tokens": 0,
                         "tokens_per_s": 0.0, "mean_accepted_length": 1.0}
        self.trainer: DraftTrainer | None = None
        self.swap_log: list[dict] = []  # versions loaded: (version, published_at, loaded_at)
        self.report_progress = True  # benchmarks switch it off to measure its cost
        self.report_seconds = 0.0  # time the decode loop spent in progress reports (their whole cost to it)
        self._generating = False  # a rollout is under way (leases yield to it)
        self.leases: dict[str, dict] = {}  # lease id -> outcome, the last MAX_LEASES_KEPT
        self._trainer_done = threading.Event()
        self._lock = threading.Lock()
        self._state_lock = threading.Lock()  # state changes come from the rollout, lease and swap threads

    # ----- policy -------------------------------------------------------------------------
    def load_policy(self, state: dict, policy_version: int) -> None:
        """Copy `state` (torch tensors, or read-only numpy arrays mapped from Ray's object store) into the
        worker's policy."""
        with warnings.catch_warnings():  # from_numpy on a read-only array: we only read it
            warnings.simplefilter("ignore", UserWarning)
            state = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in state.items()}
        self.policy.load_state_dict(state)
        self.policy.requires_grad_(False)
        self.policy_version = policy_version
        # the drafter slices the policy's LM head: refresh it for the new weights (never dropping a
        # draft version that arrived meanwhile and is waiting for the next decode step)
        self.drafter.refresh()

    # ----- progress -----------------------------------------------------------------------
    def record(self) -> ProgressRecord:
        return ProgressRecord(job_id=self.job_id, worker_id=self.worker_id, state=self.state,
                              draft_version=int(self.drafter.version or 0), policy_version=self.policy_version,
                              rl_step=self.rl_step, timestamp=time.time(), **self.progress)

    def report(self, force: bool = False) -> None:
        try:
            self.reporter.report(self.record(), force=force)
        except Exception:  # progress is best effort; never fail a rollout because Redis blinked
            log.exception("worker %s: progress report failed", self.worker_id)

    def set_state(self, state: WorkerState, only_from: WorkerState | None = None) -> bool:
        """Move to `state` (and report it); with `only_from`, only if the worker is in that state now."""
        with self._state_lock:
            if only_from is not None and self.state != only_from:
                return False
            self.state = state
            self.report(force=True)
            return True

    # ----- rollouts -----------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: list[dict], rl_step: int) -> list[dict]:
        """Generate one rollout per prompt; returns plain dicts (tokens, text, finish, counters)."""
        self.rl_step = rl_step
        self._generating = True
        if self.stop_training():  # rollouts come first: a lease still running here is preempted now
            log.warning("worker %s: a drafter lease was still training when rollouts arrived; stopped it",
                        self.worker_id)
        reqs = [Request(p, SamplingParams(**kw)) for p, kw in zip(prompts, params)]
        self.progress.update(num_running=len(reqs), num_finished=0, num_total=len(reqs), num_tokens=0)
        self.set_state(WorkerState.ROLLING_OUT)
        start = time.perf_counter()
        k = self.cfg.k if self.speculating() else 0
        if not k:  # not drafting: a version published meanwhile starts serving now, between rollouts
            self.drafter.apply_pending_swap()
        stats = self.engine.stats

        def on_step(num_finished: int, num_tokens: int) -> None:  # rate-limited inside the reporter
            self.progress.update(num_running=len(reqs) - num_finished, num_finished=num_finished,
                                 num_tokens=num_tokens,
                                 tokens_per_s=num_tokens / max(time.perf_counter() - start, 1e-9),
                                 mean_accepted_length=stats.mean_accepted_length)
            if self.report_progress:
                t0 = time.perf_counter()
                self.report()
                self.report_seconds += time.perf_counter() - t0

        try:
            outs = self.engine.generate(reqs, k=k, drafter=self.drafter if k else None, record_hidden=self.cfg.tlt,
                                        on_step=on_step)
        finally:
            self._generating = False
        self.reporter.flush()
        if self.cfg.tlt:
            self.buffer.add_outputs(outs, self.policy_version)
        self.set_state(WorkerState.IDLE)
        version = int(self.drafter.version or 0)
        return [{"prompt_ids": o.prompt_ids, "token_ids": o.token_ids, "text": o.text,
                 "finish_reason": o.finish_reason, "num_steps": o.num_steps, "num_accepted": o.num_accepted,
                 "draft_version": version} for o in outs]

    # ----- drafter training leases ---------------------------------------------------------
    def check_lease(self, lease: dict) -> None:
        """ValueError naming the field if `lease` is malformed, or if this worker already holds one."""
        for name in ("lease_id", "parent_version", "deadline_s"):
            if name not in lease:
                raise ValueError(f"lease is missing {name!r}")
        if float(lease["deadline_s"]) <= 0:
            raise ValueError(f"lease deadline_s must be > 0, got {lease['deadline_s']}")
        if int(lease["parent_version"]) < 0:
            raise ValueError(f"lease parent_version must be >= 0, got {lease['parent_version']}")
        with self._lock:
            running = [lid for lid, r in self.leases.items() if r["state"] == "running"]
            if running:
                raise ValueError(f"worker {self.worker_id} already holds lease {running[0]}")
            self.leases[str(lease["lease_id"])] = {"state": "running", "result": None, "error": None}

    def train_drafter(self, lease: dict, checked: bool = False) -> dict:
        """Train a copy from the lease's parent version on the local buffer until its deadline or a
        stop; publish the copy (atomically) if it took at least one step. The outcome stays in
        `self.leases` so a scheduler that restarted can still collect it."""
        if not checked:
            self.check_lease(lease)
        lease_id = str(lease["lease_id"])
        try:
            result = self._train(lease)
        except Exception as exc:
            with self._lock:
                self.leases[lease_id] = {"state": "failed", "result": None, "error": f"{type(exc).__name__}: {exc}"}
            raise
        with self._lock:
            self.leases[lease_id] = {"state": "done", "result": result, "error": None}
            done = [lid for lid, r in self.leases.items() if r["state"] != "running"]
            for lid in done[:-MAX_LEASES_KEPT]:
                del self.leases[lid]
        return result

    def _train(self, lease: dict) -> dict:
        parent = int(lease["parent_version"])
        deadline_s = float(lease["deadline_s"])
        head = self._head_for(parent)
        with self._lock:
            self.trainer = DraftTrainer(self.policy, head, self.cfg.train or TrainConfig())
            if self._generating:  # rollouts arrived while the parent loaded: the GPU is theirs
                self.trainer.request_stop()
        if not self._generating:
            self.set_state(WorkerState.TRAINING)
        try:
            rep = self.trainer.train(self.buffer, max_seconds=deadline_s)
        finally:
            with self._lock:
                self.trainer = None
                self._trainer_done.set()
            # a rollout that started meanwhile owns the worker's state
            self.set_state(WorkerState.ROLLING_OUT if self._generating else WorkerState.IDLE)
        result = {"lease_id": lease.get("lease_id"), "steps": rep.num_steps, "tokens": rep.num_tokens,
                  "seconds": rep.seconds, "stopped": rep.stopped, "version": None}
        if rep.num_steps > 0:
            meta = DraftMeta(version=0, parent_version=parent, policy_version=self.policy_version,
                             num_steps=rep.num_steps, total_steps=rep.num_steps, num_tokens=rep.num_tokens,
                             head_config=head_config(head), extra={"worker": self.worker_id,
                                                                  "lease_id": lease.get("lease_id")})
            result["version"] = self.copies.publish(head.state_dict(), meta)
        return result

    def lease_result(self, lease_id: str) -> dict | None:
        """{"state": running | done | failed, "result", "error"}, or None for a lease this worker never had."""
        with self._lock:
            entry = self.leases.get(str(lease_id))
            return dict(entry) if entry else None

    def _head_for(self, version: int):
        return self._head_and_meta(version)[0]

    def _head_and_meta(self, version: int):
        if version == 0 and self.served.latest_version() is None:
            return new_head(self.policy, self.buffer if len(self.buffer) else None, self.cfg.draft_vocab_size), None
        return self._load_head(self.served, version)

    def _load_head(self, store: DraftStore, version: int):
        """(head in the policy's dtype, meta) of a stored version (checksum-checked by the store)."""
        state, meta = store.load(version)
        return head_from_state(meta.head_config, state).to(self.policy.dtype), meta

    def evaluate_drafts(self, drafts: list[dict], k: int, greedy: bool, max_tokens: int = EVAL_TOKENS) -> dict:
        """Offline accepted length of each {"store": "served" | "copies", "version"} on this worker's most
        recent rollouts of its newest policy version (drafter/evaluate.py); the scheduler's publish rule.
        A draft asked with "calibrate": true (sampled only) is scored at the draft temperature that
        accepts the most on those rollouts, which is returned in "draft_temperatures" (None for the
        others): a draft is published with the temperature it was scored at."""
        for d in drafts:
            if not isinstance(d.get("calibrate", False), bool):
                raise ValueError(f"calibrate must be a boolean, got {d.get('calibrate')!r}")
            if d.get("calibrate") and greedy:
                raise ValueError("calibrate applies to sampled scoring only (greedy drafts the argmax)")
        rollouts = self.buffer.rollouts
        if not rollouts:
            raise ValueError(f"worker {self.worker_id} has no rollouts to evaluate drafts on")
        newest = max(r.policy_version for r in rollouts)
        recent, num_tokens = [], 0
        for r in sorted((r for r in rollouts if r.policy_version == newest), key=lambda r: -r.order):
            if num_tokens >= max_tokens:
                break
            recent.append(r)
            num_tokens += r.num_pairs
        lengths, temperatures = [], []
        for d in drafts:
            store = {"served": self.served, "copies": self.copies}.get(d.get("store"))
            if store is None:
                raise ValueError(f"store must be 'served' or 'copies', got {d.get('store')!r}")
            head, _ = self._load_head(store, int(d["version"]))
            if d.get("calibrate"):
                tau, scores = calibrate_draft_temperature(head, self.policy, recent, k)
                lengths.append(scores[tau])
                temperatures.append(tau)
            else:
                lengths.append(expected_accepted_length(head, self.policy, recent, k, greedy))
                temperatures.append(None)
        return {"accepted_lengths": lengths, "draft_temperatures": temperatures, "num_tokens": num_tokens,
                "policy_version": newest, "worker_id": self.worker_id}

    def stop_training(self, wait_s: float = 0.0) -> bool:
        """Ask a running trainer to stop (it does within one micro-step); with wait_s > 0, also wait up
        to that long for it to have stopped. Returns whether a trainer was running."""
        with self._lock:
            if self.trainer is None:
                return False
            self._trainer_done.clear()
            self.trainer.request_stop()
        if wait_s > 0:
            self._trainer_done.wait(wait_s)
        return True

    # ----- hot swap ---------------------------------------------------------------------------
    def speculating(self) -> bool:
        """Whether the next rollouts draft: TLT on, and the newest draft accepts enough tokens per step."""
        if not self.cfg.tlt:
            return False
        return self.cfg.min_accepted_length <= 0 or self.draft_accepted_length >= self.cfg.min_accepted_length

    def swap_draft(self, version: int, published_at: float | None = None) -> None:
        """Load `version` and install it (this thread). A generating worker switches heads between two
        of its decode loop's draft-state updates, without pausing it (EagleDrafter.apply_pending_swap);
        an idle worker reports SWAPPING while it loads and installs."""
        received_at = time.time()
        idle = not self._generating and self.set_state(WorkerState.SWAPPING, only_from=WorkerState.IDLE)
        try:
            head, meta = self._head_and_meta(version)
            self.draft_accepted_length = float(meta.extra.get("accepted_length") or 0.0) if meta else 0.0
            # freshly loaded, so converted in place: request_swap then has no copy to make
            self.drafter.request_swap(self.drafter.convert(head), version)
            loaded_at = time.time()
            self.drafter.apply_pending_swap()
        finally:
            if idle:
                self.set_state(WorkerState.IDLE, only_from=WorkerState.SWAPPING)
        self.swap_log.append({"version": version, "published_at": published_at, "received_at": received_at,
                              "loaded_at": loaded_at})

    def status(self) -> dict:
        rec = self.record()
        return {**rec.__dict__, "state": rec.state.value, "buffer_tokens": self.buffer.num_tokens,
                "num_swaps": self.drafter.num_swaps, "swap_times": list(self.drafter.swap_times),
                "swap_seconds": self.drafter.swap_seconds, "report_seconds": self.report_seconds}


@ray.remote(num_cpus=0)
class RolloutWorker:
    """Ray actor around RolloutRunner. Blocking work runs in threads so control calls answer."""

    def __init__(self, job_id: str, worker_id: str, cfg: WorkerConfig, redis_url: str, store_dir: str,
                 namespace: str) -> None:
        import redis

        self.runner = RolloutRunner(job_id, worker_id, cfg, redis.Redis.from_url(redis_url), store_dir, namespace)
        self._tasks: set[asyncio.Task] = set()  # background leases (kept referenced until done)
        self._listener = threading.Thread(target=self._listen, daemon=True)
        self._listener.start()

    def _listen(self) -> None:
        """Hot swap: every version published to the served store is loaded and swapped in."""
        sub = self.runner.served.subscribe()
        while True:
            msg = sub.get(timeout=1.0)
            if msg is None:  # quiet second: keep an idle worker's progress record alive
                try:
                    self.runner.reporter.heartbeat()
                except Exception:
                    log.exception("worker %s: heartbeat failed", self.runner.worker_id)
                continue
            try:
                self.runner.swap_draft(int(msg["version"]), msg.get("published_at"))
            except Exception:
                log.exception("worker %s: swap to %s failed", self.runner.worker_id, msg)

    async def load_policy(self, state_ref, policy_version: int) -> None:
        state = state_ref[0] if isinstance(state_ref, list) else state_ref
        await asyncio.to_thread(self.runner.load_policy, state, policy_version)

    async def generate(self, prompts, params, rl_step: int) -> list[dict]:
        return await asyncio.to_thread(self.runner.generate, prompts, params, rl_step)

    async def train_drafter(self, lease: dict) -> dict:
        return await asyncio.to_thread(self.runner.train_drafter, lease)

    async def start_lease(self, lease: dict) -> str:
        """Accept a lease and train in the background; poll `lease_result`. Raises ValueError for a
        malformed lease or a worker that already holds one."""
        self.runner.check_lease(lease)
        task = asyncio.get_running_loop().create_task(asyncio.to_thread(self.runner.train_drafter, lease, True))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return str(lease["lease_id"])

    async def lease_result(self, lease_id: str) -> dict | None:
        return self.runner.lease_result(lease_id)

    async def stop_training(self, wait_s: float = 0.0) -> bool:
        return await asyncio.to_thread(self.runner.stop_training, wait_s)

    async def evaluate_drafts(self, drafts: list[dict], k: int, greedy: bool) -> dict:
        return await asyncio.to_thread(self.runner.evaluate_drafts, drafts, k, greedy)

    async def swap_draft(self, version: int) -> None:
        await asyncio.to_thread(self.runner.swap_draft, version)

    async def status(self) -> dict:
        return self.runner.status()

    async def set_reporting(self, enabled: bool) -> None:
        self.runner.report_progress = enabled

    async def swap_log(self) -> list[dict]:
        return list(self.runner.swap_log)
