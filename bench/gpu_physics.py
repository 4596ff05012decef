"""`tlt bench gpu` (a): the physics of one policy forward with a KV cache.

Per (dtype, batch, tokens): the wall time of one forward (host included, synchronized after each, as a
decode step is: its verdict is read on the host), and on CUDA the GPU's kernel time and the number of
kernels (torch.profiler, CUDA activity). Wall over kernel says how much of a step the host costs: at 1.0
the GPU never waits. verify cost k: a (k+1)-token forward over a 1-token one, what a speculative step
costs against a plain one. aten_ops_per_forward: the top-level aten ops one forward issues, the host work
that CUDA graphs exist to remove, counted on the CPU on the path the GPU takes (no oneDNN linear).
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from drafter.decode.static import StaticRunner
from drafter.model import linear as model_lib
from drafter.model.causal_lm import CausalLM
from drafter.model.config import ModelConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CASE_PREFIX = "tltcase:"  # the profiler ranges that attribute kernels to a case
MAX_TOKENS = 16  # tokens per row a runner's cache has room for past the context (bench.gpu_args checks)


def forward_path(device: str) -> str:
    """What policy_forward_fn measures on `device`: drafter.decode.static's path, with CUDA graphs on a GPU."""
    return "static+graphs" if torch.device(device).type == "cuda" else "static"


def policy_forward_fn(model: CausalLM, batch: int, tokens: int, context: int, device: str,
                      runners: dict | None = None) -> Callable[[], None]:
    """A zero-argument callable running one policy forward of `tokens` new tokens per row for `batch` rows
    whose KV cache holds `context` positions (its contents do not matter to the timing), on drafter.decode.static's
    path (the engine's on a GPU; CUDA graphs there). runners: a dict in which the static runners are kept
    between calls, one per model and dtype, sized by the first call's batch (make it the largest)."""
    g = torch.Generator().manual_seed(batch * 100 + tokens)
    ids = torch.randint(0, model.cfg.vocab_size, (batch, tokens), generator=g).to(device)  # (B, T)
    positions = (context + torch.arange(tokens)).expand(batch, tokens).contiguous().to(device)  # (B, T)
    runners = {} if runners is None else runners
    key = (id(model), model.dtype)
    if key not in runners:
        runners[key] = StaticRunner(model, max_batch=batch, max_len=context + MAX_TOKENS)
    runner = runners[key]

    def run() -> None:
        runner.forward(ids, positions, context + tokens)

    return run


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def wall_ms(fn: Callable[[], None], device: str, iters: int, warmup: int = 3) -> float:
    """Median wall milliseconds of one call, synchronized after each (as a decode step reads its result)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def kernel_times(cases: list[tuple[str, Callable[[], None]]], iters: int) -> dict[str, tuple[float, float]]:
    """{case: (kernel ms per call, kernels per call)} on CUDA, all cases in one profiler session: each case
    runs `iters` times inside a named range and synchronizes before it ends, so every device activity
    (kernels, copies, memsets) that starts inside the range is that case's."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for name, fn in cases:
            with record_function(CASE_PREFIX + name):
                for _ in range(iters):
                    fn()
                torch.cuda.synchronize()
    events = prof.events()
    windows = sorted((e.time_range.start, e.time_range.end, e.name[len(CASE_PREFIX):]) for e in events
                     if e.name.startswith(CASE_PREFIX) and e.device_type == DeviceType.CPU)
    starts = [w[0] for w in windows]
    totals = {name: [0.0, 0] for _, _, name in windows}
    for e in events:
        if e.device_type != DeviceType.CUDA or e.name.startswith(CASE_PREFIX):  # the ranges' GPU-side copies
            continue
        i = bisect.bisect_right(starts, e.time_range.start) - 1
        if i >= 0 and e.time_range.start <= windows[i][1]:
            totals[windows[i][2]][0] += e.time_range.elapsed_us() / 1e3
            totals[windows[i][2]][1] += 1
    return {name: (ms / iters, n / iters) for name, (ms, n) in totals.items()}


