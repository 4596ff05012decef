"""The offline bundle's parts (deploy/bundle_parts.py, shipped as unpack.py) and the node's freeze
(deploy/bundle_have.py): split, check and join on real files; which of a node's pins the bundle leaves out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.bundle_have import constraints, demands, meets, provided, read_freeze
from deploy.bundle_parts import PARTS_MANIFEST, UNPACKER, PartsError, check_parts, parse_size, unpack, write_parts


@pytest.fixture
def bundle(tmp_path) -> Path:
    """A small bundle directory: incompressible bytes (as wheels and the GGUF are) in a few files."""
    root = tmp_path / "src" / "bundle"
    (root / "wheels").mkdir(parents=True)
    (root / "wheels" / "a-1.0-py3-none-any.whl").write_bytes(os.urandom(50_000))
    (root / "wheels" / "b-2.0-py3-none-any.whl").write_bytes(os.urandom(30_000))
    (root / "install.sh").write_text("#!/bin/sh\necho installed into \"$1\"\n")
    return root


@pytest.fixture
def parts(bundle, tmp_path) -> Path:
    out = tmp_path / "parts"
    write_parts(bundle, out, max_part_bytes=20_000)
    return out


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(("text", "size"), [("60000000", 60_000_000), ("60M", 60_000_000), ("60MB", 60_000_000),
                                            ("60Mi", 60 * 2**20), ("60MiB", 60 * 2**20), ("1k", 1000),
                                            ("2G", 2 * 10**9), ("512Ki", 512 * 1024)])
def test_part_sizes_read_as_bytes_with_decimal_or_binary_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "60T", "-5M", "1.5M", "M", "0"])
def test_a_bad_part_size_is_refused_with_the_units_it_takes(text):
    with pytest.raises(PartsError, match=r"part size .*(K, M or G|at least 1 byte)"):
        parse_size(text)


def test_the_parts_are_at_most_the_size_and_join_into_the_same_files(bundle, parts, tmp_path):
    manifest = json.loads((parts / PARTS_MANIFEST).read_text())
    names = [p["name"] for p in manifest["parts"]]
    assert manifest["num_parts"] == len(names) >= 4  # 80 kB of random bytes in parts of 20 kB
    assert names == [f"tlt-bundle.tar.gz.{i:03d}" for i in range(len(names))]
    assert all((parts / n).stat().st_size <= 20_000 for n in names)
    assert all((parts / n).stat().st_size == 20_000 for n in names[:-1])
    assert manifest["total_bytes"] == sum((parts / n).stat().st_size for n in names)
    assert sorted(p.name for p in parts.iterdir()) == sorted([*names, PARTS_MANIFEST, UNPACKER])
    out = unpack(parts, tmp_path / "node")
    assert out == tmp_path / "node" / "bundle"
    assert files_of(out) == files_of(bundle)
    assert os.access(out / "install.sh", os.X_OK) == os.access(bundle / "install.sh", os.X_OK)


def test_a_missing_part_is_named_and_nothing_is_unpacked(parts, tmp_path):
    (parts / "tlt-bundle.tar.gz.002").unlink()
    with pytest.raises(PartsError, match=r"1 of \d+ parts .* cannot be used.*\n  tlt-bundle\.tar\.gz\.002 is missing "
                                         r"\(20000 bytes, sha256 [0-9a-f]{64}\)"):
        unpack(parts, tmp_path / "node")
    assert not (tmp_path / "node").exists()


def test_a_damaged_part_is_named_with_what_it_should_be(parts, tmp_path):
    damaged = parts / "tlt-bundle.tar.gz.001"
    data = bytearray(damaged.read_bytes())
    data[100] ^= 0xFF  # one flipped byte, same size
    damaged.write_bytes(bytes(data))
    with pytest.raises(PartsError, match=r"tlt-bundle\.tar\.gz\.001 is damaged: 20000 bytes, sha256 [0-9a-f]{64}; "
                                         r"parts\.json says 20000 bytes"):
        check_parts(parts)
    assert not (tmp_path / "node").exists()


def test_every_bad_part_is_named_at_once(parts):
    (parts / "tlt-bundle.tar.gz.000").unlink()
    with (parts / "tlt-bundle.tar.gz.003").open("ab") as f:
        f.write(b"x")  # one byte too many
    with pytest.raises(PartsError, match=r"(?s)2 of \d+ parts.*\.000 is missing.*\.003 is damaged: \d+ bytes"):
        check_parts(parts)


def test_parts_without_their_manifest_or_with_a_broken_one_are_refused(parts):
    manifest = parts / PARTS_MANIFEST
    manifest.write_text("{not json")
    with pytest.raises(PartsError, match=r"parts\.json is damaged: not JSON"):
        check_parts(parts)
    manifest.unlink()
    with pytest.raises(PartsError, match=r"no parts\.json in .*: copy it with the parts"):
        check_parts(parts)


def test_an_older_bundle_is_not_mixed_in_unless_forced(parts, tmp_path):
    unpack(parts, tmp_path / "node")
    stale = tmp_path / "node" / "bundle" / "wheels" / "old-0.1-py3-none-any.whl"
    stale.write_bytes(b"old")
    with pytest.raises(PartsError, match=r"bundle exists: remove it or pass --force"):
        unpack(parts, tmp_path / "node")
    unpack(parts, tmp_path / "node", force=True)
    assert not stale.exists()


def test_unpack_py_runs_on_the_standard_library_alone_and_says_which_part_is_damaged(parts, tmp_path):
    # -I -S: no site-packages, no PYTHONPATH, no user site: only what a bare python3 has
    run = [sys.executable, "-I", "-S", str(parts / UNPACKER)]
    (parts / "tlt-bundle.tar.gz.003").write_bytes(b"garbage")
    bad = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1
    assert "tlt-bundle.tar.gz.003 is damaged: 7 bytes" in bad.stderr and "Traceback" not in bad.stderr
    assert not (parts / "bundle").exists()


def test_unpack_py_joins_the_parts_and_runs_install_sh(bundle, parts, tmp_path):
    proc = subprocess.run([sys.executable, "-I", "-S", str(parts / UNPACKER), "--into", str(tmp_path / "node"),
                           "--install", str(tmp_path / "venv")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert f"installed into {tmp_path / 'venv'}" in proc.stdout
    assert files_of(tmp_path / "node" / "bundle") == files_of(bundle)


def test_a_node_freeze_is_read_as_pins_and_what_is_not_pinned_is_said(tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("# a comment\n-e git+https://example.invalid/x.git#egg=x\nNumPy==2.5.2\ntorch==2.11.0+cu130\n"
                      "typing_extensions==4.16.0  # trailing\nlocal-pkg @ file:///tmp/local_pkg-1.0.whl\n\n")
    pins, skipped = read_freeze(freeze)
    assert pins == {"numpy": "2.5.2", "torch": "2.11.0+cu130", "typing-extensions": "4.16.0"}
    assert len(skipped) == 1 and "local-pkg" in skipped[0] and "not counted as present" in skipped[0]


def test_a_line_that_is_no_requirement_is_an_error_naming_its_line(tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("numpy==2.5.2\nthis is not a requirement\n")
    with pytest.raises(ValueError, match=r"freeze\.txt:2: 'this is not a requirement' is not a `pip freeze` line"):
        read_freeze(freeze)
    with pytest.raises(ValueError, match=r"HAVE: no file .*missing\.txt"):
        read_freeze(tmp_path / "missing.txt")


ENVS = [{"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
         "platform_python_implementation": "CPython", "platform_machine": "x86_64", "sys_platform": "linux",
         "platform_system": "Linux", "os_name": "posix", "implementation_version": "3.12.3"}]


def item(name: str, version: str, *requires: str, extras: tuple[str, ...] = ()) -> dict:
    return {"metadata": {"name": name, "version": version, "requires_dist": list(requires)},
            "requested_extras": list(extras)}


def test_only_the_node_versions_the_tree_accepts_become_constraints():
    tree = [item("tlt-scheduler", "0.1", "torch>=2.5", "numpy>=1.26", "ray[default]>=2.30", "pyyaml>=6.0"),
            item("ray", "2.59", "aiohttp>=3.7; extra == 'default'", "grpcio>=1.42; extra == 'other'",
                 "async-timeout; python_version < '3.11'", extras=("default",)),
            item("aiohttp", "3.14.3", "yarl<2.0,>=1.17")]
    wanted = demands(tree, ENVS)
    assert wanted["numpy"] == [">=1.26"] and wanted["aiohttp"] == [">=3.7"]
    assert "grpcio" not in wanted and "async-timeout" not in wanted  # another extra; not on 3.12
    have = {"torch": "2.11.0+cu130", "numpy": "1.24.0", "aiohttp": "3.14.3", "yarl": "1.25.1", "pyyaml": "5.4"}
    assert constraints(have, wanted) == ["aiohttp==3.14.3", "torch==2.11.0", "yarl==1.25.1"]  # numpy, pyyaml too old


def test_a_pin_is_left_out_where_the_node_has_that_version_local_label_aside():
    pins = [{"name": "torch", "version": "2.11.0"}, {"name": "numpy", "version": "2.5.2"},
            {"name": "pyyaml", "version": "6.0.3"}, {"name": "ray", "version": "2.59.0"}]
    have = {"torch": "2.11.0+cu130", "numpy": "2.5.2", "pyyaml": "5.4"}
    assert [p["name"] for p in provided(pins, have)] == ["torch", "numpy"]
    assert meets("2.11.0+cu130", [">=2.5", ""]) and not meets("2.4.1", [">=2.5"])
