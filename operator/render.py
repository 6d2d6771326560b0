"""The child objects an InferenceDeployment becomes: pure functions from (object, spec, decision) to dicts.

Nothing here talks to the API, so `pagoda render` prints exactly what the operator would apply.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from pagoda.operator.planning import Decision
from pagoda.operator.quantity import format_quantity
from pagoda.operator.spec import InferenceSpec

GROUP = "pagoda.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceDeployment"
PLURAL = "inferencedeployments"
ENGINE_PORT = 8000
KV_DIR = "/var/cache/pagoda/kv"
MODELS_DIR = "/models"
HF_CACHE_DIR = "/models/hf"
MANAGED_BY = "pagoda-operator"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_MANAGED = "app.kubernetes.io/managed-by"
LABEL_OWNER = "pagoda.dev/inference-deployment"
HASH_ANNOTATION = "pagoda.dev/spec-hash"
PLAN_ANNOTATION = "pagoda.dev/plan-hash"  # on the pod template: which plan a pod was started with
TERMINATION_LOG = "/dev/termination-log"
PRODUCT_LABEL = "nvidia.com/gpu.product"
DEFAULT_IMAGE_REPO = "ghcr.io/pagoda-llm/pagoda-engine"


def default_image() -> str:
    """The engine image: $PAGODA_ENGINE_IMAGE (the chart sets it), else ours at this package's version."""
    override = os.environ.get("PAGODA_ENGINE_IMAGE")
    if override:
        return override
    try:
        from importlib.metadata import version

        tag = version("pagoda")
    except Exception:  # pragma: no cover - only outside an installed checkout
        tag = "latest"
    return f"{DEFAULT_IMAGE_REPO}:{tag}"


def selector_labels(name: str) -> dict[str, str]:
    return {LABEL_NAME: "pagoda-engine", LABEL_INSTANCE: name}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def common_labels(name: str) -> dict[str, str]:
    return {
        **selector_labels(name),
        LABEL_MANAGED: MANAGED_BY,
        LABEL_OWNER: name,
        "app.kubernetes.io/part-of": "pagoda",
    }


