"""The Redis side of a draft store: the version index, the latest pointer and the announcements.

Torch-free, so the scheduler reads draft versions (and the copies' merge keys) without loading
weights; workers.store.DraftStore builds on it to write and read the weights themselves.

An index entry is a JSON object (the `ENTRY_FIELDS` below) checked field by field on read:
    {"version", "parent_version", "policy_version", "path", "sha256", "num_steps", "total_steps",
     "num_tokens", "created_at", "extra"}
A lease's copy carries extra["merge_key"] (workers.store.merge_key): copies with equal keys can be
averaged.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path, PurePath
from typing import Any, TypeVar

import redis as redis_lib

from workers.message import ProtocolError
from workers.protocol.client import text
from workers.protocol.keys import (
    check_namespace,
    draft_namespaces,
    drafts_channel,
    drafts_counter_key,
    drafts_index_key,
    drafts_latest_key,
)
from workers.protocol.messages import Announcement

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_COMMIT_RETRIES = 64  # each retry means another publisher committed in between; 64 in a row is a bug
ENTRY_FIELDS: dict[str, Any] = {
    "version": int, "parent_version": int | None, "policy_version": int, "path": str, "sha256": str,
    "num_steps": int, "total_steps": int, "num_tokens": int, "created_at": int | float, "extra": dict}


def check_version(version: Any, field: str = "version") -> int:
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"{field} must be an int >= 1, got {version!r}")
    return version


def parse_entry(raw: str | bytes, where: str) -> dict:
    """An index entry, checked field by field; ProtocolError names the bad one."""
    try:
        d = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError("entry", f"{where}: index entry is not JSON ({exc})") from None
    if not isinstance(d, dict):
        raise ProtocolError("entry", f"{where}: index entry is not a JSON object")
    for name, kind in ENTRY_FIELDS.items():
        if name not in d:
            raise ProtocolError(name, f"{where}: index entry field {name} is missing")
        if isinstance(d[name], bool) or not isinstance(d[name], kind):
            raise ProtocolError(name, f"{where}: index entry field {name} has the wrong type: {d[name]!r}")
    p = d["path"]
    if PurePath(p).name != p or p in ("", ".", ".."):
        raise ProtocolError("path", f"{where}: index entry field path must be a bare file name, got {p!r}")
    return d


def job_draft_dirs(store_dir: str | Path, job_id: str) -> tuple[Path, Path]:
    """A job's two draft directories under the store root, (served, copies): jobs sharing a root
    never collide. The namespaces beside them are protocol.draft_namespaces(job_id)."""
    draft_namespaces(job_id)  # checks the id: it becomes a directory name
    root = Path(store_dir) / job_id
    return root / "served", root / "copies"


class DraftIndex:
    """One namespace's index of draft versions in Redis (no weights: see workers.store.DraftStore)."""

    def __init__(self, redis: redis_lib.Redis, namespace: str) -> None:
        self.redis, self.namespace = redis, check_namespace(namespace)

    def remove(self, versions: list[int], directory: str | Path) -> list[int]:
        """Delete versions no one will load again (the copies of a round already decided) from this
        index and their files from `directory`: entries first, then files, so a crash in between
        leaves an orphan file that DraftStore.recover may adopt, never an entry without its file. The
        latest pointer is left alone: versions are never reused. Returns the versions removed here;
        unknown ones, and entries too unreadable to name their file, are skipped."""
        if not isinstance(versions, list | tuple):
            raise ValueError(f"versions must be a list of versions, got {versions!r}")
        for v in versions:
            check_version(v, "versions")
        index, removed = drafts_index_key(self.namespace), []
        for v in sorted(set(versions)):
            raw = self.redis.hget(index, str(v))
            if raw is None:
                continue  # never indexed here, or another remover took it
            try:
                name = parse_entry(raw, f"{self.namespace}/v{v}")["path"]
            except ProtocolError as exc:
                log.error("draft store %s: not removing v%d: %s", self.namespace, v, exc)
                continue
            if self.redis.hdel(index, str(v)):
                (Path(directory) / name).unlink(missing_ok=True)
                removed.append(v)
        return removed

    # ----- reading ----------------------------------------------------------------------------
    def entry(self, version: int) -> dict:
        version = check_version(version)
        raw = self.redis.hget(drafts_index_key(self.namespace), str(version))
        if raw is None:
            raise ValueError(f"version {version} is not in draft store {self.namespace!r}")
        return parse_entry(raw, f"{self.namespace}/v{version}")

    def versions(self) -> list[dict]:
        """Every index entry, by version; malformed entries are logged and left out."""
        entries = []
        for field, raw in self.redis.hgetall(drafts_index_key(self.namespace)).items():
            try:
                entries.append(parse_entry(raw, f"{self.namespace}/v{text(field)}"))
            except ProtocolError as exc:
                log.error("skipping draft index entry: %s", exc)
        return sorted(entries, key=lambda e: e["version"])

    def latest_version(self) -> int | None:
        value = self.redis.get(drafts_latest_key(self.namespace))
        if value is None:
            return None
        try:
            return check_version(int(value), "latest")
        except ValueError:
            raise ProtocolError("latest", f"{drafts_latest_key(self.namespace)} holds {value!r}") from None

    def subscribe(self) -> Subscription:
        """Announcements of versions that became latest, from now on."""
        return Subscription(self.redis, drafts_channel(self.namespace))

    # ----- writing the index ------------------------------------------------------------------
    def _watched(self, key: str, body: Callable[[redis_lib.client.Pipeline], T], what: str) -> T:
        """`body` on a pipeline that WATCHes `key` (it ends with MULTI ... EXEC, or returns before), run
        again each time another client changed `key` in between."""
        with self.redis.pipeline(transaction=True) as pipe:
            for _ in range(MAX_COMMIT_RETRIES):
                try:
                    pipe.watch(key)
                    return body(pipe)
                except redis_lib.WatchError:
                    continue  # another publisher moved it: read it again and compare again
        raise RuntimeError(f"store {self.namespace!r}: could not {what} in {MAX_COMMIT_RETRIES} tries")

    def _commit(self, version: int, entry: dict) -> bool:
        """Index `entry`; move latest to `version` and announce it only if that is forward.
        Returns whether latest moved. One MULTI/EXEC, retried while WATCH sees latest change."""
        def body(pipe: redis_lib.client.Pipeline) -> bool:
            current = self._latest_watched(pipe)
            is_forward = current is None or current < version
            pipe.multi()
            pipe.hset(drafts_index_key(self.namespace), str(version), json.dumps(entry))
            if is_forward:
                pipe.set(drafts_latest_key(self.namespace), version)
                pipe.publish(drafts_channel(self.namespace), Announcement(
                    version, entry["sha256"], entry["path"], time.time()).to_json())
            pipe.execute()
            return is_forward

        return self._watched(drafts_latest_key(self.namespace), body, f"commit v{version}")

    def _latest_watched(self, pipe: redis_lib.client.Pipeline) -> int | None:
        value = pipe.get(drafts_latest_key(self.namespace))  # immediate: the pipeline is in WATCH mode
        return None if value is None else int(value)

    def _raise_counter(self, version: int) -> None:
        """Counter >= version, so a later publish never reuses an existing file's version."""
        key = drafts_counter_key(self.namespace)

        def body(pipe: redis_lib.client.Pipeline) -> None:
            current = pipe.get(key)
            if current is None or int(current) < version:
                pipe.multi()
                pipe.set(key, version)
                pipe.execute()

        self._watched(key, body, f"raise the version counter to {version}")


class Subscription:
    """A pub/sub subscription to one store's announcements."""

    def __init__(self, redis: redis_lib.Redis, channel: str) -> None:
        self.channel = channel
        self.pubsub = redis.pubsub(ignore_subscribe_messages=True)
        self.pubsub.subscribe(channel)  # subscribed when this returns: later announcements arrive

    def get(self, timeout: float = 1.0) -> Announcement | None:
        """The next announcement, or None after `timeout` s. Malformed messages are logged and skipped."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            msg = self.pubsub.get_message(timeout=max(remaining, 0.0))
            if msg is not None and msg.get("type") == "message":
                try:
                    return Announcement.from_json(msg["data"])
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
