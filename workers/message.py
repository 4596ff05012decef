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
from dataclasses import MISSING, asdict, dataclass, fields
from enum import Enum
from typing import Any, ClassVar, Self


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


@functools.cache
def _plan(cls: type) -> _Plan:
    """A message class's fields and resolved annotations, worked out once: typing.get_type_hints per
    message was most of the cost of reading 2,048 progress records in a watcher tick."""
    hints = typing.get_type_hints(cls)
    fs = fields(cls)
    bases = {f.name: _base(hints[f.name]) for f in fs}
    return _Plan(tuple((f.name, bases[f.name][0], f.name in cls.SIGNED, bases[f.name][1]) for f in fs),
                 frozenset(f.name for f in fs),
                 tuple(f.name for f in fs if f.default is MISSING and f.default_factory is MISSING))


class Message:
    """Base of the dataclass messages: validated on construction (a bad message is never written),
    JSON on the wire, unknown or missing fields named on read."""

    SIGNED: ClassVar[frozenset[str]] = frozenset()  # number fields that may be negative

    def __post_init__(self) -> None:
        for name, kind, signed, is_optional in _plan(type(self)).checks:
            value = getattr(self, name)
            checked = _check(name, value, kind, signed, is_optional)
            if checked is not value:  # an enum member for its string
                setattr(self, name, checked)

    def to_dict(self) -> dict:
        return asdict(self)  # type: ignore[call-overload]

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), allow_nan=False)

    @classmethod
    def from_dict(cls, d: Any) -> Self:
        if not isinstance(d, dict):
            raise ProtocolError(cls.__name__, f"must be a JSON object, got {type(d).__name__}")
        plan = _plan(cls)
        unknown = d.keys() - plan.names
        if unknown:
            unknown = sorted(unknown)
            raise ProtocolError(unknown[0], f"unknown field (all unknown: {unknown})")
        missing = next((n for n in plan.required if n not in d), None)
        if missing is not None:
            raise ProtocolError(missing, "missing")
        return cls(**d)

    @classmethod
    def from_json(cls, raw: str | bytes) -> Self:
        try:
            d = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ProtocolError(cls.__name__, f"not JSON: {exc}") from None
        return cls.from_dict(d)
