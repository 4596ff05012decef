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
    lines = without_frames(str(exc).splitlines())
    message = redact("; ".join(line.strip() for line in lines if line.strip()))
    return (f"{type(exc).__name__}: {message}" if message else type(exc).__name__)[:max_chars]


_FRAME = re.compile(r'File ".*", line \d+')


def without_frames(lines: list[str]) -> list[str]:
    """A message's lines without the traceback it may embed (Ray puts an actor's creation-task traceback in
    the error that tells its death): each `File "...", line N` line and the source and ^^^ lines indented under
    it, and "Traceback (most recent call last):". What it says first and the error it ends with are kept."""
    out, frame_indent = [], None
    for line in lines:
        indent = len(line) - len(line.lstrip())
        if _FRAME.match(line.strip()):
            frame_indent = indent
        elif frame_indent is not None and indent > frame_indent:
            continue  # the frame's source line, its markers
        elif line.strip() != "Traceback (most recent call last):":
            frame_indent = None
            out.append(line)
    return out


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


class WorkerError(RuntimeError):
    """A job ended by its rollout workers (every one failed); `workers`: their ids, where in the job it was."""

    def __init__(self, message: str, workers: list[str] = ()) -> None:
        super().__init__(message)
        self.workers = list(workers)

    def __reduce__(self):  # crosses Ray as a pickled cause: with its workers
        return type(self), (str(self), self.workers)


def where_in_job(rl_step: int | None, phase: str | None = None, workers: list[str] = ()) -> str:
    """"start", "step 3 (rollout)", "step 3 (sync), workers w0, w1": where a job was when it failed."""
    if rl_step is None:
        return "start"
    where = f"step {rl_step}" + (f" ({phase.lower()})" if phase else "")
    if workers:
        where += f", worker{'s' if len(workers) > 1 else ''} {', '.join(workers)}"
    return where


def job_error(exc: BaseException, where: str, max_chars: int = MAX_ERROR_CHARS) -> str:
    """A failed job's `error`: what failed and where in the job, in one line ("at step 2 (update): Type: ...")."""
    return f"at {where}: {one_line(exc, max_chars)}"[:max_chars]
