"""`tlt submit / jobs / status / cancel`: a small REST client (stdlib only) with clear errors."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

from workers.protocol.states import TERMINAL_JOB_STATES

DEFAULT_URL = "http://127.0.0.1:8080"


class ClientError(ValueError):
    """Anything the user should read: unreachable scheduler, HTTP errors with the server's detail."""


def base_url(url: str | None) -> str:
    return (url or os.environ.get("TLT_URL") or DEFAULT_URL).rstrip("/")


def call(method: str, url: str, path: str, body: dict | None = None, token: str | None = None,
         headers: dict | None = None) -> object:
    token = token or os.environ.get("TLT_API_TOKEN")
    h = {"Content-Type": "application/json", **(headers or {})}
    if token:
        h["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(base_url(url) + path, method=method, headers=h,
                                 data=json.dumps(body).encode() if body is not None else None)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        try:
            detail = json.loads(exc.read()).get("detail")
        except (json.JSONDecodeError, AttributeError):
            detail = exc.reason
        if isinstance(detail, list):  # validation errors: "field: message" each
            detail = "; ".join(f"{'.'.join(str(p) for p in d.get('loc', ())[1:])}: {d.get('msg')}"
                               if isinstance(d, dict) else str(d) for d in detail)
        raise ClientError(f"{method} {path}: HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ClientError(f"cannot reach the scheduler at {base_url(url)} ({getattr(exc, 'reason', exc)}); "
                          "start it with `tlt serve` or pass --url / set TLT_URL") from None


def load_spec(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise ClientError(f"no such job file: {path}")
    kind = "YAML" if file.suffix in (".yaml", ".yml") else "JSON"
    import yaml

    try:
        text = file.read_text()
        spec = yaml.safe_load(text) if kind == "YAML" else json.loads(text)
    except (yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ClientError(f"{path} is not valid {kind}: {exc}") from None
    if not isinstance(spec, dict):
        raise ClientError(f"{path} must hold a mapping of JobSpec fields")
    return spec


def bar(done: int, total: int, width: int = 20) -> str:
    filled = int(width * done / total) if total else width
    return "[" + "#" * filled + "." * (width - filled) + "]"


def status_table(job: dict, workers: list[dict]) -> str:
    lines = [f"job {job['job_id']}  {job['state']}  steps done: {job.get('steps', 0)}"
             + (f"  error: {job['error']}" if job.get("error") else "")]
    for w in workers:
        lines.append(f"  {w['worker_id']:>6} {w['state']:<12} {w.get('scheduler_class') or '':<11} "
                     f"{bar(w['num_finished'], w['num_total'])} "
                     f"{w['num_finished']:>4}/{w['num_total']:<4} {w['tokens_per_s']:8.1f} tok/s  "
                     f"acc {w['mean_accepted_length']:.2f}  draft v{w['draft_version']}  step {w['rl_step']}")
    return "\n".join(lines)


def watch(url: str | None, job_id: str, interval_s: float = 1.0, once: bool = False, token: str | None = None) -> str:
    while True:
        job = call("GET", url, f"/v1/jobs/{job_id}", token=token)
        table = status_table(job, call("GET", url, f"/v1/jobs/{job_id}/workers", token=token))
        if once or job["state"] in TERMINAL_JOB_STATES:
            return table
        print("\033[2J\033[H" + table, flush=True)
        time.sleep(interval_s)
