"""An offline bundle in parts small enough to carry, and its unpacking on the node (`make bundle SPLIT=SIZE`).

Python's standard library only: this file goes into the parts' directory as `unpack.py`, and a node has
python3 and little else. On the node:

    python3 unpack.py [--into DIR] [--force] [--install VENV]

checks every part named in parts.json (size and sha256) and names each one missing or damaged before anything
is written; then joins them as one stream and unpacks the tar into DIR (default: the parts' own directory),
and with --install runs the bundle's install.sh into VENV (a new VENV is made with the python3 running
unpack.py, so that it sees that python3's torch).

deploy/bundle.py writes the parts with `write_parts`: one gzipped tar of the bundle directory, cut into files
of at most `max_part_bytes` each, and parts.json: each part's name, bytes and sha256, in order. Wheels are zip
files already and the GGUF is quantized, so compression saves little: gzip took 231 MB to 225 MB in 7 s here,
xz to 219 MB in 3 minutes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

PARTS_MANIFEST = "parts.json"
UNPACKER = "unpack.py"
FORMAT = 1  # parts.json's layout; unpack.py refuses another
COMPRESSION = "gz"  # the stdlib's zlib: any python3 reads it (xz saved 3% more, 25 times slower)
CHUNK = 1 << 20
SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


class PartsError(ValueError):
    """The parts cannot make the bundle (missing or damaged parts, a bad manifest, a bad size)."""


def parse_size(text: str) -> int:
    """Bytes from '60000000', '60M' or '60MB' (10**6), '60Mi' or '60MiB' (2**20); K and G alike."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmg]i?)?b?\s*", text, re.IGNORECASE)
    if match is None:
        raise PartsError(f"part size {text!r}: give bytes, or a number with K, M or G (10**3, 10**6, 10**9) or "
                         "Ki, Mi or Gi (2**10, 2**20, 2**30), e.g. 60M")
    size = int(match.group(1)) * SIZE_UNITS[(match.group(2) or "").lower()]
    if size < 1:
        raise PartsError(f"part size {text!r}: must be at least 1 byte")
    return size


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


class PartWriter:
    """A write-only file that lands in numbered files of at most `max_bytes` each, hashing as it goes."""

    def __init__(self, directory: Path, archive: str, max_bytes: int) -> None:
        self.directory, self.archive, self.max_bytes = directory, archive, max_bytes
        self.parts: list[dict] = []
        self._file = None
        self._digest = None

    def _next(self) -> None:
        self._close_part()
        name = f"{self.archive}.{len(self.parts):03d}"
        self.parts.append({"name": name, "bytes": 0, "sha256": None})
        self._file = (self.directory / name).open("wb")
        self._digest = hashlib.sha256()

    def _close_part(self) -> None:
        if self._file is not None:
            self._file.close()
            self.parts[-1]["sha256"] = self._digest.hexdigest()
            self._file = None

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        while view:
            if self._file is None or self.parts[-1]["bytes"] == self.max_bytes:
                self._next()
            n = min(len(view), self.max_bytes - self.parts[-1]["bytes"])
            self._file.write(view[:n])
            self._digest.update(view[:n])
            self.parts[-1]["bytes"] += n
            view = view[n:]
        return len(data)

    def close(self) -> list[dict]:
        self._close_part()
        return self.parts


