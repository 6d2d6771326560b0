"""What every object the operator renders shares: the API group, labels, metadata with the owner reference,
the spec hash, spec.pod's pass-through fields and the default image. Pure functions, like render.py and
model_cache.py, which both build on these (and so neither imports the other for them)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pagoda.engine import envs
from pagoda.operator.spec import InferenceSpec

GROUP = "pagoda.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceDeployment"
PLURAL = "inferencedeployments"
MANAGED_BY = "pagoda-operator"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_MANAGED = "app.kubernetes.io/managed-by"
LABEL_OWNER = "pagoda.dev/inference-deployment"
HASH_ANNOTATION = "pagoda.dev/spec-hash"
TERMINATION_LOG = "/dev/termination-log"
# What `make image-gpu` / `make image-check` build (images/check.py): localhost/pagoda-engine:VERSION is the GPU
# flavour, VERSION-cpu the CPU one. Nothing publishes them: push them to a registry and point the chart there
# (charts/pagoda/README.md).
DEFAULT_IMAGE_REPO = "localhost/pagoda-engine"
CPU_TAG_SUFFIX = "-cpu"


def default_image() -> str:
    """The engine image (GPU flavour): $PAGODA_ENGINE_IMAGE (the chart sets it), else ours at this package's
    version."""
    override = envs.engine_image()
    if override:
        return override
    try:
        from importlib.metadata import version

        tag = version("pagoda")
    except Exception:  # pragma: no cover - only outside an installed checkout
        tag = "latest"
    return f"{DEFAULT_IMAGE_REPO}:{tag}"


def cpu_flavour(image: str) -> str:
    """The CPU flavour of an engine image: its tag with `-cpu` appended, as the images are tagged (the GPU
    flavour's CUDA wheels are gigabytes a CPU node never uses). An image named by digest or without a tag,
    or already a `-cpu` tag, is returned as it is: there is no flavour to derive."""
    if "@" in image:
        return image
    _, colon, tag = image.rpartition(":")
    if not colon or "/" in tag or tag.endswith(CPU_TAG_SUFFIX):  # no tag (a colon of a registry's port)
        return image
    return image + CPU_TAG_SUFFIX


def selector_labels(name: str) -> dict[str, str]:
    return {LABEL_NAME: "pagoda-engine", LABEL_INSTANCE: name}


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


def metadata(body: dict[str, Any], name: str, **extra: Any) -> dict[str, Any]:
    """A child's metadata: its name, the common labels, the namespace and owner reference of `body`."""
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


def pod_fields(spec: InferenceSpec, pod_spec: dict[str, Any]) -> None:
    """spec.pod's pass-through fields, on an engine, router or download pod spec."""
    pod = spec.pod
    if pod.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s["name"]} for s in pod.image_pull_secrets]
    if pod.affinity:
        pod_spec["affinity"] = pod.affinity
    if pod.priority_class_name:
        pod_spec["priorityClassName"] = pod.priority_class_name
