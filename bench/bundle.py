"""`tlt bench bundle`: the offline bundle a GPU node needs, built and measured (issue 40's figure: at most 4 parts
of at most 60 MB, the GGUF in). docs/bench/bundle.json.

It runs `make bundle`'s builder from the checkout (deploy/bundle.py, which is not in the installed package) for
the node of docs/operations.md, "A GPU node": its `pip freeze` (deploy/gpu-node-freeze.txt), Python 3.12,
manylinux_2_28_x86_64, parts of 60M (60 * 10**6 bytes), with the check (for another Python than this one, pip
checks that every wheel installs on the target's tags). The parts land where bench/gpu_rl.sh takes them from
(dist/bundle-parts). Records the parts and their sizes, the bundle's size before the tar, its largest files, and
what it leaves to the node.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.record import ROOT, deploy_script

BUILDER = ROOT / "deploy" / "bundle.py"
GGUF = "model/SmolLM2-135M-Instruct.Q4_1.gguf"
GOAL_MAX_PARTS = 4  # issue 40: files reach the GPU nodes in transfers of at most about 60 MB
GOAL_MAX_PART_BYTES = 60_000_000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--have", default="deploy/gpu-node-freeze.txt", help="the node's `pip freeze` (HAVE)")
    p.add_argument("--split", default="60M", help="the largest part (SPLIT; 60M = 60*10**6 bytes)")
    p.add_argument("--python-version", default="3.12", help="the node's Python (PYVER)")
    p.add_argument("--platform", default="manylinux_2_28_x86_64", help="the node's platform tag (PLATFORM)")
    p.add_argument("--bundle-dir", default="dist/bundle", help="where the bundle goes; its parts: BUNDLE_DIR-parts")
    p.add_argument("--no-check", action="store_true", help="skip the check after the build")


def run(args: argparse.Namespace) -> dict:
    if not BUILDER.is_file():
        raise ValueError(f"tlt bench bundle builds from a checkout: no {BUILDER} (run it where the repository is)")
    out = (ROOT / args.bundle_dir).resolve()
    cmd = [sys.executable, str(BUILDER), "build", "--out", str(out), "--have", str(ROOT / args.have),
           "--split", args.split, "--python-version", args.python_version, "--platform", args.platform,
           *(["--no-check"] if args.no_check else [])]
    config = {"have": args.have, "split": args.split, "python_version": args.python_version,
              "platform": args.platform, "checked": not args.no_check}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)  # its progress: on stderr, as it goes
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        return {"bench": "bundle", "config": config, "seconds": seconds,
                "errors": [f"deploy/bundle.py build exited {proc.returncode} (its output is above)"]}
    manifest = json.loads((out / "manifest.json").read_text())
    parts = json.loads((Path(f"{out}-parts") / "parts.json").read_text())
    files = {f["path"]: f["bytes"] for f in manifest["files"]}
    part_bytes = [p["bytes"] for p in parts["parts"]]
    largest = sorted(files.items(), key=lambda kv: -kv[1])[:6]
    return {
        "bench": "bundle", "config": config,
        "bundle_parts": len(part_bytes), "part_bytes": part_bytes, "max_part_bytes": parts["max_part_bytes"],
        "parts_total_bytes": sum(part_bytes), "compression": parts["compression"],
        "bundle_bytes": manifest["total_bytes"], "num_wheels": sum(p.startswith("wheels/") for p in files),
        "gguf_included": GGUF in files, "gguf_bytes": files.get(GGUF),
        "largest_files": [{"path": path, "bytes": size} for path, size in largest],
        "num_provided_by_node": len(manifest["provided_by_node"]), "num_excluded": len(manifest["excluded"]),
        "provided_by_node": manifest["provided_by_node"], "excluded": manifest["excluded"],
        "goal": {"max_parts": GOAL_MAX_PARTS, "max_part_bytes": GOAL_MAX_PART_BYTES, "gguf_included": True},
        "goal_met": (len(part_bytes) <= GOAL_MAX_PARTS and max(part_bytes) <= GOAL_MAX_PART_BYTES
                     and GGUF in files),
        "transfer": transfer_fit(Path(f"{out}-parts")),
        "seconds": seconds,
    }


def transfer_fit(parts_dir: Path) -> dict:
    """deploy/transfer.py's fit of these parts beside this tree in a lent machine's calls (a script of the
    checkout, as the builder is)."""
    module = deploy_script("transfer")
    return module.fit(parts_dir, ROOT) | {"limit_bytes": module.TRANSFER_LIMIT}


def summary(result: dict) -> list[str]:
    if result.get("errors"):
        return [f"bundle: {e}" for e in result["errors"]]
    mb = [f"{b / 1e6:.1f}" for b in result["part_bytes"]]
    return [f"bundle for {result['config']['python_version']} {result['config']['platform']}, HAVE "
            f"{result['config']['have']}: {result['bundle_parts']} parts ({', '.join(mb)} MB), "
            f"{result['parts_total_bytes'] / 1e6:.1f} MB in all ({result['bundle_bytes'] / 1e6:.1f} MB unpacked), "
            f"GGUF {'in' if result['gguf_included'] else 'left out'}; the node provides "
            f"{result['num_provided_by_node']} + {result['num_excluded']} (torch and CUDA); goal "
            f"{'met' if result['goal_met'] else 'NOT met'} (<= {GOAL_MAX_PARTS} parts of <= 60 MB with the GGUF)",
            transfer_line(result.get("transfer"))]


def transfer_line(transfer: dict | None) -> str:
    if not transfer:
        return "bundle: no transfer fit recorded"
    tree = f"the tree ({transfer['tree_bytes'] / 1e6:.1f} MB)"
    if transfer["fits"]:
        return f"bundle: a lent machine takes these parts in {transfer['calls']} calls, each with {tree}"
    return (f"bundle: these parts do not fit a lent machine's calls beside {tree}; parts of "
            f"{transfer['room_bytes'] // 10**6}M would, in {transfer['calls_at_fitting_split']} calls")