def write_parts(bundle: Path, out: Path, max_part_bytes: int, archive: str = "tlt-bundle.tar.gz",
                info: dict | None = None) -> dict:
    """Writes `bundle` (a directory) as parts of at most `max_part_bytes` into `out` (made afresh), with
    parts.json and this file as unpack.py; returns the manifest. `info`: more fields for parts.json."""
    if not bundle.is_dir():
        raise PartsError(f"no bundle directory at {bundle}")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    writer = PartWriter(out, archive, max_part_bytes)
    with tarfile.open(fileobj=writer, mode=f"w|{COMPRESSION}") as tar:
        tar.add(bundle, arcname=bundle.name)
    parts = writer.close()
    manifest = {"format": FORMAT, "archive": archive, "compression": COMPRESSION, "bundle_dir": bundle.name,
                "max_part_bytes": max_part_bytes, "total_bytes": sum(p["bytes"] for p in parts),
                "num_parts": len(parts), "parts": parts, **(info or {})}
    (out / PARTS_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    shutil.copy2(Path(__file__), out / UNPACKER)
    return manifest


def read_manifest(parts_dir: Path) -> dict:
    path = parts_dir / PARTS_MANIFEST
    if not path.is_file():
        raise PartsError(f"no {PARTS_MANIFEST} in {parts_dir}: copy it with the parts (it lists them)")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as exc:
        raise PartsError(f"{path} is damaged: not JSON ({exc}); copy it again") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or "parts" not in manifest:
        raise PartsError(f"{path}: not a parts manifest of format {FORMAT} (written by another version?)")
    return manifest


def check_parts(parts_dir: Path) -> dict:
    """The manifest, once every part it lists is in `parts_dir` with its size and sha256; else PartsError
    naming every part that is missing or damaged."""
    manifest = read_manifest(parts_dir)
    problems = []
    for part in manifest["parts"]:
        path = parts_dir / part["name"]
        if not path.is_file():
            problems.append(f"{part['name']} is missing ({part['bytes']} bytes, sha256 {part['sha256']})")
            continue
        size, digest = path.stat().st_size, file_sha256(path)
        if (size, digest) != (part["bytes"], part["sha256"]):
            problems.append(f"{part['name']} is damaged: {size} bytes, sha256 {digest}; {PARTS_MANIFEST} says "
                            f"{part['bytes']} bytes, sha256 {part['sha256']}")
    if problems:
        raise PartsError(f"{len(problems)} of {len(manifest['parts'])} parts in {parts_dir} cannot be used; copy "
                         "them again (nothing was unpacked):\n  " + "\n  ".join(problems))
    return manifest


class JoinedParts:
    """The parts read in order as one stream (a read-only file for tarfile's stream mode)."""

    def __init__(self, paths: list[Path]) -> None:
        self._paths = list(paths)
        self._file = None

    def read(self, size: int = -1) -> bytes:
        chunks = []
        while size != 0:
            if self._file is None:
                if not self._paths:
                    break
                self._file = self._paths.pop(0).open("rb")
            block = self._file.read(size if size > 0 else CHUNK)
            if not block:
                self._file.close()
                self._file = None
                continue
            chunks.append(block)
            size -= len(block) if size > 0 else 0
        return b"".join(chunks)


def unpack(parts_dir: Path, into: Path | None = None, force: bool = False) -> Path:
    """Checks the parts, then joins and unpacks them; the bundle's directory (`into`/bundle_dir)."""
    manifest = check_parts(parts_dir)
    into = into or parts_dir
    dest = into / manifest["bundle_dir"]
    if dest.exists():
        if not force:
            raise PartsError(f"{dest} exists: remove it or pass --force (an older bundle's files would mix in)")
        shutil.rmtree(dest)
    into.mkdir(parents=True, exist_ok=True)
    stream = JoinedParts([parts_dir / p["name"] for p in manifest["parts"]])
    with tarfile.open(fileobj=stream, mode=f"r|{manifest['compression']}") as tar:
        for member in tar:
            name = Path(member.name)
            if name.is_absolute() or ".." in name.parts or name.parts[0] != manifest["bundle_dir"]:
                raise PartsError(f"the archive holds {member.name!r}, outside {manifest['bundle_dir']}/")
            if not (member.isfile() or member.isdir()):
                raise PartsError(f"the archive holds {member.name!r}, neither a file nor a directory")
            tar.extract(member, into, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="unpack.py", description="Check the bundle's parts, join and unpack them.")
    p.add_argument("--parts", default=str(Path(__file__).resolve().parent),
                   help="the directory of the parts and parts.json (default: this file's)")
    p.add_argument("--into", help="where the bundle's directory goes (default: the parts' directory)")
    p.add_argument("--force", action="store_true", help="replace a bundle directory already there")
    p.add_argument("--install", metavar="VENV", help="then run the bundle's install.sh into VENV")
    args = p.parse_args(argv)
    parts_dir = Path(args.parts).resolve()
    try:
        bundle = unpack(parts_dir, Path(args.into).resolve() if args.into else None, args.force)
    except PartsError as exc:
        print(f"unpack.py: {exc}", file=sys.stderr)
        return 1
    print(f"unpacked {bundle} from {len(read_manifest(parts_dir)['parts'])} parts (sizes and sha256 checked)")
    if args.install is None:
        print(f"next: sh {bundle}/install.sh VENV")
        return 0
    # a new venv is made with the python3 running this (PYTHON= another), e.g. the node's with torch
    env = {**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable)}
    return subprocess.run(["sh", str(bundle / "install.sh"), args.install], env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
