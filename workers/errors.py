"""How an error is told to users (JobResult.error, LeaseOutcome.error, ScoringResult.error, a step's
failures): one line, its type and its message; the traceback goes to the log, not to the record."""

from __future__ import annotations

MAX_ERROR_CHARS = 500  # a line a status page shows whole


def one_line(exc: BaseException, max_chars: int = MAX_ERROR_CHARS) -> str:
    """`exc` as "Type: message", a multi-line message joined with "; " (a validation error names its
    field on its second line). A Ray task error is told by the error it wraps."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    message = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return (f"{type(exc).__name__}: {message}" if message else type(exc).__name__)[:max_chars]