def _owner(body: dict[str, Any]) -> list[dict[str, Any]]:
    meta = body.get("metadata", {})
    if not meta.get("uid"):
        return []  # `pagoda render` of a file: there is no owner yet
    return [
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": meta["name"],
            "uid": meta["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def _metadata(body: dict[str, Any], name: str, **extra: Any) -> dict[str, Any]:
    meta = body.get("metadata", {})
    out: dict[str, Any] = {"name": name, "labels": common_labels(meta["name"])}
    if meta.get("namespace"):
        out["namespace"] = meta["namespace"]
    owners = _owner(body)
    if owners:
        out["ownerReferences"] = owners
    out.update(extra)
    return out


def with_hash(obj: dict[str, Any]) -> dict[str, Any]:
    """Stamp the object with a hash of itself, so drift and change are one string comparison away."""
    digest = hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
    obj["metadata"].setdefault("annotations", {})[HASH_ANNOTATION] = digest
    return obj


def plan_hash(args: list[str]) -> str:
    """A short digest of the engine's arguments: pods started with the same plan carry the same one."""
    return hashlib.sha256(json.dumps(args).encode()).hexdigest()[:16]


def engine_args(spec: InferenceSpec, decision: Decision) -> list[str]:
    """`pagoda serve` arguments: model, listener, the plan's flags, then the user's extraArgs.

    Every flag here is one `pagoda serve` has: reconcile runs them through the engine's own dry run
    (operator/contract.py) before any pod exists. The device is explicit, so a GPU pod never falls back to
    the CPU and a CPU pod never probes for a GPU.
    """
    model = spec.model
    args: list[str] = []
    if model.kind == "hf":
        args.append(model.model_id)
    elif model.kind == "pvc":
        claim, _, path = model.source[len("pvc://") :].partition("/")
        args.append(f"{MODELS_DIR}/{claim}/{path}")
    elif model.kind == "file":
        args.append(model.source[len("file://") :])
    args += ["--host", "0.0.0.0", "--port", str(ENGINE_PORT), "--served-model-name", model.served_model_name]
    if model.revision:
        args += ["--revision", model.revision]
    args += ["--device", "cpu" if decision.gpu is None else "cuda"]
    plan = decision.plan
    args += plan.to_engine_args()
    args += ["--max-num-queued-reqs", str(decision.max_num_queued_reqs)]
    args.append(
        "--enable-prefix-caching" if spec.engine.enable_prefix_caching else "--no-enable-prefix-caching"
    )
    if plan.kv_offload_disk_bytes:
        args += ["--kv-offload-disk-dir", KV_DIR]
    return args + list(spec.engine.extra_args)


def _resources(spec: InferenceSpec, decision: Decision) -> dict[str, Any]:
    requests = dict(spec.resources.get("requests", {}))
    limits = dict(spec.resources.get("limits", {}))
    if "memory" not in requests and "memory" not in limits:
        # The engine itself plus the KV it keeps in RAM (planning.pod_memory_bytes).
        requests["memory"] = limits["memory"] = format_quantity(decision.pod_memory_bytes)
    requests.setdefault("cpu", "1" if decision.gpu is None else "4")
    if decision.gpu is not None:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(spec.gpu.count)
    return {"requests": requests, "limits": limits}


def _probe(path: str, period: int, failures: int, initial: int = 0) -> dict[str, Any]:
    probe: dict[str, Any] = {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }
    if initial:
        probe["initialDelaySeconds"] = initial
    return probe


def statefulset(body: dict[str, Any], spec: InferenceSpec, decision: Decision) -> dict[str, Any]:
    name = body["metadata"]["name"]
    env: list[dict[str, Any]] = [{"name": "HF_HUB_OFFLINE", "value": "1"}]
    mounts: list[dict[str, Any]] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    shm = "1Gi" if decision.gpu is None else f"{8 * spec.gpu.count}Gi"
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}},
        {"name": "tmp", "emptyDir": {}},
    ]
    if spec.model.kind == "hf":
        env.append({"name": "HF_HOME", "value": HF_CACHE_DIR})
        mounts.append({"name": "model-cache", "mountPath": HF_CACHE_DIR, "readOnly": True})
        volumes.append(
            {
                "name": "model-cache",
                "persistentVolumeClaim": {"claimName": spec.model.cache_volume_claim, "readOnly": True},
            }
        )
    elif spec.model.kind == "pvc":
        claim = spec.model.source[len("pvc://") :].split("/", 1)[0]
        mounts.append({"name": "model", "mountPath": f"{MODELS_DIR}/{claim}", "readOnly": True})
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
    if spec.api_key_secret:
        secret, key = spec.api_key_secret
        env.append({"name": "PAGODA_API_KEY", "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}})
    claim_templates: list[dict[str, Any]] = []
    if decision.nvme_bytes:
        mounts.append({"name": "kv-offload", "mountPath": KV_DIR})
        pvc_spec: dict[str, Any] = {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": format_quantity(decision.nvme_bytes)}},
        }
        if spec.offload.nvme_storage_class:
            pvc_spec["storageClassName"] = spec.offload.nvme_storage_class
        claim_templates.append(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": "kv-offload", "labels": selector_labels(name)},
                "spec": pvc_spec,
            }
        )

    args = engine_args(spec, decision)
    container = {
        "name": "engine",
        "image": spec.image or default_image(),
        "imagePullPolicy": "IfNotPresent",
        "command": ["pagoda", "serve"],
        "args": args,
        "env": env,
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "resources": _resources(spec, decision),
        "startupProbe": _probe("/health", 10, 180),  # weights can take many minutes to load
        "readinessProbe": _probe("/health", 5, 3),
        "livenessProbe": _probe("/health", 10, 6),
        "volumeMounts": mounts,
        # An engine that runs out of memory at start-up writes what it measured here (exit code 3); the
        # operator re-plans from it. Any other failure leaves the log's tail.
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "runAsNonRoot": True,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    node_selector = dict(spec.gpu.node_selector)
    tolerations = list(spec.gpu.tolerations)
    if decision.gpu is not None:
        node_selector[PRODUCT_LABEL] = decision.product_label
        tolerations.append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": 60,
        "enableServiceLinks": False,
        # The engine never calls the Kubernetes API: no token to steal from a compromised pod.
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    if tolerations:
        pod_spec["tolerations"] = tolerations
    sts_spec: dict[str, Any] = {
        "replicas": spec.replicas,
        "serviceName": f"{name}-headless",
        "podManagementPolicy": "Parallel",
        "selector": {"matchLabels": selector_labels(name)},
        "template": {
            "metadata": {
                "labels": common_labels(name),
                "annotations": {
                    "prometheus.io/scrape": "true",
                    "prometheus.io/port": str(ENGINE_PORT),
                    "prometheus.io/path": "/metrics",
                    PLAN_ANNOTATION: plan_hash(args),
                },
            },
            "spec": pod_spec,
        },
    }
    if claim_templates:
        sts_spec["volumeClaimTemplates"] = claim_templates
        # The disk tier outlives pod restarts (that is its point) but not the deployment.
        sts_spec["persistentVolumeClaimRetentionPolicy"] = {"whenDeleted": "Delete", "whenScaled": "Retain"}
    return with_hash(
        {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _metadata(body, name), "spec": sts_spec}
    )


def services(body: dict[str, Any]) -> list[dict[str, Any]]:
    name = body["metadata"]["name"]
    port = {"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}
    client = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(body, name),
        "spec": {"type": "ClusterIP", "selector": selector_labels(name), "ports": [port]},
    }
    client["metadata"]["labels"]["pagoda.dev/service"] = "client"
    headless = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(body, f"{name}-headless"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(name),
            "ports": [port],
        },
    }
    headless["metadata"]["labels"]["pagoda.dev/service"] = "headless"
    return [with_hash(client), with_hash(headless)]


def disruption_budget(body: dict[str, Any]) -> dict[str, Any]:
    name = body["metadata"]["name"]
    return with_hash(
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": _metadata(body, name),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name)}},
        }
    )


def service_monitor(body: dict[str, Any], spec: InferenceSpec) -> dict[str, Any]:
    name = body["metadata"]["name"]
    return with_hash(
        {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "ServiceMonitor",
            "metadata": _metadata(body, name),
            "spec": {
                "selector": {"matchLabels": {**selector_labels(name), "pagoda.dev/service": "client"}},
                # Dashboards and alerts select engine series by these pod labels.
                "podTargetLabels": ["app.kubernetes.io/name", "app.kubernetes.io/instance"],
                "endpoints": [
                    {"port": "http", "path": "/metrics", "interval": spec.service_monitor_interval}
                ],
            },
        }
    )


def children(
    body: dict[str, Any], spec: InferenceSpec, decision: Decision, *, with_service_monitor: bool
) -> list[dict[str, Any]]:
    """Every child, in the order they are applied (the workload last, after what it depends on)."""
    out = [*services(body), disruption_budget(body)]
    if with_service_monitor and spec.service_monitor:
        out.append(service_monitor(body, spec))
    out.append(statefulset(body, spec, decision))
    return out
