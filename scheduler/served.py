"""What a job's steps served per live-batch bucket, from their step records (GET /v1/jobs/{id}/steps'
bucket_served: {bucket: {k: [tokens, steps, rows, seconds]}}; records from before seconds were kept end at rows):
pure arithmetic over JSON, shared by `tlt demo` and `tlt bench rl` (bench.rl_figures)."""

from __future__ import annotations

from collections.abc import Iterator

from drafter.draft.meter import bucket_low_edge

MAX_TAIL_BUCKET = 4  # the tail's buckets: at most this many live rows (issue 40's "buckets of <= 4 live rows")


def by_edge(item: tuple[str, object]) -> int:
    """Sort key of a (bucket, value) pair: the bucket's smallest batch size."""
    return bucket_low_edge(item[0])


def served_cells(steps: list[dict]) -> Iterator[tuple[str, int, list[float]]]:
    """(bucket, k, cell) over the steps' bucket_served cells ([tokens, steps, rows, seconds]; older records end at
    rows)."""
    for s in steps:
        for name, by_k in s.get("bucket_served", {}).items():
            for k, cell in by_k.items():
                yield name, int(k), cell


def served_sums(steps: list[dict], drafting_only: bool = False) -> dict[str, list[float]]:
    """{bucket: [tokens, rows]} over the steps' bucket_served (StepRecord.bucket_served), every k or k > 0 only."""
    acc: dict[str, list[float]] = {}
    for name, k, cell in served_cells(steps):
        if k > 0 or not drafting_only:
            a = acc.setdefault(name, [0.0, 0.0])
            a[0], a[1] = a[0] + cell[0], a[1] + cell[2]
    return acc


def accepted_by_bucket(steps: list[dict], drafting_only: bool = False) -> dict[str, float]:
    """{bucket: tokens per row-forward} over `steps` (plain steps count 1.0 each row unless drafting_only)."""
    return {name: t / r for name, (t, r) in sorted(served_sums(steps, drafting_only).items(), key=by_edge) if r > 0}


def tail_accepted_length(steps: list[dict]) -> float | None:
    """Tokens per row-forward in the buckets of at most MAX_TAIL_BUCKET live rows, every k; None if none ran."""
    sums = [tr for name, tr in served_sums(steps).items() if bucket_low_edge(name) <= MAX_TAIL_BUCKET]
    rows = sum(r for _, r in sums)
    return sum(t for t, _ in sums) / rows if rows > 0 else None


def bucket_rates(steps: list[dict]) -> dict[str, tuple[float, float]]:
    """{live-batch bucket: (tokens/s, seconds decoded)} over the steps' bucket_throughput ({bucket: [tokens,
    seconds]}, summed over workers)."""
    acc: dict[str, list[float]] = {}
    for s in steps:
        for name, (tokens, seconds) in s.get("bucket_throughput", {}).items():
            a = acc.setdefault(name, [0.0, 0.0])
            a[0], a[1] = a[0] + tokens, a[1] + seconds
    return {name: (t / s, s) for name, (t, s) in acc.items() if s > 0}


def k_rates(steps: list[dict]) -> dict[str, dict[str, list[float]]]:
    """{bucket: {k: [tokens/s, steps]}} over the steps' bucket_served: each draft length's own rate where it served
    (worker-seconds; records without seconds are left out), what the adaptive tuner chose between."""
    acc: dict[str, dict[int, list[float]]] = {}
    for name, k, cell in served_cells(steps):
        if len(cell) > 3:
            a = acc.setdefault(name, {}).setdefault(k, [0.0, 0.0, 0])
            a[0], a[1], a[2] = a[0] + cell[0], a[1] + cell[3], a[2] + cell[1]
    return {name: {str(k): [t / sec, n] for k, (t, sec, n) in sorted(by_k.items()) if sec > 0}
            for name, by_k in sorted(acc.items(), key=by_edge)}


def step_work(step: dict) -> tuple:
    """What a step generated, as far as its record tells: token count, length percentiles and mean reward. Equal
    between two jobs' steps under coupled sampling (JobSpec.coupled_sampling) while their policies are equal: the
    same rollouts, so their times compare speed alone."""
    return step["num_tokens"], tuple(sorted(step["response_lengths"].items())), step["mean_reward"]


def tail_tokens_per_s(steps: list[dict]) -> float | None:
    """Tokens per second a worker decoded while its live batch was in the tail (buckets of at most MAX_TAIL_BUCKET
    rows), from bucket_rates; None if none ran. A rate, so two jobs whose samples differ in length (speculative
    sampling draws other samples than plain, from the same distribution) still compare."""
    tail = [(rate * seconds, seconds) for name, (rate, seconds) in bucket_rates(steps).items()
            if bucket_low_edge(name) <= MAX_TAIL_BUCKET]
    seconds = sum(s for _, s in tail)
    return sum(t for t, _ in tail) / seconds if seconds > 0 else None
