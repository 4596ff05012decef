"""The bench registry (bench/cli.py): every bench is declared there, takes its options and the common ones, and
has its result written by the registry alone, with the commit, the machine and the date. The cheap benches
run for real at tiny sizes (dataplane, observability; scheduler in test_scheduler.py, gpu in test_gpu.py); a
stand-in bench, this module, checks the registry's own rules."""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import pytest

from bench import cli
from scheduler.cli import main as tlt

ROOT = Path(__file__).parents[2]
PROVENANCE = {"commit", "machine", "date"}


def add_arguments(p) -> None:  # the stand-in bench: this module
    p.add_argument("--size", type=int, default=2)


def run(args) -> dict:
    if args.size < 1:
        raise ValueError(f"--size must be >= 1, got {args.size}")
    return {"size": args.size, "errors": {"x": "failed"} if args.size == 13 else {}}


def record_as(result: dict) -> tuple[str, str | None]:
    return ("standin_big", "a card") if result["size"] > 100 else ("standin", None)


def summary(result: dict) -> list[str]:
    return [f"size {result['size']}"]


@pytest.fixture
def standin(monkeypatch):
    monkeypatch.setitem(cli.BENCHES, "standin", cli.Bench(__name__, "the registry's test bench"))


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_every_bench_declares_its_options_and_a_run_and_gets_the_common_options():
    assert set(cli.BENCHES) == {"engine", "drafter", "drafter-history", "gpu", "dataplane", "observability",
                                "scheduler", "rl", "faults", "bundle"}
    for name in cli.BENCHES:
        module = cli.load(name)
        assert callable(module.add_arguments) and callable(module.run), name
        args = cli.build_parser("tlt bench", name).parse_args([name, "--out-dir", "/x", "--json"])
        assert (args.bench, args.out_dir, args.json) == (name, "/x", True)


def writers(path: Path) -> list[int]:
    """Lines of `path` that call write_result or write a file under docs/bench themselves."""
    tree = ast.parse(path.read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    return [n.lineno for n in calls
            if (getattr(n.func, "id", None) or getattr(n.func, "attr", None)) == "write_result"]


def test_the_registry_is_the_only_writer_of_a_benchs_result():
    found = {p.name: writers(p) for p in sorted((ROOT / "bench").glob("*.py")) if writers(p)}
    assert found == {"cli.py": found.get("cli.py")} and found["cli.py"], found
    # and the module every bench lives in is one the registry names
    modules = {p.stem for p in (ROOT / "bench").glob("*.py")}
    assert {b.module.removeprefix("bench.") for b in cli.BENCHES.values()} <= modules


def test_the_registry_writes_prints_and_exits_by_the_result(standin, tmp_path, capsys):
    assert cli.main(["standin", "--size", "3", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0] == "size 3"  # the summary, without --json
    printed, written = json.loads(out[-1]), json.loads((tmp_path / "standin.json").read_text())
    assert printed.pop("path") == str(tmp_path / "standin.json") and printed == written
    assert set(written) >= PROVENANCE and written["size"] == 3 and "gpu" not in written["machine"]
    assert cli.main(["standin", "--size", "200", "--json", "--out-dir", str(tmp_path)]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 1  # --json: the JSON object alone
    big = json.loads((tmp_path / "standin_big.json").read_text())  # record_as: its name and card
    assert big["machine"]["gpu"] == "a card" and list(big["machine"])[0] == "gpu"
    assert cli.main(["standin", "--size", "13", "--json", "--out-dir", str(tmp_path)]) == 1  # errors listed
    assert last_json(capsys.readouterr().out)["errors"] == {"x": "failed"}


def test_bad_input_is_named_and_writes_nothing(standin, tmp_path, capsys):
    assert cli.main(["standin", "--size", "0", "--out-dir", str(tmp_path)]) == 2
    assert "python3 -m bench.cli: error: --size must be >= 1, got 0" in capsys.readouterr().err
    assert tlt(["bench", "standin", "--size", "0", "--out-dir", str(tmp_path)]) == 2
    assert "tlt: error: --size must be >= 1" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    with pytest.raises(SystemExit):
        tlt(["bench", "nosuch"])
    assert "invalid choice: 'nosuch'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tlt(["bench", "--help"])
    listing = capsys.readouterr().out
    assert all(f"  {name} " in listing for name in cli.BENCHES)  # listed, none imported for it


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is importable here: nothing re-runs")
def test_engine_reruns_itself_in_the_engines_venv_with_its_options(monkeypatch, tmp_path):
    import os

    import bench.record

    python = tmp_path / ".venv-engines" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    monkeypatch.setattr(bench.record, "ROOT", tmp_path)
    calls = []

    def execv(path, argv):
        calls.append((path, argv))
        raise SystemExit(0)

    monkeypatch.setattr(os, "execv", execv)
    with pytest.raises(SystemExit):
        tlt(["bench", "engine", "--prompts", "2", "--json"])
    assert calls == [(str(python), [str(python), "-m", "bench.cli", "engine", "--prompts", "2", "--json"])]


def test_dataplane_and_observability_write_their_json_through_the_registry(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TLT_CACHE_DIR", str(tmp_path / "cache"))
    runs = {"observability": ["--workers", "4", "--steps", "2", "--events", "2", "--repeats", "2"],
            "dataplane": ["--model", "tiny", "--workers", "2", "--prompts", "1", "--group-size", "2",
                          "--new-tokens", "8", "--swap-trials", "1"]}
    for name, options in runs.items():
        assert tlt(["bench", name, "--json", *options, "--out-dir", str(tmp_path)]) == 0
        printed = last_json(capsys.readouterr().out)
        written = json.loads((tmp_path / f"{name}.json").read_text())
        assert printed.pop("path") == str(tmp_path / f"{name}.json") and printed == written
        assert set(written) >= PROVENANCE and written["machine"]["num_cores"] >= 1
    assert json.loads((tmp_path / "observability.json").read_text())["num_workers"] == 4
    dataplane = json.loads((tmp_path / "dataplane.json").read_text())
    assert dataplane["num_workers"] == 2 and len(dataplane["steps"]) == 1 and 0 < dataplane["rollout_fraction"] < 1
