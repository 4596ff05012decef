"""The compose and k8s files parse, and every image, port, env var, secret and mounted file they
name exists in the code, the Dockerfile or the repo."""

from __future__ import annotations

import dataclasses
import re

import pytest
import yaml

from scheduler.policy import PolicySettings
from tests.deploy.promql import ROOT

COMPOSE = ROOT / "deploy/compose/docker-compose.yaml"
K8S = sorted((ROOT / "deploy/k8s").glob("*.yaml"))
DOCKERFILE = ROOT / "deploy/docker/Dockerfile"
SOURCES = "\n".join(p.read_text() for d in ("scheduler", "workers", "drafter") for p in (ROOT / d).rglob("*.py"))
# env vars read by the software in the images, not by our code
NOT_OURS = {"RAY_AUTH_MODE": "read by Ray: token authentication on or off"}


def k8s_docs() -> list[dict]:
    return [d for p in K8S for d in yaml.safe_load_all(p.read_text()) if d]


def walk(node, key: str):
    """Every value stored under `key` anywhere in a parsed YAML tree."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                yield v
            yield from walk(v, key)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v, key)


def project_image() -> str:
    name, tag = re.search(r"-t (tlt-scheduler):(\S+)", DOCKERFILE.read_text()).groups()
    assert f'org.opencontainers.image.title="{name}"' in DOCKERFILE.read_text()
    return f"{name}:{tag}"


def all_images() -> list[str]:
    compose = yaml.safe_load(COMPOSE.read_text())
    return [s["image"] for s in compose["services"].values()] + list(walk(k8s_docs(), "image"))


def test_everything_parses_and_compose_has_its_services_with_health_checks():
    compose = yaml.safe_load(COMPOSE.read_text())
    assert set(compose["services"]) == {"scheduler", "redis", "ray-head", "prometheus", "grafana"}
    for name, service in compose["services"].items():
        assert service.get("healthcheck", {}).get("test"), f"{name} has no health check"
    kinds = {d["kind"] for d in k8s_docs()}
    assert {"RayCluster", "Deployment", "Service", "StatefulSet", "PersistentVolumeClaim", "Secret",
            "ServiceMonitor", "Kustomization"} <= kinds
    listed = set(next(d for d in k8s_docs() if d["kind"] == "Kustomization")["resources"])
    assert listed == {p.name for p in K8S} - {"kustomization.yaml"}


def test_images_are_the_project_image_or_pinned():
    ours = project_image()
    for image in all_images():
        if image.startswith("tlt-scheduler"):
            assert image == ours, image
        else:
            assert ":" in image and not image.endswith(":latest"), f"unpinned image {image}"


def env_names() -> set[str]:
    compose = yaml.safe_load(COMPOSE.read_text())
    names = {n for s in compose["services"].values() for n in s.get("environment", {})}
    names |= {e["name"] for env in walk(k8s_docs(), "env") for e in env}
    names |= set(re.findall(r"\b(TLT_[A-Z_]+)=", DOCKERFILE.read_text()))  # the image's own ENV
    return names


def test_every_env_var_is_read_by_the_code_or_named_as_not_ours():
    fields = {f"TLT_POLICY_{f.name.upper()}" for f in dataclasses.fields(PolicySettings)}
    names = env_names()
    assert {"REDIS_URL", "TLT_API_TOKEN_FILE"} <= names
    for name in names:
        if name in NOT_OURS:
            continue
        if name.startswith("TLT_POLICY_"):
            assert name in fields, f"{name}: no such PolicySettings field"
        else:
            assert f'"{name}"' in SOURCES, f"{name} is set in a manifest but the code never reads it"


def test_the_scheduler_listens_where_the_manifests_and_the_dockerfile_say():
    compose = yaml.safe_load(COMPOSE.read_text())
    sched = compose["services"]["scheduler"]
    port = sched["command"][sched["command"].index("--port") + 1]
    assert sched["ports"] == [f"{port}:{port}"] and port in sched["healthcheck"]["test"][-1]
    deploy = next(d for d in k8s_docs() if d["kind"] == "Deployment")
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][container["command"].index("--port") + 1] == port
    assert [p["containerPort"] for p in container["ports"]] == [int(port)]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": int(port)}
    service = next(d for d in k8s_docs() if d["kind"] == "Service" and d["metadata"]["name"] == "tlt-scheduler")
    assert service["spec"]["ports"][0]["targetPort"] == int(port)
    assert service["metadata"]["annotations"]["prometheus.io/port"] == port
    docker = DOCKERFILE.read_text()
    assert f"EXPOSE {port}" in docker and f"127.0.0.1:{port}/healthz" in docker
    assert re.search(r'^CMD \["tlt", "serve".*"--port", "' + port + '"', docker, re.M)
    # `tlt serve` has these options
    from scheduler.cli import build_parser

    serve = build_parser().parse_args(sched["command"][1:])
    assert serve.port == int(port) and serve.ray_address == "ray-head:6379"


def test_every_secret_is_defined_and_every_mounted_file_exists():
    compose = yaml.safe_load(COMPOSE.read_text())
    defined = set(compose["secrets"])
    for name, service in compose["services"].items():
        assert set(service.get("secrets", [])) <= defined, name
    token_file = compose["services"]["scheduler"]["environment"]["TLT_API_TOKEN_FILE"]
    assert token_file == f"/run/secrets/{compose['services']['scheduler']['secrets'][0]}"
    secrets = {d["metadata"]["name"] for d in k8s_docs() if d["kind"] == "Secret"}
    used = set(walk(k8s_docs(), "secretName")) | {r["name"] for r in walk(k8s_docs(), "secretKeyRef")}
    assert used and used <= secrets
    claims = {d["metadata"]["name"] for d in k8s_docs() if d["kind"] == "PersistentVolumeClaim"}
    assert set(walk(k8s_docs(), "claimName")) <= claims
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE.parent / source).exists(), f"mounted {source} does not exist"


@pytest.mark.parametrize("path", [COMPOSE, *K8S], ids=lambda p: p.name)
def test_yaml_parses(path):
    assert [d for d in yaml.safe_load_all(path.read_text()) if d]
