"""Adaptive speculation: the draft length k (0 = plain decoding) chosen per live-batch-size bucket from the accepted
tokens per second each (bucket, k) measurably gives. Pure Python: no torch.

Speculation pays where a policy forward is cheap to widen (the tail: small batches) and can cost at large batches,
where verifying k extra tokens per row is real compute; how much depends on the draft, the device and the model, so it
is measured rather than set by a threshold. A `DraftLengthTuner` is an epsilon-greedy bandit per bucket, as in TLT,
that learns from steady steps only (the engine reports no step that captured a graph, caught the draft up or followed
a change of k) and so serves every arm in runs:
    0. a prior (`StepCostPrior`: the draft's calibrated acceptance and the device's step costs) ranks the arms before
       anything is measured: its best arm serves a bucket's first steps (a draft that pays at a batch size is used
       there at once, in the tail too), and only the arms it expects to pay (by PRIOR_MARGIN past the smallest
       bucket: its costs are rough where the rows outgrow a CPU's compute), and plain, are tried in 1.; without a
       prior every eligible arm is;
    1. forced tries: each arm is served in a run until it has `num_tries` steady steps in the bucket;
    2. then the arm with the best tokens/s estimate serves: the bucket's live rows times the tokens a row emits at k
       over a step's seconds now, which is the arm's cost times the bucket's level. A step's seconds drift whichever
       arm serves (the context grows, rows finish: the same bucket's 4 rows and 3 cost nearly alike in bf16 on a
       CPU), so an arm's seconds from when it last served are no measure against the serving arm's newest: ranked
       by them, the serving arm looked the slowest after a few steps and the tuner went round its arms in runs of
       two (an ad hoc trace at 3 rows). So the first RUN_MEASURES steady steps of a run measure the arm's cost
       against the level (EMAs), and the later ones move the level (the bucket's first steady step sets both): arms
       are compared by costs measured beside each other. A row's tokens come from the bucket's acceptance of each
       position given the ones before it, over every drafting row of every k (decayed by POOL_DECAY per step: a step
       costs much the same whatever it accepts, and one at batch 1 emits 1..k+1 tokens by chance, so a per-arm mean
       needs many steps to tell two arms apart), or one
       geometric acceptance fitted to the steps' tokens (fit_acceptance) where a position has fewer than
       `min_row_samples` rows, the prior's acceptance counted in as that many rows more (ranked by its first steps' own
       tokens a paying arm could lose to plain after its forced tries and wait out stale_steps: simulated at 0.45
       acceptance, up to 58 of a one-row tail's first 100 steps plain), or without a prior each arm's own EMA of tokens
       until the bucket has that many drafting rows. A bounded share of steps (at most `explore_frac` of the bucket's
       steps, growing only as sqrt(steps) later) re-measures the least recently tried other eligible arm, in runs of
       `run_length` steps: exploring costs at most explore_frac x (best - worst) / best; and an arm not served for
       `stale_steps` of the bucket's steps is re-measured afresh (its new samples replace its estimate), the wait
       doubling each time it is and resetting when it wins: an estimate taken while the core was busy (a lease, the
       learner) would otherwise keep a paying arm off for the rest of the job, since only the arm that serves is
       measured again. This costs O(log(steps)) runs per arm;
    3. a new draft (`new_draft`: a hot swap) makes every speculative arm's estimate stale: each is tried again
       `num_retries` times; its old estimate dropped, or, for a draft published for beating the serving one, kept
       as one sample (the pooled acceptance at a quarter of its weight).
Eligible arms (with a prior or without): what a step gains from drafting k tokens shrinks as the batch
grows (each row's extra k tokens are compute a wider batch no longer hides), so a bucket drafts k > 0 only where the
nearest smaller bucket measured has found k faster than plain by more than the step-cost model says the step's extra
cost grows from its rows to this bucket's (`StepCostPrior.relative_cost`; on a CPU about 5-10% a bucket: `tlt bench rl`
run AT served k = 1 at 9-16 rows, 0.95x its plain, on 5-8 rows' 1.05x); what a smaller bucket measured of k overrules
the prior's expectation of k, but for the one-row bucket's, which only adds to it (a CPU's one-row plain step runs as
GEMVs: k gains less there than with 2 rows). The smallest bucket ("1", the end of every rollout that shrinks) tries
every arm; a large batch is never slowed by trying drafts that a smaller batch already shows do not pay. A rollout
reaches its small buckets last, so without a prior its first large-batch steps decode plainly.
The engine asks `choose(batch_size)` before each step and reports `record(batch_size, k, num_tokens, seconds)` after it;
the choice depends only on past steps, so verification stays lossless.
A drafter of two sources (drafter.draft.combined: history or the EAGLE head, per row) also says which source drafted how
many rows and what they had accepted (`record_sources`): every chooser keeps that per bucket (`bucket_sources`) for its
reports, and no choice reads it (the chooser serves the k the mix of sources pays at).
"""

