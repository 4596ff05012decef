"""The deployment files against the real schemas, offline: the schemas come from installed packages.

- deploy/k8s: every built-in Kubernetes object against the Kubernetes OpenAPI schemas that kubernetes-validate
  ships, in strict mode (an unknown field fails, as with `kubectl apply --validate=strict`), for the oldest and
  the newest Kubernetes in K8S_VERSIONS.
- deploy/k8s/raycluster.yaml: KubeRay's RayCluster CRD is in no PyPI package, so it cannot be produced here and
  is not vendored (nor written by hand). What can be checked is: the RayCluster's metadata and every pod
  template in it (head group, each worker group), against the Kubernetes ObjectMeta and PodTemplateSpec
  schemas; that is all of the file except KubeRay's own fields (rayVersion, rayStartParams, replicas...).
- deploy/compose: against the Compose Specification's JSON schema that check-jsonschema vendors
  (`--builtin-schema vendor.compose-spec`), run through check-jsonschema itself.

Each validator is shown a broken copy too, so a schema that is not really applied fails here.
"""

from __future__ import annotations

import copy
import functools
import json
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate import SchemaNotFoundError, ValidationError

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "deploy/k8s"
COMPOSE_FILE = ROOT / "deploy/compose/docker-compose.yaml"
# the oldest and the newest Kubernetes whose schemas kubernetes-validate (pinned in pyproject.toml) ships
K8S_VERSIONS = ("1.25", "1.37")
# kinds with no offline schema, and why; everything else in deploy/k8s must validate
NO_OFFLINE_SCHEMA = {
    "Kustomization": "kustomize's build file, not a Kubernetes API object; no installable package ships its schema"
                     " (test_manifests.py checks that it lists every manifest)",
    "RayCluster": "KubeRay's CRD is in no PyPI package; its metadata and pod templates are checked below",
    "ServiceMonitor": "no PyPI package ships the Prometheus operator's CRD schema (only generated Python models)",
}


