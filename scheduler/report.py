"""`tlt report JOB --out DIR`: PNG plots and a Markdown summary of one job, from the REST API.

- timeline.png: per worker (GPU), its state over time (generating, idle at the barrier while others
  still generate, the learner phase when every worker waits for the update, training the drafter,
  swapping, failed), with step starts marked;
- steps.png: accepted length, rollout tokens/s and the draft versions served, per RL step;
- phases.png: step time by phase, stacked;
- summary.md: the totals (idle and reclaimed worker-seconds and their ratio), the publish decisions,
  and the three images.
The pure parts (`spans`, `totals`) take the API's JSON and are tested on their own.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from scheduler.client import call  # noqa: E402
from workers.protocol.states import WorkerState

LEARNER = "LEARNER"  # drawn only: waiting while no worker generates (weight sync, log-probs, update)
COLORS = {WorkerState.ROLLING_OUT: "#3b82f6", WorkerState.IDLE: "#d1d5db", LEARNER: "#c4b5fd",
          WorkerState.TRAINING: "#16a34a", WorkerState.SWAPPING: "#f59e0b", WorkerState.FAILED: "#dc2626"}
LABELS = {WorkerState.ROLLING_OUT: "generating", WorkerState.IDLE: "idle at the barrier (others generate)",
          LEARNER: "learner phase (all wait for the update)", WorkerState.TRAINING: "training the drafter",
          WorkerState.SWAPPING: "swapping a draft in", WorkerState.FAILED: "failed"}
PHASES = ("weight_sync", "rollout", "reward", "logprob", "update")


def spans(events: list[dict], end: float | None = None) -> dict[str, list[tuple[str, float, float, int]]]:
    """Worker state transitions (oldest first) -> per worker [(state, start, end, rl_step)]; a state
    lasts until the worker's next transition, the last one until `end` (default: the last event)."""
    end = max((e["ts"] for e in events), default=0.0) if end is None else end
    out: dict[str, list] = {}
    for e in events:
        runs = out.setdefault(e["worker"], [])
        if runs:
            state, start, _, step = runs[-1]
            runs[-1] = (state, start, e["ts"], step)
        runs.append((e["to"], e["ts"], max(end, e["ts"]), e["rl_step"]))
    return out


def generating(runs: dict[str, list[tuple[str, float, float, int]]]) -> list[tuple[float, float]]:
    """The times some worker generates: the union of every ROLLING_OUT span, merged, in order."""
    out: list[tuple[float, float]] = []
    for start, end in sorted((a, b) for r in runs.values() for state, a, b, _ in r if state == WorkerState.ROLLING_OUT):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def split_waits(runs: dict[str, list[tuple[str, float, float, int]]]) -> dict[str, list[tuple[str, float, float, int]]]:
    """Each IDLE span cut where the rollout ends: IDLE while another worker still generates (idle at
    the barrier: the time TLT reclaims), LEARNER while none does (everyone waits for the update)."""
    busy = generating(runs)
    out: dict[str, list] = {}
    for worker, spans_ in runs.items():
        pieces = out.setdefault(worker, [])
        for state, start, end, step in spans_:
            if state != WorkerState.IDLE:
                pieces.append((state, start, end, step))
                continue
            t = start
            for a, b in busy:
                if b <= t or a >= end:
                    continue
                if a > t:
                    pieces.append((LEARNER, t, a, step))
                pieces.append((WorkerState.IDLE, max(a, t), min(b, end), step))
                t = min(b, end)
            if t < end:
                pieces.append((LEARNER, t, end, step))
    return out


def totals(steps: list[dict], drafts: dict) -> dict:
    step_s = sum(sum(s["timings"].values()) for s in steps)
    rollout_s = sum(s["timings"].get("rollout", 0.0) for s in steps)
    idle = sum(s["idle_worker_s"] for s in steps)
    reclaimed = float(drafts.get("reclaimed_worker_s", 0.0))
    return {"num_steps": len(steps), "step_s": step_s, "rollout_s": rollout_s,
            "rollout_share": rollout_s / step_s if step_s else 0.0, "idle_worker_s": idle,
            "reclaimed_worker_s": reclaimed, "reclaimed_ratio": reclaimed / idle if idle else None,
            "num_leases": drafts.get("num_leases", 0), "num_published": drafts.get("num_published", 0),
            "num_rejected": drafts.get("num_rejected", 0)}


