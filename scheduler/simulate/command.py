"""The `tlt simulate` command line (heavy imports only when it runs, so `tlt` starts fast)."""

from __future__ import annotations

import argparse
import json
import sys


def _ints(option: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{option} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{option} must list integers >= 1, got {text!r}")
    return values


def _simulate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from scheduler.simulate.run import run_all, summary_lines
    from workers.results import write_result

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    result = run_all(profiles=tuple(p.strip() for p in args.profile.split(",") if p.strip()),
                     gpus=_ints("--gpus", args.gpus), num_steps=args.steps,
                     tick_workers=_ints("--tick-workers", args.tick_workers),
                     validation_seeds=args.validation_seeds, log=log)
    if args.plot:
        try:
            from scheduler.simulate.plots import write_plots

            result["plots"] = write_plots(result, Path(args.plot))
        except ValueError as exc:
            log(f"tlt simulate: plots skipped: {exc}")
    result["path"] = str(write_result("simulate", result, Path(args.out_dir) if args.out_dir else None))
    if not args.json:
        print("\n".join(summary_lines(result)))
    print(json.dumps(result))
    return 0


def add_simulate_command(sub) -> None:
    sim = sub.add_parser("simulate", help="discrete-event simulation of RL steps on N workers with the real policy: "
                         "validation, then projections (writes docs/bench/simulate.json)")
    sim.add_argument("--profile", default="gpu-8b,gpu-235b", help="GPU profiles to project: gpu-8b, gpu-235b")
    sim.add_argument("--gpus", default="8,64,512,2048", help="GPU counts to project, e.g. 8,64,512,2048")
    sim.add_argument("--steps", type=int, default=5, help="RL steps per job (TLT's draft improves over steps)")
    sim.add_argument("--tick-workers", default="2048,16384", help="worker counts the policy tick is timed at")
    sim.add_argument("--validation-seeds", type=int, default=40, help="simulated repeats of this machine's bench")
    sim.add_argument("--plot", default=None, metavar="DIR", help="write speedup.png, idle.png, tick.png here")
    sim.add_argument("--out-dir", default=None, help="where simulate.json goes (default docs/bench)")
    sim.add_argument("--json", action="store_true", help="print only the JSON object on stdout")
    sim.set_defaults(func=_simulate)
