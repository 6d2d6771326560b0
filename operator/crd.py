"""The InferenceDeployment CustomResourceDefinition, generated from the typed spec (operator/spec.py).

`python -m pagoda.operator.crd` (`make crds`) writes crds/ and the chart's copy;
tests/operator/test_crd_generation.py fails when either differs from what this module generates.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml
from pagoda.operator import render
from pagoda.operator.schema import object_schema
from pagoda.operator.spec import InferenceSpec

FILE_NAME = f"{render.GROUP}_{render.PLURAL}.yaml"
HEADER = (
    "# InferenceDeployment: one model served by a set of Pagoda engine pods, sized by the operator.\n"
    "# Generated from operator/spec.py by `make crds` (python -m pagoda.operator.crd): do not edit by hand.\n"
)
PRINTER_COLUMNS = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.source"},
    {"name": "GPU", "type": "string", "jsonPath": ".status.gpu.product"},
    {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "MaxModelLen", "type": "integer", "jsonPath": ".status.plan.max_model_len"},
    {"name": "Status", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]
PRESERVE = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "observedGeneration": {"type": "integer"},
        "phase": {
            "type": "string",
            "description": "One word for `kubectl get`: the Ready condition's reason (Downloading, "
            "AllReplicasReady, PodsNotReady, ScaledToZero, or why the spec cannot be served).",
        },
        "conditions": {
            "type": "array",
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
            "items": {
                "type": "object",
                "required": ["type", "status"],
                "properties": {
                    "type": {"type": "string"},
                    "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
                    "reason": {"type": "string"},
                    "message": {"type": "string"},
                    "lastTransitionTime": {"type": "string", "format": "date-time"},
                    "observedGeneration": {"type": "integer"},
                },
            },
        },
        "plan": {
            **PRESERVE,
            "description": "Every value the operator chose for the engine, with its reason.",
        },
        "gpu": {
            "type": "object",
            "properties": {
                "product": {"type": "string"},
                "memoryMiB": {"type": "integer"},
                "computeCapability": {"type": "string"},
                "count": {"type": "integer"},
                "nodes": {"type": "array", "items": {"type": "string"}},
                "reason": {"type": "string"},
            },
        },
        "model": {
            **PRESERVE,
            "description": "The model download (hf:// and s3:// sources): phase (Pending, Downloading, Ready, "
            "Failed), bytes and files done of the total, the Job, the volume, and on failure the reason "
            "(ModelAccessDenied, ModelNotFound, ModelVolumeFull, ModelDownloadFailed) and message.",
        },
        "replicas": {"type": "integer"},
        "readyReplicas": {"type": "integer"},
        "endpoint": {"type": "string"},
        "selector": {"type": "string"},
        "planImage": {
            "type": "string",
            "description": "The engine image the plan's memory figures hold for. After an image change, the "
            "first Ready pod of the new image reports what it measured; beyond 10% of the plan the operator "
            "re-plans from the measurement (status.refit, Event Replanned), else this moves on.",
        },
        "routing": {
            "type": "object",
            "properties": {"policy": {"type": "string"}, "router": {"type": "string"}},
        },
        "autoscaling": PRESERVE,
        "gateway": {
            "type": "object",
            "description": "spec.gateway: whether the cluster serves inference.networking.k8s.io/v1 "
            "(apiServed), and the InferencePool and endpoint picker (Deployment and Service) rendered for it.",
            "properties": {
                "apiServed": {"type": "boolean"},
                "inferencePool": {"type": "string"},
                "picker": {"type": "string"},
            },
        },
        "refit": {
            **PRESERVE,
            "description": "Re-plans after an engine ran out of memory (OOMKilled, or exit code 3 at start-up) "
            "for this generation of the spec: the settings lowered (settings), each failure and change "
            "(history, lastFailure with the engine's measured memory profile), and whether the operator gave up "
            "(exhausted; then Ready=False with reason RefitExhausted). Cleared when the spec changes.",
        },
    },
}


def crd() -> dict[str, Any]:
    spec_schema = object_schema(InferenceSpec)
    description = spec_schema.pop("description")
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{render.PLURAL}.{render.GROUP}",
            "labels": {"app.kubernetes.io/name": "pagoda", "app.kubernetes.io/component": "crd"},
        },
        "spec": {
            "group": render.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": render.KIND,
                "listKind": f"{render.KIND}List",
                "plural": render.PLURAL,
                "singular": render.KIND.lower(),
                "shortNames": ["infd"],
                "categories": ["all", "pagoda"],
            },
            "versions": [
                {
                    "name": render.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": description,
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema,
                                "status": STATUS_SCHEMA,
                            },
                        }
                    },
                }
            ],
        },
    }


def crd_yaml() -> str:
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=110, allow_unicode=True)


def targets(root: Path) -> list[Path]:
    """crds/ (what users `kubectl apply`) and the chart's copy."""
    return [root / "crds" / FILE_NAME, root / "charts" / "pagoda" / "crds" / FILE_NAME]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagoda.operator.crd", description=__doc__)
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the repository (default: here)")
    parser.add_argument("--check", action="store_true", help="exit 1 if a file differs, write nothing")
    args = parser.parse_args(argv)
    text = crd_yaml()
    stale = [p for p in targets(args.root) if not p.is_file() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"{p} differs from operator/spec.py: run `make crds`", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