def plot_timeline(events: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(11, 1.8 + 0.45 * max(len({e["worker"] for e in events}), 1)))
    if events:
        t0 = events[0]["ts"]
        runs = split_waits(spans(events))
        workers = sorted(runs, key=lambda w: (len(w), w))
        for row, worker in enumerate(workers):
            for state, start, end, _ in runs[worker]:
                ax.barh(row, end - start, left=start - t0, color=COLORS.get(state, "#9ca3af"), height=0.7)
        starts = {}
        for e in events:
            if e["to"] == WorkerState.ROLLING_OUT:
                starts.setdefault(e["rl_step"], e["ts"])
        for step, ts in starts.items():
            ax.axvline(ts - t0, color="#1d2330", alpha=0.3, linewidth=0.8)
            ax.text(ts - t0, len(workers) - 0.55, f" step {step}", fontsize=7, alpha=0.7, va="bottom")
        ax.set_yticks(range(len(workers)), workers)
        ax.invert_yaxis()  # w0 on top
        ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()],
                  labels=list(LABELS.values()), loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, fontsize=8,
                  frameon=False)
    else:
        ax.text(0.5, 0.5, "no worker events yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("seconds since the job's first worker event")
    ax.set_title("Per-GPU state over time", pad=36)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_steps(steps: list[dict], path: Path) -> None:
    fig, (a1, a2, a3) = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    x = [s["rl_step"] for s in steps]
    a1.plot(x, [s.get("mean_accepted_length", 1.0) for s in steps], marker="o")
    a1.set_ylabel("accepted length")
    a2.plot(x, [s.get("num_tokens", 0) / max(s["timings"].get("rollout", 0.0), 1e-9) for s in steps], marker="o",
            color="#16a34a")
    a2.set_ylabel("rollout tokens/s")
    a3.plot(x, [max(s.get("draft_versions", {}).values(), default=0) for s in steps], marker="o", color="#f59e0b")
    a3.set_ylabel("draft version")
    a3.yaxis.set_major_locator(MaxNLocator(integer=True))
    a3.xaxis.set_major_locator(MaxNLocator(integer=True))  # shared by the three
    a3.set_xlabel("RL step")
    if not steps:
        a1.text(0.5, 0.5, "no finished steps yet", ha="center", va="center", transform=a1.transAxes)
    fig.suptitle("Speculative decoding over RL steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_phases(steps: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4))
    x = [s["rl_step"] for s in steps]
    bottom = [0.0] * len(steps)
    for phase in PHASES:
        values = [s["timings"].get(phase, 0.0) for s in steps]
        ax.bar(x, values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values)]
    if not steps:
        ax.text(0.5, 0.5, "no finished steps yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("RL step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("seconds")
    ax.set_title("Step time by phase")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_markdown(job: dict, t: dict, drafts: dict) -> str:
    spec = job["spec"]
    serving = "none" if drafts.get("serving_version") is None else f"v{drafts['serving_version']}"
    ratio = "n/a (no idle time)" if t["reclaimed_ratio"] is None else f"{t['reclaimed_ratio']:.0%}"
    lines = [f"# Job {job['job_id']}", "",
             f"- state: {job['state']}" + (f" ({job['error']})" if job.get("error") else ""),
             f"- model {spec.get('model')}, {spec.get('num_workers')} rollout workers, "
             f"TLT {'on' if spec.get('tlt') else 'off'}, {t['num_steps']} of {spec.get('num_steps')} steps done",
             f"- step time {t['step_s']:.1f} s in all, rollout {t['rollout_s']:.1f} s ({t['rollout_share']:.0%})",
             f"- idle worker-seconds at the barrier: {t['idle_worker_s']:.1f}; reclaimed for drafter training: "
             f"{t['reclaimed_worker_s']:.1f} ({ratio})",
             f"- drafter leases {t['num_leases']}, versions published {t['num_published']}, "
             f"candidates rejected {t['num_rejected']}, serving draft {serving}", ""]
    if not t["num_steps"]:
        lines += ["No RL step has finished yet: the step plots are empty.", ""]
    if drafts.get("decisions"):
        lines += ["| candidate | merged copies | accepted length | serving | outcome |", "|---|---|---|---|---|"]
        for d in drafts["decisions"]:
            def fmt(v):
                return "-" if v is None else f"{v:.2f}"
            published = d.get("published_version")
            outcome = f"published v{published}" if published is not None else f"rejected: {d.get('reason') or '?'}"
            merged = ", ".join(str(v) for v in d.get("merged") or [])
            lines.append(f"| {d.get('candidate')} | {merged} | {fmt(d.get('candidate_accepted_length'))} | "
                         f"{fmt(d.get('serving_accepted_length'))} | {outcome} |")
        lines.append("")
    lines += ["![per-GPU timeline](timeline.png)", "", "![over RL steps](steps.png)", "",
              "![step time by phase](phases.png)", ""]
    return "\n".join(lines)


def read_steps(url: str | None, job_id: str, token: str | None = None) -> list[dict]:
    """Every step record of a job, page by page (the API answers a bounded page from `start`)."""
    steps: list[dict] = []
    while page := call("GET", url, f"/v1/jobs/{job_id}/steps?start={len(steps)}", token=token):
        steps += page
    return steps


def write_report(url: str | None, job_id: str, out_dir: str | Path, token: str | None = None) -> dict[str, str]:
    """Fetch the job over REST and write the plots and summary.md into out_dir; returns the paths."""
    job = call("GET", url, f"/v1/jobs/{job_id}", token=token)
    events = call("GET", url, f"/v1/jobs/{job_id}/events?limit=100000", token=token)  # the API's most
    steps = read_steps(url, job_id, token)
    drafts = call("GET", url, f"/v1/jobs/{job_id}/drafts", token=token)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / f"{name}.png" for name in ("timeline", "steps", "phases")}
    plot_timeline(events, paths["timeline"])
    plot_steps(steps, paths["steps"])
    plot_phases(steps, paths["phases"])
    paths["summary"] = out / "summary.md"
    paths["summary"].write_text(summary_markdown(job, totals(steps, drafts), drafts))
    return {k: str(v) for k, v in paths.items()}
