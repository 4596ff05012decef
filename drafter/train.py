"""Drafter training: the EAGLE head learns the policy's next-token distribution from rollouts.

Loss per pair j = (h_j, x_{j+1}): cross-entropy of the head's draft distribution against the
policy's own distribution softmax(lm_head(h_{j+1})) over the draft vocabulary, plus a smooth-L1
regression of the predicted feature onto h_{j+1}.

Training-time unrolling (EAGLE-3's "training-time test"): at inference, draft step s > 0 feeds the
head its own previous prediction instead of the policy's feature. Unroll step s reproduces that:
slot j's input feature is step s-1's prediction at slot j-1, and its attention sees exactly what it
would see at inference: the true-feature keys of its chain's past (positions <= j - s) plus the keys
its own chain produced at steps 1..s (one per step, on the diagonal).

Training runs in micro-steps (one optimizer step each); a stop request aborts the current micro-step
before its optimizer update, so a trainer stops within one micro-step and never half-applies one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn.functional as F

from drafter.buffer import PackedBatch, RolloutBuffer, iter_batches
from drafter.checkpoint import DraftMeta, load_trainer_state, save_trainer_state
from drafter.config import TrainConfig
from drafter.eagle import EagleHead, draft_lm_weight
from drafter.model import CausalLM, apply_rotary, fast_bf16


class StopRequestedError(Exception):
    """Raised inside a micro-step when a stop was requested; the step is discarded."""


def _shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    """x (R, T, ...) -> y with y[:, j] = x[:, j - n] (the first n slots are zeros)."""
    if n == 0:
        return x
    return torch.cat([torch.zeros_like(x[:, :n]), x[:, :-n]], dim=1)


@dataclass
class VarlenLayout:
    """Packed rows flattened for a variable-length attention kernel: the real slots, segment by segment."""

    index: torch.Tensor  # (N,) flat slot index into (R*T) of every real pair, in segment order
    cu_seqlens: torch.Tensor  # (S+1,) int32 cumulative segment lengths
    max_len: int


def varlen_layout(seq_ids: torch.Tensor) -> VarlenLayout:
    """Segments are contiguous runs of one seq id within a row (ids are unique across the batch) and
    their slots are in position order, so flat slot order is segment order."""
    flat = seq_ids.reshape(-1)
    index = (flat >= 0).nonzero().squeeze(1)
    _, counts = torch.unique_consecutive(flat[index], return_counts=True)
    cu = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=seq_ids.device)
    cu[1:] = counts.cumsum(0)
    return VarlenLayout(index, cu, int(counts.max()) if counts.numel() else 0)


def varlen_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True):
    """flash_attn_varlen_func's contract in plain torch, (N, H, D) in and out: the CPU counterpart
    the GPU kernel is tested against (training without flash-attn stays on masked SDPA, not this)."""
    if not torch.equal(cu_seqlens_q, cu_seqlens_k):
        raise ValueError("the reference kernel needs the same segments for queries and keys")
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        out[a:b] = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), is_causal=causal,
            enable_gqa=q.shape[1] != k.shape[1]).transpose(0, 1)
    return out


def flash_varlen_kernel():
    """flash-attn's varlen kernel when it is installed and a GPU is present, else None."""
    if not torch.cuda.is_available():
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def varlen_step0_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: VarlenLayout,
                           kernel) -> torch.Tensor:
    """Unroll step 0 is plain causal attention within each packed segment: run it as a varlen kernel
    over the real slots only. q (R, H, T, D), k/v (R, Hkv, T, D) -> (R, H, T, D); padding slots get
    zeros (their outputs are never in a loss, and later steps only let them attend to themselves)."""
    R, H, T, D = q.shape

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).reshape(R * T, x.shape[1], D)[layout.index]

    qf, kf, vf = flat(q), flat(k), flat(v)
    half = q.dtype if q.dtype in (torch.float16, torch.bfloat16) or kernel is varlen_attention_reference \
        else torch.bfloat16  # flash-attn takes half precision only
    out = kernel(qf.to(half), kf.to(half), vf.to(half), layout.cu_seqlens, layout.cu_seqlens, layout.max_len,
                 layout.max_len, causal=True).to(q.dtype)
    full = torch.zeros(R * T, H, D, dtype=q.dtype, device=q.device).index_copy(0, layout.index, out)
    return full.view(R, T, H, D).transpose(1, 2)


