"""What a simulation is given: the workload, the cost of decoding, the drafter's acceptance, the learner's
phases and the control plane's latencies. Each profile (scheduler/simulate/cpu.py, gpu.py) fills these
with values and says where each comes from (`sources`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from scheduler.policy import PolicySettings
from scheduler.simulate.cost import StepCost
from scheduler.simulate.lengths import LengthModel
from workers.engines import Speculation


def _check(obj, positive: tuple[str, ...] = (), non_negative: tuple[str, ...] = (),
           fractions: tuple[str, ...] = ()) -> None:
    """ValueError naming the first field out of its range."""
    for name in positive + non_negative + fractions:
        value = getattr(obj, name)
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
        if name in positive and value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
        if name in non_negative and value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
        if name in fractions and not 0 <= value <= 1:
            raise ValueError(f"{name} must be in [0, 1], got {value}")


@dataclass(frozen=True)
class Acceptance:
    """A draft's per-position acceptance rate a as a function of its training and of policy drift:

        a(s) = max_rate - (max_rate - min_rate) exp(-s / train_tau_s)

    s being the training seconds (on one worker) that still count on the current policy. Each policy
    update keeps `drift_retain` of every draft's s. K copies trained t_i seconds from one parent and
    averaged count as mean(t_i) K^merge_exponent (averaging is not sequential training: < K, > 1)."""

    min_rate: float  # an untrained head
    max_rate: float  # what training on the current policy approaches
    warm_rate: float  # the warm start's rate on the first policy
    train_tau_s: float
    drift_retain: float
    merge_exponent: float = 0.5  # assumption: between mean (0) and sequential sum (1)
    train_steps_per_s: float = 2.0  # lease micro-steps per second: a copy's num_steps (group_copies weighs them)
    score_noise: float = 0.03  # std of a scored accepted length from a round's finite evaluation tokens

    def __post_init__(self) -> None:
        _check(self, positive=("train_tau_s", "train_steps_per_s"), non_negative=("score_noise",),
               fractions=("min_rate", "max_rate", "warm_rate", "drift_retain", "merge_exponent"))
        if not self.min_rate <= self.warm_rate <= self.max_rate < 1:
            raise ValueError("warm_rate: need min_rate <= warm_rate <= max_rate < 1, got "
                             f"{self.min_rate}, {self.warm_rate}, {self.max_rate}")

    def rate(self, trained_s: float) -> float:
        return self.max_rate - (self.max_rate - self.min_rate) * math.exp(-max(trained_s, 0.0) / self.train_tau_s)

    def warm_seconds(self) -> float:
        """The training seconds that put an untrained head at warm_rate."""
        gap = self.max_rate - self.min_rate
        if gap <= 0 or self.warm_rate >= self.max_rate:
            return 1e12 if gap > 0 else 0.0
        return -self.train_tau_s * math.log((self.max_rate - self.warm_rate) / gap)

    def merged_seconds(self, copy_seconds: list[float]) -> float:
        if not copy_seconds:
            return 0.0
        return sum(copy_seconds) / len(copy_seconds) * len(copy_seconds) ** self.merge_exponent


@dataclass(frozen=True)
class Phases:
    """The learner's phases and the control plane's latencies (seconds)."""

    sync_s: float  # weight sync before a rollout
    learner_s: tuple[float, ...]  # reward + log-probs + update, per step (the last repeats)
    tick_s: float  # the watcher's tick (scheduler.settings.TICK_S)
    report_interval_s: float = 0.1  # progress records: at most 10 writes/s per worker (workers/progress.py)
    dispatch_s: float = 0.06  # lease offer to training (tlt bench scheduler: dispatch p50)
    preempt_s: float = 0.063  # stop request to trainer stopped (tlt bench scheduler: preemption p50)
    lease_setup_s: float = 0.5  # a lease loads its parent before its first micro-step
    copy_publish_s: float = 0.5  # a stopped lease writes its copy to the copies store
    scoring_s: float = 10.0  # merge a round's copies, score candidate and serving draft
    publish_s: float = 1.0  # write the candidate to the served store
    swap_s: float = 0.16  # publish to serving on a worker (tlt bench dataplane: swap p50)
    train_slowdown: float = 1.0  # generating workers' step time x this while another worker trains (CPU: one bus)

    def __post_init__(self) -> None:
        _check(self, positive=("tick_s", "report_interval_s", "train_slowdown"),
               non_negative=("sync_s", "dispatch_s", "preempt_s", "lease_setup_s", "copy_publish_s", "scoring_s",
                             "publish_s", "swap_s"))
        if not self.learner_s or any(not (isinstance(v, int | float) and v >= 0) for v in self.learner_s):
            raise ValueError(f"learner_s must be a non-empty tuple of seconds >= 0, got {self.learner_s!r}")

    def learner_at(self, rl_step: int) -> float:
        return self.learner_s[min(rl_step, len(self.learner_s) - 1)]


@dataclass(frozen=True)
class Workload:
    lengths: LengthModel
    prompts_per_worker: int  # prompt groups each worker generates per step (round-robin assignment)
    group_size: int
    prompt_tokens: float  # mean prompt length, chat template included
    draft_k: int  # the longest draft (JobSpec.draft_k)
    speculation: Speculation = Speculation.ADAPTIVE  # JobSpec.speculation
    gpus_per_worker: int = 1  # an engine instance spans this many GPUs (tensor or expert parallel)

    def __post_init__(self) -> None:
        for name in ("prompts_per_worker", "group_size", "draft_k", "gpus_per_worker"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        _check(self, non_negative=("prompt_tokens",))
        if self.speculation not in set(Speculation):
            raise ValueError(f"speculation must be one of {', '.join(Speculation)}, got {self.speculation!r}")
        object.__setattr__(self, "speculation", Speculation(self.speculation))  # a name given: the mode


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    workload: Workload
    cost: StepCost
    acceptance: Acceptance
    phases: Phases
    policy: PolicySettings = field(default_factory=PolicySettings)
    sources: dict[str, str] = field(default_factory=dict)  # parameter -> where its value comes from

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name must be non-empty")
        for name, kind in (("workload", Workload), ("cost", StepCost), ("acceptance", Acceptance),
                           ("phases", Phases), ("policy", PolicySettings)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"{name} must be a {kind.__name__}")

    def summary(self) -> dict:
        """The parameters as plain data, for the JSON record."""
        def plain(obj):
            if hasattr(obj, "__dataclass_fields__"):
                return {f.name: plain(getattr(obj, f.name)) for f in fields(obj)}
            if isinstance(obj, tuple | list):
                return [plain(v) for v in obj]
            return obj
        return plain(self)
