"""`tlt bench gpu`: its CPU form end to end on a tiny preset, with the packages a GPU node lacks blocked (so
the path never rots, and never grows an import the node cannot satisfy); options; the CUDA test runner;
the physics' kernel attribution on CUDA where there is one. This module imports only what a GPU node has
(the `tlt` command's test skips there), so the CUDA test set can list it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from bench.gpu import GOALS, main, met, record_as
from bench.gpu_args import CPU_SIZES, CUDA_SIZES, add_arguments, settings_from_args
from bench.gpu_physics import headline, kernel_times
from bench.gpu_tests import junit_counts, read_test_paths, run_cuda_tests

ROOT = Path(__file__).parents[2]
BLOCKED = ("ray", "redis", "fastapi", "uvicorn", "orjson", "simpy", "pydantic", "prometheus_client", "starlette")
# a meta_path finder that refuses the packages a bare GPU node lacks, as a missing package would
BLOCKER = textwrap.dedent(f"""
    import sys
    class Blocked:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {BLOCKED!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: a GPU node has none)")
            return None
    sys.meta_path.insert(0, Blocked())
""")
TINY = ["--device", "cpu", "--model", "tiny", "--threads", "1", "--json", "--physics-iters", "2",
        "--warm-prompts", "4", "--warm-task-prompts", "2", "--warm-new-tokens", "16", "--warm-steps", "3",
        "--calib-prompts", "2", "--sweep-prompts", "1", "--sweep-new-tokens", "8", "--ks", "2",
        "--batch-sizes", "1,2", "--batch-new-tokens", "6", "--train-seconds", "0.5", "--stop-trials", "1",
        "--drift-steps", "1", "--drift-eval-prompts", "1", "--adapt-prompts", "2", "--adapt-seconds", "0.5",
        "--longtail-prompts", "2", "--longtail-group", "2", "--longtail-new-tokens", "16"]


def run_blocked(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """`python -m bench.gpu ARGS` with the GPU node's missing packages blocked and a private cache."""
    code = BLOCKER + f"import runpy; sys.argv = ['bench.gpu', *{args!r}]; runpy.run_module('bench.gpu', " \
                     "run_name='__main__', alter_sys=True)"
    env = {**os.environ, "TLT_CACHE_DIR": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)


