"""What the API answers to bad requests: a 4xx naming the field, never a 5xx, never the input echoed back.

- Validation errors (422) list {loc, msg, type} per problem. FastAPI's own handler also echoes each
  offending `input` (and `ctx`): a 50 MB body came back whole, and an input JSON cannot encode (NaN,
  Infinity, a lone surrogate) turned the 422 into a 500. Messages are cut to MAX_MESSAGE_CHARS and
  made encodable.
- Redis unreachable (a connection or timeout error): 503 with Retry-After, never a 500 with a traceback.
- At most MAX_ERRORS_REPORTED problems are listed, and one entry counts the rest: a 422 stays a few KB.
- A request with both Content-Length and Transfer-Encoding gets a 400 and its connection closed (RFC 9112
  6.1), so a request smuggled after it on the connection is never read.
- Bodies over MAX_BODY_BYTES are refused with 413 before they are parsed (Content-Length, or counted
  as they arrive when it is absent); bodies that are not UTF-8 (UTF-16, UTF-32, Latin-1) with 422 json_invalid,
  as malformed JSON is (RFC 8259 8.1: JSON between systems is UTF-8).
  The app sees a body only once it is whole and passed both checks.
"""

from __future__ import annotations

import json
import logging

import redis as redis_lib
from fastapi import FastAPI, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

# a JobSpec is about 1 KB (three paths of at most 4 KB each at worst); datasets are named by path, never sent inline
MAX_BODY_BYTES = 64 << 10
MAX_MESSAGE_CHARS = 300
# problems listed in one 422 (a body of 60k unknown keys got a 5.4 MB answer); the rest are counted in one more entry
MAX_ERRORS_REPORTED = 20
RETRY_AFTER_S = 5  # what a 503 asks a client to wait while Redis is unreachable
log = logging.getLogger(__name__)


class ErrorOut(BaseModel):
    """Every error but a 422: one line."""

    detail: str


def _documented(description: str) -> dict:
    return {"model": ErrorOut, "description": description}


# the error answers of the /v1/jobs routes, as the OpenAPI schema documents them (422s are FastAPI's own)
JOB_ROUTE_ERRORS = {
    400: _documented("a body that cannot be read (malformed framing, nesting too deep, a bad Content-Length)"),
    401: _documented("a token is configured and the request has none, or a wrong one"),
    404: _documented("no such job"),
    408: _documented("a body not complete 10 s after its headers (`tlt serve`: scheduler.serve.BODY_TIMEOUT_S); "
                     "the connection is closed"),
    409: _documented("the job already ended (cancel)"),
    413: _documented(f"a body over {MAX_BODY_BYTES} bytes"),
    503: _documented("the scheduler's Redis is unreachable; retry after Retry-After seconds"),
}
OPS_ROUTE_ERRORS = {503: _documented("not ready (readyz: what is missing) or Redis unreachable")}


def safe_text(value: object, max_chars: int = MAX_MESSAGE_CHARS) -> str:
    """`value` as text that JSON can always encode (lone surrogates and NULs escaped), at most max_chars."""
    s = str(value)
    s = s.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")
    return s if len(s) <= max_chars else s[: max_chars - 3] + "..."


def _unknown_field(error: dict) -> dict:
    """An unknown field's error located at its parent: its name is the client's, and is not echoed."""
    return {"loc": list(error.get("loc", ()))[:-1], "type": "extra_forbidden",
            "msg": "an unknown field (its name is not echoed; docs/api.md lists the fields)"}


def validation_detail(errors) -> list[dict]:
    """Pydantic/FastAPI errors without their inputs: [{"loc": [...], "msg": ..., "type": ...}], the first
    MAX_ERRORS_REPORTED of them and one entry counting the rest (a 422 stays a few KB whatever the body)."""
    errors = [_unknown_field(e) if e.get("type") == "extra_forbidden" else e for e in errors]
    out = [{"loc": [safe_text(p, 100) if isinstance(p, str) else p for p in e.get("loc", ())][:8],
            "msg": safe_text(e.get("msg", "invalid")), "type": safe_text(e.get("type", "value_error"), 60)}
           for e in errors[:MAX_ERRORS_REPORTED]]
    if len(errors) > MAX_ERRORS_REPORTED:
        out.append({"loc": ["body"], "msg": f"{len(errors) - MAX_ERRORS_REPORTED} more problems not listed",
                    "type": "too_many_errors"})
    return out