from __future__ import annotations

import math

from drafter.draft.meter import BUCKET_EDGES, Bucket, Meter, arms_for, bucket_low_edge, bucket_of
from drafter.draft.step_model import StepCostPrior, fit_acceptance, tokens_by_position

# the pooled acceptance's memory: each step of a bucket weighs the earlier ones down by this (about the last 128
# steps speak: acceptance drifts along a response and with the draft's version)
POOL_DECAY = 1 - 1 / 128
NEW_DRAFT_POOL_KEEP = 0.25  # the pooled acceptance's weight kept when a new draft serves (new_draft)
# a run's first steady steps that measure its arm's cost against the bucket's level; the later ones move the level
RUN_MEASURES = 2
# the step-cost model a tuner without a prior carries a smaller bucket's gains by (DraftLengthTuner._eligible)
DEFAULT_COSTS = StepCostPrior()
# the gain the prior must expect of k for a bucket past the smallest to try k on its word alone: its step-cost model is
# rough where the rows outgrow a CPU's compute (bf16 on an AVX512-BF16 EPYC, `tlt bench rl` run AY: a k = 1 step at
# 9-16 rows cost 2.1 plain ones against the model's 1.6, and the shipped draft's prior, 1.00x there, had the frozen
# arm serve k = 1 in 62 of its steps there at 0.69x its plain rate)
PRIOR_MARGIN = 1.1


