"""helm/tandem's values.schema.json, generated: ``cluster`` is cluster/config.py's model as JSON Schema (so
``helm install`` refuses what ``tandem serve`` would), the rest is the chart's own settings.

    python -m cluster.values_schema > helm/tandem/values.schema.json
"""

from __future__ import annotations

import json
from typing import Any

from cluster.config import ClusterConfig


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        out["required"] = required
    return out


_STR = {"type": "string"}
_BOOL = {"type": "boolean"}
_MAP = {"type": "object"}  # Kubernetes objects passed through as they are (resources, nodeSelector)
_LIST = {"type": "array"}
_QUANTITY = {"type": ["string", "integer"]}


def _placement(**extra: Any) -> dict[str, Any]:
    return {"nodeSelector": _MAP, "tolerations": _LIST, **extra}


def values_schema() -> dict[str, Any]:
    cluster = ClusterConfig.model_json_schema(ref_template="#/$defs/{model}")
    defs = cluster.pop("$defs", {})
    cluster.pop("title", None)
    group = _obj(_placement(memory=_QUANTITY))
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "helm/tandem values",
        **_obj({
            "image": _obj({"repository": _STR, "tag": _STR,
                           "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]}}, ["repository", "tag"]),
            "imagePullSecrets": _LIST,
            "rayVersion": _STR,
            "cluster": cluster,
            "head": _obj(_placement(resources=_MAP)),
            "workerGroups": _obj({"prefill": group, "decode": group}),
            "rayAutoscaler": _obj({"enabled": _BOOL, "idleTimeoutSeconds": {"type": "integer", "minimum": 0}}),
            "router": _obj({
                "replicas": {"type": "integer", "minimum": 1},
                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                "service": _obj({"type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]}, "annotations": _MAP}),
                "resources": _MAP,
                "pdbMinAvailable": {"type": "integer", "minimum": 0},
                **_placement()}),
            "redis": _obj({"externalUrl": {"type": "string", "pattern": "^(|rediss?://.+)$"}, "image": _STR,
                           "storage": _QUANTITY, "resources": _MAP}),
            "apiKey": _obj({"existingSecret": _STR, "value": _STR, "adminValue": _STR}),
            "monitoring": _obj({
                "serviceMonitor": _obj({"enabled": _BOOL, "interval": _STR, "labels": _MAP}),
                "prometheusRule": _obj({"enabled": _BOOL, "labels": _MAP,
                                        "attainmentBelow": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                                        "queueSecondsAbove": {"type": "number", "exclusiveMinimum": 0}}),
                "grafanaDashboard": _obj({"enabled": _BOOL, "labels": _MAP})}),
        }, ["image", "cluster"]),
        "$defs": defs,
    }


if __name__ == "__main__":
    print(json.dumps(values_schema(), indent=2, sort_keys=True))