def test_the_cpu_form_runs_end_to_end_without_the_control_planes_packages(tmp_path):
    out = tmp_path / "out"
    proc = run_blocked([*TINY, "--out-dir", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])  # the JSON object is printed last
    assert json.loads((out / "gpu_cpu.json").read_text())["date"] == result["date"]
    assert not (out / "gpu.json").exists()  # a CPU run never writes the GPU's file
    assert result["errors"] == {} and set(result["part_seconds"]) == set("abcdefgh")
    assert set(GOALS) <= set(result) and result["device"].startswith("cpu: ")
    assert result["machine"]["cpu_model"] and result["commit"] and result["cpu_threads"] == 1
    assert result["forward_path"] == "static" and result["engine_path"] in ("eager", "static")
    # physics: every case of the CPU grid measured, the headline keys read from it; no kernel times on a CPU
    table = result["physics"]["table"]["fp32"]
    assert set(table) == {"b1", "b8"} and all(set(row) == {"t1", "t4"} for row in table.values())
    assert 0 < result["forward_ms_b1_fp32"] == table["b1"]["t1"]["wall_ms"]
    assert result["verify_cost_k3_b1"] == pytest.approx(table["b1"]["t4"]["wall_ms"] / table["b1"]["t1"]["wall_ms"],
                                                        abs=1e-3)
    assert result["forward_ms_b1_bf16"] is None and result["wall_over_kernel_b1"] is None
    assert 30 * 10 <= result["aten_ops_per_forward_b1"] <= 30 * 60  # 30 layers, some ops each
    # warm start: trained here (3 steps), then the draft served every later part
    warm = result["warm_start"]
    assert warm["cached"] is False and warm["train_steps"] == 3 and warm["harvested_tokens"] > 0
    assert result["warm_start_s"] == pytest.approx(warm["harvest_s"] + warm["train_s"], abs=0.02)
    assert result["speedup_greedy_b1"] > 0 and result["speedup_t1_b1"] > 0
    greedy_cells = [v for key, v in result["sweep_b1"]["sweep"]["greedy"].items() if key.startswith("warm_k")]
    assert result["accepted_greedy_best"] == max(c["mean_accepted_length"] for c in greedy_cells) >= 1.0
    assert result["accepted_t1_best"] >= 1.0 and result["harvest_tokens_per_s"] == warm["harvest_tokens_per_s"] > 0
    assert result["sweep_b1"]["greedy_identical_fraction_b1"] == 1.0
    # the batch sweep: each arm at each batch size, plain the reference; greedy speculation is lossless
    sweep = result["batch_sweep"]
    assert set(sweep["table"]["temp1"]) == {"b1", "b2"} and sweep["table"]["temp1"]["b2"]["plain"]["ratio"] == 1.0
    cells = [r for out in (sweep, result["batch_sweep_bf16"]) for t in out["table"].values() for r in t.values()]
    assert result["adaptive_min_ratio"] == min(r["adaptive"]["over_best"] for r in cells)
    assert result["greedy_identical_fraction"] == result["greedy_identical_fraction_bf16"] == 1.0
    assert sweep["greedy_compared"] == 2 * (1 + 2)  # 2 arms, b1 + b2 rows
    cell = sweep["table"]["greedy"]["b2"]
    assert result["spec_step_cost_k4_b2"] == cell["k4"]["spec_step_cost"] > 0 and "speedup_k4_t1_b1_bf16" in result
    assert cell["plain"]["host_reads_per_step"] == 1.0  # one blocking read per decode step
    # warm-ups identical to the timed runs: nothing captured or rebuilt inside them, in any part
    assert result["graph_captures_timed"] == 0 and result["cache_rebuilds_timed"] == 0
    assert sweep["graph_captures_warm_up"] == 0 == result["longtail"]["graph_captures_warm_up"]  # a CPU captures none
    assert result["profile_b4"]["steps"] > 0 and result["profile_b4"]["top"]
    # the long tail: 2 prompts x 2 responses per arm
    tail = result["longtail"]
    assert tail["num_responses"] == 4 and tail["table"]["plain"]["max_response_tokens"] <= 16
    assert tail["tuner"] == "the batch sweep's, T=1"  # a worker's tuner, which has seen every batch size
    tail_accepted = result["longtail_tail_accepted_length"]
    assert result["tuner_prior"]["acceptance"] >= 0 and (tail_accepted is None or tail_accepted >= 1.0)
    assert result["longtail_rollout_speedup"] == pytest.approx(
        tail["table"]["plain"]["rollout_s"] / tail["table"]["adaptive"]["rollout_s"], rel=0.01)
    # issue 41: history alone, EAGLE alone and both per row, on all rows and on tail rows (1 of each group of 2)
    assert set(tail["table"]) == {"plain", "k4", "adaptive", "history", "combined", "combined_adaptive"}
    for name, cell in tail["table"].items():
        rows = cell["rows"]
        assert (rows["all"]["rows"], rows["tail"]["rows"]) == (4, 2) and rows["tail"]["accepted_length"] >= 1.0
        assert rows["all"]["tokens_per_s"] > 0 and rows["tail"]["row_tokens_per_s"] > 0
        assert (cell["history_ms_per_step"] > 0) == (name in ("history", "combined", "combined_adaptive"))
    assert tail["table"]["plain"]["rows"]["tail"]["accepted_length"] == 1.0
    assert result["longtail_rollout_speedup_history"] == pytest.approx(
        tail["table"]["plain"]["rollout_s"] / tail["table"]["combined_adaptive"]["rollout_s"], rel=0.01)
    assert "longtail_tail_speedup_history" in result and result["longtail_history_step_fraction"] > 0
    assert result["longtail_tail_rows_accepted_history"] >= 1.0
    for name in ("combined", "combined_adaptive"):  # the chooser's drafts per source and bucket
        sources = tail["table"][name]["sources"]
        # the fixed arm drafts every step; the adaptive one may serve plain throughout where plain is cheap
        assert (sources or name == "combined_adaptive") and {s for by in sources.values() for s in by} <= {
            "history", "eagle"}
        assert sum(c["rows"] for by in sources.values() for c in by.values()) <= tail["table"][name]["mean_tokens"]
    assert result["longtail_greedy_identical_fraction_history"] == 1.0 and tail["greedy"]["compared"] == 2 * 4
    assert result["train_fp32_tokens_per_s"] > 0 and result["train_bf16_tokens_per_s"] > 0
    assert 0 <= result["stop_p50_s"] <= result["stop_max_s"] < 10
    assert result["drift"]["drift_adapt_steps"] > 0
    assert result["cuda_tests_passed"] is None and "cpu" in result["cuda_tests"]["note"]

    # again, the warm start only: its draft comes from the cache, with the timings it was built in
    again = run_blocked([*TINY, "--out-dir", str(out), "--parts", "b"], tmp_path)
    assert again.returncode == 0, again.stderr[-4000:]
    cached = json.loads(again.stdout.strip().splitlines()[-1])
    assert cached["warm_start"]["cached"] is True and cached["warm_start_s"] == result["warm_start_s"]
    assert cached["speedup_greedy_b1"] is None and set(cached["part_seconds"]) == {"h", "b"}


