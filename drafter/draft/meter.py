"""What every draft-length chooser measures, per live-batch-size bucket: the tokens, seconds, steps and rows each
draft length k served (reports and benchmarks), the state the adaptive tuner keeps beside them per bucket (`Bucket`,
`Arm`: drafter.draft.adaptive reads and writes it), and the chooser that always serves one k (`FixedDraftLength`: the
tuner's baselines); `DraftLengthChooser`, what the engine asks of any chooser. Pure Python: no torch."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from drafter.draft.step_model import StepCostPrior


class DraftLengthChooser(Protocol):
    """Chooses each step's draft length from the live batch size and learns from what the step gave
    (drafter.draft.adaptive.DraftLengthTuner; FixedDraftLength, below, for a fixed k)."""

    def choose(self, batch_size: int) -> int: ...
    def record(self, batch_size: int, k: int, num_tokens: int, seconds: float, steady: bool = True) -> None: ...
    def record_rows(self, batch_size: int, k: int, rows: list[tuple[int, int]]) -> None: ...  # (drafted, accepted)
    def record_sources(self, batch_size: int, sources: dict[str, tuple[int, int, int]]) -> None:
        """What each draft source of the step drafted and had accepted (Drafter.step_sources): reports only."""


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
class Arm:
    """What the adaptive tuner knows of one draft length in one bucket."""

    tokens: float = 0.0  # EMA of a step's tokens
    # EMA of a step's seconds over the bucket's level when it ran (Bucket.level): its cost against the other arms'
    cost: float = 0.0
    num_samples: int = 0  # since its estimate was last made stale
    rows: float = 0.0  # EMA of a step's live rows
    num_tries_left: int = 0  # forced tries still owed
    last_step: int = -1  # the bucket step it last served
    stale_waits: int = 0  # re-measured this many times since it last won: it waits stale_steps << this when it loses


@dataclass
class Bucket:
    """One live-batch-size bucket: every arm's estimate, the level their costs are relative to, and what served."""

    arms: dict[int, Arm]
    # the seconds of a step of cost 1 now, and the live rows now (EMAs): a step's seconds drift along a rollout (its
    # context grows, its rows finish) whichever arm serves, so arms measured at different times are ranked by their
    # costs against the level when they ran (DraftLengthTuner.record), not by their seconds then
    level: float = 0.0
    rows: float = 0.0
    run_k: int | None = None  # the arm of the latest steady step, and the steady steps its run has had so far
    run_steady: int = 0
    num_steps: int = 0
    num_explored: int = 0
    last_k: int | None = None  # the arm served last step
    run_left: int = 0  # steps the exploring arm still serves in its run
    totals: dict[int, list[float]] = field(default_factory=dict)  # k -> [tokens, seconds], all time
    # k -> [steps, live rows] it served, all time: tokens / rows is the bucket's accepted length at k (plain: 1.0)
    served: dict[int, list[int]] = field(default_factory=dict)
    # source -> [rows, tokens drafted, drafts accepted] over the steps a drafter of several sources served, all time
    sources: dict[str, list[int]] = field(default_factory=dict)
    # k -> [rows, tokens] of the drafting steps, decayed by POOL_DECAY per step of the bucket: what fit_acceptance reads
    pooled: dict[int, list[float]] = field(default_factory=dict)
    acceptance: float | None = None  # the pooled acceptance, the prior's counted in (DraftLengthTuner._fit)
    # position j's [rows that reached it, rows that had it accepted] (record_rows), aged with `pooled`: one acceptance
    # misreads a draft accepted in stretches (run S: 1.35 per row-step at k=1, 1.60 at k=2, fitted as 1.37 and 1.51)
    positions: list[list[float]] = field(default_factory=list)


class Meter:
    """Per (bucket, k) throughput, for reports and benchmarks."""

    def __init__(self, arms: tuple[int, ...], num_tries: int) -> None:
        self.arms = arms
        self._num_tries = num_tries
        self._buckets: dict[str, Bucket] = {}
        self._lock = threading.Lock()  # new_draft comes from the swap listener's thread

    def _bucket(self, batch_size: int) -> Bucket:
        name = bucket_of(batch_size)
        b = self._buckets.get(name)
        if b is None:
            b = self._buckets[name] = Bucket({k: Arm(num_tries_left=self._num_tries) for k in self.arms})
        return b

    def _count(self, b: Bucket, batch_size: int, k: int, num_tokens: int, seconds: float) -> None:
        """Every step, steady or not, in the totals (reports); called with the lock held."""
        t = b.totals.setdefault(k, [0.0, 0.0])
        t[0] += num_tokens
        t[1] += max(seconds, 0.0)
        n = b.served.setdefault(k, [0, 0])
        n[0] += 1
        n[1] += batch_size

    def record_sources(self, batch_size: int, sources: dict[str, tuple[int, int, int]]) -> None:
        """A step's drafts per source ({source: (rows, tokens drafted, drafts accepted)}, Drafter.step_sources):
        counted in the bucket's reports only; no choice depends on them."""
        with self._lock:
            b = self._bucket(batch_size)
            for source, (rows, drafted, accepted) in sources.items():
                cell = b.sources.setdefault(source, [0, 0, 0])
                cell[0], cell[1], cell[2] = cell[0] + rows, cell[1] + drafted, cell[2] + accepted

    def record_rows(self, batch_size: int, k: int, rows: list[tuple[int, int]]) -> None:
        """Each live row's (drafts proposed, drafts accepted) in a step at k, after its record: a meter keeps none."""

    def bucket_sources(self) -> dict[str, dict[str, tuple[int, int, int]]]:
        """{bucket: {source: (rows, tokens drafted, drafts accepted)}} so far (cumulative), where a drafter of several
        sources served; 1 + accepted / rows is a source's accepted length there."""
        with self._lock:
            return {name: {source: tuple(cell) for source, cell in sorted(b.sources.items())}
                    for name, b in self._buckets.items() if b.sources}

    def bucket_served(self) -> dict[str, dict[int, tuple[float, int, int, float]]]:
        """{bucket: {k: (tokens, steps, rows, seconds)}} over every step so far (cumulative: take differences):
        what each draft length served and emitted there, and its seconds; tokens / rows is the accepted length per
        row-forward, tokens / seconds its rate (what the choice of k is judged by, steady steps or not)."""
        with self._lock:
            return {name: {k: (b.totals[k][0], steps, rows, b.totals[k][1])
                           for k, (steps, rows) in sorted(b.served.items())}
                    for name, b in self._buckets.items()}

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


class FixedDraftLength(Meter):
    """Always the same k ("always": k = draft_k; "off": k = 0), measured like the tuner's arms."""

    def __init__(self, k: int) -> None:
        super().__init__(arms_for(k)[-1:], 0)
        self.k = k

    def choose(self, batch_size: int) -> int:
        return self.k

    def record(self, batch_size: int, k: int, num_tokens: int, seconds: float, steady: bool = True) -> None:
        with self._lock:
            self._count(self._bucket(batch_size), batch_size, k, num_tokens, seconds)

    def new_draft(self, prior: StepCostPrior | None = None) -> None:
        return None

    def summary(self) -> dict[str, int]:
        with self._lock:
            return {name: self.k for name in self._buckets}
