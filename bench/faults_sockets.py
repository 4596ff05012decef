"""The raw-socket probes of `tlt bench faults` on a real `tlt serve` (bench.faults_service.served); the tests run the
same probes and assert on the counts (tests/scheduler/test_serve.py): clients that never finish their headers, a
body that stops short of its Content-Length, and a request with both Content-Length and Transfer-Encoding followed
by a smuggled one."""

from __future__ import annotations

import socket
import time

SMUGGLED = (b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"0\r\n\r\nGET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
# a POST declaring 100 bytes of body and sending 10 (issue 42: held open past 40 s)
STALLED_BODY = (b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                b'{"model": ')
MAX_STALL_WAIT_S = 60.0  # how long the stalled-body probe waits for the server to close before it gives up


def exchange(port: int, raw: bytes, timeout_s: float) -> tuple[bytes, float]:
    """Send `raw`, read until the server closes the connection; (what came back, seconds until the close)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        t0 = time.monotonic()
        s.sendall(raw)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return got, time.monotonic() - t0


def smuggling(port: int) -> dict:
    """Both Content-Length and Transfer-Encoding, then a second request on the same connection: the first must get
    a 4xx and the second no answer at all (RFC 9112 6.1)."""
    got, _ = exchange(port, SMUGGLED, timeout_s=10)
    status = int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/1.1 ") else None
    return {"status": status, "num_answers": got.count(b"HTTP/1.1 ")}


def slow_clients(port: int, num_clients: int, wait_s: float) -> dict:
    """`num_clients` connections that send a partial request line and headers and then a byte a second, never
    finishing them; after `wait_s`, how many the server still holds open."""
    socks = []
    for _ in range(num_clients):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    deadline, is_open = time.monotonic() + wait_s, [True] * num_clients
    while time.monotonic() < deadline and any(is_open):
        for i, s in enumerate(socks):
            if not is_open[i]:
                continue
            try:
                s.sendall(b"X")
                if s.recv(1, socket.MSG_DONTWAIT) == b"":
                    is_open[i] = False
            except BlockingIOError:
                pass
            except OSError:
                is_open[i] = False
        time.sleep(1.0)
    for s in socks:
        s.close()
    return {"num_clients": num_clients, "num_held": sum(is_open), "wait_s": wait_s}


def stalled_body(port: int, wait_s: float = MAX_STALL_WAIT_S) -> dict:
    """STALLED_BODY, then nothing: the seconds until the server closes the connection (`wait_s` if it never does)
    and the status it answered first, if any."""
    try:
        got, held_s = exchange(port, STALLED_BODY, timeout_s=wait_s)
    except TimeoutError:  # still open after wait_s
        got, held_s = b"", wait_s
    status = int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/1.1 ") else None
    return {"held_s": round(held_s, 2), "status": status, "answer": got.split(b"\r\n\r\n", 1)[-1][:200].decode()}
