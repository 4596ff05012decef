"""Draft checkpoints: self-describing safetensors files with a sha256, written atomically.

A file's metadata (safetensors' str -> str header) holds "kind" ("draft" or "trainer"), "tlt_meta"
(a DraftMeta as JSON), for trainer files "trainer" and "optimizer" (JSON), and "sha256". The sha256
covers every tensor (names in sorted order, each with dtype, shape and raw bytes) and every metadata
entry except "sha256" itself, so the checksum can live inside the file it protects. Nothing is
pickled: optimizer hyperparameters and counters travel as JSON, optimizer state tensors as tensors.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

log = logging.getLogger(__name__)

DRAFT, TRAINER = "draft", "trainer"
MODEL_PREFIX, OPTIM_PREFIX = "model.", "optim."


class CheckpointError(ValueError):
    """A checkpoint file is corrupt, truncated, of the wrong kind, or does not fit what loads it."""


@dataclass
class DraftMeta:
    version: int  # draft version; 0 = the untrained init
    parent_version: int | None  # None only for the init: required so lineage is never left out by accident
    policy_version: int  # policy version the draft was trained against
    num_steps: int = 0  # optimizer steps trained in this copy since its parent
    total_steps: int = 0  # optimizer steps over the whole lineage
    num_tokens: int = 0  # training tokens seen in this copy
    head_config: dict = field(default_factory=dict)  # whatever rebuilds the head, e.g. {"policy": ..., "eagle": ...}
    created_at: float = field(default_factory=time.time)  # wall clock, for humans; versions give the order
    extra: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DraftMeta:
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError("tlt_meta is not a JSON object")
        names = {f.name for f in fields(cls)}
        if set(d) != names:
            raise ValueError(f"tlt_meta fields: missing {sorted(names - set(d))}, unknown {sorted(set(d) - names)}")
        for name, types in _META_TYPES.items():
            if not isinstance(d[name], types) or isinstance(d[name], bool):
                raise ValueError(f"tlt_meta.{name} has the wrong type: {d[name]!r}")
        return cls(**d)


_META_TYPES: dict[str, type | tuple[type, ...]] = {
    "version": int, "parent_version": (int, type(None)), "policy_version": int, "num_steps": int, "total_steps": int,
    "num_tokens": int, "head_config": dict, "created_at": (int, float), "extra": dict}


def draft_path(directory: str | Path, version: int) -> Path:
    return Path(directory) / f"draft-v{version:06d}.safetensors"


def _digest(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    h = hashlib.sha256()

    def put(b) -> None:  # bytes or a 1-D uint8 array; length-prefixed, so distinct inputs give distinct streams
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)

    for name in sorted(tensors):
        t = tensors[name]
        put(name.encode())
        put(f"{t.dtype}|{tuple(t.shape)}".encode())
        put(t.reshape(-1).view(torch.uint8).numpy())  # raw bytes, no copy (works for bf16 too)
    for key in sorted(metadata):
        if key != "sha256":
            put(key.encode())
            put(metadata[key].encode())
    return h.hexdigest()


def _write(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """Atomic write: temp file in the same directory, fsync, rename over `path`, fsync the directory."""
    path = Path(path)
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel():  # safetensors refuses tensors that share storage (tied weights)
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    metadata = {**metadata, "sha256": _digest(out, metadata)}
    save_file_atomic(path, out, metadata)
    return metadata["sha256"]


def save_file_atomic(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """safetensors' save_file made durable: temp file in the same directory, fsync, rename over
    `path`, fsync the directory. A crash leaves the old file or the new one, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.close(fd)
        save_file(tensors, tmp, metadata=metadata)  # writes and closes; what is left is to make it durable
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; weights are not secret and other readers need them
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _read(path: str | Path, kind: str) -> tuple[dict[str, torch.Tensor], dict[str, str], DraftMeta]:
    """Read and verify a checkpoint on cpu; every way it can be broken becomes a CheckpointError."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    except (OSError, SafetensorError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: unreadable or truncated safetensors file ({e})") from e
    for key in ("kind", "tlt_meta", "sha256"):
        if key not in metadata:
            raise CheckpointError(f"{path}: missing metadata {key!r} (not a tlt checkpoint)")
    if _digest(tensors, metadata) != metadata["sha256"]:
        raise CheckpointError(f"{path}: sha256 checksum mismatch (file is corrupt)")
    if metadata["kind"] != kind:
        raise CheckpointError(f"{path}: is a {metadata['kind']!r} checkpoint, expected {kind!r}")
    try:
        meta = DraftMeta.from_json(metadata["tlt_meta"])
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: malformed tlt_meta: {e}") from e
    return tensors, metadata, meta


def save_draft(path: str | Path, state: dict[str, torch.Tensor], meta: DraftMeta) -> str:
    """Write a draft's weights (e.g. EagleHead.state_dict()) and meta; returns the sha256."""
    return _write(path, state, {"kind": DRAFT, "tlt_meta": meta.to_json()})