@functools.cache
def k8s_docs() -> tuple[tuple[str, dict], ...]:
    """(file name, object) for every object in deploy/k8s."""
    return tuple((p.name, d) for p in sorted(K8S_DIR.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d)


def k8s_doc(kind: str, name: str | None = None) -> dict:
    docs = [d for _, d in k8s_docs() if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(docs) == 1, f"want one {kind} {name or ''}, found {len(docs)}"
    return copy.deepcopy(docs[0])


def validate(doc: dict, version: str) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


def raycluster_pod_templates(cluster: dict) -> list[dict]:
    """Each pod template of the RayCluster as a core/v1 PodTemplate, the built-in object that holds a
    PodTemplateSpec, named after the group and carrying the RayCluster's metadata otherwise."""
    spec = cluster["spec"]
    groups = [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec.get("workerGroupSpecs", [])]
    return [{"apiVersion": "v1", "kind": "PodTemplate",
             "metadata": cluster["metadata"] | {"name": f"{cluster['metadata']['name']}-{group}"},
             "template": g["template"]} for group, g in groups]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_objects_match_the_kubernetes_schemas(version):
    validated, skipped = [], set()
    for file, doc in k8s_docs():
        try:
            validate(doc, version)
            validated.append(doc["kind"])
        except SchemaNotFoundError:
            assert doc["kind"] in NO_OFFLINE_SCHEMA, f"{file}: no schema for {doc['apiVersion']} {doc['kind']}"
            skipped.add(doc["kind"])
        except ValidationError as e:
            pytest.fail(f"{file}: {doc['kind']} {doc['metadata']['name']} at {'.'.join(map(str, e.absolute_path))}:"
                        f" {e.message} (Kubernetes {version})")
    assert skipped == set(NO_OFFLINE_SCHEMA), f"stale NO_OFFLINE_SCHEMA entries: {set(NO_OFFLINE_SCHEMA) - skipped}"
    assert {"Deployment", "Service", "StatefulSet", "PersistentVolumeClaim", "Secret", "Namespace"} <= set(validated)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_raycluster_pod_templates_match_the_kubernetes_schema(version):
    cluster = k8s_doc("RayCluster")
    templates = raycluster_pod_templates(cluster)
    assert len(templates) == 1 + len(cluster["spec"]["workerGroupSpecs"]) >= 2
    for template in templates:
        try:
            validate(template, version)
        except ValidationError as e:
            pytest.fail(f"raycluster.yaml: {template['metadata']['name']}"
                        f" at {'.'.join(map(str, e.absolute_path))}: {e.message} (Kubernetes {version})")


def break_deployment_replicas() -> dict:
    doc = k8s_doc("Deployment", "tlt-scheduler")
    doc["spec"]["replicas"] = "one"
    return doc


def break_deployment_container_field() -> dict:
    doc = k8s_doc("Deployment", "tlt-scheduler")
    doc["spec"]["template"]["spec"]["containers"][0]["imagePulPolicy"] = "Always"  # misspelt
    return doc


def break_raycluster_head_port() -> dict:
    head = raycluster_pod_templates(k8s_doc("RayCluster"))[0]
    head["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "gcs"
    return head


def break_raycluster_worker_volume() -> dict:
    worker = raycluster_pod_templates(k8s_doc("RayCluster"))[1]
    worker["template"]["spec"]["volumes"][0]["persistentVolumeClaim"] = {"claim": "tlt-drafts"}
    return worker


BROKEN_K8S = [  # (a broken copy, the message it must be rejected with, the path of the field named)
    (break_deployment_replicas, "'one' is not of type 'integer'", ["spec", "replicas"]),
    (break_deployment_container_field, r"\('imagePulPolicy' was unexpected\)",
     ["spec", "template", "spec", "containers", 0]),
    (break_raycluster_head_port, "'gcs' is not of type 'integer'",
     ["template", "spec", "containers", 0, "ports", 0, "containerPort"]),
    (break_raycluster_worker_volume, r"'claimName' is a required property|\('claim' was unexpected\)",
     ["template", "spec", "volumes", 0, "persistentVolumeClaim"]),
]


@pytest.mark.parametrize(("broken", "match", "path"), [pytest.param(*b, id=b[0].__name__) for b in BROKEN_K8S])
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_a_broken_kubernetes_object_is_rejected(broken, match, path, version):
    with pytest.raises(ValidationError, match=match) as caught:
        validate(broken(), version)
    assert list(caught.value.absolute_path) == path


def check_compose(path: Path) -> dict:
    """check-jsonschema's JSON report on one compose file, against the Compose Specification it vendors."""
    run = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                          "--output-format", "json", str(path)], capture_output=True, text=True, timeout=60)
    assert run.returncode in (0, 1), run.stderr
    report = json.loads(run.stdout)
    assert report["status"] == ("ok" if run.returncode == 0 else "fail"), run.stdout
    return report


def test_the_compose_file_matches_the_compose_specification():
    report = check_compose(COMPOSE_FILE)
    assert report == {"status": "ok", "errors": []}


def test_a_broken_compose_file_is_rejected(tmp_path):
    doc = yaml.safe_load(COMPOSE_FILE.read_text())
    doc["services"]["redis"]["healthchek"] = doc["services"]["redis"].pop("healthcheck")  # misspelt
    doc["services"]["scheduler"]["ports"] = "8080:8080"  # a string, not a list
    broken = tmp_path / "docker-compose.yaml"
    broken.write_text(yaml.safe_dump(doc))
    report = check_compose(broken)
    errors = {e["path"]: e["message"] for e in report["errors"]}
    assert "'healthchek' was unexpected" in errors.get("$.services.redis", ""), errors
    assert "'8080:8080' is not of type 'array'" in errors.get("$.services.scheduler.ports", ""), errors
