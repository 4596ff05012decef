"""Drafter training: the EAGLE head learns the policy's next-token distribution from rollouts, by the loss of
drafter.train.loss over the training-time unrolling (drafter.train.unroll).

Training runs in micro-steps (one optimizer step each); a stop request aborts the current micro-step
before its optimizer update, so a trainer stops within one micro-step and never half-applies one.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from drafter.draft.head import EagleHead, draft_lm_weight
from drafter.model.causal_lm import CausalLM
from drafter.model.config import TrainConfig
from drafter.model.linear import fast_bf16
from drafter.train.buffer import PackedBatch, RolloutBuffer, iter_batches
from drafter.train.checkpoint import DraftMeta, load_trainer_state, save_trainer_state
from drafter.train.loss import draft_loss
from drafter.train.unroll import LossIndex, loss_mask

__all__ = ["DraftTrainer", "StopRequestedError", "TrainReport", "draft_loss", "tf32_matmuls"]


STOP_POLL_S = 0.002  # how often a step waiting for its batch to be packed looks for a stop request


class StopRequestedError(Exception):
    """Raised inside a micro-step when a stop was requested; the step is discarded."""


@contextmanager
def tf32_matmuls(device: torch.device, enabled: bool):
    """On CUDA with `enabled`, float32 matmuls on TF32 tensor cores inside the block, the flag restored after it
    (the policy serving beside the trainer keeps its own precision); anywhere else, nothing changes."""
    if not enabled or device.type != "cuda":
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@dataclass
class TrainReport:
    num_steps: int = 0
    num_tokens: int = 0
    seconds: float = 0.0
    stopped: bool = False  # True when a stop request ended training
    losses: list[float] = field(default_factory=list)
    last_stats: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / max(self.seconds, 1e-9)


class DraftTrainer:
    """Trains an EagleHead against a frozen policy on a RolloutBuffer, in stoppable micro-steps."""

    def __init__(self, policy: CausalLM, head: EagleHead, cfg: TrainConfig | None = None) -> None:
        self.device = head.fc.weight.device  # where it trains: batches are moved here, whole
        if policy.device != self.device:
            raise ValueError(f"the head is on {self.device} and the policy on {policy.device}: the head trains on "
                             "the policy's device (its embedding and LM head score every step)")
        self.policy, self.head, self.cfg = policy, head, cfg or TrainConfig()
        self.head.train().requires_grad_(True)
        self.head.vocab_ids.requires_grad_(False)
        params = [p for p in head.parameters() if p.requires_grad]
        # fused on CUDA (one kernel for every parameter); elsewhere torch's default, as before
        self.optimizer = torch.optim.AdamW(params, lr=self.cfg.lr, betas=self.cfg.betas,
                                           weight_decay=self.cfg.weight_decay,
                                           fused=True if self.device.type == "cuda" else None)
        self.num_rows = self.cfg.rows_per_step(self.device.type)  # rows per micro-step (TrainConfig.tokens_per_step)
        auto = self.cfg.bf16_autocast is None and not self.cfg.bf16_weights
        self.bf16_autocast = fast_bf16(head.fc.weight.device) if auto else bool(self.cfg.bf16_autocast)
        # bf16_weights: the bf16 copy the loss runs on (the head's float32 weights stay the optimizer's masters)
        self._work = copy.deepcopy(head).to(torch.bfloat16) if self.cfg.bf16_weights else None
        self.step = 0  # optimizer steps taken by this trainer (drives the schedule)
        self.num_tokens = 0
        self.stop_event = threading.Event()
        self._epoch = 0
        self._batches: Iterator[PackedBatch] | None = None
        # on a GPU the next batch is packed on the host while the device runs a step (a 32k-pair batch takes a good
        # part of a step to pack); None on a CPU, whose cores the step uses
        self._packer = ThreadPoolExecutor(1, thread_name_prefix="draft-pack") if self.device.type == "cuda" else None
        self._packed: Future | None = None  # the batch being packed for the next step
        self._lm_weight: tuple[torch.Tensor, torch.Tensor, tuple, torch.Tensor] | None = None

    def lm_weight(self) -> torch.Tensor:
        """draft_lm_weight in the dtype the loss computes in (bf16 under autocast), kept between
        micro-steps and rebuilt when the policy's LM head or the head's vocabulary changes in place."""
        w, ids = self.policy.lm_head.weight, self.head.vocab_ids
        dtype = torch.bfloat16 if self.bf16_autocast or self._work is not None else self.head.fc.weight.dtype
        key = (w._version, ids._version, dtype)
        kept = self._lm_weight
        # the tensors themselves, not their addresses: a replaced weight may reuse a freed one's memory
        if kept is None or kept[0] is not w or kept[1] is not ids or kept[2] != key:
            with torch.no_grad():
                self._lm_weight = kept = w, ids, key, draft_lm_weight(self.head, self.policy).to(dtype)
        return kept[3]

    def lr_at(self, step: int, budget_progress: float | None = None) -> float:
        """The rate at optimizer step `step`: linear warmup, then cosine decay to lr * min_lr_ratio at
        total_steps or, given `budget_progress` (the spent fraction of a train() budget), at its end."""
        c = self.cfg
        if step < c.warmup_steps:
            return c.lr * (step + 1) / c.warmup_steps
        if budget_progress is not None:
            progress = min(1.0, max(0.0, budget_progress))
        else:
            progress = min(1.0, (step - c.warmup_steps) / max(1, c.total_steps - c.warmup_steps))
        cosine = 0.5 * (1 + math.cos(progress * math.pi))
        return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * cosine)

    def request_stop(self) -> None:
        self.stop_event.set()

    def _check_stop(self) -> None:
        if self.stop_event.is_set():
            raise StopRequestedError

    def next_batch(self, buffer: RolloutBuffer) -> PackedBatch:
        """Cycle over the buffer, one shuffled epoch after another, passing over batches in which no
        pair has a target (rollouts of a single pair)."""
        if len(buffer) == 0:
            raise ValueError("the rollout buffer is empty: nothing to train on")
        fresh = False  # this call began an epoch: if that one holds no target either, none does
        while True:
            if self._batches is None:
                if fresh:
                    raise ValueError("no pair of the rollout buffer has a target: its rollouts are one pair long")
                self._batches = iter_batches(buffer.read_for_training(), self.cfg.max_tokens_per_row, self.num_rows,
                                             shuffle=True, seed=self.cfg.seed + self._epoch)
                self._epoch += 1
                fresh = True
            for batch in self._batches:
                if bool(loss_mask(batch, 0).any()):
                    return batch
            self._batches = None

    def _next_packed(self, buffer: RolloutBuffer) -> PackedBatch:
        """next_batch, and on a GPU the one after it started packing in the background. A batch packed for a step
        that never ran (a stop, a budget spent) is the next call's first."""
        if self._packer is None:
            return self.next_batch(buffer)
        packed = self._packed = self._packed or self._packer.submit(self.next_batch, buffer)
        while not wait([packed], timeout=STOP_POLL_S).done:  # a stop is not kept waiting for the packing
            self._check_stop()
        self._packed = None  # a packing that failed (a buffer with no target yet) is not the next call's answer
        batch = packed.result()
        self._packed = self._packer.submit(self.next_batch, buffer)
        return batch

    def micro_step(self, batch: PackedBatch, budget_progress: float | None = None) -> dict:
        """One optimizer step; raises StopRequestedError (with nothing applied) if a stop arrives mid-way.
        budget_progress: how much of the train() call's budget is spent (anneal_to_budget only). Returns the
        step's figures, read from the device at once (train() reads them every stats_every steps instead)."""
        return self._read([self._step(batch, budget_progress)])[0]

    def _step(self, batch: PackedBatch, budget_progress: float | None) -> tuple[list[str], torch.Tensor, dict]:
        """micro_step without reading anything back: the names and (n,) device tensor of the step's figures, and
        its host-side ones (lr)."""
        # where the loss reads, from the masks while they are on the CPU (no host sync on a GPU), then the batch
        # on the head's device in its dtype: packed on the CPU, moved once
        index = LossIndex.of(batch, self.cfg.num_unroll).to(self.device)
        head = self.head if self._work is None else self._work
        batch = batch.to(self.device, head.fc.weight.dtype)
        lr = self.lr_at(self.step, budget_progress)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        masters = [p for p in self.head.parameters() if p.requires_grad]
        if self._work is not None:  # the bf16 copy from the masters, as they are now (a merge may have changed them)
            work = [p for p in head.parameters() if p.requires_grad]
            with torch.no_grad():
                torch._foreach_copy_(work, masters)
            for p in work:
                p.grad = None
        with tf32_matmuls(self.device, self.cfg.tf32):
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16_autocast):
                loss, stats = draft_loss(head, self.policy, batch, self.cfg, self._check_stop, self.lm_weight(),
                                         index)
            self._check_stop()
            loss.backward()
            self._check_stop()
            if self._work is not None:  # float32 gradients of the masters, from the bf16 copy's
                for m, p in zip(masters, work, strict=True):
                    m.grad = None if p.grad is None else p.grad.float()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.cfg.max_grad_norm)
            self.optimizer.step()
        self.step += 1
        self.num_tokens += batch.num_tokens
        names = [*stats, "loss", "grad_norm"]
        values = torch.stack([t.detach().float() for t in (*stats.values(), loss, grad_norm)])  # (n,), on the device
        host = {"lr": lr} if budget_progress is None else {"lr": lr, "budget_progress": budget_progress}
        return names, values, host

    @staticmethod
    def _read(steps: list[tuple[list[str], torch.Tensor, dict]]) -> list[dict]:
        """The figures of `steps`, read in one transfer (each read of a device tensor waits for the device)."""
        if not steps:
            return []
        rows = torch.stack([v for _, v, _ in steps]).tolist() if len({len(n) for n, _, _ in steps}) == 1 \
            else [v.tolist() for _, v, _ in steps]  # the number of unrolled steps with pairs varies by batch
        return [{**dict(zip(names, row, strict=True)), **host} for (names, _, host), row in zip(steps, rows)]

    def train(self, buffer: RolloutBuffer, max_steps: int | None = None, max_seconds: float | None = None,
              on_step: Callable[[int, dict], None] | None = None,
              checkpoint: Callable[[DraftTrainer], None] | None = None, checkpoint_every: int = 0) -> TrainReport:
        """Train until max_steps, max_seconds or a stop request. Checkpoints via `checkpoint` every
        `checkpoint_every` steps and once at the end (also after a stop). The steps' figures are read from the
        device every stats_every steps (and at the end): on_step(step, stats) is called then, for each of them."""
        if max_steps is None and max_seconds is None:
            raise ValueError("give max_steps or max_seconds, or training never ends")
        report = TrainReport()
        start = time.perf_counter()
        pending: list[tuple[int, tuple]] = []  # (step, unread figures)

        def flush() -> None:
            for (step, _), stats in zip(pending, self._read([p for _, p in pending])):
                report.losses.append(stats["loss"])
                report.last_stats = stats
                if on_step is not None:
                    on_step(step, stats)
            pending.clear()

        self.head.train()
        try:
            while not self.stop_event.is_set():
                if max_steps is not None and report.num_steps >= max_steps:
                    break
                if max_seconds is not None and time.perf_counter() - start >= max_seconds:
                    break
                try:
                    batch = self._next_packed(buffer)
                    progress = None
                    if self.cfg.anneal_to_budget:
                        spent = [report.num_steps / max_steps] if max_steps else []
                        if max_seconds:
                            spent.append((time.perf_counter() - start) / max_seconds)
                        progress = max(spent, default=1.0)
                    pending.append((self.step + 1, self._step(batch, progress)))
                except StopRequestedError:
                    self.optimizer.zero_grad(set_to_none=True)
                    break
                report.num_steps += 1
                report.num_tokens += batch.num_tokens
                if len(pending) >= self.cfg.stats_every:
                    flush()
                if checkpoint is not None and checkpoint_every and self.step % checkpoint_every == 0:
                    checkpoint(self)
            flush()
        finally:
            self.head.eval()
        report.stopped = self.stop_event.is_set()
        if checkpoint is not None:
            checkpoint(self)
        report.seconds = time.perf_counter() - start
        return report

    def config_dict(self) -> dict:
        return asdict(self.cfg)

    def save(self, path, meta: DraftMeta) -> str:
        """Atomic, resumable checkpoint of head, optimizer and counters (see drafter.train.checkpoint)."""
        trainer = {"step": self.step, "num_tokens": self.num_tokens, "epoch": self._epoch, "config": self.config_dict()}
        return save_trainer_state(path, self.head.state_dict(), self.optimizer, meta, trainer)

    def resume(self, path) -> DraftMeta:
        """Continue from a checkpoint written by `save`: weights, optimizer moments and step counter.
        The epoch restarts from a fresh shuffle; only micro-steps after the checkpoint are lost."""
        meta, trainer = load_trainer_state(path, self.head, self.optimizer)
        self.step, self.num_tokens = int(trainer["step"]), int(trainer["num_tokens"])
        if self._packed is not None:  # packed from the epoch before: dropped with it
            self._packed.exception()
        self._epoch, self._batches, self._packed = int(trainer.get("epoch", 0)), None, None
        return meta
