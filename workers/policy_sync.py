"""Weight sync, learner to rollout workers: how a new policy version reaches each worker's device.

Same node as the driver (every worker of a one-node job): the driver writes the version ONCE as a safetensors
file, in /dev/shm where it has room (tmpfs: memory, never the disk) else in the job's policy directory, and
sends each worker the file's path and size (a small JSON-able dict). The worker maps the file (safetensors: no
pickle, no code) and copies the weights into its policy on its own device: from the learner's GPU to the page
cache to each worker's GPU, one host copy in all however many workers share the node. The driver removes the
file once every worker has loaded it.
Another node: the arrays go through Ray's object store (workers.step_data.shareable_state: numpy arrays, which
Ray ships out of band and each worker maps without unpickling a tensor), put only when such a worker exists.

CUDA IPC (torch.multiprocessing's reductions) would save the host copy, but its handles are pickles, it needs
the learner's GPU visible in each worker (Ray hides it: each sees its own) and it pins the learner's memory
until every worker lets go; a policy's sync is milliseconds next to its rollout (docs/architecture.md).
Writing and reading need only torch and safetensors (the CUDA test set runs them on a bare GPU node).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

log = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm")  # tmpfs on Linux; containers often give it 64 MiB, too little for a policy
SHM_HEADROOM = 2  # /dev/shm is used when it has this many times the file's size free: others share it
ALIASES_KEY = "tlt_aliases"  # metadata: {name: the name its tensor was written under} for tied weights
SYNC_KEY = "policy_sync_file"  # a sync message's path: {SYNC_KEY: path, "num_bytes": size}


def sync_file_name(job_id: str, policy_version: int) -> str:
    return f"tlt-{job_id}-policy-v{policy_version:06d}.safetensors"


def sync_directory(store_dir: str | Path, job_id: str, num_bytes: int) -> Path:
    """/dev/shm when it exists and has room for `num_bytes` (SHM_HEADROOM times), else the job's policy
    directory (policy_checkpoint.policy_dir: on local disk, read back from the page cache)."""
    from workers.policy_checkpoint import policy_dir  # its ids' checks need the protocol's packages

    if SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK) and shutil.disk_usage(SHM_DIR).free >= SHM_HEADROOM * num_bytes:
        return SHM_DIR
    return policy_dir(store_dir, job_id)


def write_policy_file(state: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    """Write `state` (on any device) to `path` as safetensors, tied weights once (their other names in the
    metadata), atomically (a temp file renamed). Returns the message a worker loads it with:
    {SYNC_KEY: path, "num_bytes": its size}."""
    tensors, aliases, seen = {}, {}, {}
    for name, t in state.items():
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t.detach().to("cpu").contiguous()  # (the one device-to-host copy of the sync)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata={ALIASES_KEY: json.dumps(aliases)})
    os.replace(tmp, path)
    return {SYNC_KEY: str(path), "num_bytes": path.stat().st_size}


def is_sync_message(source: dict) -> bool:
    """Whether a worker's load_policy got a sync file's message (not a state: no parameter has this name)."""
    return SYNC_KEY in source


def read_policy_file(message: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The state a write_policy_file message names, as CPU tensors mapped from the file (the caller copies them
    onto its device: load_state_dict). ValueError naming the file if it is not there, or not whole."""
    path = Path(message[SYNC_KEY])
    try:
        if path.stat().st_size != int(message["num_bytes"]):
            raise ValueError(f"policy sync file {path}: {path.stat().st_size} bytes, {message['num_bytes']} written")
        with safe_open(str(path), framework="pt", device="cpu") as f:
            aliases = json.loads((f.metadata() or {}).get(ALIASES_KEY, "{}"))
            state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    except OSError as exc:
        raise ValueError(f"policy sync file {path}: {exc.strerror or exc}") from None
    for name, source in aliases.items():
        state[name] = state[source]
    return state


class PolicyFiles:
    """A driver's sync files: one per version pushed, removed once its workers have loaded it (`done`), and
    any left behind by a driver of this job that died (`clear`)."""

    def __init__(self, store_dir: str | Path, job_id: str) -> None:
        self.store_dir, self.job_id = store_dir, job_id
        self.current: Path | None = None

    def write(self, state: dict[str, torch.Tensor], policy_version: int) -> dict[str, Any]:
        num_bytes = sum(t.numel() * t.element_size() for t in state.values())
        path = sync_directory(self.store_dir, self.job_id, num_bytes) / sync_file_name(self.job_id, policy_version)
        self.done()
        self.current = path
        return write_policy_file(state, path)

    def done(self) -> None:
        """Remove the file of the version pushed last (its workers have loaded it)."""
        if self.current is not None:
            self.current.unlink(missing_ok=True)
            self.current = None

    def clear(self) -> None:
        """Remove every sync file of this job, in either directory."""
        from workers.policy_checkpoint import policy_dir

        for directory in (SHM_DIR, policy_dir(self.store_dir, self.job_id)):
            for stale in directory.glob(f"tlt-{self.job_id}-policy-v*.safetensors") if directory.is_dir() else ():
                stale.unlink(missing_ok=True)
        self.current = None
