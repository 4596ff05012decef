"""Validated JSON dataclass messages: the base every message type of workers/protocol.py derives from.

A message checks each field against its annotation on construction (int, float, bool, str, dict,
list, a StrEnum, or X | None; numbers finite, and >= 0 unless named in SIGNED), so a bad message is
never written; reading names the unknown, missing or bad field.
"""

from __future__ import annotations

import functools
import json
import math
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, fields
from enum import Enum
from typing import Any, ClassVar, Self

import orjson  # reads: several times json's speed on the watcher's 2,048 records a tick


class ProtocolError(ValueError):
    """A message or key part that does not follow the protocol; `field` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message

    def __reduce__(self) -> tuple:  # picklable with both arguments: it crosses Ray as a command's error
        return type(self), (self.field, self.message)


def _base(kind: Any) -> tuple[Any, bool]:
    """(the plain type of annotation `kind`, whether None is allowed)."""
    is_optional = isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union
    if is_optional:
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    return typing.get_origin(kind) or kind, is_optional


def _check(name: str, value: Any, kind: Any, signed: bool, is_optional: bool | None = None) -> Any:
    """`value` as field `name` of type `kind` (int, float, bool, str, dict, list, a StrEnum, or X | None;
    with `is_optional` given, `kind` is the plain type already); numbers must be finite, and >= 0
    unless `signed`."""
    if is_optional is None:
        kind, is_optional = _base(kind)
    if is_optional and value is None:
        return None
    if type(value) is kind:  # the common case, first (an int for a float field takes the long way)
        if (kind is float and not math.isfinite(value)) or (kind in (int, float) and value < 0 and not signed):
            raise ProtocolError(name, f"must be a finite number{'' if signed else ' >= 0'}, got {value!r}")
        return value
    if isinstance(kind, type) and issubclass(kind, Enum):
        try:
            return kind(value)
        except ValueError:
            raise ProtocolError(name, f"must be one of {[m.value for m in kind]}, got {value!r}") from None
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind in (int, float):
        ok = not isinstance(value, bool) and isinstance(value, int if kind is int else int | float)
        if ok and (not math.isfinite(value) or (value < 0 and not signed)):
            raise ProtocolError(name, f"must be a finite number{'' if signed else ' >= 0'}, got {value!r}")
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ProtocolError(name, f"must be {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


@dataclass(frozen=True)
class _Plan:
    checks: tuple  # (name, plain type, signed, optional) per field, in order
    names: frozenset
    required: tuple
    required_set: frozenset
    validate: Callable[[Any], None]  # checks (and converts) every field of a message in place


def _fast_test(i: int, kind: Any, signed: bool) -> str | None:
    """Source of a test that value `v` passes field i's check as it stands (no conversion), or None."""
    if kind is int:
        return "type(v) is int" + ("" if signed else " and v >= 0")
    if kind is float:
        return "type(v) is float and " + ("-inf < v < inf" if signed else "0.0 <= v < inf")
    if kind in (str, bool, dict, list):
        return f"type(v) is K{i}"
    return None


def _validator(checks: tuple) -> Callable[[Any], None]:
    """One function checking every field: the common case (the value already of its exact type, in range) is
    one inline test per field, the rest goes through _check; an enum field's text becomes its member by one
    dict lookup. Built from source once per message class, as dataclasses builds __init__: a generic loop over
    the fields was most of the cost of reading 2,048 progress records in a watcher tick."""
    lines, env = ["def validate(m):", "    d = m.__dict__"], {"_check": _check, "inf": math.inf}
    for i, (name, kind, signed, is_optional) in enumerate(checks):
        env[f"K{i}"], env[f"N{i}"], env[f"S{i}"], env[f"O{i}"] = kind, name, signed, is_optional
        slow = f"d[N{i}] = _check(N{i}, v, K{i}, S{i}, O{i})"
        lines.append(f"    v = d[N{i}]")
        if isinstance(kind, type) and issubclass(kind, Enum):
            env[f"E{i}"] = {member.value: member for member in kind}
            lines.append(f"    if type(v) is not K{i}:")
            lines.append(f"        e = E{i}.get(v) if type(v) is str else None")
            lines.append(f"        if e is not None: d[N{i}] = e")
            lines.append(f"        else: {slow}")
            continue
        test = _fast_test(i, kind, signed)
        if test is None:
            lines.append(f"    {slow}")
        else:
            lines.append(f"    if not ({test}){' and v is not None' if is_optional else ''}: {slow}")
    namespace: dict[str, Any] = {}
    exec(compile("\n".join(lines), "<message validator>", "exec"), env, namespace)  # noqa: S102 (our own source)
    return namespace["validate"]


@functools.cache
def _plan(cls: type) -> _Plan:
    """A message class's fields and resolved annotations, worked out once: typing.get_type_hints per
    message was most of the cost of reading 2,048 progress records in a watcher tick."""
    hints = typing.get_type_hints(cls)
    fs = fields(cls)
    bases = {f.name: _base(hints[f.name]) for f in fs}
    checks = tuple((f.name, bases[f.name][0], f.name in cls.SIGNED, bases[f.name][1]) for f in fs)
    required = tuple(f.name for f in fs if f.default is MISSING and f.default_factory is MISSING)
    return _Plan(checks, frozenset(f.name for f in fs), required, frozenset(required), _validator(checks))


class Message:
    """Base of the dataclass messages: validated on construction (a bad message is never written),
    JSON on the wire, unknown or missing fields named on read."""

    SIGNED: ClassVar[frozenset[str]] = frozenset()  # number fields that may be negative

    def __post_init__(self) -> None:
        _plan(type(self)).validate(self)  # an enum member replaces its text

    def to_dict(self) -> dict:
        return asdict(self)  # type: ignore[call-overload]

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), allow_nan=False)

    @classmethod
    def from_dict(cls, d: Any) -> Self:
        if not isinstance(d, dict):
            raise ProtocolError(cls.__name__, f"must be a JSON object, got {type(d).__name__}")
        plan = _plan(cls)
        if not plan.names.issuperset(d):
            unknown = sorted(d.keys() - plan.names)
            raise ProtocolError(unknown[0], f"unknown field (all unknown: {unknown})")
        if not plan.required_set <= d.keys():
            raise ProtocolError(next(n for n in plan.required if n not in d), "missing")
        return cls(**d)

    @classmethod
    def from_json(cls, raw: str | bytes) -> Self:
        try:
            d = orjson.loads(raw)
        except orjson.JSONDecodeError:  # json reads NaN and Infinity, so the check below names the field
            try:
                d = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ProtocolError(cls.__name__, f"not JSON: {exc}") from None
        return cls.from_dict(d)
