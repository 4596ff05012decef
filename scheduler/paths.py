"""Which server files a REST client may name: a job's model, warm draft and dataset paths must lie under
the scheduler's configured roots (Settings.model_roots / data_roots; TLT_MODEL_ROOTS / TLT_DATA_ROOTS).

The check is made at submit, before anything is stored, and it never opens the file: a path outside
every root gets the same answer whether it exists or not, so the API cannot be used to probe the
server's file system. Symbolic links are resolved first, so a link under a root cannot point out of it.
Presets, the packaged SmolLM2 and `store:JOBID:VERSION` drafts are names, not paths, and always pass.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from drafter.model.config import cache_root
from workers.spec import JobSpec
from workers.warm import parse_store_ref

MODEL_ROOTS_ENV = "TLT_MODEL_ROOTS"  # os.pathsep-separated directories: models and warm drafts
DATA_ROOTS_ENV = "TLT_DATA_ROOTS"  # os.pathsep-separated directories: datasets


def default_roots(store_dir: str) -> tuple[str, ...]:
    """The project cache (converted models, warm drafts) and the draft store (other jobs' drafts)."""
    return str(cache_root()), store_dir


def job_roots(model_roots: tuple[str, ...] | None, data_roots: tuple[str, ...] | None,
              store_dir: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(model roots, data roots): the configured ones, default_roots where None."""
    return model_roots or default_roots(store_dir), data_roots or default_roots(store_dir)


def roots_from_env(environ: Mapping[str, str], name: str) -> tuple[str, ...] | None:
    """The roots an environment variable lists (os.pathsep-separated), None when it is unset or empty.
    ValueError naming the variable for a relative entry: a root must not depend on the server's cwd."""
    raw = environ.get(name, "")
    roots = tuple(p for p in raw.split(os.pathsep) if p.strip())
    relative = [p for p in roots if not Path(p).expanduser().is_absolute()]
    if relative:
        raise ValueError(f"{name}: roots must be absolute paths, got {relative[0]!r}")
    return roots or None


def is_under(path: str, roots: Iterable[str]) -> bool:
    """Whether `path`, symbolic links resolved, lies under one of `roots` (also resolved)."""
    try:
        real = Path(os.path.realpath(Path(path).expanduser()))
    except (OSError, ValueError):  # a NUL byte, a loop of links
        return False
    for root in roots:
        base = Path(os.path.realpath(Path(root).expanduser()))
        if real == base or base in real.parents:
            return True
    return False


def spec_path_errors(spec: JobSpec, model_roots: Iterable[str], data_roots: Iterable[str]) -> list[tuple[str, str]]:
    """(field, message) for each path in `spec` outside its roots; [] when every path is allowed."""
    model_roots, data_roots = tuple(model_roots), tuple(data_roots)
    named = []
    if spec.model_is_path:
        named.append(("model", spec.model, model_roots, MODEL_ROOTS_ENV))
    if spec.warm_draft is not None and parse_store_ref(spec.warm_draft) is None:
        named.append(("warm_draft", spec.warm_draft, model_roots, MODEL_ROOTS_ENV))
    if spec.dataset_path is not None:
        named.append(("dataset_path", spec.dataset_path, data_roots, DATA_ROOTS_ENV))
    return [(field, f"{field} must be a path under the server's {env.removeprefix('TLT_').lower()} "
             f"(set {env} on the scheduler to allow more)")
            for field, path, roots, env in named if not is_under(path, roots)]