def _stop_in_backward(x: torch.Tensor, check_stop: Callable[[], None] | None) -> None:
    """Check for a stop when backward reaches `x` too: the backward pass is most of a micro-step, and
    an exception raised in a gradient hook aborts it (the trainer then drops the partial gradients)."""
    if check_stop is not None and x.requires_grad:
        x.register_hook(lambda grad: check_stop())


def unrolled_predictions(head: EagleHead, embed: torch.nn.Embedding, batch: PackedBatch,
                         num_unroll: int, check_stop: Callable[[], None] | None = None,
                         varlen_kernel=None) -> list[torch.Tensor]:
    """Predicted features for unroll steps 0..num_unroll-1, each (R, T, D). With `varlen_kernel`
    (flash-attn's on a GPU) step 0 runs it over the packed segments; later steps need keys from
    other steps on the diagonal, which no varlen kernel expresses, so they stay on masked SDPA."""
    feats, positions, seq = batch.feats, batch.positions, batch.seq_ids
    layout = varlen_layout(seq) if varlen_kernel is not None else None
    R, T, _ = feats.shape
    emb = embed(batch.tokens)  # (R, T, D), frozen
    rope = head.rotary(positions, feats.dtype)
    same = (seq[:, :, None] == seq[:, None, :]) & (seq[:, :, None] >= 0)  # (R, Tq, Tk)
    eye = torch.eye(T, dtype=torch.bool, device=feats.device).expand(R, T, T)
    layer_keys: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in head.layers]
    preds, x_feats = [], feats
    for s in range(num_unroll):
        if check_stop is not None:
            check_stop()
        # keys visible to step s at query slot j: true keys at positions <= pos_j - s ...
        base = same & (positions[:, None, :] <= positions[:, :, None] - s)  # (R, Tq, Tk)
        # ... and step t's key at slot j - (s - t), t = 1..s (shifted onto the diagonal)
        masks = [base] + [eye] * s
        mask = torch.cat(masks, dim=-1).unsqueeze(1)  # (R, 1, T, T*(s+1))
        # no chain of s steps inside the segment (or padding): attend to itself, never to nothing
        lonely = (positions - batch.seg_start < s) | (seq < 0)
        mask[..., :T] |= eye.unsqueeze(1) & lonely.view(R, 1, T, 1)
        x = head.fc(torch.cat([emb, x_feats], dim=-1))  # (R, T, 2D) -> (R, T, D)
        for li, layer in enumerate(head.layers):
            attn = layer.attn
            h = layer.input_norm(x)
            q, k, v = attn.qkv_proj(h).split(attn.split, dim=-1)
            q = apply_rotary(q.view(R, T, attn.num_heads, attn.head_dim), *rope).transpose(1, 2)  # (R, H, T, D)
            k = apply_rotary(k.view(R, T, attn.num_kv_heads, attn.head_dim), *rope).transpose(1, 2)
            v = v.view(R, T, attn.num_kv_heads, attn.head_dim).transpose(1, 2)  # (R, Hkv, T, D)
            layer_keys[li].append((k, v))
            ks = [layer_keys[li][0][0]] + [_shift_right(layer_keys[li][t][0].transpose(1, 2), s - t).transpose(1, 2)
                                           for t in range(1, s + 1)]
            vs = [layer_keys[li][0][1]] + [_shift_right(layer_keys[li][t][1].transpose(1, 2), s - t).transpose(1, 2)
                                           for t in range(1, s + 1)]
            if s == 0 and layout is not None:
                out = varlen_step0_attention(q, k, v, layout, varlen_kernel)
            else:
                out = F.scaled_dot_product_attention(q, torch.cat(ks, dim=2), torch.cat(vs, dim=2), attn_mask=mask,
                                                     enable_gqa=attn.num_heads != attn.num_kv_heads)  # (R, H, T, D)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(R, T, -1))
            _stop_in_backward(x, check_stop)
            x = x + layer.mlp(layer.post_attn_norm(x))
            _stop_in_backward(x, check_stop)
        pred = head.norm(x)
        preds.append(pred)
        x_feats = _shift_right(pred, 1)  # slot j's next input is this step's prediction at slot j-1
    return preds


