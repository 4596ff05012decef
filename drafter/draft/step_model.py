"""What a speculative step is expected to give: the tokens a row emits per step at draft length k when each drafted
position is accepted with chance a once the ones before it were (the draft's acceptance by position is nearly flat:
deploy/drafts/*/report.json, acceptance_by_position), the acceptance that explains what steps emitted, and the
prior the adaptive tuner ranks draft lengths by before it has measured them. Pure Python: no torch."""

from __future__ import annotations

from dataclasses import dataclass


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens per row per step at draft length k: E(k) = 1 + a + a^2 + ... + a^k (the bonus token included)."""
    return k + 1.0 if acceptance >= 1 else (1 - acceptance ** (k + 1)) / (1 - acceptance)


def tokens_by_position(accepted: list[float], k: int) -> float:
    """Tokens per row per step at draft length k when position j (1-based) is accepted with chance accepted[j - 1]
    once the ones before it were: 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k; positions past the list take its last."""
    if not accepted:
        raise ValueError("tokens_by_position needs the acceptance of at least one position")
    total, survive = 1.0, 1.0
    for j in range(k):
        survive *= accepted[min(j, len(accepted) - 1)]
        total += survive
    return total


def fit_acceptance(counts: dict[int, tuple[float, float]]) -> float:
    """The acceptance a that explains {k: (rows, tokens)} measured at draft lengths k >= 1 (row-steps and the tokens
    they emitted, pooled over k): sum_k rows_k E(k) = sum_k tokens_k, by bisection (E grows with a), in [0, 0.999].
    Pooling the lengths is what makes it steady at batch 1, where one step emits 1..k+1 tokens by chance.
    ValueError when no row was counted."""
    items = [(k, rows) for k, (rows, _) in counts.items() if k >= 1 and rows > 0]
    if not items:
        raise ValueError(f"fit_acceptance needs rows at a draft length >= 1, got {counts}")
    tokens = sum(t for k, (rows, t) in counts.items() if k >= 1 and rows > 0)
    low, high = 0.0, 1.0 - 1e-9
    for _ in range(30):  # to 1e-9
        mid = (low + high) / 2
        low, high = (mid, high) if sum(rows * expected_tokens(mid, k) for k, rows in items) < tokens else (low, mid)
    return min(low, 0.999)


@dataclass(frozen=True)
class StepCostPrior:
    """What each k is expected to give before it is measured, relative to plain decoding at the same batch size.

    Tokens per row per step with a draft accepted position by position with chance `acceptance`:
        E(k) = 1 + a + a^2 + ... + a^k
    A forward over n tokens in all costs 1 + n / knee_tokens one-token forwards (bound by reading the weights
    until n nears the knee, by compute past it), and drafting k tokens k x draft_cost of one. So at batch B:
        gain(B, k) = E(k) / ((1 + B (k + 1) / knee_tokens + k draft_cost) / (1 + B / knee_tokens))
    Defaults: a weak draft and SmolLM2's measured costs (a 4-token verify at batch 1 costs 1.06-1.24 one-token
    forwards on a CPU and an H100: knee 32; the head's k draft passes 3-5% of a forward each). A CPU's batch
    costs grow faster (step_costs: CPU_KNEE_TOKENS)."""

    acceptance: float = 0.55
    knee_tokens: float = 32.0
    draft_cost: float = 0.04

    @classmethod
    def step_costs(cls, device_type: str) -> dict[str, float]:
        """The costs of a device kind where they differ from the defaults: a CPU's knee is CPU_KNEE_TOKENS."""
        return {"knee_tokens": CPU_KNEE_TOKENS} if device_type == "cpu" else {}

    def __post_init__(self) -> None:
        if not 0 <= self.acceptance < 1:
            raise ValueError(f"acceptance must be in [0, 1), got {self.acceptance}")
        if self.knee_tokens <= 0 or self.draft_cost < 0:
            raise ValueError(f"knee_tokens must be > 0 and draft_cost >= 0, got {self.knee_tokens}, "
                             f"{self.draft_cost}")

    @classmethod
    def from_accepted_length(cls, accepted_length: float, k: int, **costs: float) -> StepCostPrior:
        """The prior of a draft measured to accept `accepted_length` tokens per step at k (its calibrated score,
        the bonus token included): the acceptance a with E(k) = accepted_length (fit_acceptance)."""
        if k < 1 or not 1 <= accepted_length <= k + 1:
            raise ValueError(f"accepted_length must be in [1, k + 1] with k >= 1, got {accepted_length} at k={k}")
        return cls(acceptance=fit_acceptance({k: (1.0, accepted_length)}), **costs)

    def expected_tokens(self, k: int) -> float:
        return expected_tokens(self.acceptance, k)

    def relative_cost(self, batch_size: float, k: int) -> float:
        """A step at k over a plain step's seconds at batch_size (the model above, acceptance aside)."""
        return (1 + batch_size * (k + 1) / self.knee_tokens + k * self.draft_cost) / (1 + batch_size / self.knee_tokens)

    def gain(self, batch_size: int, k: int) -> float:
        """Expected tokens/s of k over plain's at batch_size."""
        return self.expected_tokens(k) / self.relative_cost(batch_size, k)


# A CPU core runs out of compute near 8 tokens per forward: SmolLM2-135M plain decoding, one pinned core per worker,
# 115 ms a step at 9-16 live rows and 185 ms at 17-32 (tlt bench rl, docs/bench/rl.json at d202dd6) gives
# 1 + n / knee with knee ~8 (the knee of 32 holds on a GPU and made the tuner try drafts in the CPU's bulk, at
# 0.80-0.88x plain there)
CPU_KNEE_TOKENS = 8.0
