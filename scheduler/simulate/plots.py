"""PNG plots of a `tlt simulate` result (matplotlib, when it is installed)."""

from __future__ import annotations

from pathlib import Path


def write_plots(result: dict, directory: Path) -> dict[str, str]:
    """speedup.png, idle.png and tick.png in `directory`; ValueError with a clear message without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install matplotlib); the JSON was written without plots") \
            from None
    directory.mkdir(parents=True, exist_ok=True)
    rows = result["projections"]
    # each profile's projections by GPU count
    series = {name: sorted((r for r in rows if r["profile"] == name), key=lambda r: r["num_gpus"])
              for name in sorted({r["profile"] for r in rows})}
    paths = {}

    def save(fig, name: str) -> None:
        fig.tight_layout()
        paths[name] = str(directory / f"{name}.png")
        fig.savefig(paths[name], dpi=120)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for name, mine in series.items():
        gpus = [r["num_gpus"] for r in mine]
        ax.plot(gpus, [r["step_speedup"] for r in mine], "o-", label=f"{name}: step, TLT")
        ax.plot(gpus, [r["frozen_step_speedup"] for r in mine], "s--", label=f"{name}: step, frozen draft")
        ax.plot(gpus, [r["rollout_speedup"] for r in mine], "^:", label=f"{name}: rollout, TLT")
        ax.plot(gpus, [r["max_step_speedup_if_rollout_free"] for r in mine], "x-.", alpha=0.5,
                label=f"{name}: step bound if the rollout were free")
    ax.axhline(2.0, color="grey", lw=0.8)
    ax.set(xscale="log", xlabel="GPUs", ylabel="speed-up over plain decoding",
           title="Projected speed-up (tlt simulate)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save(fig, "speedup")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, mine in series.items():
        gpus = [r["num_gpus"] for r in mine]
        ax.plot(gpus, [r["idle_fraction_plain"] for r in mine], "o-", label=f"{name}: idle at the barrier, plain")
        ax.plot(gpus, [r["reclaimed_ratio"] for r in mine], "s--", label=f"{name}: reclaimed / idle, TLT")
    ax.set(xscale="log", ylim=(0, 1), xlabel="GPUs", ylabel="fraction", title="Idle time and what TLT reclaims")
    ax.legend(fontsize=7)
    save(fig, "idle")

    ticks = result["policy_tick"]["pure_policy"]
    if ticks:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        workers = sorted(int(n) for n in ticks)
        for key, label in (("p50_s", "p50"), ("p99_s", "p99"), ("cpu_p99_s", "p99, CPU time")):
            ax.plot(workers, [ticks[str(n)][key] * 1e3 for n in workers], "o-", label=label)
        ax.axhline(100, color="grey", lw=0.8)
        ax.set(xscale="log", xlabel="simulated workers", ylabel="ms per tick", title="Policy cost per tick")
        ax.legend(fontsize=7)
        save(fig, "tick")
    return paths
