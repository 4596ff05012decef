"""How an error is told to users (JobResult.error, LeaseOutcome.error, ScoringResult.error, a step's
failures): one line, its type and its message; the traceback goes to the log, not to the record."""

from __future__ import annotations

import re

MAX_ERROR_CHARS = 500  # a line a status page shows whole


def one_line(exc: BaseException, max_chars: int = MAX_ERROR_CHARS) -> str:
    """`exc` as "Type: message", a multi-line message joined with "; " (a validation error names its
    field on its second line). A Ray task error is told by the error it wraps."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    message = redact("; ".join(line.strip() for line in str(exc).splitlines() if line.strip()))
    return (f"{type(exc).__name__}: {message}" if message else type(exc).__name__)[:max_chars]


# what Ray puts in an actor's death message that a user of the API has no business seeing: process ids, node
# addresses and ids, actor ids (the log has them all, with the traceback)
_HOST_DETAILS = [
    (re.compile(r"\s*\((?:pid=\d+|ip=[^,)]*)(?:,\s*(?:pid=\d+|ip=[^,)]*))*\)"), ""),
    (re.compile(r"\b(?:pid|ip|node_ip|node_id|worker_id|actor_id)=\S+"), ""),
    (re.compile(r"\b(?:[Aa]ctor|[Nn]ode|[Ww]orker) (?:ID|id):?\s*[0-9a-f]{16,}"), ""),
    (re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"), "<host>"),
    (re.compile(r"\x1b\[[0-9;]*m"), ""),  # ANSI colours
]


def redact(text: str) -> str:
    """`text` without Ray's host details (pids, IPs, node/actor ids) and terminal colour codes."""
    for pattern, replacement in _HOST_DETAILS:
        text = pattern.sub(replacement, text)
    return " ".join(text.split())
