"""Draft weight store: versioned drafter checkpoints in a directory, their index in Redis.

publish() allocates a version with INCR, writes the file first (atomically, with its sha256), then
one MULTI/EXEC records it in the index, moves the latest pointer forward and announces it. The
pointer is compared under WATCH and the transaction retried if another publisher moved it, so it
never goes back: a slower publisher that commits an older version after a newer one only adds its
index entry, and is not announced (a subscriber would otherwise swap backward).

If the file write fails, the index, the pointer and the channel are untouched; the allocated version
number stays unused (versions are increasing, not dense). If the process dies between the file and
the commit, the file is an orphan: consistency_check() reports it and recover() indexes it.
The directory may be a shared filesystem: files are found by name (draft_path), never by scanning.
The Redis side (index, latest, announcements) is workers.draft_index.DraftIndex, which is torch-free.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

import redis as redis_lib
import torch
from safetensors import safe_open

from drafter.draft.head import EagleHead, head_from_state
from drafter.train.checkpoint import CheckpointError, DraftMeta, draft_path, load_draft, merge_drafts, save_draft
from workers.draft_index import DraftIndex, check_version, job_draft_dirs, parse_entry
from workers.protocol.client import text
from workers.protocol.keys import draft_namespaces, drafts_counter_key, drafts_index_key

STALE_TEMP_S = 3600.0  # a temp file untouched this long belongs to a crashed writer (writes take seconds)


def merge_key(parent_version: int | None, head_config: dict, state: dict[str, torch.Tensor]) -> str:
    """Hex digest of what copies must share to be averaged (drafter.train.checkpoint.merge_drafts): the parent,
    the head's configuration and every integer tensor (the draft vocabulary). Two first leases on
    different workers each pick a draft vocabulary from their own rollouts, so their keys differ."""
    h = hashlib.sha256(json.dumps([parent_version, head_config], sort_keys=True).encode())
    for name, t in sorted(state.items()):
        if not t.is_floating_point():
            h.update(name.encode() + b"\0" + hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes())
                     .hexdigest().encode())
    return h.hexdigest()


class DraftStore(DraftIndex):
    def __init__(self, redis: redis_lib.Redis, directory: str | Path, namespace: str = "default") -> None:
        super().__init__(redis, namespace)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    # ----- writing ----------------------------------------------------------------------------
    def publish(self, state: dict[str, torch.Tensor], meta: DraftMeta) -> int:
        """Store a draft's weights under the next version; returns it. `meta.version` is ignored
        (the store allocates it); the caller's meta is not modified."""
        if not isinstance(meta, DraftMeta):
            raise ValueError(f"meta must be a DraftMeta, got {type(meta).__name__}")
        version = int(self.redis.incr(drafts_counter_key(self.namespace)))
        meta = dataclasses.replace(meta, version=version)
        path = draft_path(self.directory, version)
        sha = save_draft(path, state, meta)  # raises before Redis is touched beyond the counter
        self._commit(version, self._entry_for(meta, path.name, sha))
        return version

    @staticmethod
    def _entry_for(meta: DraftMeta, name: str, sha: str) -> dict:
        return {"version": meta.version, "parent_version": meta.parent_version, "policy_version": meta.policy_version,
                "path": name, "sha256": sha, "num_steps": meta.num_steps, "total_steps": meta.total_steps,
                "num_tokens": meta.num_tokens, "created_at": meta.created_at, "extra": meta.extra}

    def merge_and_publish(self, versions: list[int], policy_version: int | None = None,
                          into: DraftStore | None = None) -> int:
        """Step-weighted average of copies (same parent) from this store, published to `into`
        (default: here). The result records the copies' parent and, in extra, the merged versions."""
        if not isinstance(versions, list | tuple) or not versions:
            raise ValueError(f"versions must be a non-empty list of versions, got {versions!r}")
        for v in versions:
            check_version(v, "versions")
        if len(set(versions)) != len(versions):
            raise ValueError(f"versions has duplicates: {list(versions)}")
        if policy_version is not None and (isinstance(policy_version, bool) or not isinstance(policy_version, int)
                                           or policy_version < 0):
            raise ValueError(f"policy_version must be an int >= 0 or None, got {policy_version!r}")
        state, meta = merge_drafts([self.load(v) for v in versions], new_version=0)
        if policy_version is not None:
            meta.policy_version = policy_version
        meta.extra["merged_from"] = self.namespace
        return (into or self).publish(state, meta)

    def remove(self, versions: list[int]) -> list[int]:
        """DraftIndex.remove over this store's directory."""
        return super().remove(versions, self.directory)

    # ----- reading ----------------------------------------------------------------------------
    def load(self, version: int, device: str | torch.device = "cpu") -> tuple[dict[str, torch.Tensor], DraftMeta]:
        """The weights and meta of `version`; CheckpointError if the file is missing, corrupt, or not
        the one the index recorded (sha256)."""
        entry = self.entry(version)
        state, meta = load_draft(self.directory / entry["path"], device, expected_sha256=entry["sha256"])
        if meta.version != version:
            raise CheckpointError(f"{entry['path']}: holds version {meta.version}, the index says {version}")
        return state, meta

    def load_head(self, version: int, dtype: torch.dtype,
                  device: torch.device | str = "cpu") -> tuple[EagleHead, DraftMeta]:
        """The head of a stored version in `dtype` on `device` (the policy's it will draft, train or be scored
        against), and its meta (checksum-checked by `load`)."""
        state, meta = self.load(version)
        return head_from_state(meta.head_config, state).to(device=device, dtype=dtype), meta

    # ----- after a crash ----------------------------------------------------------------------
    def consistency_check(self) -> dict:
        """{"bad": [{"version", "error"}], "orphans": [file names]}: index entries that are malformed
        or whose file is missing or corrupt, and draft files no index entry names."""
        bad, indexed = [], set()
        for field, raw in self.redis.hgetall(drafts_index_key(self.namespace)).items():
            version = text(field)
            try:
                entry = parse_entry(raw, f"{self.namespace}/v{version}")
                indexed.add(entry["path"])
                self.load(entry["version"])
            except (ValueError, OSError) as exc:  # CheckpointError and ProtocolError are ValueErrors
                bad.append({"version": int(version) if version.isdigit() else version, "error": str(exc)})
        orphans = sorted(p.name for p in self.directory.glob("draft-v*.safetensors") if p.name not in indexed)
        return {"bad": sorted(bad, key=lambda b: str(b["version"]).zfill(12)), "orphans": orphans}

    def recover(self, stale_temp_s: float = STALE_TEMP_S) -> dict:
        """Index the orphans that load cleanly (a publisher died between its file and its commit),
        keep the version counter ahead of every file, and delete temp files older than
        `stale_temp_s`. Bad index entries are reported, not removed. Returns what it did."""
        report = self.consistency_check()
        adopted, rejected = [], []
        for name in report["orphans"]:
            path = self.directory / name
            try:
                _, meta = load_draft(path)
                if draft_path(self.directory, meta.version).name != name:
                    raise CheckpointError(f"{name}: holds version {meta.version}, not the one in its name")
                with safe_open(str(path), framework="pt") as f:
                    sha = (f.metadata() or {})["sha256"]  # load_draft has just checked it
            except (CheckpointError, OSError, KeyError) as exc:
                rejected.append({"path": name, "error": str(exc)})
                continue
            self._raise_counter(meta.version)
            self._commit(meta.version, self._entry_for(meta, name, sha))
            adopted.append(meta.version)
        removed = []
        for tmp in self.directory.glob(".draft-v*.tmp"):
            try:
                if time.time() - tmp.stat().st_mtime > stale_temp_s:
                    tmp.unlink()
                    removed.append(tmp.name)
            except FileNotFoundError:
                continue  # its writer finished (renamed it) or another recover() took it
        return {"bad": report["bad"], "adopted": adopted, "rejected": rejected, "removed_temp": sorted(removed)}


def job_stores(redis: redis_lib.Redis, directory: str | Path, job_id: str) -> tuple[DraftStore, DraftStore]:
    """A job's two draft stores, (served, copies), in the namespaces of protocol.draft_namespaces and
    the directories `directory`/job_id/served and .../copies (so jobs sharing a root never collide).
    Served holds the versions workers swap in; copies holds each lease's trained copy and the merged
    candidates."""
    (served_ns, copies_ns), (served_dir, copies_dir) = draft_namespaces(job_id), job_draft_dirs(directory, job_id)
    return DraftStore(redis, served_dir, served_ns), DraftStore(redis, copies_dir, copies_ns)