def loss_mask(batch: PackedBatch, step: int) -> torch.Tensor:
    """(R, T-1) bool: the pairs whose unroll step `step` is trained: the prediction at pair j of step s
    comes from a chain rooted at pair j - s, which must lie in the same packed segment (a long
    rollout cut into chunks starts its chains afresh in each chunk), and the pair needs a target."""
    return batch.target_mask[:, :-1] & (batch.positions[:, :-1] - step >= batch.seg_start[:, :-1])


def draft_loss(head: EagleHead, policy: CausalLM, batch: PackedBatch, cfg: TrainConfig,
               check_stop: Callable[[], None] | None = None,
               lm_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """lm_weight: draft_lm_weight(head, policy), possibly already in the autocast dtype (a trainer
    keeps one copy instead of gathering and casting 8192 x D weights at every use). The LM head, the
    largest matmul of a step, runs on the trained pairs only (loss_mask), not on padding or pairs
    without a chain."""
    if lm_weight is None:
        lm_weight = draft_lm_weight(head, policy)
    target_feats = batch.feats[:, 1:]  # (R, T-1, D): h_{j+1} for pair j
    first = loss_mask(batch, 0)  # every later step's pairs are among these
    with torch.no_grad():
        target_logits = F.linear(target_feats[first], lm_weight).float()  # (N, V')
        target_p = F.softmax(target_logits, dim=-1)
        target_top = target_logits.argmax(-1)
        del target_logits
    kernel = flash_varlen_kernel() if cfg.varlen_attention and batch.feats.is_cuda else None
    preds = unrolled_predictions(head, policy.embed_tokens, batch, cfg.num_unroll, check_stop, kernel)
    total, stats = 0.0, {}
    for s, pred in enumerate(preds):
        valid = first if s == 0 else loss_mask(batch, s)  # (R, T-1)
        if not bool(valid.any()):
            continue
        picked = valid[first]  # (N,): which of the targets this step trains on
        trained = pred[:, :-1][valid]  # (n, D)
        logits = head.draft_logits(trained, lm_weight)  # (n, V')
        logp = F.log_softmax(logits.float(), dim=-1)
        ce = -(target_p[picked] * logp).sum(-1).mean()
        reg = F.smooth_l1_loss(trained, target_feats[valid])
        with torch.no_grad():
            agree = (logits.argmax(-1) == target_top[picked]).float().mean()
        total = total + cfg.unroll_decay**s * (ce + cfg.hidden_loss_weight * reg)
        stats[f"ce_{s}"], stats[f"acc_{s}"] = float(ce.detach()), float(agree)
    return total, stats


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
        self.policy, self.head, self.cfg = policy, head, cfg or TrainConfig()
        self.head.train().requires_grad_(True)
        self.head.vocab_ids.requires_grad_(False)
        params = [p for p in head.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=self.cfg.lr, betas=self.cfg.betas,
                                           weight_decay=self.cfg.weight_decay)
        auto = self.cfg.bf16_autocast is None
        self.bf16_autocast = fast_bf16(head.fc.weight.device) if auto else bool(self.cfg.bf16_autocast)
        self.step = 0  # optimizer steps taken by this trainer (drives the schedule)
        self.num_tokens = 0
        self.stop_event = threading.Event()
        self._epoch = 0
        self._batches: Iterator[PackedBatch] | None = None
        self._lm_weight: tuple[torch.Tensor, torch.Tensor, tuple, torch.Tensor] | None = None

    def lm_weight(self) -> torch.Tensor:
        """draft_lm_weight in the dtype the loss computes in (bf16 under autocast), kept between
        micro-steps and rebuilt when the policy's LM head or the head's vocabulary changes in place."""
        w, ids = self.policy.lm_head.weight, self.head.vocab_ids
        dtype = torch.bfloat16 if self.bf16_autocast else self.head.fc.weight.dtype
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
        cosine = 0.5 * (1 + torch.cos(torch.tensor(progress * torch.pi)).item())
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
                self._batches = iter_batches(buffer, self.cfg.max_tokens_per_row, self.cfg.num_rows, shuffle=True,
                                             seed=self.cfg.seed + self._epoch)
                self._epoch += 1
                fresh = True
            for batch in self._batches:
                if bool(loss_mask(batch, 0).any()):
                    return batch
            self._batches = None

    def micro_step(self, batch: PackedBatch, budget_progress: float | None = None) -> dict:
        """One optimizer step; raises StopRequestedError (with nothing applied) if a stop arrives mid-way.
        budget_progress: how much of the train() call's budget is spent (anneal_to_budget only)."""
        dtype = self.head.fc.weight.dtype
        batch = replace(batch, feats=batch.feats.to(dtype))
        lr = self.lr_at(self.step, budget_progress)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(batch.feats.device.type, dtype=torch.bfloat16, enabled=self.bf16_autocast):
            loss, stats = draft_loss(self.head, self.policy, batch, self.cfg, self._check_stop, self.lm_weight())
        self._check_stop()
        loss.backward()
        self._check_stop()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.cfg.max_grad_norm)
        self.optimizer.step()
        self.step += 1
        self.num_tokens += batch.num_tokens
        stats.update(loss=float(loss.detach()), grad_norm=float(grad_norm), lr=lr)
        return stats

    def train(self, buffer: RolloutBuffer, max_steps: int | None = None, max_seconds: float | None = None,
              on_step: Callable[[int, dict], None] | None = None,
              checkpoint: Callable[[DraftTrainer], None] | None = None, checkpoint_every: int = 0) -> TrainReport:
        """Train until max_steps, max_seconds or a stop request. Checkpoints via `checkpoint` every
        `checkpoint_every` steps and once at the end (also after a stop)."""
        if max_steps is None and max_seconds is None:
            raise ValueError("give max_steps or max_seconds, or training never ends")
        report = TrainReport()
        start = time.perf_counter()
        self.head.train()
        try:
            while not self.stop_event.is_set():
                if max_steps is not None and report.num_steps >= max_steps:
                    break
                if max_seconds is not None and time.perf_counter() - start >= max_seconds:
                    break
                batch = self.next_batch(buffer)
                progress = None
                if self.cfg.anneal_to_budget:
                    spent = [report.num_steps / max_steps] if max_steps else []
                    if max_seconds:
                        spent.append((time.perf_counter() - start) / max_seconds)
                    progress = max(spent, default=1.0)
                try:
                    stats = self.micro_step(batch, progress)
                except StopRequestedError:
                    self.optimizer.zero_grad(set_to_none=True)
                    break
                report.num_steps += 1
                report.num_tokens += batch.num_tokens
                report.losses.append(stats["loss"])
                report.last_stats = stats
                if on_step is not None:
                    on_step(self.step, stats)
                if checkpoint is not None and checkpoint_every and self.step % checkpoint_every == 0:
                    checkpoint(self)
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
        """Atomic, resumable checkpoint of head, optimizer and counters (see drafter.checkpoint)."""
        trainer = {"step": self.step, "num_tokens": self.num_tokens, "epoch": self._epoch, "config": self.config_dict()}
        return save_trainer_state(path, self.head.state_dict(), self.optimizer, meta, trainer)

    def resume(self, path) -> DraftMeta:
        """Continue from a checkpoint written by `save`: weights, optimizer moments and step counter.
        The epoch restarts from a fresh shuffle; only micro-steps after the checkpoint are lost."""
        meta, trainer = load_trainer_state(path, self.head, self.optimizer)
        self.step, self.num_tokens = int(trainer["step"]), int(trainer["num_tokens"])
        self._epoch, self._batches = int(trainer.get("epoch", 0)), None
        return meta
