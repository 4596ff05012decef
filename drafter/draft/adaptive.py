"""Adaptive speculation: the draft length k (0 = plain decoding) chosen per live-batch-size bucket from
the accepted tokens per second each (bucket, k) measurably gives. Pure Python: no torch.

Speculation pays where a policy forward is cheap to widen (the tail: small batches) and can cost at large
batches, where verifying k extra tokens per row is real compute; how much depends on the draft, the
device and the model, so it is measured rather than set by a threshold. A `DraftLengthTuner` is an
epsilon-greedy bandit per bucket, as in TLT:
    1. forced tries: every eligible arm (k) is tried `num_tries` times in a bucket, round robin, and at
       small batches more often, until it has emitted for `min_row_samples` rows (16 steps at batch 1);
    2. then the arm with the best tokens/s estimate (an EMA of tokens over an EMA of seconds) serves, and a
       bounded share of steps (at most `explore_frac` of the bucket's steps, growing only as sqrt(steps)
       later) re-measures the least recently tried other eligible arm: exploring costs at most
       explore_frac x (best - worst) / best;
    3. a new draft (`new_draft`: a hot swap) makes every speculative arm's estimate stale: each is
       tried again `num_retries` times (more at small batches, as in 1.) and its new samples replace the
       old estimate.
Eligible arms: what a step gains from drafting k tokens shrinks as the batch grows (each row's extra k
tokens are compute a wider batch no longer hides), so a bucket drafts k > 0 only where the nearest smaller
bucket measured has found k faster than plain. The smallest bucket ("1", the end of every rollout that
shrinks) tries every arm; a large batch is never slowed by trying drafts that a smaller batch already
shows do not pay. A rollout reaches its small buckets last, so its first large-batch steps decode plainly.
The engine asks `choose(batch_size)` before each step and reports `record(batch_size, k, num_tokens,
seconds)` after it; the choice depends only on past steps, so verification stays lossless.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

# upper edges of the live-batch-size buckets; past the last one: one bucket "33+"
BUCKET_EDGES = (1, 2, 4, 8, 16, 32)


def bucket_of(batch_size: int) -> str:
    """'1', '2', '3-4', '5-8', '9-16', '17-32' or '33+'."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    low = 1
    for edge in BUCKET_EDGES:
        if batch_size <= edge:
            return str(edge) if low == edge else f"{low}-{edge}"
        low = edge + 1
    return f"{low}+"


def bucket_low_edge(bucket: str) -> int:
    """A bucket's smallest batch size ('3-4' -> 3, '33+' -> 33)."""
    return int(bucket.split("-")[0].rstrip("+"))


def arms_for(k_max: int) -> tuple[int, ...]:
    """The draft lengths tried: 0, the powers of two below k_max, and k_max (few arms: little to explore)."""
    if not isinstance(k_max, int) or k_max < 0:
        raise ValueError(f"k_max must be an int >= 0, got {k_max!r}")
    return tuple(sorted({0, k_max} | {1 << i for i in range(5) if (1 << i) < k_max}))


@dataclass
class _Arm:
    tokens: float = 0.0  # EMA of a step's tokens
    seconds: float = 0.0  # EMA of a step's seconds
    num_samples: int = 0  # since its estimate was last made stale
    num_tries_left: int = 0  # forced tries still owed
    last_step: int = -1  # the bucket step it last served

    @property
    def rate(self) -> float:
        """Tokens/s: the ratio of the EMAs (a mean of per-step ratios would overweight the lucky fast steps)."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Bucket:
    arms: dict[int, _Arm]
    num_steps: int = 0
    num_explored: int = 0
    totals: dict[int, list[float]] = field(default_factory=dict)  # k -> [tokens, seconds], all time


class _Meter:
    """Per (bucket, k) throughput, for reports and benchmarks."""

    def __init__(self, arms: tuple[int, ...], num_tries: int, min_row_samples: int = 0) -> None:
        self.arms = arms
        self._num_tries, self._min_row_samples = num_tries, min_row_samples
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()  # new_draft comes from the swap listener's thread

    def _tries(self, name: str, base: int) -> int:
        """Forced tries per arm in bucket `name`: `base`, and enough steps for min_row_samples rows (a step at
        batch 1 emits 1..k+1 tokens by chance: one or two of them say little; a wide batch averages)."""
        return max(base, -(-self._min_row_samples // bucket_low_edge(name))) if base else 0

    def _bucket(self, batch_size: int) -> _Bucket:
        name = bucket_of(batch_size)
        b = self._buckets.get(name)
        if b is None:
            tries = self._tries(name, self._num_tries)
            b = self._buckets[name] = _Bucket({k: _Arm(num_tries_left=tries) for k in self.arms})
        return b

    def bucket_totals(self) -> dict[str, tuple[float, float]]:
        """{bucket: (tokens, seconds)} over every step so far, whatever k served (cumulative: take differences)."""
        with self._lock:
            return {name: (sum(t for t, _ in b.totals.values()), sum(s for _, s in b.totals.values()))
                    for name, b in self._buckets.items()}

    def throughput(self) -> dict[str, dict[int, float]]:
        """{bucket: {k: tokens/s over every step it served}}."""
        with self._lock:
            return {name: {k: t / s for k, (t, s) in sorted(b.totals.items()) if s > 0}
                    for name, b in self._buckets.items()}


class FixedDraftLength(_Meter):
    """Always the same k ("always": k = draft_k; "off": k = 0), measured like the tuner's arms."""

    def __init__(self, k: int) -> None:
        super().__init__(arms_for(k)[-1:], 0)
        self.k = k

    def choose(self, batch_size: int) -> int:
        return self.k

    def record(self, batch_size: int, k: int, num_tokens: int, seconds: float) -> None:
        with self._lock:
            t = self._bucket(batch_size).totals.setdefault(k, [0.0, 0.0])
            t[0] += num_tokens
            t[1] += max(seconds, 0.0)

    def new_draft(self) -> None:
        return None

    def summary(self) -> dict[str, int]:
        with self._lock:
            return {name: self.k for name in self._buckets}


