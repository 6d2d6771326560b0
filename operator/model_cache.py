"""Weights into the cluster: the model cache volume, the download Job that fills it once, and what the
operator reads back (the Job's state, the progress lines in its pod's log, the result in its termination
message). Rendering is pure like render.py; reading the result is `download_state`.

hf:// and s3:// sources are downloaded by `pagoda-model-download` (operator/download/) from the operator's
own image (small, no torch; the chart passes it as PAGODA_DOWNLOAD_IMAGE) into a PersistentVolumeClaim; the
engine pods start only when the Job has succeeded, and mount the claim read-only. With
`spec.model.cache.perPod` each pod has its own claim (a volumeClaimTemplate) filled by an init container.
Credentials reach the download container only, as optional secretKeyRefs of spec.model.secretRef: the operator
never reads the Secret, and no rendered object, log line or status holds a token.

On GPUs the same Job compiles the deployment's Triton kernels once, after the download (which becomes its init
container): `pagoda kernels warm` from the engine image, given the GPU and the engine's own `pagoda serve`
flags, writes every variant that engine launches into a folder of the cache volume named by a digest of the
image, GPU and flags (`kernel_dir`); the engine pods read it through PAGODA_KERNEL_CACHE, before the image's
own warmed kernels. No GPU is needed to compile. A failed compile fails nothing: the engine then compiles
what it misses when it starts, as it would without the step.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pagoda.engine import envs
from pagoda.operator import objects
from pagoda.operator.download.progress import parse_progress
from pagoda.operator.download.result import (
    ACCESS_DENIED,
    EXIT_CODES,
    FAILED,
    FORMAT,
    NOT_FOUND,
    READY,
    VOLUME_FULL,
)
from pagoda.operator.planning import Decision
from pagoda.operator.quantity import format_quantity
from pagoda.operator.spec import AdapterSpec, InferenceSpec

GiB = 1 << 30
CACHE_DIR = (
    "/models/cache"  # where the cache claim is mounted (read-write in the download, read-only in the engine)
)
HF_HOME = f"{CACHE_DIR}/hf"
S3_DIR = f"{CACHE_DIR}/s3"
CONTAINER = "model-download"
KERNEL_CONTAINER = "kernels-warm"
KERNELS_DIR = f"{CACHE_DIR}/kernels"  # one folder per kernel set (kernel_dir)
IMAGE_KERNEL_CACHE = (
    "/opt/pagoda/kernel-cache"  # the engine image's own warmed kernels (its PAGODA_KERNEL_CACHE)
)
# exit 0 whatever the compile did: the weights are what the Job is for, a kernel compiled at start-up is slower
KERNEL_SCRIPT = (
    'pagoda kernels warm "$@" > /dev/null || echo "pagoda kernels warm failed (exit $?): the engine compiles '
    'its kernels when it starts" >&2'
)
COMPONENT_LABEL = "pagoda.dev/component"
COMPONENT = "model-download"
DEFAULT_IMAGE_REPO = "localhost/pagoda-operator"  # what `make image-check` builds (images/check.py)
SECRET_KEYS = {
    "hf": ("HF_TOKEN",),
    "s3": (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_REGION",
        "AWS_ENDPOINT_URL",
    ),
}
BACKOFF_LIMIT = 4  # retries of a failed download pod (each resumes); none for the reasons below
FINAL_EXIT_CODES = sorted(EXIT_CODES[r] for r in (ACCESS_DENIED, NOT_FOUND, VOLUME_FULL))
LOG_TAIL_LINES = 40
SIZE_FACTOR, SIZE_MARGIN = 1.2, 2 * GiB  # cache claim for `size: auto`: the weights x 1.2 + 2 GiB
# status.model.phase
PENDING, DOWNLOADING, READY_PHASE, FAILED_PHASE = "Pending", "Downloading", "Ready", "Failed"


def download_image() -> str:
    """$PAGODA_DOWNLOAD_IMAGE (the chart sets the operator's image), else ours at this package's version."""
    override = envs.download_image()
    if override:
        return override
    return f"{DEFAULT_IMAGE_REPO}:{objects.default_image().rsplit(':', 1)[-1]}"


def claim_name(name: str, spec: InferenceSpec) -> str:
    """The claim downloaded weights live on: spec.model.cache.claimName, else the one the operator makes."""
    return spec.model.cache.claim_name or f"{name}-model-cache"


def cache_bytes(spec: InferenceSpec, decision: Decision) -> int:
    """spec.model.cache.size, else the weights' bytes x 1.2 + 2 GiB in whole GiB."""
    if spec.model.cache.size:
        return spec.model.cache.size
    weights = decision.shape.weight_bytes if decision.shape is not None else 0
    return -(-int(weights * SIZE_FACTOR + SIZE_MARGIN) // GiB) * GiB


def model_path(spec: InferenceSpec) -> str:
    """What `pagoda serve` gets as its model for a downloaded source: the hub id (found in HF_HOME) or the
    directory the S3 objects were written to."""
    if spec.model.kind == "s3":
        return f"{S3_DIR}/{spec.model.location.rstrip('/')}"
    return spec.model.model_id


def adapter_path(adapter: AdapterSpec) -> str:
    """Where the engine finds a downloaded adapter: `org/name[@revision]` (found in HF_HOME), or the directory
    its S3 objects were written to."""
    if adapter.kind == "s3":
        return f"{S3_DIR}/{adapter.location.rstrip('/')}"
    return adapter.location


def downloaded_adapters(spec: InferenceSpec) -> list[AdapterSpec]:
    return [a for a in spec.adapters if a.downloads]


def download_key(spec: InferenceSpec) -> str:
    """A short digest of what is downloaded: a new source, revision or downloaded adapter is a new Job."""
    what = [f"{spec.model.source}@{spec.model.revision or ''}"] if spec.model.downloads else []
    what += [a.source for a in downloaded_adapters(spec)]
    return hashlib.sha256("\n".join(what).encode()).hexdigest()[:8]


def job_name(name: str, spec: InferenceSpec) -> str:
    return f"{name}-download-{download_key(spec)}"


def download_container(spec: InferenceSpec) -> dict[str, Any]:
    args = []
    if spec.model.downloads:
        args += [
            "--source",
            spec.model.source.split("@", 1)[0] if spec.model.kind == "hf" else spec.model.source,
        ]
    args += ["--dest", CACHE_DIR, "--termination-log", objects.TERMINATION_LOG]
    if spec.model.kind == "hf":
        args += ["--revision", spec.model.revision or "main"]
    for adapter in downloaded_adapters(spec):
        args += ["--adapter", adapter.source]
    env: list[dict[str, Any]] = [{"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"}]
    if spec.model.secret_ref is not None:
        secret = spec.model.secret_ref.name
        kinds = {spec.model.kind} | {a.kind for a in downloaded_adapters(spec)}
        env += [
            {"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": True}}}
            for kind in ("hf", "s3")
            if kind in kinds
            for key in SECRET_KEYS[kind]
        ]
    return {
        "name": CONTAINER,
        "image": download_image(),
        "imagePullPolicy": "IfNotPresent",
        "command": ["pagoda-model-download"],
        "args": args,
        "env": env,
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
        "volumeMounts": [
            {"name": "model-cache", "mountPath": CACHE_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "terminationMessagePath": objects.TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "runAsNonRoot": True,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }


def kernel_dir(image: str, gpu_product: str, serve_args: list[str]) -> str:
    """The cache volume's folder of the kernels an engine with these serve flags launches on this GPU, from
    this image (its torch and Triton make the cache keys): a new plan or image is a new folder."""
    what = json.dumps([image, gpu_product, serve_args])
    return f"{KERNELS_DIR}/{hashlib.sha256(what.encode()).hexdigest()[:16]}"


def kernel_cache_env(image: str, gpu_product: str, serve_args: list[str]) -> dict[str, str]:
    """PAGODA_KERNEL_CACHE of an engine pod: the deployment's kernels first, then the image's."""
    return {
        "name": "PAGODA_KERNEL_CACHE",
        "value": f"{kernel_dir(image, gpu_product, serve_args)}:{IMAGE_KERNEL_CACHE}",
    }


def kernel_container(
    image: str, gpu_product: str, serve_args: list[str], spec: InferenceSpec
) -> dict[str, Any]:
    """`pagoda kernels warm` for the engine `pagoda serve <serve_args>` on this GPU (a catalogue name or GFD
    product label), from the engine image, into kernel_dir on the cache volume; reads the model's config from
    the cache (HF_HOME, offline), needs no GPU, and exits 0 even when it fails (KERNEL_SCRIPT)."""
    args = ["--gpu", gpu_product, "--cache-dir", kernel_dir(image, gpu_product, serve_args), "--jobs", "2",
            "--", *serve_args]  # fmt: skip
    env = [
        {"name": "HF_HOME", "value": HF_HOME},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "HOME", "value": "/tmp"},
        {"name": "TRITON_CACHE_DIR", "value": "/tmp/triton"},
        {"name": "PAGODA_NATIVE_KERNELS", "value": "0"},
    ]
    return {
        "name": KERNEL_CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["sh", "-c", KERNEL_SCRIPT, KERNEL_CONTAINER],
        "args": args,
        "env": env,
        "resources": {"requests": {"cpu": "2", "memory": "2Gi"}, "limits": {"memory": "8Gi"}},
        "volumeMounts": [
            {"name": "model-cache", "mountPath": CACHE_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": download_container(spec)["securityContext"],
    }


def cache_claim(
    body: dict[str, Any], spec: InferenceSpec, decision: Decision, replicas: int
) -> dict[str, Any]:
    """The shared cache claim the operator creates (not with cache.claimName or perPod)."""
    name = body["metadata"]["name"]
    mode = spec.model.cache.access_mode
    if mode == "auto":
        mode = "ReadWriteOnce" if replicas <= 1 else "ReadWriteMany"
    claim_spec: dict[str, Any] = {
        "accessModes": [mode],
        "resources": {"requests": {"storage": format_quantity(cache_bytes(spec, decision))}},
    }
    if spec.model.cache.storage_class:
        claim_spec["storageClassName"] = spec.model.cache.storage_class
    meta = objects.metadata(body, claim_name(name, spec))
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": claim_spec}


def download_job(
    body: dict[str, Any], spec: InferenceSpec, kernels: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A Job that fills the cache claim once; retried (resuming) unless the failure is final. With
    ``kernels`` (kernel_container's, GPU deployments) the download is its init container and the kernels
    are compiled after it."""
    name = body["metadata"]["name"]
    labels = {**objects.common_labels(name), COMPONENT_LABEL: COMPONENT}
    labels[objects.LABEL_NAME] = "pagoda-model-download"  # not an engine pod: selectors and PDB skip it
    meta = objects.metadata(body, job_name(name, spec))
    meta["labels"] = dict(labels)
    pod_spec = {
        "restartPolicy": "Never",
        **(
            {"initContainers": [download_container(spec)], "containers": [kernels]}
            if kernels
            else {"containers": [download_container(spec)]}
        ),
        "volumes": [
            {"name": "model-cache", "persistentVolumeClaim": {"claimName": claim_name(name, spec)}},
            {"name": "tmp", "emptyDir": {}},
        ],
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    objects.pod_fields(spec, pod_spec)  # pull secrets (the operator image may be private), scheduling
    return objects.with_hash(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": meta,
            "spec": {
                "backoffLimit": BACKOFF_LIMIT,
                "podFailurePolicy": {
                    "rules": [
                        {
                            "action": "FailJob",
                            "onExitCodes": {
                                "containerName": CONTAINER,
                                "operator": "In",
                                "values": FINAL_EXIT_CODES,
                            },
                        }
                    ]
                },
                "template": {"metadata": {"labels": labels}, "spec": pod_spec},
            },
        }
    )


def _result(pods: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The download's result line from the newest finished pod's termination message."""
    for pod in sorted(pods, key=lambda p: p.get("metadata", {}).get("creationTimestamp") or "", reverse=True):
        status = pod.get("status") or {}
        for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
            message = ((cs.get("state") or {}).get("terminated") or {}).get("message") or ""
            for line in reversed(message.strip().splitlines()):
                try:
                    data = json.loads(line)
                except ValueError:
                    continue
                if isinstance(data, dict) and data.get("format") == FORMAT:
                    return data
    return None


def download_state(
    spec: InferenceSpec, job: dict[str, Any] | None, pods: list[dict[str, Any]], log: str, claim: str
) -> dict[str, Any]:
    """status.model from the Job, its pods and the running pod's log tail."""
    source = spec.model.source if spec.model.downloads else downloaded_adapters(spec)[0].source
    state: dict[str, Any] = {"source": source, "claim": claim, "phase": PENDING}
    if downloaded_adapters(spec):
        state["adapters"] = [a.source for a in downloaded_adapters(spec)]
    if spec.model.revision:
        state["revision"] = spec.model.revision
    if job is None:
        return state
    state["job"] = job["metadata"]["name"]
    status = job.get("status") or {}
    progress = parse_progress(log) or {}
    state.update({k: v for k, v in progress.items() if k in ("bytes", "totalBytes", "files", "totalFiles")})
    result = _result(pods)
    failed = any(
        c.get("type") == "Failed" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    if int(status.get("succeeded") or 0) > 0:
        state["phase"] = READY_PHASE
        if result and result.get("reason") == READY:
            state.update(bytes=result["bytes"], totalBytes=result["bytes"], files=result["files"],
                         totalFiles=result["files"], message=result["message"])  # fmt: skip
        return state
    if failed:
        state["phase"] = FAILED_PHASE
        state["reason"] = (result or {}).get("reason") or FAILED
        state["message"] = (result or {}).get("message") or next(
            (c.get("message") for c in status.get("conditions") or [] if c.get("type") == "Failed"),
            "the Job failed",
        )
        return state
    if int(status.get("active") or 0) > 0:
        state["phase"] = DOWNLOADING
    if result and result.get("reason") != READY:  # a try that failed and will be retried
        state["lastError"] = f"{result['reason']}: {result['message']}"
    return state


def progress_words(state: dict[str, Any]) -> str:
    if not state.get("totalBytes"):
        return f"downloading {state['source']} (job {state.get('job', '-')})"
    done, total = state.get("bytes", 0), state["totalBytes"]
    return (
        f"downloading {state['source']}: {done / GiB:.2f} of {total / GiB:.2f} GiB ({100 * done / total:.0f}%), "
        f"{state.get('files', 0)} of {state.get('totalFiles', 0)} files (job {state.get('job')})"
    )
