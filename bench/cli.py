"""`tlt bench NAME` (also `python3 -m bench.cli NAME`): the registry of benchmarks, their one front door.

A bench is one module of bench/ with
    add_arguments(parser)   its options; the registry adds --json and --out-dir to every bench
    run(args) -> dict       the measurement as a JSON-ready dict; it writes no file itself
and, where it needs them,
    record_as(result) -> (name, accelerator)   the file's name and card when they are not NAME and none
                                                (gpu: gpu.json with the GPU on CUDA, gpu_cpu.json on a CPU)
    summary(result) -> list[str]               lines printed before the JSON object when --json is not given
The registry alone writes the result to docs/bench/NAME.json (or --out-dir), through workers/results.py,
which adds the commit, the machine and the date; it prints the result (with its "path") last on stdout, and
exits 1 when the result lists "errors". Adding a bench is one module and one entry in BENCHES.

A bench's module is imported only when that bench runs or shows its --help: `tlt` stays torch-free, and
`python3 -m bench.gpu` runs on a GPU node that has none of the control plane's packages. The `tlt` CLI mounts
`add_command` through the entry point group "tlt.commands" (pyproject.toml), so the scheduler names no bench.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

DESCRIPTION = "benchmarks; each prints a JSON object last and writes it to docs/bench/NAME.json"


@dataclass(frozen=True)
class Bench:
    module: str  # holds add_arguments(parser) and run(args) -> dict
    help: str


BENCHES: dict[str, Bench] = {
    "engine": Bench("bench.engine", "our engine vs vLLM, plain and with the same trained EAGLE-3 draft"),
    "drafter": Bench("bench.drafter", "trained drafters: acceptance, speed-up, drift, stops"),
    "drafter-history": Bench("bench.drafter_history", "history drafts, the EAGLE head and both combined on the "
                             "long-tail task's groups at T=1: accepted length, tokens/s, tail rows, drafter cost"),
    "gpu": Bench("bench.gpu", "one GPU in one run: forward physics, warm start, speculation at batch 1 and in "
                 "batches, a long-tail rollout, drift, training, the CUDA tests"),
    "dataplane": Bench("bench.dataplane", "GRPO job on local Ray: step breakdown, hot swap, progress cost"),
    "observability": Bench("bench.observability", "CPU cost of /metrics and the status page at N workers"),
    "scheduler": Bench("bench.scheduler", "dispatch and preemption latency on real workers; the policy pass at N "
                       "simulated workers"),
    "rl": Bench("bench.rl", "the same RL job plain, with a frozen warm draft, and with TLT, side by side"),
    "faults": Bench("bench.faults", "fuzz, hostile input, Redis outage, driver kill, idempotency: counts"),
    "bundle": Bench("bench.bundle", "the offline bundle a GPU node needs (make bundle HAVE=... SPLIT=60M): parts, "
                    "sizes, the GGUF"),
}


def load(name: str) -> ModuleType:
    return importlib.import_module(BENCHES[name].module)


def add_common(parser: argparse.ArgumentParser) -> None:
    """The options every bench has."""
    parser.add_argument("--out-dir", default=None, help="where the result's JSON file goes (default docs/bench)")
    parser.add_argument("--json", action="store_true", help="print only the JSON object on stdout (always last)")


def build_parser(prog: str, name: str | None = None) -> argparse.ArgumentParser:
    """Every bench as a subcommand; only `name`'s module is imported, for its options."""
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    sub = parser.add_subparsers(dest="bench", required=True, metavar="NAME")
    for bench_name, bench in BENCHES.items():
        p = sub.add_parser(bench_name, help=bench.help, description=bench.help)
        if bench_name == name:
            load(name).add_arguments(p)
            add_common(p)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the bench `args.bench`, write its result (the one place that does), print it last."""
    from workers.results import finite, write_result

    module = load(args.bench)
    result = module.run(args)
    name, accelerator = module.record_as(result) if hasattr(module, "record_as") else (args.bench, None)
    out_dir = Path(args.out_dir) if args.out_dir else None
    result["path"] = str(write_result(name, result, out_dir, accelerator=accelerator))
    if not args.json and hasattr(module, "summary"):
        print("\n".join(module.summary(result)))
    print(json.dumps(finite(result)))
    return 1 if result.get("errors") else 0


def dispatch(argv: list[str], prog: str) -> int:
    """Parse `NAME [options]` and run it; a ValueError (bad input) propagates for the caller to name."""
    argv = list(argv)
    args = build_parser(prog, argv[0] if argv and argv[0] in BENCHES else None).parse_args(argv)
    args.bench_argv = argv[1:]  # as given: `engine` re-runs itself with them in .venv-engines
    return run(args)


def main(argv: list[str] | None = None, prog: str = "python3 -m bench.cli") -> int:
    try:
        return dispatch(sys.argv[1:] if argv is None else argv, prog)
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


def add_command(sub) -> None:
    """`tlt bench` (entry point "tlt.commands"): NAME and its options are parsed here, when it runs."""
    listing = "\n".join(f"  {name:14s} {bench.help}" for name, bench in BENCHES.items())
    bench = sub.add_parser("bench", help=DESCRIPTION, description=DESCRIPTION,
                           epilog=f"benches (`tlt bench NAME --help` for its options):\n{listing}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("argv", nargs=argparse.REMAINDER, metavar="NAME ...", help="a bench and its options")
    bench.set_defaults(func=lambda args: dispatch(args.argv, "tlt bench"))


if __name__ == "__main__":
    sys.exit(main())
