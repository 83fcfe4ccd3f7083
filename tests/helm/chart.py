"""Render helm/tandem offline with the Helm engine in a wheel (helm-python-sdk): no cluster, no helm binary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "tandem"
# The default values, and the two GPU sets the README installs with -f.
VALUE_SETS = {"default": None, "gpu-1p1d": REPO / "helm" / "values-gpu.yaml",
              "gpu-2p6d": REPO / "helm" / "values-gpu-2p6d.yaml"}
# What monitoring adds (the CRDs of the Prometheus operator) is rendered only when it is switched on.
MONITORING = {"monitoring": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True},
                             "grafanaDashboard": {"enabled": True}}}


def values(name: str) -> dict[str, Any]:
    path = VALUE_SETS[name]
    return {} if path is None else yaml.safe_load(path.read_text())


def render(overrides: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every object the chart makes for these values (on top of values.yaml), in template order."""
    manifests = helm.Chart.load(CHART).render(overrides or {}, name="tandem", namespace="serving", is_install=True)
    docs = []
    for path, text in sorted(manifests.items()):
        if path.endswith(".txt") or not text.strip():
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
