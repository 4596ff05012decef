"""The scheduler's decisions, as pure functions over plain records: no Redis, no Ray, no torch.

Given every worker's latest progress and the driver's phase, `decide` classifies the workers in the
one vocabulary of workers/protocol.py (ROLLING_OUT, STRAGGLER, IDLE, TRAINING, FAILED, STALE), says
whether the long tail has begun, which idle workers get a drafter-training lease and until when, and
which trainers to preempt. `track_rollouts` and `reclaimed_by_step` count a lease's time only while
the step's rollout was under way (some worker still generating). Between rounds, `choose_scorer`
picks the worker that merges and scores the round's copies, `group_copies` picks the copies that can
be averaged, and `should_publish` says whether the merged draft may replace the one being served.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from workers.protocol.states import GENERATING_STATES, Phase, WorkerState

# what classify() can say of a worker (SWAPPING is reported, and classified by whether it generates)
CLASSES = (WorkerState.ROLLING_OUT, WorkerState.STRAGGLER, WorkerState.IDLE, WorkerState.TRAINING,
           WorkerState.FAILED, WorkerState.STALE)
_GENERATING_CLASSES = frozenset({WorkerState.ROLLING_OUT, WorkerState.STRAGGLER})
_UNCOUNTED = frozenset({WorkerState.FAILED, WorkerState.STALE})  # neither counted nor given work
RECENT_ROLLOUTS = 3  # finished rollouts whose median duration remaining_from weighs


class WorkerView(NamedTuple):
    """What the policy needs of a worker's progress record (a tuple: the watcher makes one per worker per tick,
    16,384 of them in `tlt simulate`'s tick timing, where a frozen dataclass cost twice as much to build)."""

    worker_id: str
    state: WorkerState  # what the worker reports of itself
    num_finished: int
    num_total: int
    timestamp: float
    buffer_tokens: int = 0  # harvested training pairs: a lease needs data
    rl_step: int = -1  # the RL step its record is of (-1: not known, taken as current)


@dataclass(frozen=True)
class CopyView:
    """What the policy needs of a trained copy's index entry."""

    version: int
    num_steps: int
    merge_key: str | None  # copies average only with the same key (parent, head shape, integer tensors)


