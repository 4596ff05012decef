"""Draft weight store: versioned drafter checkpoints in a directory, their index in Redis.

publish() writes the file first (atomically, with its sha256), then one MULTI/EXEC records it in
the index, moves the latest pointer forward (never back: WATCH and retry) and announces it on the
namespace's pub/sub channel. If the file write fails, Redis is untouched.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import redis as redis_lib

from drafter.checkpoint import CheckpointError, DraftMeta, draft_path, load_draft, merge_drafts, save_draft
from workers.protocol import drafts_channel, drafts_counter_key, drafts_index_key, drafts_latest_key

log = logging.getLogger(__name__)


class DraftStore:
    def __init__(self, redis, directory: str | Path, namespace: str = "default") -> None:
        self.redis, self.directory, self.namespace = redis, Path(directory), namespace
        self.directory.mkdir(parents=True, exist_ok=True)

    def publish(self, state: dict, meta: DraftMeta) -> int:
        version = int(self.redis.incr(drafts_counter_key(self.namespace)))
        meta.version = version
        path = draft_path(self.directory, version)
        sha = save_draft(path, state, meta)
        entry = {"version": version, "parent_version": meta.parent_version, "policy_version": meta.policy_version,
                 "path": path.name, "sha256": sha, "num_steps": meta.num_steps, "total_steps": meta.total_steps,
                 "num_tokens": meta.num_tokens, "created_at": meta.created_at, "extra": meta.extra}
        self._record(version, entry)
        return version

    def _record(self, version: int, entry: dict) -> None:
        latest_key = drafts_latest_key(self.namespace)
        message = json.dumps({"version": version, "sha256": entry["sha256"], "path": entry["path"],
                              "published_at": time.time()})
        with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(latest_key)
                    current = pipe.get(latest_key)
                    pipe.multi()
                    pipe.hset(drafts_index_key(self.namespace), str(version), json.dumps(entry))
                    if current is None or int(current) < version:
                        pipe.set(latest_key, version)
                    pipe.publish(drafts_channel(self.namespace), message)
                    pipe.execute()
                    return
                except redis_lib.WatchError:
                    continue  # another publisher moved latest: re-read and compare again

    def entry(self, version: int) -> dict:
        raw = self.redis.hget(drafts_index_key(self.namespace), str(version))
        if raw is None:
            raise ValueError(f"draft version {version} is not in store {self.namespace!r}")
        return json.loads(raw)

    def load(self, version: int, device: str = "cpu") -> tuple[dict, DraftMeta]:
        entry = self.entry(version)
        return load_draft(self.directory / entry["path"], device, expected_sha256=entry["sha256"])

    def latest_version(self) -> int | None:
        value = self.redis.get(drafts_latest_key(self.namespace))
        return None if value is None else int(value)

    def versions(self) -> list[dict]:
        entries = [json.loads(v) for v in self.redis.hgetall(drafts_index_key(self.namespace)).values()]
        return sorted(entries, key=lambda e: e["version"])

    def merge_and_publish(self, versions: list[int], into: DraftStore | None = None) -> int:
        """Step-weighted average of copies from this store, published to `into` (default: here)."""
        copies = [self.load(v) for v in versions]
        state, meta = merge_drafts(copies, new_version=0)
        return (into or self).publish(state, meta)

    def consistency_check(self) -> dict:
        """After a crash: index entries whose file is missing or corrupt, and files nobody indexed."""
        bad, indexed = [], set()
        for entry in self.versions():
            indexed.add(entry["path"])
            try:
                self.load(entry["version"])
            except (CheckpointError, OSError) as exc:
                bad.append({"version": entry["version"], "error": str(exc)})
        orphans = sorted(p.name for p in self.directory.glob("draft-v*.safetensors") if p.name not in indexed)
        return {"bad": bad, "orphans": orphans}

    def subscribe(self) -> Subscription:
        return Subscription(self.redis, drafts_channel(self.namespace))


class Subscription:
    def __init__(self, redis, channel: str) -> None:
        self.pubsub = redis.pubsub(ignore_subscribe_messages=True)
        self.pubsub.subscribe(channel)

    def get(self, timeout: float = 1.0) -> dict | None:
        msg = self.pubsub.get_message(timeout=timeout)
        if msg is None:
            return None
        try:
            data = json.loads(msg["data"])
            int(data["version"])
            return data
        except (ValueError, KeyError, TypeError) as exc:
            log.error("ignoring malformed draft announcement %r: %s", msg.get("data"), exc)
            return None

    def close(self) -> None:
        self.pubsub.close()