def not_utf8(body: bytes) -> str | None:
    """Why `body` is not UTF-8 JSON text, or None. A NUL byte is never in UTF-8 JSON (control characters in its
    strings are escaped) and always in UTF-16 or UTF-32 JSON (its structure is ASCII)."""
    if b"\x00" in body:
        return "not UTF-8 (UTF-16 or UTF-32?): JSON between systems is UTF-8 (RFC 8259, section 8.1)"
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"not UTF-8 (byte {exc.start}): JSON between systems is UTF-8 (RFC 8259, section 8.1)"
    return None


def field_error(field: str, message: str, kind: str = "value_error", where: str = "body") -> list[dict]:
    """A route's own 422 detail for one field of the body (or "query", "header"), in the shape validation
    errors have (what the OpenAPI schema declares for 422)."""
    return [{"loc": [where, field], "msg": safe_text(message), "type": kind}]


async def _on_redis_down(request: Request, exc: Exception) -> JSONResponse:
    log.warning("%s %s: Redis is unreachable (%s)", request.method, request.url.path, exc)
    return JSONResponse({"detail": "the scheduler's Redis is unreachable; retry later"},
                        status_code=status.HTTP_503_SERVICE_UNAVAILABLE, headers={"Retry-After": str(RETRY_AFTER_S)})


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse({"detail": validation_detail(exc.errors())}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)


class BodyLimit:
    """ASGI middleware: reads the whole body before the app sees any of it, then 413 for a body over max_bytes
    (declared or counted), 422 (json_invalid) for one that is not UTF-8 (RFC 8259 8.1: UTF-16 and UTF-32 JSON,
    which Python's json would read, are refused; a UTF-8 byte order mark is let through, as the RFC allows), and
    400, closing the connection, for a body framed both ways. A refused body never reaches the app, so it changes
    nothing."""

    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        if b"transfer-encoding" in headers and b"content-length" in headers:  # RFC 9112 6.1: a smuggling vector
            await self._refuse(send, status.HTTP_400_BAD_REQUEST, "both content-length and transfer-encoding: "
                               "the body's framing is ambiguous", close=True)
            return
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                too_large = int(declared) > self.max_bytes
            except ValueError:
                await self._refuse(send, status.HTTP_400_BAD_REQUEST, "content-length: not a number")
                return
            if too_large:
                await self._refuse(send, status.HTTP_413_CONTENT_TOO_LARGE, self._message())
                return
        chunks, received = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left (or the server timed its body out)
                return
            chunks.append(message.get("body", b""))
            received += len(chunks[-1])
            if received > self.max_bytes:  # stop reading: the rest is never looked at
                await self._refuse(send, status.HTTP_413_CONTENT_TOO_LARGE, self._message())
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if problem := not_utf8(body):  # malformed JSON text: answered as FastAPI answers any (422, json_invalid)
            await self._refuse(send, status.HTTP_422_UNPROCESSABLE_CONTENT,
                               [{"loc": ["body"], "msg": f"JSON decode error: {problem}", "type": "json_invalid"}])
            return
        is_sent = False

        async def replayed():
            nonlocal is_sent
            if is_sent:  # the body was read: what comes next is the client leaving
                return await receive()
            is_sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replayed, send)

    def _message(self) -> str:
        return f"request body over {self.max_bytes} bytes"

    @staticmethod
    async def _refuse(send, code: int, detail: str | list[dict], close: bool = False) -> None:
        """Answer `code` with `detail`; `close`: and close the connection after it (what follows on it is unread)."""
        body = json.dumps({"detail": detail}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": code,
                    "headers": headers + ([(b"connection", b"close")] if close else [])})
        await send({"type": "http.response.body", "body": body})


def install(app: FastAPI, max_body_bytes: int = MAX_BODY_BYTES) -> None:
    """The handlers and the body limit above, on `app`."""
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    for exc_type in (redis_lib.ConnectionError, redis_lib.TimeoutError):  # Redis blinks: 503, never a 500
        app.add_exception_handler(exc_type, _on_redis_down)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