@dataclass(frozen=True)
class PolicySettings:
    stale_after_s: float = 5.0  # 50 missed reports at 10/s: the worker is gone or wedged
    straggler_done_fraction: float = 0.5  # still generating once half the workers are done
    straggler_progress_ratio: float = 0.5  # or below half the median progress of those still generating
    long_tail_idle_fraction: float = 0.25  # the tail begins when a quarter of the workers wait at the barrier
    min_lease_s: float = 5.0  # shorter leases do not pay for loading the parent and checkpointing
    max_lease_s: float = 600.0  # bounds the work a lost lease can waste
    lease_margin: float = 0.8  # stop before the estimated end of rollout, so preemption rarely waits
    min_buffer_tokens: int = 512  # a trainer needs data; fewer pairs than this overfit in seconds
    publish_tolerance: float = 0.0  # a merged draft may not accept fewer tokens per step than the served one
    # start scoring a round only if the rollout's estimated rest is this many times the last round's scoring
    scoring_margin: float = 1.5
    # delete a round's copies and candidate file once it is decided (a published candidate lives on in the
    # served store): a long job makes a few copies per step, tens of MB each for an 8B policy's head
    prune_copies: bool = True
    # a worker's first record of a rollout lags the rollout's start (its generate call in flight, more on a busy
    # box): for this long, a worker whose record is of an earlier step counts as generating, not idle (no lease,
    # no scoring on a worker about to generate); past it, it got no work this step and is idle
    first_report_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("straggler_done_fraction", "straggler_progress_ratio", "long_tail_idle_fraction",
                     "lease_margin"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.first_report_s < 0:
            raise ValueError(f"first_report_s must be >= 0, got {self.first_report_s}")
        if self.scoring_margin < 0:
            raise ValueError(f"scoring_margin must be >= 0, got {self.scoring_margin}")
        if self.min_lease_s <= 0 or self.max_lease_s < self.min_lease_s:
            raise ValueError("min_lease_s and max_lease_s: need 0 < min_lease_s <= max_lease_s")


@dataclass(frozen=True)
class Lease:
    worker_id: str
    deadline_s: float
    parent_version: int


@dataclass
class Decision:
    classes: dict[str, WorkerState]
    long_tail: bool
    grants: list[Lease] = field(default_factory=list)
    preempt: list[str] = field(default_factory=list)
    remaining_rollout_s: float | None = None


def rollout_under_way(phase: Phase) -> bool:
    """The driver's phase as the policy sees it: only while the step's rollout is under way may idle
    workers train; in SYNC, UPDATE and DONE every GPU is needed (or the job is over)."""
    return phase == Phase.ROLLOUT


@dataclass(frozen=True)
class RolloutWindow:
    """One step's rollout phase: from the driver's ROLLOUT record to the moment the phase left ROLLOUT
    (None: still under way)."""

    rl_step: int
    start: float
    end: float | None = None


def track_rollouts(windows: list[RolloutWindow], phase: Phase, rl_step: int, since: float,
                   max_kept: int = 8) -> list[RolloutWindow]:
    """The rollout windows after seeing the driver's phase record (phase, rl_step, since). A ROLLOUT
    record opens its step's window; any other phase closes the open one at its `since` (the moment
    the rollout ended: the driver writes the next phase as it ends). A window left open when a later
    step's record is seen (its end was missed) closes at that record's `since`: an upper bound."""
    out = list(windows)
    if out and out[-1].end is None and (phase != Phase.ROLLOUT or rl_step != out[-1].rl_step):
        out[-1] = RolloutWindow(out[-1].rl_step, out[-1].start, max(since, out[-1].start))
    if phase == Phase.ROLLOUT and not any(w.rl_step == rl_step for w in out):
        out.append(RolloutWindow(rl_step, since))
    return out[-max_kept:]


def overlap_s(start: float, end: float, window_start: float, window_end: float | None) -> float:
    """Seconds of [start, end] within [window_start, window_end] (None: open-ended)."""
    upper = end if window_end is None else min(end, window_end)
    return max(0.0, upper - max(start, window_start))


def reclaimed_by_step(started_at: float, ended_at: float, windows: list[RolloutWindow]) -> dict[int, float]:
    """A lease's reclaimed worker-seconds per step: the part of [started_at, ended_at] that fell within
    the step's rollout window. Time after the rollout ended (everyone waits for the update) is not
    reclaimed, so a step's reclaimed time never exceeds its workers' time idle at the barrier."""
    out: dict[int, float] = {}
    for w in windows:
        seconds = overlap_s(started_at, ended_at, w.start, w.end)
        if seconds > 0:
            out[w.rl_step] = out.get(w.rl_step, 0.0) + seconds
    return out


def classify(views: list[WorkerView], now: float, s: PolicySettings, rl_step: int | None = None,
             rollout_elapsed_s: float = 0.0) -> dict[str, WorkerState]:
    return _classify(views, now, s, rl_step, rollout_elapsed_s)[0]


def _classify(views: list[WorkerView], now: float, s: PolicySettings, rl_step: int | None = None,
              rollout_elapsed_s: float = 0.0) -> tuple[dict[str, WorkerState], float]:
    """(classes, the slowest generating worker's progress: 1.0 when none generates). `rl_step`: the step whose
    rollout is under way, `rollout_elapsed_s` into it (None: no rollout; records' steps are not compared). One
    pass, no property calls and no Enum hashing per worker: it runs every tick over every worker (16,384 in `tlt
    simulate`'s tick timing)."""
    failed, stale, training = WorkerState.FAILED, WorkerState.STALE, WorkerState.TRAINING
    idle, straggler, rolling = WorkerState.IDLE, WorkerState.STRAGGLER, WorkerState.ROLLING_OUT
    generating_states = tuple(GENERATING_STATES)  # `in` a tuple compares, where a set would hash each Enum
    oldest = now - s.stale_after_s
    # records of steps before this are of workers whose first report of the rollout is on its way
    before = rl_step if rl_step is not None and rollout_elapsed_s < s.first_report_s else -1
    classes: dict[str, WorkerState] = {}
    fresh: list[tuple[WorkerView, float | None]] = []  # (view, progress if generating)
    progresses: list[float] = []
    num_starting = 0
    for v in views:
        state = v.state
        if state == failed:
            classes[v.worker_id] = failed
        elif v.timestamp < oldest:
            classes[v.worker_id] = stale
        elif state in generating_states:
            progress = v.num_finished / v.num_total if v.num_total else 1.0  # its finished fraction
            progresses.append(progress)
            fresh.append((v, progress))
        elif 0 <= v.rl_step < before and state != training:  # about to generate: no progress to count yet
            classes[v.worker_id] = rolling
            num_starting += 1
        else:
            fresh.append((v, None))
    num_done = len(fresh) - len(progresses)
    done_fraction = num_done / (len(fresh) + num_starting) if fresh else 0.0
    cut = s.straggler_progress_ratio * statistics.median(progresses) if progresses else 0.0
    all_stragglers = done_fraction >= s.straggler_done_fraction
    for v, progress in fresh:
        if progress is None:
            classes[v.worker_id] = training if v.state == training else idle
        elif all_stragglers or progress < cut:
            classes[v.worker_id] = straggler
        else:
            classes[v.worker_id] = rolling
    return classes, min(progresses, default=1.0)


def remaining_from(slowest_progress: float, rollout_elapsed_s: float,
                   recent_rollout_s: Sequence[float] = ()) -> float:
    """Time until the slowest generating worker finishes. Its progress so far, extrapolated (`slowest_progress`:
    its finished fraction; 1.0: none generating), or, where longer, what is left of the median of the job's
    recent rollouts (`recent_rollout_s`, finished ones: completed_rollout_s). The extrapolation reads a long tail
    short: the rows still generating are the long ones, so a worker at 17 of 20 rows after 12 s has seconds left,
    not the 2 s its finished fraction gives, and the tail's idle workers would get no lease. Steps of one job draw
    their prompts from one task, so their rollouts last about as long (with nothing generating, none is left)."""
    if slowest_progress >= 1:
        return 0.0
    extrapolated = rollout_elapsed_s if slowest_progress <= 0 else \
        rollout_elapsed_s * (1 - slowest_progress) / slowest_progress  # nothing finished yet: as long again
    if not recent_rollout_s:
        return extrapolated
    return max(extrapolated, statistics.median(recent_rollout_s) - rollout_elapsed_s)


def completed_rollout_s(windows: list[RolloutWindow], max_kept: int = RECENT_ROLLOUTS) -> tuple[float, ...]:
    """The durations of the latest `max_kept` finished rollout windows, oldest first (remaining_from's history)."""
    return tuple(w.end - w.start for w in windows if w.end is not None)[-max_kept:]


def decide(views: list[WorkerView], now: float, phase: Phase, rollout_elapsed_s: float, serving_version: int,
           s: PolicySettings, leased: frozenset[str] = frozenset(), busy: frozenset[str] = frozenset(),
           rl_step: int | None = None, recent_rollout_s: Sequence[float] = ()) -> Decision:
    """`leased`: workers holding a lease the scheduler has not collected yet. Their progress record
    may lag or say ROLLING_OUT (a new rollout began), so leases, not records, decide preemption.
    `busy`: workers doing other work for the scheduler (the scorer): they get no lease. `rl_step`: the
    step of the driver's phase record; a worker whose record is of an earlier step is about to generate
    for s.first_report_s into a rollout (None: records' steps are not compared). `recent_rollout_s`: the
    job's latest finished rollouts' durations (completed_rollout_s), which the rest of this one is estimated
    from beside the slowest worker's progress (remaining_from)."""
    is_rollout = rollout_under_way(phase)
    classes, slowest = _classify(views, now, s, rl_step if is_rollout else None, rollout_elapsed_s)
    idle_state, training_state = WorkerState.IDLE, WorkerState.TRAINING
    num_counted, idle, training = 0, [], []
    for v in views:  # one pass over every worker (it runs every tick)
        c = classes[v.worker_id]
        if c in _UNCOUNTED:
            continue
        num_counted += 1
        if c == idle_state:
            if v.worker_id not in leased:
                idle.append(v)
        elif c == training_state:
            training.append(v.worker_id)
    long_tail = is_rollout and num_counted > 0 and len(idle) / num_counted >= s.long_tail_idle_fraction
    decision = Decision(classes, long_tail)
    if not is_rollout:  # the weight sync and the policy update need the GPUs back
        decision.preempt = sorted(set(training) | set(leased))
        return decision
    # a leased worker given rollouts again needs its GPU back
    decision.preempt = sorted(w for w in leased if classes.get(w) in _GENERATING_CLASSES)
    remaining = remaining_from(slowest, rollout_elapsed_s, recent_rollout_s)
    decision.remaining_rollout_s = remaining
    deadline = min(s.max_lease_s, s.lease_margin * remaining)
    if long_tail and deadline >= s.min_lease_s:
        decision.grants = [Lease(v.worker_id, deadline, serving_version) for v in idle
                           if v.buffer_tokens >= s.min_buffer_tokens and v.worker_id not in busy]
    return decision


def scoring_fits(remaining_rollout_s: float | None, last_scoring_s: float | None, s: PolicySettings) -> bool:
    """Whether a round started now is likely scored before the rollout ends: the rest of the rollout is at
    least `scoring_margin` times what the last round took (unknown before the first: yes; margin 0: always).
    A round that ran on into the learner's phases would take a core or a GPU from it."""
    if remaining_rollout_s is None:
        return False
    return last_scoring_s is None or remaining_rollout_s >= s.scoring_margin * last_scoring_s


def choose_scorer(classes: dict[str, WorkerState], phase: Phase, trained: Collection[str],
                  leased: Collection[str] = ()) -> tuple[str | None, bool]:
    """(scorer, held_out): the worker that merges a round's copies and scores the candidate on its
    recent rollouts: a free worker none of whose recent rollouts the round's copies trained on (`trained`: the
    workers that trained in the round and have generated nothing since); None while there is none (score later,
    without slowing the long tail or the learner). A copy scores higher on the rollouts it trained on (offline
    on SmolLM2: +0.05 accepted tokens over its parent there, -0.03 on held-out ones), so such a score would
    publish drafts that serve worse; a worker that trained scores again once its next rollout is in (the
    worker checks it too: workers.scoring.recent_rollouts). Free: idle at the barrier during a rollout. Outside
    one the learner's phases (sync, update) need every GPU, or every core where the learner shares the machine
    with the workers: nobody scores. held_out is True whenever a scorer is named (kept in the round's record)."""
    if not rollout_under_way(phase):
        return None, False
    held_out = sorted(w for w, c in classes.items() if c == WorkerState.IDLE and w not in leased and w not in trained)
    return (held_out[0], True) if held_out else (None, False)


def group_copies(copies: list[CopyView]) -> tuple[list[int], list[int]]:
    """(merged, dropped): the largest group of copies that can be averaged (by training steps, then
    by size; the first such group on a tie) and the rest, each in the given order. Copies average
    only with the same merge key: two first leases on different workers each pick a draft
    vocabulary from their own rollouts. A copy without a key averages with no other."""
    groups: dict[str, list[CopyView]] = {}
    for c in copies:
        groups.setdefault(c.merge_key if c.merge_key is not None else f"\0v{c.version}", []).append(c)
    if not groups:
        return [], []
    best = max(groups.values(), key=lambda g: (sum(c.num_steps for c in g), len(g)))
    merged = [c.version for c in best]
    return merged, [c.version for c in copies if c.version not in merged]


def should_publish(candidate_accepted_length: float | None, serving_accepted_length: float | None,
                   s: PolicySettings) -> bool:
    """Publish a merged draft only if it was scored and, measured on the same recent rollouts, it is
    not worse than the serving one (nothing served yet: any scored candidate)."""
    if candidate_accepted_length is None:
        return False
    if serving_accepted_length is None:
        return True
    return candidate_accepted_length >= serving_accepted_length - s.publish_tolerance
