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
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import redis as redis_lib
import torch
from safetensors import safe_open

from drafter.checkpoint import CheckpointError, DraftMeta, draft_path, load_draft, merge_drafts, save_draft
from workers.protocol import (
    ProtocolError,
    announcement,
    check_namespace,
    drafts_channel,
    drafts_counter_key,
    drafts_index_key,
    drafts_latest_key,
    parse_announcement,
    text,
)

log = logging.getLogger(__name__)

MAX_COMMIT_RETRIES = 64  # each retry means another publisher committed in between; 64 in a row is a bug
STALE_TEMP_S = 3600.0  # a temp file untouched this long belongs to a crashed writer (writes take seconds)
_ENTRY_TYPES: dict[str, Any] = {
    "version": int, "parent_version": int | None, "policy_version": int, "path": str, "sha256": str,
    "num_steps": int, "total_steps": int, "num_tokens": int, "created_at": int | float, "extra": dict}


def _check_version(version: Any, field: str = "version") -> int:
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"{field} must be an int >= 1, got {version!r}")
    return version


def parse_entry(raw: str | bytes, where: str) -> dict:
    """An index entry, checked field by field; CheckpointError names the bad one."""
    try:
        d = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{where}: index entry is not JSON ({exc})") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{where}: index entry is not a JSON object")
    for name, kind in _ENTRY_TYPES.items():
        if name not in d:
            raise CheckpointError(f"{where}: index entry field {name} is missing")
        if isinstance(d[name], bool) or not isinstance(d[name], kind):
            raise CheckpointError(f"{where}: index entry field {name} has the wrong type: {d[name]!r}")
    p = d["path"]
    if Path(p).name != p or p in ("", ".", ".."):
        raise CheckpointError(f"{where}: index entry field path must be a bare file name, got {p!r}")
    return d


