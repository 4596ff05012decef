"""What the target node already has (`make bundle HAVE=FILE`, FILE a `pip freeze` of the node), and which of
its distributions the bundle can leave out.

deploy/bundle.py resolves the project for the target once as is, then again with the node's pins as pip
constraints, each pin whose version meets every requirement on that name in the first resolution, so that
pip keeps the node's versions where the project's tree allows them. A distribution the second resolution
picks at the node's version (`name==version` in the freeze, local labels such as +cu130 aside) is left out;
any other is bundled, the node's version being too old or too new for the tree.
"""

from __future__ import annotations

from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version


def read_freeze(path: Path) -> tuple[dict[str, str], list[str]]:
    """({canonical name: version} of the freeze's `name==version` lines, [lines not counted and why]).
    Comments, blank lines and pip options are skipped; a line that is no requirement is a ValueError."""
    if not path.is_file():
        raise ValueError(f"HAVE: no file {path} (a `pip freeze` of the target node, one name==version a line)")
    pins, skipped = {}, []
    for num, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith(("#", "-")):
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement as exc:
            raise ValueError(f"{path}:{num}: {raw!r} is not a `pip freeze` line (name==version): {exc}") from None
        specs = list(req.specifier)
        if req.url or len(specs) != 1 or specs[0].operator not in ("==", "==="):
            skipped.append(f"{path.name}:{num}: {line} (no pinned version: not counted as present)")
            continue
        try:
            Version(specs[0].version)
        except InvalidVersion:
            skipped.append(f"{path.name}:{num}: {line} (not a PEP 440 version: not counted as present)")
            continue
        pins[canonicalize_name(req.name)] = specs[0].version
    return pins, skipped


def demands(items: list[dict], envs: list[dict[str, str]]) -> dict[str, list[str]]:
    """{canonical name: [specifier, ...]}: every requirement of the resolved tree (pip's report items, the
    project's own included) that holds on the target (its marker true in one of `envs`)."""
    out: dict[str, list[str]] = {}
    for item in items:
        contexts = [{**env, "extra": extra} for env in envs for extra in ["", *(item.get("requested_extras") or [])]]
        for line in item["metadata"].get("requires_dist", []):
            req = Requirement(line)
            if req.marker is None or any(map(req.marker.evaluate, contexts)):
                out.setdefault(canonicalize_name(req.name), []).append(str(req.specifier))
    return out


def meets(version: str, specifiers: list[str]) -> bool:
    """Whether `version` (a local label such as +cu130 included) meets every one of `specifiers`."""
    return all(SpecifierSet(s).contains(Version(version), prereleases=True) for s in specifiers)


def constraints(have: dict[str, str], wanted: dict[str, list[str]]) -> list[str]:
    """pip constraints pinning the node's version of each name whose version meets what the tree wants (its
    public part: an index has torch 2.11.0, not the node's 2.11.0+cu130)."""
    return sorted(f"{name}=={Version(v).public}" for name, v in have.items() if meets(v, wanted.get(name, [])))


def provided(pins: list[dict], have: dict[str, str]) -> list[dict]:
    """The resolved pins that the node has at the same version (a local label aside)."""
    return [p for p in pins if p["name"] in have and meets(have[p["name"]], [f"=={p['version']}"])]
