"""Response lengths of an RL step: a mixture of capped lognormals, drawn per prompt group, and its fit.

A step has prompt groups (GRPO: `group_size` responses to one prompt). Each prompt is of one kind (short
answers, detailed reasoning, ...), and within a kind a prompt has its own typical length: `group_share` of a
kind's log-variance lies between prompts, the rest between the responses to one prompt. A response longer
than `max_tokens` stops there (the cap, max_new_tokens), so the cap holds a point mass, as published runs
show (responses clipped at the maximum length). `fit` finds the parameters that reproduce given figures.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

MIX_BLOCK = 10  # an exact mix holds round(weight * 10) prompts of a kind in every 10 (workers.tasks.LongTailTask)


def normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


@dataclass(frozen=True)
class LengthKind:
    """One kind of prompt: its share of the prompts and its responses' lognormal length (tokens)."""

    weight: float
    median: float
    sigma: float  # log-space standard deviation of one response's length

    def __post_init__(self) -> None:
        if not 0 < self.weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {self.weight}")
        if not self.median > 0:
            raise ValueError(f"median must be > 0 tokens, got {self.median}")
        if not 0 < self.sigma <= 5:
            raise ValueError(f"sigma must be in (0, 5], got {self.sigma}")

    def capped_mean(self, cap: float) -> float:
        """E[min(L, cap)] of a lognormal: exp(mu + s^2/2) Phi((ln cap - mu - s^2)/s) + cap P(L > cap)."""
        mu, s = math.log(self.median), self.sigma
        z = (math.log(cap) - mu) / s
        return math.exp(mu + s * s / 2) * normal_cdf(z - s) + cap * (1 - normal_cdf(z))

    def cdf(self, x: float) -> float:
        return normal_cdf((math.log(x) - math.log(self.median)) / self.sigma) if x > 0 else 0.0

    def cap_probability(self, cap: float) -> float:
        return 1.0 - self.cdf(cap)


@dataclass(frozen=True)
class LengthModel:
    kinds: tuple[LengthKind, ...]
    max_tokens: int  # the cap: max_new_tokens
    group_share: float = 0.0  # share of a kind's log-variance between prompts (the rest within a group)
    min_tokens: int = 1  # a response has at least one token (EOS or the stop)
    exact_mix: bool = False  # kinds drawn exactly per block of 10 prompts, as the longtail task does

    def __post_init__(self) -> None:
        if not self.kinds:
            raise ValueError("kinds must hold at least one LengthKind")
        if abs(sum(k.weight for k in self.kinds) - 1.0) > 1e-6:
            raise ValueError(f"kinds: weights must sum to 1, got {sum(k.weight for k in self.kinds)}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [1, max_tokens], got {self.min_tokens}")
        if not 0 <= self.group_share < 1:
            raise ValueError(f"group_share must be in [0, 1), got {self.group_share}")

    # ----- the distribution of one response (marginal over prompts) --------------------------------
    def cdf(self, x: float) -> float:
        if x >= self.max_tokens:
            return 1.0
        return sum(k.weight * k.cdf(x) for k in self.kinds)

    def quantile(self, p: float) -> float:
        if not 0 < p < 1:
            raise ValueError(f"p must be in (0, 1), got {p}")
        if self.cdf(self.max_tokens * (1 - 1e-12)) <= p:
            return float(self.max_tokens)
        lo, hi = math.log(1e-3), math.log(self.max_tokens)
        for _ in range(80):  # bisection in log space: smooth and monotone
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.cdf(math.exp(mid)) < p else (lo, mid)
        return math.exp((lo + hi) / 2)

    def mean(self) -> float:
        return sum(k.weight * k.capped_mean(self.max_tokens) for k in self.kinds)

    # ----- drawing a step ---------------------------------------------------------------------------
    def prompt_kinds(self, rng: random.Random, num_prompts: int) -> list[int]:
        """The kind of each prompt: independent draws, or an exact mix per block of MIX_BLOCK prompts."""
        if not self.exact_mix:
            return rng.choices(range(len(self.kinds)), weights=[k.weight for k in self.kinds], k=num_prompts)
        out: list[int] = []
        while len(out) < num_prompts:
            block = [i for i, k in enumerate(self.kinds) for _ in range(round(k.weight * MIX_BLOCK))]
            block = (block + [0] * MIX_BLOCK)[:MIX_BLOCK]
            rng.shuffle(block)
            out.extend(block)
        return out[:num_prompts]

    def sample_groups(self, rng: random.Random, num_prompts: int, group_size: int) -> list[list[int]]:
        """Response lengths (tokens) of `num_prompts` groups of `group_size` responses each."""
        between, within = math.sqrt(self.group_share), math.sqrt(1 - self.group_share)
        groups = []
        for kind_index in self.prompt_kinds(rng, num_prompts):
            kind = self.kinds[kind_index]
            mu = math.log(kind.median) + kind.sigma * between * rng.gauss(0.0, 1.0)
            groups.append([min(self.max_tokens, max(self.min_tokens, round(math.exp(mu + kind.sigma * within
                                                                                    * rng.gauss(0.0, 1.0)))))
                           for _ in range(group_size)])
        return groups


def nelder_mead(f: Callable[[Sequence[float]], float], x0: Sequence[float], step: float = 0.3,
                num_iters: int = 400, tol: float = 1e-10) -> list[float]:
    """Minimise f from x0 (the classic simplex method: reflect, expand, contract, shrink)."""
    n = len(x0)
    simplex = [list(x0)] + [[x + (step if i == j else 0.0) for j, x in enumerate(x0)] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(num_iters):
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centroid = [sum(x[j] for x in simplex[:-1]) / n for j in range(n)]

        def toward(c: float, _centroid=centroid, _worst=simplex[-1]) -> list[float]:  # centroid + c (worst - centroid)
            return [m + c * (w - m) for m, w in zip(_centroid, _worst)]

        reflected = toward(-1.0)
        fr = f(reflected)
        if fr < values[0]:
            expanded = toward(-2.0)
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = toward(0.5)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:  # shrink toward the best
                simplex = [simplex[0]] + [[b + 0.5 * (x - b) for b, x in zip(simplex[0], s)] for s in simplex[1:]]
                values = [values[0]] + [f(s) for s in simplex[1:]]
    return simplex[min(range(n + 1), key=values.__getitem__)]


def log_error(predicted: dict[str, float], targets: dict[str, float]) -> float:
    """Sum of squared log ratios: every figure counts by its relative error."""
    return sum(math.log(max(predicted[k], 1e-12) / v) ** 2 for k, v in targets.items())


def fit(build: Callable[[Sequence[float]], LengthModel], figures: Callable[[LengthModel], dict[str, float]],
        targets: dict[str, float], x0: Sequence[float]) -> tuple[LengthModel, dict[str, float]]:
    """The model `build(x)` whose `figures` come closest to `targets` (relative error), and its figures.
    Deterministic: the same inputs give the same fit."""

    def loss(x: Sequence[float]) -> float:
        try:
            return log_error(figures(build(x)), targets)
        except ValueError:  # outside the parameters' domain
            return 1e9

    model = build(nelder_mead(loss, x0))
    return model, figures(model)