def test_the_blocker_would_catch_an_import_the_gpu_node_lacks():
    proc = subprocess.run([sys.executable, "-c", BLOCKER + "import workers.spec"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0 and "blocked: a GPU node has none" in proc.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--ks", "2,x"], "--ks must be comma-separated integers"),
    (["--batch-sizes", "0"], "--batch-sizes must be integers >= 1"),
    (["--physics-dtypes", "fp16"], "--physics-dtypes must be fp32 and/or bf16"),
    (["--physics-tokens", "1,17"], "--physics-tokens must be at most 16"),
    (["--parts", "az"], "--parts must be letters of abcdefgh"),
    (["--parts", "h", "--skip-tests"], "leaves nothing to run"),
    (["--train-seconds", "0"], "--train-seconds must be > 0"),
    (["--warm-steps", "0"], "--warm-steps must be >= 1"),
    (["--model", "smollm2-135m-shape", "--parts", "ab"], "serves the physics (a) and the tests (h) only"),
])
def test_bad_options_get_a_clear_error(args, message, capsys):
    assert main(["--device", "cpu", *args]) == 2
    assert message in capsys.readouterr().err


def test_tlt_bench_gpu_is_the_same_command(capsys):
    tlt = pytest.importorskip("scheduler.cli", reason="the tlt CLI needs the control plane's packages")
    assert tlt.main(["bench", "gpu", "--device", "cpu", "--ks", "0"]) == 2
    assert "tlt: error: --ks must be integers >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tlt.main(["bench", "gpu", "--help"])
    assert "--longtail-new-tokens" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_asked_for_where_there_is_none_says_so(capsys):
    assert main([]) == 2
    assert "no CUDA device is visible" in capsys.readouterr().err


def parse(*argv: str, cuda: bool = True):
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    return settings_from_args(p.parse_args(list(argv)), cuda)


def test_sizes_default_per_device_and_options_override_them():
    gpu = parse()
    assert gpu.device == "cuda" and gpu.sizes == CUDA_SIZES
    assert {1, 8, 32, 64, 128} <= set(gpu.sizes.physics_batches) and gpu.sizes.physics_tokens == tuple(range(1, 10))
    assert gpu.sizes.harvest_batch == 256 and gpu.sizes.batch_sizes == (1, 4, 16, 64)
    cpu = parse("--device", "cpu", "--ks", "3,5", "--skip-tests", cuda=False)
    assert cpu.sizes.ks == (3, 5) and "h" not in cpu.parts
    assert cpu.sizes.physics_dtypes == ("fp32",) and cpu.sizes.warm_steps == CPU_SIZES.warm_steps


def test_a_cpu_run_is_recorded_apart_from_the_gpus():
    assert record_as({"device_type": "cuda", "device": "NVIDIA H100 80GB HBM3"}) == ("gpu", "NVIDIA H100 80GB HBM3")
    assert record_as({"device_type": "cpu", "device": "cpu: Intel Xeon"}) == ("gpu_cpu", None)


def test_headline_keys_come_from_the_physics_table():
    cell = {"wall_ms": 3.0, "kernel_ms": 2.0, "wall_over_kernel": 1.5, "kernels": 300.0}
    table = {"fp32": {"b1": {"t1": cell, "t4": {**cell, "wall_ms": 3.3}},
                      "b64": {"t1": {**cell, "wall_over_kernel": 1.2}}}}
    h = headline(table)
    assert h["verify_cost_k3_b1"] == 1.1 and h["wall_over_kernel_b64"] == 1.2
    assert h["kernels_per_forward_b1_fp32"] == 300
    assert h["forward_ms_b1_bf16"] is None
    assert headline({"fp32": {"b1": {"t1": cell}}})["verify_cost_k3_b1"] is None


def test_goals_compare_in_their_direction():
    assert met(1.4, GOALS["forward_ms_b1_bf16"]) is True and met(1.6, GOALS["forward_ms_b1_bf16"]) is False
    assert met(1.9, GOALS["speedup_greedy_b1"]) is True and met(None, GOALS["speedup_greedy_b1"]) is None
    assert met(0, GOALS["cuda_tests_passed"]) is False and met(0, GOALS["cuda_tests_failed"]) is True


def write_test_set(root: Path, listing: str) -> Path:
    (root / "tests").mkdir()
    (root / "tests" / "test_x.py").write_text("def test_cuda_ok():\n    pass\n\ndef test_cuda_broken():\n"
                                              "    assert False\n\ndef test_other():\n    assert False\n")
    listing_file = root / "tests" / "cuda_tests.txt"
    listing_file.write_text(listing)
    return listing_file


