"""helm/tandem renders for the default values and the two GPU sets, passes ``helm lint``, its core kinds pass
``kubernetes-validate --strict``, its RayCluster validates against KubeRay's CRD, the cluster YAML it mounts
passes ``tandem serve --dry-run``, and values.schema.json (generated from cluster/config.py) rejects bad values."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from cluster.values_schema import values_schema
from tests.helm.chart import CHART, MONITORING, REPO, VALUE_SETS, by_kind, deep_merge, render, values

KUBE_VERSION = "1.32.0"
CORE_KINDS = {"ConfigMap", "Secret", "Service", "Deployment", "StatefulSet", "PodDisruptionBudget"}
KUBERAY_CRD = REPO.parent / "shared" / "schemas" / "kuberay" / "ray.io_rayclusters.yaml"


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_renders_and_core_kinds_pass_kubernetes_validate_strict(name):
    v = deep_merge(values(name), MONITORING)
    if not v.get("apiKey", {}).get("existingSecret"):  # the chart makes the Secret from a key in values
        v["apiKey"] = {"value": "sk-test", "adminValue": "sk-admin"}
    docs = render(v)
    kinds = {d["kind"] for d in docs}
    assert {"RayCluster", "ConfigMap", "Deployment", "StatefulSet", "Service", "PodDisruptionBudget",
            "ServiceMonitor", "PrometheusRule"} <= kinds, kinds
    assert ("Secret" in kinds) == (name == "default")
    for doc in docs:
        if doc["kind"] in CORE_KINDS:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_helm_lint_passes(name):
    report = helm.lint(CHART, values(name), strict=True, kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report.get("errors", [])
    assert not problems, problems


def _closed(schema: Any) -> Any:
    """The CRD's schema with unknown keys refused where it lists its keys (the API server prunes them
    silently; a typo in the chart should fail here instead)."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_raycluster_validates_against_kuberays_crd(name):
    crd = yaml.safe_load(KUBERAY_CRD.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = _closed(version["schema"]["openAPIV3Schema"])
    (cluster,) = by_kind(render(values(name)), "RayCluster")
    assert cluster["apiVersion"] == "ray.io/v1"
    jsonschema.validate(cluster, schema)
    # A typo is caught: the check can fail.
    bad = json.loads(json.dumps(cluster))
    bad["spec"]["workerGroupSpecs"][0]["maxReplica"] = 3
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def _cluster_yaml(name: str) -> str:
    (config,) = [d for d in by_kind(render(values(name)), "ConfigMap") if d["metadata"]["name"].endswith("-config")]
    return str(config["data"]["cluster.yaml"])


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_the_mounted_cluster_yaml_passes_dry_run(name, tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(_cluster_yaml(name))
    done = subprocess.run([sys.executable, "-m", "cluster.cli", "serve", "-c", str(path), "--dry-run"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)
    assert resolved["redis"]["url"] == "redis://tandem-redis:6379/0" and resolved["ray"]["address"] == "auto"
    for role in ("prefill", "decode"):
        assert resolved[role]["resources"]["resources"][f"tandem_{role}"] == 1


def test_pools_pin_to_their_worker_groups_and_size_them():
    v = values("gpu-2p6d")
    (cluster,) = by_kind(render(v), "RayCluster")
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    for role in ("prefill", "decode"):
        pool, group = v["cluster"][role], groups[role]
        assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (
            pool["replicas"], pool["min_replicas"], pool["max_replicas"])
        assert group["rayStartParams"]["resources"] == f'\'{{"tandem_{role}": 1}}\''
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == pool["resources"]["num_gpus"]
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "tandem controller -c /etc/tandem/cluster.yaml" in head["args"][0]


def test_api_key_comes_from_a_secret():
    docs = render({"apiKey": {"existingSecret": "my-keys"}})
    assert not by_kind(docs, "Secret")
    (router,) = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-router")]
    container = router["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    assert env["TANDEM_API_KEY"] == {"name": "my-keys", "key": "api-key"}


def test_external_redis_replaces_the_statefulset():
    docs = render({"redis": {"externalUrl": "redis://cache.example:6379/2"}})
    assert not by_kind(docs, "StatefulSet")
    assert "url: redis://cache.example:6379/2" in _cluster_yaml_of(docs)


def _cluster_yaml_of(docs: list[dict[str, Any]]) -> str:
    return str(next(d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-config"))["data"]
               ["cluster.yaml"])


def test_values_schema_is_generated_from_the_config_model():
    committed = json.loads((CHART / "values.schema.json").read_text())
    assert committed == values_schema(), "regenerate: python -m cluster.values_schema > helm/tandem/values.schema.json"


@pytest.mark.parametrize("bad, where", [
    ({"cluster": {"decode": {"replicas": "two"}}}, "replicas"),
    ({"cluster": {"decode": {"max_num_seqs": 4}}}, "max_num_seqs"),  # an engine key one level too high
    ({"cluster": {"slo": {"ttft_ms": -1}}}, "ttft_ms"),
    ({"router": {"replica": 3}}, "replica"),
])
def test_values_schema_rejects_a_bad_value(bad, where):
    chart = helm.Chart.load(CHART)
    chart.validate_schema(chart.merge_values({}))  # the defaults pass
    with pytest.raises(helm.HelmValuesError, match=where):
        chart.validate_schema(chart.merge_values(bad))


def test_dashboard_is_valid_json_with_panels():
    dashboard = json.loads((CHART / "files" / "dashboard.json").read_text())
    assert len(dashboard["panels"]) >= 12 and all(p["targets"] for p in dashboard["panels"])
    assert Path(CHART / "files" / "alerts.yaml").exists()