class DraftLengthTuner(Meter):
    """Chooses k in arms_for(k_max) per live-batch bucket from measured tokens/s (see the module doc)."""

    def __init__(self, k_max: int, *, num_tries: int = 2, min_row_samples: int = 16, num_retries: int = 1,
                 ema: float = 0.2, explore_frac: float = 0.02, run_length: int = 4, stale_steps: int = 64,
                 prior: StepCostPrior | None = None) -> None:
        if num_tries < 1 or num_retries < 1:
            raise ValueError(f"num_tries and num_retries must be >= 1, got {num_tries}, {num_retries}")
        if run_length < 2:
            raise ValueError(f"run_length must be >= 2 (a run's first step is never steady), got {run_length}")
        if not 0 < ema <= 1:
            raise ValueError(f"ema must be in (0, 1], got {ema}")
        if not 0 <= explore_frac < 1:
            raise ValueError(f"explore_frac must be in [0, 1), got {explore_frac}")
        if stale_steps <= run_length:
            raise ValueError(f"stale_steps must be > run_length ({run_length}), got {stale_steps}")
        super().__init__(arms_for(k_max), num_tries)
        self.min_row_samples = min_row_samples
        self.k_max, self.num_retries, self.ema, self.explore_frac = k_max, num_retries, ema, explore_frac
        self.run_length, self.stale_steps, self.prior = run_length, stale_steps, prior

    def _expected(self, batch_size: int) -> dict[int, float]:
        """The prior's gain of each arm at the bucket's smallest batch size (plain 1.0); {} without a prior."""
        if self.prior is None:
            return {}
        low = bucket_low_edge(bucket_of(batch_size))
        return {k: self.prior.gain(low, k) for k in self.arms}

    def _eligible(self, batch_size: int) -> tuple[int, ...]:
        """The arms a bucket may serve: 0, and each k > 0 that the nearest smaller bucket measured faster than plain
        by more than the step-cost model says k's extra cost grows from its rows to this bucket's; a k that bucket has
        not measured yet (or every k, where no smaller bucket has measured plain) is eligible where the prior
        expects it to pay, by PRIOR_MARGIN past the smallest bucket (every arm in the smallest bucket when there is
        no prior). Measured gains overrule the prior: a prior from a draft's held-out score can expect k = 1 to pay
        at 9 rows where the rollouts' tail measures it short (`tlt bench rl` run AU: 0.91x its plain there). The
        one-row bucket's gains only add to the prior's: on a CPU its plain steps run as GEMVs, so a k near 1x there
        can pay 1.4x with 2 rows (`tlt bench rl` run AW's frozen arm served plain in 279 of one worker's 286 two-row
        steps while k = 1 and 2 ran 1.4-1.6x plain there; one row's near-1x vetoing them is one way this tuner did
        that, which tests/drafter/test_adaptive.py reproduces; the run kept no trace of its estimates). Called with
        the lock held."""
        name, expected = bucket_of(batch_size), self._expected(batch_size)
        order = [bucket_of(e) for e in BUCKET_EDGES] + [bucket_of(BUCKET_EDGES[-1] + 1)]
        # the arms the prior alone would have this bucket try: by PRIOR_MARGIN past the smallest bucket
        margin = 1.0 if name == order[0] else PRIOR_MARGIN
        hoped = {k for k in self.arms if k > 0 and expected.get(k, 0.0) > margin}
        smaller = [self._buckets.get(n) for n in order[: order.index(name)]]
        below = next((sb for sb in reversed(smaller) if sb is not None and sb.arms[0].num_samples > 0), None)
        if below is None and name == order[0] and self.prior is None:
            return self.arms
        if below is None:
            return (0, *(k for k in self.arms if k in hoped))
        # what k gained below, carried to this bucket's rows by the step-cost model: a k that barely paid there
        # (measured within noise of plain) is not tried where each row's k extra tokens cost more
        here = self._buckets.get(name)
        one_row = smaller[0]  # the smallest bucket's, whose gains only add to the prior's
        costs, rows = self.prior or DEFAULT_COSTS, max(bucket_low_edge(name), here.rows if here else 0.0)
        plain = self._rate(below, 0)

        def pays(k: int) -> bool:
            if below.arms[k].num_samples == 0:
                return k in hoped
            carried = self._rate(below, k) * costs.relative_cost(below.rows, k) / costs.relative_cost(rows, k) > plain
            # one row's gain is a floor for more rows, not a ceiling: there a CPU's plain step runs as GEMVs, cheap
            # beside any verify's GEMMs, so k gains more with 2 rows than with 1; the prior's expectation stands too
            return carried or (below is one_row and k in hoped)

        return (0, *(k for k in self.arms if k > 0 and pays(k)))

    def choose(self, batch_size: int) -> int:
        """The draft length for the next step with `batch_size` sequences live."""
        with self._lock:
            b = self._bucket(batch_size)
            b.num_steps += 1
            eligible = self._eligible(batch_size)
            owed = [k for k in eligible if b.arms[k].num_tries_left > 0]
            if owed:  # forced tries, in runs: the arm served last while it owes; then the prior's best first
                expected = self._expected(batch_size)
                k = b.last_k if b.last_k in owed else max(
                    owed, key=lambda a: (expected.get(a, 0.0), b.arms[a].num_tries_left, -b.arms[a].last_step, -a))
                return self._serve(b, k)
            if b.run_left > 0 and b.last_k in eligible:  # an exploring run goes on
                b.run_left -= 1
                b.num_explored += 1
                return self._serve(b, b.last_k)
            best = self._best(b, eligible, batch_size)
            b.arms[best].stale_waits = 0  # a winner's wait starts anew
            others = [k for k in eligible if k != best]
            n = b.num_steps
            stale = [k for k in others if n - b.arms[k].last_step >= self.stale_steps << b.arms[k].stale_waits]
            if stale:  # re-measured afresh, the next wait twice as long
                k = min(stale, key=lambda a: (b.arms[a].last_step, a))
                arm = b.arms[k]
                arm.stale_waits, arm.num_samples = arm.stale_waits + 1, 0
                b.num_explored += 1
                b.run_left = self.run_length - 1
                return self._serve(b, k)
            if others and b.num_explored < min(self.explore_frac * n, math.sqrt(n) * self.explore_frac * 10):
                b.num_explored += 1
                b.run_left = self.run_length - 1
                best = min(others, key=lambda a: (b.arms[a].last_step, a))
            return self._serve(b, best)

    @staticmethod
    def _serve(b: Bucket, k: int) -> int:
        b.arms[k].last_step, b.last_k = b.num_steps, k
        return k

    def record(self, batch_size: int, k: int, num_tokens: int, seconds: float, steady: bool = True) -> None:
        """A step with `batch_size` live drafted up to k tokens per row and emitted num_tokens in all. Every step
        counts in the totals (reports); only a steady one teaches the arm's estimate."""
        if seconds <= 0:
            return
        with self._lock:
            b = self._bucket(batch_size)
            self._count(b, batch_size, k, num_tokens, seconds)
            arm = b.arms.get(k)
            if arm is not None:  # what it accepted, steady or not (plain steps only age the pool)
                self._pool(b, k, batch_size, num_tokens)
            if arm is None or not steady:  # a k this tuner never chooses (the engine capped it), or a step that
                return  # captured, rebuilt or switched: measured, not learned
            weight = max(self.ema, 1.0 / (arm.num_samples + 1))  # the first samples are averaged, then EMA
            arm.tokens += weight * (num_tokens - arm.tokens)
            arm.rows += weight * (batch_size - arm.rows)
            b.rows += (self.ema if b.rows > 0 else 1.0) * (batch_size - b.rows)
            if k != b.run_k:
                b.run_k, b.run_steady = k, 0
            if b.level <= 0:  # the bucket's first steady step: its arm's cost is the unit
                b.level, arm.cost = seconds, 1.0
            elif b.run_steady < RUN_MEASURES or arm.num_samples == 0:  # a run's first steps: the arm against the level
                arm.cost += weight * (seconds / b.level - arm.cost)
            else:  # a run going on: the level follows the drift, the arms' costs stay as they were measured
                b.level += self.ema * (seconds / arm.cost - b.level)
            b.run_steady += 1
            arm.num_samples += 1
            arm.num_tries_left = max(arm.num_tries_left - 1, 0)

    def new_draft(self, prior: StepCostPrior | None = None, keep_estimates: bool = False) -> None:
        """A different draft serves from now on: each speculative arm is tried again `num_retries` times. prior: the
        new draft's expected gain (its calibrated score; None keeps the prior). Without keep_estimates the old
        estimates and pooled acceptances are dropped; with it (a draft published for beating the serving one: what
        the old one measured is a floor) each arm's estimate is kept as one sample and the pools at
        NEW_DRAFT_POOL_KEEP of their weight (dropped, they left the large buckets plain until the tail measured the
        new draft again: `tlt bench rl` run L, 25-47% plain steps after each publish, frozen 9-18%)."""
        with self._lock:
            if prior is not None:
                self.prior = prior
            for b in self._buckets.values():
                keep = NEW_DRAFT_POOL_KEEP if keep_estimates else 0.0
                b.pooled = {k: [r * keep, t * keep] for k, (r, t) in b.pooled.items()} if keep else {}
                b.positions = [[r * keep, t * keep] for r, t in b.positions] if keep else []
                b.acceptance = self._fit(b)
                for k, arm in b.arms.items():
                    if k > 0:
                        arm.num_samples = min(arm.num_samples, 1) if keep_estimates else 0
                        arm.num_tries_left = max(arm.num_tries_left, self.num_retries)

    def _best(self, b: Bucket, eligible: tuple[int, ...], batch_size: int) -> int:
        """The eligible arm with the best tokens/s estimate; ties go to the shorter draft (cheaper). Before any
        is measured: the prior's best (plain without a prior)."""
        measured = [k for k in eligible if b.arms[k].num_samples > 0]
        if not measured:
            expected = self._expected(batch_size)
            return max(eligible, key=lambda k: (expected.get(k, 1.0 if k == 0 else 0.0), -k))
        return max(measured, key=lambda k: (self._rate(b, k), -k))

    def record_rows(self, batch_size: int, k: int, rows: list[tuple[int, int]]) -> None:
        """Each live row's (drafts proposed, drafts accepted) in a step at k: into the bucket's per-position
        acceptance (`Bucket.positions`), which `_rate` prefers once every position up to k has min_row_samples."""
        with self._lock:
            b = self._bucket(batch_size)
            for drafted, accepted in rows if k > 0 else ():
                for j in range(min(drafted, accepted + 1)):  # position j + 1 was reached: all before accepted
                    if j == len(b.positions):
                        b.positions.append([0.0, 0.0])
                    b.positions[j][0] += 1
                    b.positions[j][1] += float(accepted > j)

    def _pool(self, b: Bucket, k: int, num_rows: int, num_tokens: int) -> None:
        """A step's rows and tokens into the bucket's pooled acceptance (k = 0: none), older steps decayed: every
        step of the bucket ages it, so what a draft accepted before a long run of plain steps fades as the arm's
        other estimates go stale (see `stale_steps`)."""
        for cell in (*b.pooled.values(), *b.positions):
            cell[0], cell[1] = cell[0] * POOL_DECAY, cell[1] * POOL_DECAY
        if k > 0:
            cell = b.pooled.setdefault(k, [0.0, 0.0])
            cell[0], cell[1] = cell[0] + num_rows, cell[1] + num_tokens
        b.acceptance = self._fit(b)

    def _fit(self, b: Bucket) -> float | None:
        """fit_acceptance of the drafting rows, with the prior's acceptance as min_row_samples more rows at k=1
        (module doc, 2.); without a prior, None until min_row_samples rows have drafted."""
        m, counts = max(self.min_row_samples, 1), {k: tuple(cell) for k, cell in b.pooled.items()}
        if self.prior is not None:
            rows, tokens = counts.get(1, (0.0, 0.0))
            counts[1] = (rows + m, tokens + m * (1 + self.prior.acceptance))
        return fit_acceptance(counts) if sum(r for r, _ in counts.values()) >= m else None

    def _rate(self, b: Bucket, k: int) -> float:
        """Arm k's tokens/s estimate now: the bucket's live rows times the tokens a row emits at k (by each position's
        acceptance, shrunk toward the pooled one; for plain, or without a pool, the arm's own EMA of tokens per row)
        over a step's seconds at its cost and the bucket's level."""
        arm = b.arms[k]
        if arm.cost <= 0 or arm.rows <= 0 or b.level <= 0:
            return 0.0
        per_row = arm.tokens / arm.rows
        if k > 0 and b.acceptance is not None:
            m, a = max(self.min_row_samples, 1), b.acceptance  # each position's rows, with m of the geometric fit's
            by_position = [(accepted + m * a) / (rows + m) for rows, accepted in b.positions[:k]]
            per_row = tokens_by_position(by_position + [a] * (k - len(by_position)), k)
        return b.rows * per_row / (arm.cost * b.level)

    def best(self, batch_size: int) -> int:
        with self._lock:
            return self._best(self._bucket(batch_size), self._eligible(batch_size), batch_size)

    def summary(self) -> dict[str, int]:
        """{bucket: the k it serves now}, for the buckets seen (the step record's `speculation`)."""
        with self._lock:
            return {name: self._best(b, self._eligible(low := bucket_low_edge(name)), low)
                    for name, b in self._buckets.items()}

    def estimates(self) -> dict[str, dict[int, float]]:
        """{bucket: {k: tokens/s estimate}} for the arms measured (what the choice ranks them by)."""
        with self._lock:
            return {name: {k: self._rate(b, k) for k, a in b.arms.items() if a.num_samples > 0}
                    for name, b in self._buckets.items()}