@contextlib.contextmanager
def gpu_like_linear():
    """Linear layers on F.linear (aten::linear), as on a GPU, instead of the CPU's oneDNN-packed kernels."""
    old = os.environ.get("TLT_CPU_LINEAR")
    os.environ["TLT_CPU_LINEAR"] = "mkl"
    model_lib.onednn_linear_available.cache_clear()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TLT_CPU_LINEAR", None)
        else:
            os.environ["TLT_CPU_LINEAR"] = old
        model_lib.onednn_linear_available.cache_clear()


def smollm2_layout(num_layers: int = ModelConfig().num_layers) -> CausalLM:
    """A random model with SmolLM2-135M's layout (ModelConfig's defaults: 30 layers, 9 query and 3 KV
    heads, tied embeddings) and narrow widths: the same ops per forward at a fraction of the memory."""
    cfg = replace(ModelConfig(), vocab_size=512, hidden_size=72, head_dim=8, intermediate_size=192,
                  max_position=512, num_layers=num_layers)
    return CausalLM(cfg).eval().requires_grad_(False)


def aten_ops_per_forward(model: CausalLM, context: int = 128) -> int:
    """Top-level aten ops (events named aten::* whose parent is not an aten op) of one batch-1, one-token
    forward of `model` (on the CPU) on the path the GPU takes."""
    with gpu_like_linear(), torch.inference_mode():
        fn = policy_forward_fn(model, 1, 1, context, "cpu")
        fn()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
    return sum(1 for e in prof.events() if e.name.startswith("aten::")
               and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")))


def physics(model: CausalLM, device: str, batches: tuple[int, ...], tokens: tuple[int, ...],
            dtypes: tuple[str, ...], context: int, iters: int, profile_iters: int,
            progress: Callable[[str], None]) -> dict:
    """The table {dtype: {"b{B}": {"t{T}": {wall_ms, kernel_ms, wall_over_kernel, kernels}}}} and the headline
    keys. The policy is float32; bf16 is measured on a bf16 copy."""
    is_cuda = torch.device(device).type == "cuda"
    table: dict = {}
    for name in dtypes:
        dtype = DTYPES[name]
        policy = model if dtype == model.dtype else copy.deepcopy(model).to(dtype)
        runners: dict = {}
        with torch.inference_mode():
            cases = [(f"b{b}_t{t}", policy_forward_fn(policy, b, t, context, device, runners))
                     for b in sorted(batches, reverse=True) for t in tokens]  # the largest batch sizes the runner
            rows = {case: {"wall_ms": round(wall_ms(fn, device, iters), 4)} for case, fn in cases}
            if is_cuda and profile_iters > 0:
                for case, (kernel_ms, kernels) in kernel_times(cases, profile_iters).items():
                    rows[case].update(kernel_ms=round(kernel_ms, 4), kernels=round(kernels, 1),
                                      wall_over_kernel=round(rows[case]["wall_ms"] / max(kernel_ms, 1e-9), 3))
        table[name] = {f"b{b}": {f"t{t}": rows[f"b{b}_t{t}"] for t in tokens} for b in batches}
        progress(f"physics {name}: " + ", ".join(f"b{b}: {table[name][f'b{b}']['t1']['wall_ms']:.2f} ms"
                                                 for b in batches if 1 in tokens))
        del policy, runners
    return {"table": table, **headline(table)}


def headline(table: dict) -> dict:
    """The physics keys of the result (None where the grid did not measure the case)."""

    def cell(dtype: str, b: int, t: int, key: str):
        return table.get(dtype, {}).get(f"b{b}", {}).get(f"t{t}", {}).get(key)

    one, four = cell("fp32", 1, 1, "wall_ms"), cell("fp32", 1, 4, "wall_ms")
    return {"forward_ms_b1_fp32": one, "forward_ms_b1_bf16": cell("bf16", 1, 1, "wall_ms"),
            "wall_over_kernel_b1": cell("fp32", 1, 1, "wall_over_kernel"),
            "wall_over_kernel_b64": cell("fp32", 64, 1, "wall_over_kernel"),
            "verify_cost_k3_b1": round(four / one, 3) if one and four else None,
            "kernels_per_forward_b1_fp32": cell("fp32", 1, 1, "kernels")}