def test_the_cuda_test_set_runs_from_its_list_and_is_counted(tmp_path):
    listing = write_test_set(tmp_path, "# the CUDA tests\n\ntests/test_x.py  # both cuda tests\n")
    assert read_test_paths(listing) == ["tests/test_x.py"]
    counts = run_cuda_tests(tmp_path / "junit.xml", 120, listing)
    assert (counts["passed"], counts["failed"], counts["tests"]) == (1, 1, 2)  # test_other: deselected by -k cuda
    assert junit_counts(tmp_path / "junit.xml")["failed"] == 1


def test_a_bad_test_list_or_report_is_named(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        read_test_paths(tmp_path / "absent.txt")
    listing = write_test_set(tmp_path, "# nothing but comments\n")
    with pytest.raises(ValueError, match="lists no test paths"):
        read_test_paths(listing)
    listing.write_text("tests/test_x.py\ntests/test_gone.py\n")
    with pytest.raises(ValueError, match="do not exist: tests/test_gone.py"):
        read_test_paths(listing)
    (tmp_path / "junk.xml").write_text("not xml")
    with pytest.raises(ValueError, match="not a readable junit XML report"):
        junit_counts(tmp_path / "junk.xml")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kernels_are_attributed_to_their_case():
    x = torch.randn(256, 256, device="cuda")

    def matmuls(n: int):
        def run() -> None:
            for _ in range(n):
                x @ x
        return run

    times = kernel_times([("one", matmuls(1)), ("three", matmuls(3)), ("none", lambda: None)], iters=2)
    assert times["one"][1] >= 1 and times["three"][1] == pytest.approx(3 * times["one"][1])  # per call
    assert 0 < times["one"][0] < times["three"][0] and times["none"] == (0.0, 0.0)


def test_the_long_tail_times_every_arm_on_plain_decodings_lengths():
    """(g)'s length_matched: each row runs as long as plain's sample of it (EOS and stop ids ignored); plain's
    matched run is its natural one token for token, and a speculative arm, sampling other tokens, emits exactly
    those lengths."""
    from bench.gpu_longtail import length_matched
    from drafter.decode.engine import Engine, Request
    from drafter.decode.sampling import SamplingParams
    from drafter.draft.eagle import EagleDrafter
    from drafter.draft.head import new_head
    from tests.conftest import random_prompts, tiny_model

    model = tiny_model(vocab_size=16, seed=2, eos=(3,))
    engine = Engine(model)
    reqs = [Request(p, SamplingParams(temperature=1.0, max_new_tokens=24, seed=i, stop_token_ids=(5,)))
            for i, p in enumerate(random_prompts([4, 6, 3, 5, 7, 4], 16, seed=8))]
    natural = engine.generate(reqs)
    lengths = [len(o.token_ids) for o in natural]
    assert min(lengths) < 24 == max(lengths)  # some stopped early (EOS or the stop id), some ran to the cap
    matched = length_matched(engine, reqs)
    assert [r.params.max_new_tokens for r in matched] == lengths
    assert all(r.params.ignore_eos and not r.params.stop_token_ids for r in matched)
    assert [o.token_ids for o in engine.generate(matched)] == [o.token_ids for o in natural]
    spec = engine.generate(matched, k=3, drafter=EagleDrafter(model, new_head(model, None, None), None))
    assert [len(o.token_ids) for o in spec] == lengths


def test_runs_of_parts_merge_into_the_whole_result():
    """`tlt bench gpu --merge`: the H200 run's two calls (docs/bench/history/gpu_h200_2026-11-28: --parts abcdh, then
    befg with the warm draft cached), in either order, give the figures of docs/bench/gpu.json (merged by hand then;
    its two keys added after the run aside); bad inputs are named."""
    import json

    from bench.gpu import merge
    from bench.record import ROOT

    runs = ROOT / "docs" / "bench" / "history" / "gpu_h200_2026-11-28"
    first, second = (json.loads((runs / f"gpu_{p}.json").read_text()) for p in ("abcdh", "befg"))
    merged, by_hand = merge([second, first]), json.loads((ROOT / "docs" / "bench" / "gpu.json").read_text())
    later = {"accepted_greedy_best", "accepted_t1_best"}
    assert all(merged[k] == by_hand[k] for k in by_hand["goals_met"] if k not in later)
    assert merged["warm_start"] == first["warm_start"] and merged["longtail"] == second["longtail"]
    assert merged["part_seconds"]["b"] == 162.7 and merged["parts"] == "abcdefgh" and merged["total_s"] == 496.2
    assert merge([first, second])["goals_met"] == merged["goals_met"]
    with pytest.raises(ValueError, match="no run has part"):
        merge([first])
    with pytest.raises(ValueError, match="different devices"):
        merge([first, {**second, "device": "NVIDIA H100 80GB HBM3"}])
    with pytest.raises(ValueError, match="results of `tlt bench gpu`"):
        merge([{"bench": "rl", "parts": "abc"}])
