"""A probe of the static engine's step cost on one device, with no model file: SmolLM2-135M's shapes with random
weights and a random EAGLE-3 head (the static path drafts k and verifies k + 1 every step whatever is accepted,
so a step's cost does not depend on the weights). Per dtype (bf16, fp32), batch, temperature (0, 1) and k (0, 1,
2, 4): ms per decode step (the faster of two timed runs after an untimed one) and its ratio to plain; then
torch.profiler over batch 4 at k = 0 and 2 and batch 1 at k = 2 (device busy against wall: the host's share).

    python3 -m bench.step_probe [cuda|cpu] [BATCHES, default 1,4,16,64] [NEW_TOKENS, default 64]

Needs only torch (a bare GPU node's python3). Writes $OUT/probe_steps.json (default /tmp). A diagnostic, not one of
the issues' figures: those come from `tlt bench gpu` on the real model (part d). Its H100 run:
docs/bench/step_probe_gpu.json, read in docs/benchmarks.md ("GPU")."""
import json
import os
import sys
import time

import torch

from bench.gpu_cells import profile_step, timed
from bench.gpu_decode import ByteTokenizer, sweep_requests
from drafter.decode.engine import Engine
from drafter.draft.eagle import EagleDrafter
from drafter.draft.head import EagleHead
from drafter.model.config import ModelConfig
from drafter.model.loading import random_model

KS = (0, 1, 2, 4)


def probe(device: str, batches: tuple[int, ...], new_tokens: int, cfg: ModelConfig | None = None,
          dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32), log=print) -> dict:
    """Per dtype: {"cells": {"b{B}_T{T}": {k: ms_per_step, accepted, captures, rebuilds, host_reads,
    cost_vs_plain}}, "profile": {case: profile_step's dict}}. `cfg`: the model's shapes (default SmolLM2-135M's)."""
    if not batches or new_tokens < 1:
        raise ValueError(f"batches must be given and new_tokens >= 1, got {batches} and {new_tokens}")
    cfg = cfg or ModelConfig()
    out: dict = {}
    for dtype in dtypes:
        model = random_model(cfg, 0, dtype, device)
        tok = ByteTokenizer(cfg.vocab_size)
        engine = Engine(model, tok)
        drafter = EagleDrafter(model, EagleHead(model.cfg).to(device), "auto")
        cells = {}
        for b in batches:
            for temperature in (0.0, 1.0):
                reqs = sweep_requests(tok, b, temperature, new_tokens)
                row = {}
                for k in KS:
                    timed(engine, reqs, k, drafter)  # every shape met before the timed runs
                    best = min((timed(engine, reqs, k, drafter) for _ in range(2)), key=lambda r: r.ms_per_step)
                    row[k] = {"ms_per_step": round(best.ms_per_step, 3), "accepted": round(best.accepted_length, 3),
                              "captures": best.captures, "rebuilds": best.rebuilds, "host_reads": best.host_reads}
                for k in KS[1:]:
                    row[k]["cost_vs_plain"] = round(row[k]["ms_per_step"] / row[0]["ms_per_step"], 3)
                cells[f"b{b}_T{temperature:g}"] = row
                log(f"{dtype} batch {b} T={temperature:g}: " + ", ".join(
                    f"k={k} {row[k]['ms_per_step']} ms" for k in KS))
        prof = {f"b4_k{k}": profile_step(engine, sweep_requests(tok, 4, 1.0, new_tokens), k, drafter if k else None)
                for k in (0, 2)}
        prof["b1_k2"] = profile_step(engine, sweep_requests(tok, 1, 1.0, new_tokens), 2, drafter)
        out[str(dtype)] = {"cells": cells, "profile": prof}
        del engine, drafter, model
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def main(argv: list[str]) -> int:
    device = argv[0] if argv else "cuda"
    batches = tuple(int(b) for b in (argv[1] if len(argv) > 1 else "1,4,16,64").split(","))
    new_tokens = int(argv[2]) if len(argv) > 2 else 64
    t0 = time.perf_counter()
    out = probe(device, batches, new_tokens)
    out["seconds"] = time.perf_counter() - t0
    out["device"] = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    path = os.path.join(os.environ.get("OUT", "/tmp"), "probe_steps.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