class DraftStore:
    def __init__(self, redis: redis_lib.Redis, directory: str | Path, namespace: str = "default") -> None:
        self.redis, self.directory, self.namespace = redis, Path(directory), check_namespace(namespace)
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

    def _commit(self, version: int, entry: dict) -> bool:
        """Index `entry`; move latest to `version` and announce it only if that is forward.
        Returns whether latest moved. One MULTI/EXEC, retried while WATCH sees latest change."""
        latest_key = drafts_latest_key(self.namespace)
        with self.redis.pipeline(transaction=True) as pipe:
            for _ in range(MAX_COMMIT_RETRIES):
                try:
                    pipe.watch(latest_key)
                    current = self._latest_watched(pipe)
                    is_forward = current is None or current < version
                    pipe.multi()
                    pipe.hset(drafts_index_key(self.namespace), str(version), json.dumps(entry))
                    if is_forward:
                        pipe.set(latest_key, version)
                        pipe.publish(drafts_channel(self.namespace),
                                     announcement(version, entry["sha256"], entry["path"], time.time()))
                    pipe.execute()
                    return is_forward
                except redis_lib.WatchError:
                    continue  # another publisher moved latest: read it again and compare again
        raise RuntimeError(f"store {self.namespace!r}: could not commit v{version} in {MAX_COMMIT_RETRIES} tries")

    def _latest_watched(self, pipe: redis_lib.client.Pipeline) -> int | None:
        value = pipe.get(drafts_latest_key(self.namespace))  # immediate: the pipeline is in WATCH mode
        return None if value is None else int(value)

    def merge_and_publish(self, versions: list[int], policy_version: int | None = None,
                          into: DraftStore | None = None) -> int:
        """Step-weighted average of copies (same parent) from this store, published to `into`
        (default: here). The result records the copies' parent and, in extra, the merged versions."""
        if not isinstance(versions, list | tuple) or not versions:
            raise ValueError(f"versions must be a non-empty list of versions, got {versions!r}")
        for v in versions:
            _check_version(v, "versions")
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
        """Delete versions no one will load again (the copies of a round already decided): index
        entries first, then files, so a crash in between leaves an orphan file that recover() may
        adopt, never an index entry without its file. The latest pointer is left alone: versions are
        never reused. Returns the versions that were indexed here; unknown ones are skipped."""
        if not isinstance(versions, list | tuple):
            raise ValueError(f"versions must be a list of versions, got {versions!r}")
        for v in versions:
            _check_version(v, "versions")
        index = drafts_index_key(self.namespace)
        removed = []
        for v in sorted(set(versions)):
            raw = self.redis.hget(index, str(v))
            if raw is None or not self.redis.hdel(index, str(v)):
                continue  # never indexed here, or another remover took it
            removed.append(v)
            try:
                name = parse_entry(raw, f"{self.namespace}/v{v}")["path"]
            except CheckpointError:
                name = draft_path(self.directory, v).name
            (self.directory / name).unlink(missing_ok=True)
        return removed

    # ----- reading ----------------------------------------------------------------------------
    def entry(self, version: int) -> dict:
        version = _check_version(version)
        raw = self.redis.hget(drafts_index_key(self.namespace), str(version))
        if raw is None:
            raise ValueError(f"version {version} is not in draft store {self.namespace!r}")
        return parse_entry(raw, f"{self.namespace}/v{version}")

    def load(self, version: int, device: str | torch.device = "cpu") -> tuple[dict[str, torch.Tensor], DraftMeta]:
        """The weights and meta of `version`; CheckpointError if the file is missing, corrupt, or not
        the one the index recorded (sha256)."""
        entry = self.entry(version)
        state, meta = load_draft(self.directory / entry["path"], device, expected_sha256=entry["sha256"])
        if meta.version != version:
            raise CheckpointError(f"{entry['path']}: holds version {meta.version}, the index says {version}")
        return state, meta

    def latest_version(self) -> int | None:
        value = self.redis.get(drafts_latest_key(self.namespace))
        if value is None:
            return None
        try:
            return _check_version(int(value), "latest")
        except ValueError:
            raise ProtocolError("latest", f"{drafts_latest_key(self.namespace)} holds {value!r}") from None

    def versions(self) -> list[dict]:
        """Every index entry, by version; malformed entries are logged and left out."""
        entries = []
        for field, raw in self.redis.hgetall(drafts_index_key(self.namespace)).items():
            try:
                entries.append(parse_entry(raw, f"{self.namespace}/v{text(field)}"))
            except CheckpointError as exc:
                log.error("skipping draft index entry: %s", exc)
        return sorted(entries, key=lambda e: e["version"])

    def subscribe(self) -> Subscription:
        """Announcements of versions that became latest, from now on."""
        return Subscription(self.redis, drafts_channel(self.namespace))

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
            except (CheckpointError, ValueError, OSError) as exc:
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

    def _raise_counter(self, version: int) -> None:
        """Counter >= version, so a later publish never reuses an existing file's version."""
        key = drafts_counter_key(self.namespace)
        with self.redis.pipeline(transaction=True) as pipe:
            for _ in range(MAX_COMMIT_RETRIES):
                try:
                    pipe.watch(key)
                    current = pipe.get(key)
                    if current is not None and int(current) >= version:
                        return
                    pipe.multi()
                    pipe.set(key, version)
                    pipe.execute()
                    return
                except redis_lib.WatchError:
                    continue
        raise RuntimeError(f"store {self.namespace!r}: could not raise the version counter to {version}")


def job_stores(redis: redis_lib.Redis, directory: str | Path, namespace: str) -> tuple[DraftStore, DraftStore]:
    """A job's two draft stores under `directory`: (served, copies). Served holds the published
    versions workers swap in; copies holds each lease's trained copy and the merged candidates."""
    return (DraftStore(redis, Path(directory) / "served", namespace),
            DraftStore(redis, Path(directory) / "copies", f"{namespace}:copies"))


class Subscription:
    """A pub/sub subscription to one store's announcements; `get` returns the parsed JSON."""

    def __init__(self, redis: redis_lib.Redis, channel: str) -> None:
        self.channel = channel
        self.pubsub = redis.pubsub(ignore_subscribe_messages=True)
        self.pubsub.subscribe(channel)  # subscribed when this returns: later announcements arrive

    def get(self, timeout: float = 1.0) -> dict | None:
        """The next announcement {version, sha256, path, published_at}, or None after `timeout` s.
        Malformed messages are logged and skipped."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            msg = self.pubsub.get_message(timeout=max(remaining, 0.0))
            if msg is not None and msg.get("type") == "message":
                try:
                    return parse_announcement(msg["data"])
                except ProtocolError as exc:
                    log.error("ignoring malformed announcement on %s: %s", self.channel, exc)
            if remaining <= 0:
                return None

    def close(self) -> None:
        self.pubsub.close()

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