class DraftLengthTuner(_Meter):
    """Chooses k in arms_for(k_max) per live-batch bucket from measured tokens/s (see the module doc)."""

    def __init__(self, k_max: int, *, num_tries: int = 2, min_row_samples: int = 16, num_retries: int = 1,
                 ema: float = 0.2, explore_frac: float = 0.02) -> None:
        if num_tries < 1 or num_retries < 1:
            raise ValueError(f"num_tries and num_retries must be >= 1, got {num_tries}, {num_retries}")
        if not 0 < ema <= 1:
            raise ValueError(f"ema must be in (0, 1], got {ema}")
        if not 0 <= explore_frac < 1:
            raise ValueError(f"explore_frac must be in [0, 1), got {explore_frac}")
        super().__init__(arms_for(k_max), num_tries, min_row_samples)
        self.k_max, self.num_retries, self.ema, self.explore_frac = k_max, num_retries, ema, explore_frac

    def _eligible(self, batch_size: int) -> tuple[int, ...]:
        """The arms a bucket may serve: 0, and the k > 0 the nearest smaller bucket measured found faster than
        plain (every arm in the smallest bucket). Called with the lock held."""
        name = bucket_of(batch_size)
        order = [bucket_of(e) for e in BUCKET_EDGES] + [bucket_of(BUCKET_EDGES[-1] + 1)]
        smaller = [self._buckets.get(n) for n in order[: order.index(name)]]
        below = next((sb for sb in reversed(smaller) if sb is not None and sb.arms[0].num_samples > 0), None)
        if name == order[0]:
            return self.arms
        if below is None:
            return (0,)
        plain = below.arms[0].rate
        return (0, *(k for k in self.arms if k > 0 and below.arms[k].num_samples > 0 and below.arms[k].rate > plain))

    def choose(self, batch_size: int) -> int:
        """The draft length for the next step with `batch_size` sequences live."""
        with self._lock:
            b = self._bucket(batch_size)
            b.num_steps += 1
            eligible = self._eligible(batch_size)
            owed = [k for k in eligible if b.arms[k].num_tries_left > 0]
            if owed:  # forced tries, round robin: the arm owed most, then the least recently tried
                k = max(owed, key=lambda a: (b.arms[a].num_tries_left, -b.arms[a].last_step, -a))
                b.arms[k].last_step = b.num_steps
                return k
            best = self._best(b, eligible)
            others = [k for k in eligible if k != best]
            n = b.num_steps
            if others and b.num_explored < min(self.explore_frac * n, math.sqrt(n) * self.explore_frac * 10):
                b.num_explored += 1
                best = min(others, key=lambda a: (b.arms[a].last_step, a))
            b.arms[best].last_step = b.num_steps
            return best

    def record(self, batch_size: int, k: int, num_tokens: int, seconds: float) -> None:
        """A step with `batch_size` live drafted up to k tokens per row and emitted num_tokens in all."""
        if seconds <= 0:
            return
        with self._lock:
            b = self._bucket(batch_size)
            t = b.totals.setdefault(k, [0.0, 0.0])
            t[0] += num_tokens
            t[1] += seconds
            arm = b.arms.get(k)
            if arm is None:  # a k this tuner never chooses (the engine capped it): measured, not learned
                return
            weight = max(self.ema, 1.0 / (arm.num_samples + 1))  # the first samples are averaged, then EMA
            arm.tokens += weight * (num_tokens - arm.tokens)
            arm.seconds += weight * (seconds - arm.seconds)
            arm.num_samples += 1
            arm.num_tries_left = max(arm.num_tries_left - 1, 0)

    def new_draft(self) -> None:
        """A different draft serves from now on: the speculative arms' estimates are stale."""
        with self._lock:
            for name, b in self._buckets.items():
                retries = self._tries(name, self.num_retries)
                for k, arm in b.arms.items():
                    if k > 0:
                        arm.num_samples, arm.num_tries_left = 0, max(arm.num_tries_left, retries)

    @staticmethod
    def _best(b: _Bucket, eligible: tuple[int, ...]) -> int:
        """The eligible arm with the best tokens/s estimate; ties go to the shorter draft (cheaper)."""
        measured = [k for k in eligible if b.arms[k].num_samples > 0] or [min(eligible)]
        return max(measured, key=lambda k: (b.arms[k].rate, -k))

    def best(self, batch_size: int) -> int:
        with self._lock:
            return self._best(self._bucket(batch_size), self._eligible(batch_size))

    def summary(self) -> dict[str, int]:
        """{bucket: the k it serves now}, for the buckets seen (the step record's `speculation`)."""
        with self._lock:
            return {name: self._best(b, self._eligible(bucket_low_edge(name))) for name, b in self._buckets.items()}

    def estimates(self) -> dict[str, dict[int, float]]:
        """{bucket: {k: EMA tokens/s}} for the arms measured."""
        with self._lock:
            return {name: {k: a.rate for k, a in b.arms.items() if a.num_samples > 0}
                    for name, b in self._buckets.items()}