def load_draft(path: str | Path, device: str | torch.device = "cpu",
               expected_sha256: str | None = None) -> tuple[dict[str, torch.Tensor], DraftMeta]:
    """Read a draft; with expected_sha256 (e.g. recorded when it was published) it must match too."""
    tensors, metadata, meta = _read(path, DRAFT)
    if expected_sha256 is not None and metadata["sha256"] != expected_sha256:
        raise CheckpointError(f"{path}: sha256 differs from the expected {expected_sha256[:12]}...")
    return {k: t.to(device) for k, t in tensors.items()}, meta


def _split_tensors(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON-able copy of `obj` with each tensor moved to `tensors` and replaced by {"__tensor__": name}."""
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        return {str(k): _split_tensors(v, f"{prefix}.{k}", tensors) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_split_tensors(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)]
    return obj


def _join_tensors(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[obj["__tensor__"]]
        return {k: _join_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_join_tensors(v, tensors) for v in obj]
    return obj


def save_trainer_state(path: str | Path, state: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
                       meta: DraftMeta, trainer: dict) -> str:
    """Write a resumable trainer checkpoint: head weights, optimizer state and hyperparameters, counters."""
    tensors = {MODEL_PREFIX + k: t for k, t in state.items()}
    optim = _split_tensors(optimizer.state_dict(), OPTIM_PREFIX[:-1], tensors)
    metadata = {"kind": TRAINER, "tlt_meta": meta.to_json(), "trainer": json.dumps(trainer, sort_keys=True),
                "optimizer": json.dumps(optim, sort_keys=True)}
    return _write(path, tensors, metadata)


def load_trainer_state(path: str | Path, head: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[DraftMeta, dict]:
    """Restore `head` and `optimizer` in place (continuing is bit-identical); returns (meta, trainer dict)."""
    tensors, metadata, meta = _read(path, TRAINER)
    try:
        trainer = json.loads(metadata["trainer"])
        optim = _join_tensors(json.loads(metadata["optimizer"]), tensors)
        optim["state"] = {int(k): v for k, v in optim["state"].items()}  # JSON turned param ids into str
        for group in optim["param_groups"]:  # JSON turned tuples (betas) into lists
            for k, v in group.items():
                if k != "params" and isinstance(v, list):
                    group[k] = tuple(v)
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}: malformed trainer/optimizer metadata: {e}") from e
    weights = {k[len(MODEL_PREFIX):]: t for k, t in tensors.items() if k.startswith(MODEL_PREFIX)}
    try:
        head.load_state_dict(weights, strict=True)
        optimizer.load_state_dict(optim)
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path}: does not fit this head/optimizer: {e}") from e
    return meta, trainer


def merge_drafts(copies: list[tuple[dict[str, torch.Tensor], DraftMeta]],
                 new_version: int) -> tuple[dict[str, torch.Tensor], DraftMeta]:
    """Average copies trained from the same parent, weighted by their num_steps (plain mean if all are 0).

    Computed in float32 as base + sum_i w_i (x_i - base) with base = the first copy, so identical
    copies merge to themselves bit-exactly; cast back to each tensor's dtype. Copies must share
    parent_version, head_config, names, shapes and dtypes, and non-float tensors must be identical.
    policy_version may differ (the policy can advance while copies train): the merge takes the max
    and records every copy's in extra["policy_versions"].
    """
    if not copies:
        raise ValueError("merge_drafts needs at least one copy")
    base, first = copies[0]
    for state, meta in copies[1:]:
        if meta.parent_version != first.parent_version:
            raise ValueError(f"copies have different parents: {first.parent_version} vs {meta.parent_version}")
        if meta.head_config != first.head_config:
            raise ValueError(f"copy v{meta.version} has a different head_config")
        if set(state) != set(base):
            raise ValueError(f"copy v{meta.version} has different tensors: {sorted(set(state) ^ set(base))}")
        for k, t in state.items():
            if t.shape != base[k].shape or t.dtype != base[k].dtype:
                raise ValueError(f"copy v{meta.version}: {k} is {t.dtype}{tuple(t.shape)}, "
                                 f"expected {base[k].dtype}{tuple(base[k].shape)}")
            if not base[k].is_floating_point() and not torch.equal(t, base[k]):
                raise ValueError(f"copy v{meta.version}: non-float tensor {k} differs between copies")
    steps = [m.num_steps for _, m in copies]
    total = sum(steps)
    weights = [s / total for s in steps] if total else [1 / len(copies)] * len(copies)
    merged: dict[str, torch.Tensor] = {}
    for k, b in base.items():
        if not b.is_floating_point():
            merged[k] = b.clone()
            continue
        b32 = b.float()
        acc = torch.zeros_like(b32)
        for (state, _), w in zip(copies[1:], weights[1:]):
            acc += w * (state[k].to(b.device, torch.float32) - b32)
        merged[k] = (b32 + acc).to(b.dtype)
    metas = [m for _, m in copies]
    meta = DraftMeta(
        version=new_version, parent_version=first.parent_version,
        policy_version=max(m.policy_version for m in metas), num_steps=total,
        total_steps=max(m.total_steps - m.num_steps for m in metas) + total,
        num_tokens=sum(m.num_tokens for m in metas), head_config=copy.deepcopy(first.head_config),
        extra={"merged_versions": [m.version for m in metas], "merge_weights": weights,
               "policy_versions": [m.policy_version for m in metas]})
    return merged, meta
