"""Whether the bundle's parts fit the transfers that reach a lent GPU node: each call there carries the whole
working tree (tracked and untracked-not-ignored files) beside the one part it brings, within one limit (a lent
machine's 64 MiB). bench/gpu_rl.sh's `prepare` refuses parts that do not fit, and says the SPLIT that does;
`tlt bench bundle` records the calls a node's install takes. Standard library only.

    python3 deploy/transfer.py PARTS_DIR [--limit BYTES] [--root TREE]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

TRANSFER_LIMIT = 64 * 2**20  # bytes one call carries, the tree included
CARRIED_BESIDE = ("parts.json", "unpack.py")  # what each folder of bench/gpu_rl.sh holds beside its part
MIN_PART = 10**6  # below this, parts are not worth a call each


def tree_bytes(root: Path) -> int:
    """The bytes of what travels with every call: git's tracked and untracked-not-ignored files under root."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout
    return sum((root / f).stat().st_size for f in out.decode().split("\0") if f and (root / f).is_file())


def fit(parts_dir: Path, root: Path, limit: int = TRANSFER_LIMIT) -> dict:
    """The parts against the limit: tree_bytes, room_bytes (the largest part a call can carry), biggest_part_bytes,
    calls (one per part), fits, why not (`error`, None when it fits), and calls_at_fitting_split (the calls parts
    of the largest whole-M SPLIT that fits would take; None where none fits)."""
    manifest = json.loads((parts_dir / "parts.json").read_text())
    sizes = [p["bytes"] for p in manifest["parts"]]
    tree = tree_bytes(root)
    extra = sum((parts_dir / f).stat().st_size for f in CARRIED_BESIDE if (parts_dir / f).is_file())
    room = limit - tree - extra
    split = room // 10**6  # the largest SPLIT in whole M that fits
    biggest = max(sizes)
    error = None
    if room < MIN_PART:
        error = (f"the tree alone ({tree / 1e6:.1f} MB) leaves no room for a part in a call's {limit / 1e6:.1f} MB: "
                 "make the tree smaller")
    elif biggest > room:
        error = (f"a call carries the tree ({tree / 1e6:.1f} MB) and one part ({biggest / 1e6:.1f} MB): "
                 f"{(tree + extra + biggest) / 1e6:.1f} MB, over a call's {limit / 1e6:.1f} MB; build parts of at "
                 f"most {split}M (make bundle ... SPLIT={split}M)")
    return {"tree_bytes": tree, "room_bytes": room, "biggest_part_bytes": biggest, "calls": len(sizes),
            "fits": error is None, "error": error,
            "calls_at_fitting_split": math.ceil(sum(sizes) / (split * 10**6)) if room >= MIN_PART else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="transfer.py", description=__doc__.split("\n\n")[0])
    p.add_argument("parts", type=Path, help="the parts' directory (parts.json)")
    p.add_argument("--limit", type=int, default=TRANSFER_LIMIT, help=f"bytes a call carries (default {TRANSFER_LIMIT})")
    p.add_argument("--root", type=Path, default=Path.cwd(), help="the tree that travels (default: here)")
    args = p.parse_args(argv)
    if not (args.parts / "parts.json").is_file():
        print(f"transfer.py: no parts.json in {args.parts}", file=sys.stderr)
        return 2
    result = fit(args.parts, args.root, args.limit)
    if result["error"]:
        print(f"transfer.py: {result['error']}", file=sys.stderr)
        return 1
    print(f"transfer.py: {result['calls']} calls, each the tree ({result['tree_bytes'] / 1e6:.1f} MB) and a part of "
          f"at most {result['biggest_part_bytes'] / 1e6:.1f} MB (room {result['room_bytes'] / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
