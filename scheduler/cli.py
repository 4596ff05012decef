"""The `tlt` command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from importlib.metadata import entry_points

from scheduler.cli_tools import add_tool_commands
from scheduler.policy import PolicySettings
from scheduler.simulate.command import add_simulate_command

# entry points (pyproject.toml) whose `add(sub)` adds a command to `tlt`: `bench` (the registry in bench/cli.py)
# comes this way, so that scheduler/ names no module of bench/
COMMAND_GROUP = "tlt.commands"


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# Ray's switch for its single-node mode (ray_constants.ENABLE_RAY_CLUSTER, read at import): off, a node's address
# is loopback and every Ray server (GCS, raylet, workers, agents) listens there alone; `_node_ip_address` alone is
# turned back into the NIC's address by Ray, and its gRPC servers then listen on every interface (measured, Ray 2.60)
RAY_SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def api_token_from_env(environ) -> str | None:
    """TLT_API_TOKEN, or the first line of the file TLT_API_TOKEN_FILE names (a mounted secret)."""
    if environ.get("TLT_API_TOKEN"):
        return environ["TLT_API_TOKEN"]
    path = environ.get("TLT_API_TOKEN_FILE")
    if not path:
        return None
    try:
        token = open(path).read().strip()  # noqa: SIM115 - read once at start
    except OSError as exc:
        raise ValueError(f"TLT_API_TOKEN_FILE: cannot read {path}: {exc.strerror}") from None
    if not token:
        raise ValueError(f"TLT_API_TOKEN_FILE: {path} is empty")
    return token


def policy_from_env(environ: dict) -> PolicySettings:
    """PolicySettings with any field overridden by TLT_POLICY_<FIELD> (e.g. TLT_POLICY_MIN_LEASE_S=2)."""
    kwargs = {}
    for f in dataclasses.fields(PolicySettings):
        raw = environ.get(f"TLT_POLICY_{f.name.upper()}")
        if raw is not None:
            kind = type(getattr(PolicySettings(), f.name))
            if kind is bool:
                if raw.strip().lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError(f"TLT_POLICY_{f.name.upper()}: not a boolean (1/0, true/false): {raw!r}")
                kwargs[f.name] = raw.strip().lower() in ("1", "true", "yes")
                continue
            try:
                kwargs[f.name] = kind(raw)
            except ValueError:
                raise ValueError(f"TLT_POLICY_{f.name.upper()}: not a number: {raw!r}") from None
    return PolicySettings(**kwargs)


def _serve(args: argparse.Namespace) -> int:
    import logging
    import os

    ray_address = args.ray_address or os.environ.get("RAY_ADDRESS") or None
    if ray_address is None and args.host in LOOPBACK_HOSTS:  # read when ray is imported, so before it is
        os.environ.setdefault(RAY_SINGLE_NODE_ENV, "0")  # the private Ray's node address: loopback, not the NIC's
    from scheduler.app import Settings
    from workers.redis_server import redis_url_from_env

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    policy = policy_from_env(os.environ)
    tick_s = float(os.environ.get("TLT_WATCH_TICK_S", Settings.watch_tick_s))
    if tick_s <= 0:
        raise ValueError(f"TLT_WATCH_TICK_S must be > 0, got {tick_s}")
    url, private = redis_url_from_env()
    if private is not None:
        print(f"tlt: REDIS_URL is unset: started a private redis-server at {url}", file=sys.stderr)
    import redis as redis_lib

    from workers.protocol.client import connect

    try:
        connect(url).ping()
    except (redis_lib.RedisError, ValueError) as exc:
        raise ValueError(f"cannot reach Redis at {url} ({exc}); check REDIS_URL") from None
    from scheduler.paths import DATA_ROOTS_ENV, MODEL_ROOTS_ENV, roots_from_env

    settings = Settings(redis_url=url, api_token=api_token_from_env(os.environ), policy=policy,
                        watch_tick_s=tick_s, ray_num_gpus=args.gpus,
                        model_roots=roots_from_env(os.environ, MODEL_ROOTS_ENV),
                        data_roots=roots_from_env(os.environ, DATA_ROOTS_ENV),
                        **({"store_dir": args.store_dir} if args.store_dir else {}),
                        **({} if args.max_jobs_per_token is None else {"max_jobs_per_token": args.max_jobs_per_token}),
                        ray_address=ray_address, ray_node_ip=args.host if args.host in LOOPBACK_HOSTS else None)
    from scheduler.serve import serve

    return serve(settings, args.host, args.port)  # graceful on SIGTERM/SIGINT, slow clients dropped


def _submit(args: argparse.Namespace) -> int:
    from scheduler.client import call, load_spec

    headers = {"Idempotency-Key": args.idempotency_key} if args.idempotency_key else None
    job = call("POST", args.url, "/v1/jobs", load_spec(args.file), args.token, headers)
    print(json.dumps(job) if args.json else f"submitted job {job['job_id']} ({job['state']})")
    return 0


def _jobs(args: argparse.Namespace) -> int:
    from scheduler.client import call

    for job in call("GET", args.url, "/v1/jobs", token=args.token):
        print(f"{job['job_id']}  {job['state']:<10} {job['spec']['model']:<16} steps {job.get('steps', 0)}")
    return 0


def _status(args: argparse.Namespace) -> int:
    from scheduler.client import watch

    print(watch(args.url, args.job, once=not args.watch, token=args.token))
    return 0


def _report(args: argparse.Namespace) -> int:
    from scheduler.report import write_report

    paths = write_report(args.url, args.job, args.out, token=args.token)
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


def _cancel(args: argparse.Namespace) -> int:
    from scheduler.client import call

    job = call("POST", args.url, f"/v1/jobs/{args.job}/cancel", None, args.token)
    print(f"job {job['job_id']}: {job['state']}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from scheduler.demo import run_demo

    return run_demo()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tlt", description="tlt-scheduler: idle-time drafter training for RL")
    sub = parser.add_subparsers(dest="command", required=True)

    for command in entry_points(group=COMMAND_GROUP):
        command.load()(sub)
    add_tool_commands(sub)
    add_simulate_command(sub)

    srv = sub.add_parser("serve", help="run the scheduler's REST API (REDIS_URL, TLT_API_TOKEN from the env)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8080)
    srv.add_argument("--gpus", type=int, default=4, help="logical GPUs for a local Ray started by the server")
    srv.add_argument("--max-jobs-per-token", type=int, default=None,
                     help="jobs the API token may have queued or running; beyond it a submit gets 429 "
                          "(default: Settings.max_jobs_per_token, docs/operations.md)")
    srv.add_argument("--store-dir", default=None,
                     help="draft weight store root (shared FS on a cluster; default: Settings.store_dir)")
    srv.add_argument("--ray-address", default=None,
                     help="join a running Ray cluster (default $RAY_ADDRESS; unset: start a private local Ray, "
                          "whose jobs end with this process)")
    srv.set_defaults(func=_serve)

    def client_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--url", default=None, help="scheduler URL (default $TLT_URL or http://127.0.0.1:8080)")
        p.add_argument("--token", default=None, help="API token (default $TLT_API_TOKEN)")

    sb = sub.add_parser("submit", help="submit a job from a YAML or JSON JobSpec file")
    sb.add_argument("file")
    sb.add_argument("--idempotency-key", default=None)
    sb.add_argument("--json", action="store_true")
    client_args(sb)
    sb.set_defaults(func=_submit)
    jb = sub.add_parser("jobs", help="list jobs")
    client_args(jb)
    jb.set_defaults(func=_jobs)
    st = sub.add_parser("status", help="a job and its workers' live progress")
    st.add_argument("job")
    st.add_argument("--watch", action="store_true", help="refresh until the job ends")
    client_args(st)
    st.set_defaults(func=_status)
    cn = sub.add_parser("cancel", help="cancel a job")
    cn.add_argument("job")
    client_args(cn)
    cn.set_defaults(func=_cancel)

    rp = sub.add_parser("report", help="PNG plots and a Markdown summary of a job")
    rp.add_argument("job")
    rp.add_argument("--out", required=True, help="directory to write timeline.png, steps.png, phases.png, summary.md")
    client_args(rp)
    rp.set_defaults(func=_report)

    demo = sub.add_parser("demo", help="run the main demo on the embedded defaults")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"tlt: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
