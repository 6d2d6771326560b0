"""The child objects an InferenceDeployment becomes: pure functions from (object, spec, decision) to dicts.

Nothing here talks to the API, so `pagoda render` prints exactly what the operator would apply.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pagoda.engine import envs
from pagoda.engine.cli.serve_args import to_argv
from pagoda.operator.discovery import INFERENCE_POOL_API, LWS_API
from pagoda.operator.objects import (
    API_VERSION as API_VERSION,
)
from pagoda.operator.objects import (
    DEFAULT_IMAGE_REPO as DEFAULT_IMAGE_REPO,
)
from pagoda.operator.objects import (
    GROUP as GROUP,
)
from pagoda.operator.objects import (
    HASH_ANNOTATION as HASH_ANNOTATION,
)
from pagoda.operator.objects import (
    KIND,
    LABEL_INSTANCE,
    LABEL_NAME,
    TERMINATION_LOG,
    common_labels,
    cpu_flavour,
    default_image,
    selector_labels,
    with_hash,
)
from pagoda.operator.objects import (
    LABEL_MANAGED as LABEL_MANAGED,
)
from pagoda.operator.objects import (
    LABEL_OWNER as LABEL_OWNER,
)
from pagoda.operator.objects import (
    MANAGED_BY as MANAGED_BY,
)
from pagoda.operator.objects import (
    PLURAL as PLURAL,
)
from pagoda.operator.objects import (
    VERSION as VERSION,
)
from pagoda.operator.objects import metadata as _metadata
from pagoda.operator.objects import pod_fields as _pod_fields
from pagoda.operator.planning import Decision
from pagoda.operator.quantity import format_quantity
from pagoda.operator.spec import DEFAULT_POLICY, ROUTER_HTTP_PORT, AdapterSpec, InferenceSpec, SpecError

ENGINE_PORT = 8000
MASTER_PORT = 29501  # on a group's leader: where the ranks of a replica spanning pods meet (--master-port)
KV_PORT = 14579  # a prefill engine's KV transfer port (the producer's kv_port)
LABEL_ROLE = "pagoda.dev/role"  # leader / worker of a LeaderWorkerSet group; prefill / decode of a pool
LEADER, WORKER, PREFILL, DECODE = "leader", "worker", "prefill", "decode"
# What LeaderWorkerSet sets in every pod of a group; the kubelet expands $(NAME) in args from the env
LWS_LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
LWS_WORKER_INDEX = "LWS_WORKER_INDEX"  # 0 is the leader
LWS_GROUP_SIZE = "LWS_GROUP_SIZE"
# The KV transfer roles of the two pools (vLLM's --kv-transfer-config spelling)
KV_ROLES = {
    PREFILL: {"kv_connector": "PagodaConnector", "kv_role": "kv_producer", "kv_port": KV_PORT},
    DECODE: {"kv_connector": "PagodaConnector", "kv_role": "kv_consumer"},
}
KV_DIR = "/var/cache/pagoda/kv"
MODELS_DIR = "/models"
PLAN_ANNOTATION = "pagoda.dev/plan-hash"  # on the pod template: which plan a pod was started with
PRODUCT_LABEL = "nvidia.com/gpu.product"
ROUTER_PORT = ROUTER_HTTP_PORT
LABEL_SERVICE = "pagoda.dev/service"
LABEL_SCRAPE = "pagoda.dev/scrape"  # Services whose endpoints the ServiceMonitor scrapes
# Drain (docs/operator.md): before SIGTERM the pod waits PRESTOP_SECONDS (endpoints and the router's health
# checks catch up), then the engine answers /health 503 while in-flight requests finish for up to
# spec.drain.timeoutSeconds (--shutdown-grace-seconds); the kubelet's grace period covers both plus a margin.
PRESTOP_SECONDS = 5
GRACE_MARGIN_SECONDS = 10
# What the autoscaler reads: the Prometheus Adapter rules in docs/operator.md expose these names.
ADAPTER_METRICS = {
    "kvCacheUsage": ("Pods", "pagoda_kv_cache_usage"),
    "waitingRequests": ("Pods", "pagoda_requests_waiting"),
    "ttftP90": ("External", "pagoda_ttft_p90_seconds"),
}
DEFAULT_PROMETHEUS_URL = "http://prometheus-operated.monitoring.svc:9090"
# Set for every engine container by the image or the engine's own start-up: never from spec.pod.env.
RESERVED_ENV = frozenset({"PAGODA_API_KEY", "HF_HUB_OFFLINE", "HF_HOME", "TRANSFORMERS_OFFLINE"})
HELD_REQUESTS = "pagoda:router_held_requests"  # the router's gauge of requests waiting for a ready engine
# How long the router of a deployment that scales to zero holds a request while no engine is ready (the
# engine's start-up: weights from the cache claim). Other deployments' routers hold nothing: 503 at once.
ROUTER_HOLD_SECONDS = 300
SCALE_UP_PODS = 2  # at most this many engine pods added per minute (each loads its weights first)


def engine_image(spec: InferenceSpec, *, cpu: bool) -> str:
    """The image the engine (and router) pods run: spec.image, else the operator's engine image in the
    flavour of the nodes they run on (its `-cpu` tag for a deployment planned onto CPUs)."""
    if spec.image:
        return spec.image
    return cpu_flavour(default_image()) if cpu else default_image()


def router_selector_labels(name: str) -> dict[str, str]:
    return {LABEL_NAME: "pagoda-router", LABEL_INSTANCE: name}


def router_name(name: str) -> str:
    return f"{name}-router"


def picker_name(name: str) -> str:
    """The endpoint picker's Deployment and Service (spec.gateway)."""
    return f"{name}-epp"


def picker_selector_labels(name: str) -> dict[str, str]:
    return {LABEL_NAME: "pagoda-epp", LABEL_INSTANCE: name}


def headless_name(name: str) -> str:
    return f"{name}-headless"


def prometheus_url() -> str:
    """Where a KEDA ScaledObject queries Prometheus: $PAGODA_PROMETHEUS_URL (the chart sets it)."""
    return envs.prometheus_url() or DEFAULT_PROMETHEUS_URL


def selector_string(name: str, role: str | None = None) -> str:
    """The scale subresource's selector (status.selector): the pods an autoscaler averages metrics over, a
    LeaderWorkerSet's leaders only (`role` leader: the workers serve no metrics of their own)."""
    return ",".join(f"{k}={v}" for k, v in engine_selector(name, role).items())


def plan_hash(args: list[str]) -> str:
    """A short digest of the engine's arguments: pods started with the same plan carry the same one."""
    return hashlib.sha256(json.dumps(args).encode()).hexdigest()[:16]


def engine_args(
    spec: InferenceSpec, decision: Decision, *, worker: bool = False, role: str | None = None
) -> list[str]:
    """`pagoda serve` arguments: model, listener, the plan's flags, then the user's extraArgs.

    Every flag here is one `pagoda serve` has: reconcile runs them through the engine's own dry run
    (operator/contract.py) before any pod exists. The device is explicit, so a GPU pod never falls back to
    the CPU and a CPU pod never probes for a GPU. A replica spanning pods (a LeaderWorkerSet group): the
    leader's command (node rank 0, serves the API), or with `worker` the other pods' (their rank from
    LeaderWorkerSet's $(LWS_WORKER_INDEX), headless); both meet at $(LWS_LEADER_ADDRESS). `role`: the KV
    transfer role of a prefill or decode pool (spec.disaggregation).
    """
    from pagoda.operator import model_cache  # (it renders with this module's helpers)

    model = spec.model
    args: list[str] = []
    if model.downloads:
        args.append(model_cache.model_path(spec))
    elif model.kind == "pvc":
        claim, _, path = model.source[len("pvc://") :].partition("/")
        args.append(f"{MODELS_DIR}/{claim}/{path}")
    elif model.kind == "file":
        args.append(model.source[len("file://") :])
    plan = decision.plan
    settings: dict[str, Any] = {  # EngineConfig fields and serve's server settings, rendered by its naming
        "host": "0.0.0.0",
        "port": ENGINE_PORT,
        "served_model_name": model.served_model_name,
        "revision": model.revision or None,
        "device": "cpu" if decision.gpu is None else "cuda",
        **plan.engine_settings(),
        "max_num_queued_reqs": decision.max_num_queued_reqs,
        "enable_prefix_caching": spec.engine.enable_prefix_caching,
        "kv_offload_disk_dir": KV_DIR if plan.kv_offload_disk_bytes else None,
        "shutdown_grace_seconds": spec.drain_seconds,
        "speculative_config": spec.engine.speculative.to_json() if spec.engine.speculative else None,
        **parallel_settings(decision, worker=worker),
        "kv_transfer_config": json.dumps(KV_ROLES[role], separators=(",", ":")) if role else None,
    }
    if spec.adapters:
        settings.update(
            enable_lora=True,
            max_loras=spec.max_loras,
            max_lora_rank=spec.engine.max_lora_rank,
            lora_modules=[f"{a.name}={adapter_path(a)}" for a in spec.adapters],
        )
    return args + to_argv(settings) + list(spec.engine.extra_args)


def parallel_settings(decision: Decision, *, worker: bool = False) -> dict[str, Any]:
    """The pipeline and multi-host flags of a replica (none for one stage on one pod), as EngineConfig
    fields: the same on every pod of a group but the node rank and --headless."""
    if decision.pipeline_parallel_size == 1 and not decision.multi_node:
        return {}
    if not decision.multi_node:
        return {"pipeline_parallel_size": decision.pipeline_parallel_size}
    return {
        "pipeline_parallel_size": decision.pipeline_parallel_size,
        "nnodes": decision.nnodes,
        "node_rank": f"$({LWS_WORKER_INDEX})" if worker else 0,
        "master_addr": f"$({LWS_LEADER_ADDRESS})",
        "master_port": MASTER_PORT,
        "headless": True if worker else None,
    }


def lws_env(name: str, namespace: str, rank: int, size: int, group: int = 0) -> dict[str, str]:
    """What LeaderWorkerSet sets in pod `rank` of group `group` (the leader's address is its pod's DNS name
    under the headless Service LWS makes, named as the LeaderWorkerSet)."""
    return {
        LWS_LEADER_ADDRESS: f"{name}-{group}.{name}.{namespace}",
        LWS_WORKER_INDEX: str(rank),
        LWS_GROUP_SIZE: str(size),
    }


def expand_env(args: list[str], env: dict[str, str]) -> list[str]:
    """`args` as the kubelet runs them: $(VAR) replaced from the container's environment (unknown ones kept)."""
    out = []
    for arg in args:
        for key, value in env.items():
            arg = arg.replace(f"$({key})", value)
        out.append(arg)
    return out


def engine_commands(
    body: dict[str, Any], spec: InferenceSpec, decision: Decision
) -> list[tuple[str, list[str]]]:
    """Every distinct `pagoda serve` command the engine pods run, named, as their containers run it ($(VAR)
    expanded as LeaderWorkerSet and the kubelet do for the first group): one pod per replica; each pool's;
    or a group's leader and every worker rank ("" names the one command of one pod per replica). What the
    contract checks (operator/contract.py)."""
    if spec.disaggregation is not None:
        return [(f"the {r} pool", engine_args(spec, decision, role=r)) for r in (PREFILL, DECODE)]
    if not decision.multi_node:
        return [("", engine_args(spec, decision))]
    meta = body["metadata"]
    name, namespace = meta["name"], meta.get("namespace") or "default"
    size = decision.nnodes
    out = [("the group's leader", expand_env(engine_args(spec, decision), lws_env(name, namespace, 0, size)))]
    worker = engine_args(spec, decision, worker=True)
    out += [
        (f"worker {rank} of the group", expand_env(worker, lws_env(name, namespace, rank, size)))
        for rank in range(1, size)
    ]
    return out


def kernel_step(spec: InferenceSpec, decision: Decision) -> tuple[str, str, list[str]] | None:
    """(engine image, catalogue GPU, serve flags) of the kernels the download Job compiles into the model
    cache (model_cache.kernel_container) for a GPU deployment whose weights it downloads; None otherwise."""
    if decision.gpu is None or decision.gpu.spec is None or not spec.downloads:
        return None
    return engine_image(spec, cpu=False), decision.gpu.spec.name, engine_args(spec, decision)


def download_job(body: dict[str, Any], spec: InferenceSpec, decision: Decision) -> dict[str, Any]:
    """The Job that fills the model cache claim (hf:// and s3:// models), with the kernel step of a GPU
    deployment after the download: what reconcile creates and `pagoda render` shows."""
    from pagoda.operator import model_cache

    kernels = kernel_step(spec, decision)
    return model_cache.download_job(
        body, spec, model_cache.kernel_container(*kernels, spec) if kernels else None
    )


def model_objects(body: dict[str, Any], spec: InferenceSpec, decision: Decision) -> list[dict[str, Any]]:
    """The objects the operator creates before any engine pod of a model it downloads into a shared cache:
    the cache claim (unless spec.model.cache.claimName names one that exists) and the download Job. None
    for other models, or a per-pod cache (each pod fills its own claim template)."""
    from pagoda.operator import model_cache

    if not spec.downloads or spec.model.cache.per_pod:
        return []
    out = []
    if not spec.model.cache.claim_name:
        pods = spec.max_possible_replicas * decision.nnodes  # every pod of a group mounts the claim
        out.append(model_cache.cache_claim(body, spec, decision, pods))
    return out + [download_job(body, spec, decision)]


def adapter_path(adapter: AdapterSpec) -> str:
    """Where the engine pod finds an adapter: in the model cache (hf://, s3://), on its claim (pvc://, mounted
    like a pvc:// model) or in the image (file://)."""
    if adapter.downloads:
        from pagoda.operator import model_cache

        return model_cache.adapter_path(adapter)
    if adapter.kind == "pvc":
        claim, _, path = adapter.location.partition("/")
        return f"{MODELS_DIR}/{claim}/{path}"
    return adapter.location  # file:///path


def pvc_claims(spec: InferenceSpec) -> list[str]:
    """The claims of pvc:// sources (the model's and the adapters'), each mounted once at /models/CLAIM."""
    sources = [spec.model.source] + [a.source for a in spec.adapters]
    return list(dict.fromkeys(s[len("pvc://") :].split("/", 1)[0] for s in sources if s.startswith("pvc://")))


def termination_grace_seconds(spec: InferenceSpec) -> int:
    """The kubelet's grace period: the preStop pause, the engine's drain, and a margin to exit."""
    return PRESTOP_SECONDS + spec.drain_seconds + GRACE_MARGIN_SECONDS


def _drain_hook() -> dict[str, Any]:
    # A pause before SIGTERM: the pod leaves the Service endpoints and the router's view while it still
    # serves; after SIGTERM the engine itself drains (503 on /health, in-flight requests finish).
    return {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SECONDS)]}}}


def _resources(spec: InferenceSpec, decision: Decision) -> dict[str, Any]:
    requests = dict(spec.resources.get("requests", {}))
    limits = dict(spec.resources.get("limits", {}))
    if "memory" not in requests and "memory" not in limits:
        # The engine itself plus the KV it keeps in RAM (planning.pod_memory_bytes).
        requests["memory"] = limits["memory"] = format_quantity(decision.pod_memory_bytes)
    requests.setdefault("cpu", str(decision.pod_cpu))
    if decision.gpu is not None:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(decision.pod_gpus or spec.gpu.count)
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


def _api_key_env(spec: InferenceSpec) -> list[dict[str, Any]]:
    if not spec.api_key_secret:
        return []
    secret, key = spec.api_key_secret
    return [{"name": "PAGODA_API_KEY", "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}]


def engine_env(spec: InferenceSpec) -> list[dict[str, Any]]:
    """The environment the operator gives the engine container (spec.pod.env comes after it)."""
    env: list[dict[str, Any]] = [{"name": "HF_HUB_OFFLINE", "value": "1"}]
    if spec.gpu.count > 0:  # a GPU pod never builds nor loads the CPU path's C kernels
        env.append({"name": "PAGODA_NATIVE_KERNELS", "value": "0"})
    if spec.model.kind == "hf" or any(a.kind == "hf" for a in spec.adapters):
        from pagoda.operator.model_cache import HF_HOME

        env.append({"name": "HF_HOME", "value": HF_HOME})
    return env + _api_key_env(spec)


def check_pod_fields(spec: InferenceSpec) -> None:
    """spec.pod.env may not set what the operator sets itself (the engine would see one or the other,
    depending on the order): raises SpecError naming the variable."""
    ours = {e["name"] for e in engine_env(spec)} | RESERVED_ENV
    for i, item in enumerate(spec.pod.env):
        if item["name"] in ours:
            raise SpecError(
                f"pod.env[{i}]",
                f"{item['name']} is set by the operator ({', '.join(sorted(ours))} are): use the spec field "
                "that controls it (apiKeySecretRef, model.source) instead",
                reason="InvalidPodFields",
            )


def _engine_pod(
    body: dict[str, Any],
    spec: InferenceSpec,
    decision: Decision,
    args: list[str],
    *,
    serving: bool = True,
    role: str | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """An engine pod's spec and the claim templates it needs. `serving`: it runs the API server (HTTP port,
    probes, drain); a LeaderWorkerSet worker does not (it runs ranks only; the group restarts as one when
    any of its pods does). A prefill pool's pods also expose the KV transfer port."""
    name = body["metadata"]["name"]
    kernels = kernel_step(spec, decision)
    env = engine_env(spec)
    if kernels:
        from pagoda.operator import model_cache

        env.append(model_cache.kernel_cache_env(*kernels))
    env += list(spec.pod.env)
    mounts: list[dict[str, Any]] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    shm = format_quantity(decision.shm_bytes)  # counted in the pod's memory (planning.needed_memory_bytes)
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}},
        {"name": "tmp", "emptyDir": {}},
    ]
    init_containers: list[dict[str, Any]] = []
    claim_templates: list[dict[str, Any]] = []
    if spec.downloads:
        from pagoda.operator import model_cache

        mounts.append({"name": "model-cache", "mountPath": model_cache.CACHE_DIR, "readOnly": True})
        if spec.model.cache.per_pod:  # each pod downloads into its own claim before the engine starts
            init_containers.append(model_cache.download_container(spec))
            if kernels:
                init_containers.append(model_cache.kernel_container(*kernels, spec))
            claim = model_cache.cache_claim(body, spec, decision, 1)
            claim_templates.append(
                {**claim, "metadata": {"name": "model-cache", "labels": selector_labels(name)}}
            )
        else:
            claim = {"claimName": model_cache.claim_name(name, spec), "readOnly": True}
            volumes.append({"name": "model-cache", "persistentVolumeClaim": claim})
    for i, claim in enumerate(pvc_claims(spec)):
        volume = "model" if i == 0 else f"model-{i}"
        mounts.append({"name": volume, "mountPath": f"{MODELS_DIR}/{claim}", "readOnly": True})
        volumes.append({"name": volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
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

    container: dict[str, Any] = {
        "name": "engine",
        "image": engine_image(spec, cpu=decision.gpu is None),
        "imagePullPolicy": "IfNotPresent",
        "command": ["pagoda", "serve"],
        "args": args,
        "env": env,
        **({"envFrom": list(spec.pod.env_from)} if spec.pod.env_from else {}),
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "resources": _resources(spec, decision),
        "startupProbe": _probe("/health", 10, 180),  # weights can take many minutes to load
        "readinessProbe": _probe("/health", 5, 3),
        "livenessProbe": _probe("/health", 10, 6),
        "volumeMounts": mounts,
        "lifecycle": _drain_hook(),
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
        node_selector.update(decision.node_selector or {PRODUCT_LABEL: decision.product_label})
        tolerations.append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
    pod_spec: dict[str, Any] = {
        **({"initContainers": init_containers} if init_containers else {}),
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
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
    _pod_fields(spec, pod_spec)
    if spec.pod.runtime_class_name:
        pod_spec["runtimeClassName"] = spec.pod.runtime_class_name
    if role == PREFILL:
        container["ports"].append({"name": "kv", "containerPort": KV_PORT, "protocol": "TCP"})
    if not serving:
        for key in ("ports", "startupProbe", "readinessProbe", "livenessProbe", "lifecycle"):
            container.pop(key)
    return pod_spec, claim_templates


def pool_name(name: str, role: str | None) -> str:
    """The engines' StatefulSet (and the stem of their headless Service): NAME, or NAME-prefill /
    NAME-decode for the pools of spec.disaggregation."""
    return f"{name}-{role}" if role else name


def engine_selector(name: str, role: str | None = None) -> dict[str, str]:
    """The pods a Service, the router and a pool's StatefulSet mean: every engine, a pool's (role prefill or
    decode), or a LeaderWorkerSet's leaders (role leader: a group is one replica)."""
    return {**selector_labels(name), **({LABEL_ROLE: role} if role else {})}


def _template_meta(name: str, args: list[str], role: str | None, *, scraped: bool = True) -> dict[str, Any]:
    annotations = {PLAN_ANNOTATION: plan_hash(args)}
    if scraped:
        annotations = {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(ENGINE_PORT),
            "prometheus.io/path": "/metrics",
            **annotations,
        }
    labels = {**common_labels(name), **({LABEL_ROLE: role} if role else {})}
    return {"labels": labels, "annotations": annotations}


def statefulset(
    body: dict[str, Any], spec: InferenceSpec, decision: Decision, role: str | None = None
) -> dict[str, Any]:
    """The engines of one pod per replica: every replica, or one pool of spec.disaggregation (`role`)."""
    name = body["metadata"]["name"]
    args = engine_args(spec, decision, role=role)
    pod_spec, claim_templates = _engine_pod(body, spec, decision, args, role=role)
    dis = spec.disaggregation
    replicas = spec.engine_replicas if dis is None or role is None else getattr(dis, role).replicas
    sts_spec: dict[str, Any] = {
        "replicas": replicas,
        "serviceName": headless_name(pool_name(name, role)),
        "podManagementPolicy": "Parallel",
        "selector": {"matchLabels": engine_selector(name, role)},
        "template": {"metadata": _template_meta(name, args, role), "spec": pod_spec},
    }
    if claim_templates:
        sts_spec["volumeClaimTemplates"] = claim_templates
        # The disk tier outlives pod restarts (that is its point) but not the deployment.
        sts_spec["persistentVolumeClaimRetentionPolicy"] = {"whenDeleted": "Delete", "whenScaled": "Retain"}
    return with_hash(
        {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _metadata(body, pool_name(name, role)),
         "spec": sts_spec}
    )  # fmt: skip


def leader_worker_set(body: dict[str, Any], spec: InferenceSpec, decision: Decision) -> dict[str, Any]:
    """A replica spanning pods: a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) of spec.replicas groups of
    `nnodes` pods. The leader serves the API and runs the first ranks; the workers join at its address. A
    pod that fails restarts its whole group (the ranks of a replica cannot rejoin one by one), and the
    deployment scales by groups."""
    name = body["metadata"]["name"]
    leader_args = engine_args(spec, decision)
    worker_args = engine_args(spec, decision, worker=True)
    leader_pod, _ = _engine_pod(body, spec, decision, leader_args)
    worker_pod, _ = _engine_pod(body, spec, decision, worker_args, serving=False)
    return with_hash(
        {
            "apiVersion": LWS_API,
            "kind": "LeaderWorkerSet",
            "metadata": _metadata(body, name),
            "spec": {
                "replicas": spec.engine_replicas,
                "startupPolicy": "LeaderCreated",
                "rolloutStrategy": {
                    "type": "RollingUpdate",
                    "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0},
                },
                "leaderWorkerTemplate": {
                    "size": decision.nnodes,
                    "restartPolicy": "RecreateGroupOnPodRestart",
                    "leaderTemplate": {
                        "metadata": _template_meta(name, leader_args, LEADER),
                        "spec": leader_pod,
                    },
                    "workerTemplate": {
                        "metadata": _template_meta(name, worker_args, WORKER, scraped=False),
                        "spec": worker_pod,
                    },
                },
            },
        }
    )


def engine_sets(body: dict[str, Any], spec: InferenceSpec, decision: Decision) -> list[dict[str, Any]]:
    """The engines: a StatefulSet, a LeaderWorkerSet (a replica spanning pods), or a StatefulSet per pool
    (spec.disaggregation)."""
    if spec.disaggregation is not None:
        return [statefulset(body, spec, decision, PREFILL), statefulset(body, spec, decision, DECODE)]
    if decision.multi_node:
        return [leader_worker_set(body, spec, decision)]
    return [statefulset(body, spec, decision)]


def services(
    body: dict[str, Any], spec: InferenceSpec | None = None, decision: Decision | None = None
) -> list[dict[str, Any]]:
    """The client Service (named as the InferenceDeployment, so clients never change) and the engines'
    headless Service. With a router the client Service selects the router pods; the router finds the
    engines through the headless Service's DNS. A replica spanning pods is its leader there (the pod that
    serves the API); two pools (spec.disaggregation) have a headless Service each."""
    name = body["metadata"]["name"]
    routed = spec is not None and spec.routing.policy is not None
    port = {"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}
    leaders = decision is not None and decision.multi_node
    client = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(body, name),
        "spec": {
            "type": "ClusterIP",
            "selector": router_selector_labels(name)
            if routed
            else engine_selector(name, LEADER if leaders else None),
            "ports": [port],
        },
    }
    client["metadata"]["labels"][LABEL_SERVICE] = "client"
    if routed:  # the router's own metrics; the engines' come through the headless Service
        client["metadata"]["labels"][LABEL_SCRAPE] = "true"
    roles: list[str | None] = [None]
    if spec is not None and spec.disaggregation is not None:
        roles = [PREFILL, DECODE]
    elif leaders:
        roles = [LEADER]
    out = [with_hash(client)]
    for role in roles:
        pool = role if role in (PREFILL, DECODE) else None
        headless = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _metadata(body, headless_name(pool_name(name, pool))),
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": engine_selector(name, role),
                "ports": [port],
            },
        }
        headless["metadata"]["labels"][LABEL_SERVICE] = "headless"
        headless["metadata"]["labels"][LABEL_SCRAPE] = "true"
        out.append(with_hash(headless))
    return out


def router_args(body: dict[str, Any], spec: InferenceSpec, *, picker: bool = False) -> list[str]:
    """`pagoda router` arguments: the policy, the engines' headless Service as DNS, the served model
    (tests/contract/test_router_args.py runs them through `pagoda router --dry-run`). The endpoint picker
    (`picker`, spec.gateway) is the same router with the ext_proc port, spec.routing's policy or tierAware."""
    meta = body["metadata"]
    namespace = meta.get("namespace") or "default"
    policy = spec.routing.policy or (DEFAULT_POLICY if picker else None)
    assert policy is not None

    def dns(role: str | None) -> str:
        return f"{headless_name(pool_name(meta['name'], role))}.{namespace}.svc.cluster.local:{ENGINE_PORT}"

    split = spec.disaggregation is not None and not picker
    args = [
        "--host", "0.0.0.0",
        "--port", str(ROUTER_PORT),
        "--policy", policy,
        "--backend-dns", dns(DECODE if split else None),
        "--model", spec.model.served_model_name,
    ]  # fmt: skip
    if split:  # a request goes to a prefill engine, then a decode engine (x-prefiller-host-port)
        args += ["--prefill-backend-dns", dns(PREFILL)]
    if spec.model.kind != "default":
        # The router hashes prompts into the engines' block hashes with the model's tokenizer; only the
        # default model's ships in the image, others are asked of an engine (/tokenize).
        args += ["--tokenizer", "backend"]
    if spec.scales_to_zero:
        # Requests wait for the engine that they wake (bounded: the router's --hold-max-requests and
        # --hold-max-bytes); without scale to zero an outage is a 503 with Retry-After at once.
        args += ["--hold-seconds", str(ROUTER_HOLD_SECONDS)]
    if picker and spec.gateway is not None:
        args += ["--ext-proc-port", str(spec.gateway.picker_port)]
    # The API key (apiKeySecretRef) reaches the router as $PAGODA_API_KEY, which `pagoda router` reads.
    return args


def router_deployment(
    body: dict[str, Any], spec: InferenceSpec, *, cpu: bool = False, picker: bool = False
) -> dict[str, Any]:
    """The router: one pod from the engine image (`pagoda router`; the engines' flavour, so a deployment
    needs one image), in front of the engine pods. With `picker`, the Gateway's endpoint picker (spec.gateway):
    the same router serving ext_proc too, under its own name and labels (the client Service never selects it)."""
    name = body["metadata"]["name"]
    env = _api_key_env(spec)
    ports = [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}]
    if picker and spec.gateway is not None:
        ports.append({"name": "grpc-ext-proc", "containerPort": spec.gateway.picker_port, "protocol": "TCP"})
    container = {
        "name": "epp" if picker else "router",
        "image": engine_image(spec, cpu=cpu),
        "imagePullPolicy": "IfNotPresent",
        "command": ["pagoda", "router"],
        "args": router_args(body, spec, picker=picker),
        "env": env,
        "ports": ports,
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}},
        # /livez: the router itself (its /health is 503 while no engine is routable: an engine outage must
        # neither restart the router nor take it out of the Service; it answers 503 + Retry-After meanwhile)
        "readinessProbe": _probe("/livez", 5, 3),
        "livenessProbe": _probe("/livez", 10, 6, initial=10),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "runAsNonRoot": True,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    selector = picker_selector_labels(name) if picker else router_selector_labels(name)
    labels = {**common_labels(name), **selector}
    meta = _metadata(body, picker_name(name) if picker else router_name(name))
    meta["labels"] = dict(labels)
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
        "terminationGracePeriodSeconds": 30,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # DNS finds the engines, not the API
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    _pod_fields(spec, pod_spec)  # the same image (pull secrets) and scheduling; no GPU runtime
    return with_hash(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta,
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": selector},
                "template": {
                    "metadata": {
                        "labels": labels,
                        "annotations": {
                            "prometheus.io/scrape": "true",
                            "prometheus.io/port": str(ROUTER_PORT),
                            "prometheus.io/path": "/metrics",
                        },
                    },
                    "spec": pod_spec,
                },
            },
        }
    )


def picker_service(body: dict[str, Any], spec: InferenceSpec) -> dict[str, Any]:
    """The endpoint picker's Service, which the InferencePool's endpointPickerRef names: the gRPC port the
    gateway calls (HTTP/2 cleartext, as the extension's own picker Service declares it) and the router's
    HTTP port (its /metrics, scraped through this Service)."""
    name = body["metadata"]["name"]
    assert spec.gateway is not None
    port = spec.gateway.picker_port
    meta = _metadata(body, picker_name(name))
    # scraped like the router's (the ServiceMonitor's "http" port): its held requests wake a scaled-to-zero
    # deployment as the router's do (held_requests_query sums every pod of the instance)
    meta["labels"][LABEL_SCRAPE] = "true"
    return with_hash(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta,
            "spec": {
                "type": "ClusterIP",
                "selector": picker_selector_labels(name),
                "ports": [
                    {"name": "grpc-ext-proc", "port": port, "targetPort": "grpc-ext-proc", "protocol": "TCP",
                     "appProtocol": "http2"},
                    {"name": "http", "port": ROUTER_PORT, "targetPort": "http", "protocol": "TCP"},
                ],
            },
        }
    )  # fmt: skip


def inference_pool(body: dict[str, Any], spec: InferenceSpec, *, leaders: bool = False) -> dict[str, Any]:
    """The InferencePool (inference.networking.k8s.io/v1) a Gateway's HTTPRoute names as its backend: the
    engine pods (the StatefulSet's selector), their OpenAI port, and our picker's Service."""
    name = body["metadata"]["name"]
    assert spec.gateway is not None
    return with_hash(
        {
            "apiVersion": INFERENCE_POOL_API,
            "kind": "InferencePool",
            "metadata": _metadata(body, name),
            "spec": {
                "selector": {"matchLabels": engine_selector(name, LEADER if leaders else None)},
                "targetPorts": [{"number": ENGINE_PORT}],
                "endpointPickerRef": {
                    "group": "",
                    "kind": "Service",
                    "name": picker_name(name),
                    "port": {"number": spec.gateway.picker_port},
                    "failureMode": spec.gateway.failure_mode,
                },
            },
        }
    )


def gateway_objects(
    body: dict[str, Any], spec: InferenceSpec, *, cpu: bool = False, leaders: bool = False
) -> list[dict[str, Any]]:
    """spec.gateway's children, in the order they are applied: the picker, then the pool that names it
    (`leaders`: the engines are LeaderWorkerSet groups, whose leaders serve)."""
    return [picker_service(body, spec), router_deployment(body, spec, cpu=cpu, picker=True),
            inference_pool(body, spec, leaders=leaders)]  # fmt: skip


def quantity(value: float) -> str:
    """A number as the API server writes a Quantity back (800m, 4, 2500m): rendered in canonical form, or
    every reconcile would see drift."""
    milli = max(round(value * 1000), 1)  # a positive target never renders as 0
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def _scale_target(name: str) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": name}


def _behavior(spec: InferenceSpec) -> dict[str, Any]:
    """Scale down one engine at a time, no faster than one drains; scale up a couple of pods a minute."""
    period = min(max(60, PRESTOP_SECONDS + spec.drain_seconds), 1800)
    return {
        "scaleDown": {
            "stabilizationWindowSeconds": 300,
            "selectPolicy": "Min",
            "policies": [{"type": "Pods", "value": 1, "periodSeconds": period}],
        },
        "scaleUp": {
            "stabilizationWindowSeconds": 0,
            "selectPolicy": "Max",
            "policies": [{"type": "Pods", "value": SCALE_UP_PODS, "periodSeconds": 60}],
        },
    }


def hpa_metric(body: dict[str, Any], spec: InferenceSpec) -> dict[str, Any]:
    """The HPA metric for spec.autoscaling, named as the Prometheus Adapter rules expose it."""
    auto = spec.autoscaling
    assert auto is not None
    kind, metric = ADAPTER_METRICS[auto.metric]
    if kind == "Pods":
        return {
            "type": "Pods",
            "pods": {
                "metric": {"name": metric},
                "target": {"type": "AverageValue", "averageValue": quantity(auto.target)},
            },
        }
    selector = {"matchLabels": {"app_kubernetes_io_instance": body["metadata"]["name"]}}
    return {
        "type": "External",
        "external": {
            "metric": {"name": metric, "selector": selector},
            "target": {"type": "Value", "value": quantity(auto.target)},
        },
    }


def hpa(body: dict[str, Any], spec: InferenceSpec) -> dict[str, Any]:
    """An autoscaling/v2 HPA on the InferenceDeployment's scale subresource (it writes spec.replicas)."""
    auto = spec.autoscaling
    assert auto is not None
    name = body["metadata"]["name"]
    return with_hash(
        {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": _metadata(body, name),
            "spec": {
                "scaleTargetRef": _scale_target(name),
                # minReplicas 0 needs KEDA (an HPA scales to zero only behind a feature gate): at least 1 here
                "minReplicas": max(1, auto.min_replicas),
                "maxReplicas": auto.max_replicas,
                "metrics": [hpa_metric(body, spec)],
                "behavior": _behavior(spec),
            },
        }
    )


def prometheus_query(body: dict[str, Any], spec: InferenceSpec) -> tuple[str, str]:
    """(PromQL, KEDA metricType) for spec.autoscaling: sums KEDA averages over the pods, or one value."""
    auto = spec.autoscaling
    assert auto is not None
    sel = _selector(body)
    if auto.metric == "kvCacheUsage":
        return f"sum(vllm:kv_cache_usage_perc{{{sel}}})", "AverageValue"
    if auto.metric == "waitingRequests":
        return f"sum(vllm:num_requests_waiting{{{sel}}})", "AverageValue"
    query = (
        f"histogram_quantile(0.9, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{{{sel}}}[2m])))"
    )
    return query, "Value"


def _selector(body: dict[str, Any]) -> str:
    meta = body["metadata"]
    return f'namespace="{meta.get("namespace") or "default"}",app_kubernetes_io_instance="{meta["name"]}"'


def held_requests_query(body: dict[str, Any]) -> str:
    """Requests the deployment's router holds for want of a ready engine (router/hold.py)."""
    return f"sum({HELD_REQUESTS}{{{_selector(body)}}}) or vector(0)"


def scaled_object(body: dict[str, Any], spec: InferenceSpec) -> dict[str, Any]:
    """A KEDA ScaledObject (when KEDA is installed) on the scale subresource, querying Prometheus."""
    auto = spec.autoscaling
    assert auto is not None
    name = body["metadata"]["name"]
    query, metric_type = prometheus_query(body, spec)
    triggers: list[dict[str, Any]] = [
        {
            "type": "prometheus",
            "metricType": metric_type,
            "metadata": {
                "serverAddress": prometheus_url(),
                "query": query,
                "threshold": f"{auto.target:.15g}",
                "activationThreshold": "0",  # active (no scale to zero) while the metric is above 0
            },
        }
    ]
    if spec.scales_to_zero:
        # From zero: requests the router holds while no engine is ready start one (one engine per held
        # request, up to maxReplicas); the deployment goes back to zero after idleSeconds with none.
        triggers.append(
            {
                "type": "prometheus",
                "metricType": "AverageValue",
                "metadata": {
                    "serverAddress": prometheus_url(),
                    "query": held_requests_query(body),
                    "threshold": "1",
                    "activationThreshold": "0",
                },
            }
        )
    return with_hash(
        {
            "apiVersion": "keda.sh/v1alpha1",
            "kind": "ScaledObject",
            "metadata": _metadata(body, name),
            "spec": {
                "scaleTargetRef": _scale_target(name),
                "minReplicaCount": auto.min_replicas,
                "maxReplicaCount": auto.max_replicas,
                "pollingInterval": 15,
                # how long every trigger must be inactive before the last engine goes (minReplicas 0 only)
                "cooldownPeriod": auto.idle_seconds if spec.scales_to_zero else 300,
                "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(spec)}},
                "triggers": triggers,
            },
        }
    )


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
                # The engines through the headless Service, the router through the client Service when
                # there is one (never both for one pod).
                "selector": {"matchLabels": {LABEL_INSTANCE: name, LABEL_SCRAPE: "true"}},
                # Dashboards and alerts select engine series by these pod labels.
                "podTargetLabels": ["app.kubernetes.io/name", "app.kubernetes.io/instance"],
                "endpoints": [
                    {"port": "http", "path": "/metrics", "interval": spec.service_monitor_interval}
                ],
            },
        }
    )


def children(
    body: dict[str, Any],
    spec: InferenceSpec,
    decision: Decision,
    *,
    with_service_monitor: bool,
    with_keda: bool = False,
    with_gateway: bool = False,
) -> list[dict[str, Any]]:
    """Every child, in the order they are applied (the engines' StatefulSet last, after what it depends on:
    the router is ready to find engines as they come, the autoscaler targets this object, not the pods).
    `with_gateway`: the cluster serves inference.networking.k8s.io/v1 (spec.gateway's pool and picker)."""
    out = [*services(body, spec, decision), disruption_budget(body)]
    if with_service_monitor and spec.service_monitor:
        out.append(service_monitor(body, spec))
    if spec.routing.policy is not None:
        out.append(router_deployment(body, spec, cpu=decision.gpu is None))
    if with_gateway and spec.gateway is not None:
        out += gateway_objects(body, spec, cpu=decision.gpu is None, leaders=decision.multi_node)
    if spec.autoscaling is not None:
        out.append(scaled_object(body, spec) if with_keda else hpa(body, spec))
    return out + engine_sets(body, spec, decision)


def unwanted(
    body: dict[str, Any],
    spec: InferenceSpec,
    *,
    with_keda: bool,
    with_gateway: bool = False,
    had_gateway: bool = False,
    decision: Decision | None = None,
    with_lws: bool = False,
) -> list[tuple[str, str]]:
    """(kind, name) of the optional children this spec does not have: deleted if they exist (a router turned
    off, autoscaling turned off, KEDA installed after an HPA was made, spec.gateway removed or its API gone;
    with `decision`, the engines of another shape: a StatefulSet after a switch to a LeaderWorkerSet or to
    two pools, and back; a LeaderWorkerSet only where its API is served, `with_lws`).
    spec.gateway's are looked for only where the deployment `had_gateway` (its status says so), the pool only
    where its API is served (`with_gateway`)."""
    name = body["metadata"]["name"]
    out: list[tuple[str, str]] = []
    if decision is not None:  # the engines of the other shapes (one pod per replica, groups, two pools)
        have = {(o["kind"], o["metadata"]["name"]) for o in engine_sets(body, spec, decision)}
        have |= {("Service", o["metadata"]["name"]) for o in services(body, spec, decision)}
        shapes = [("StatefulSet", pool_name(name, r)) for r in (None, PREFILL, DECODE)]
        shapes += [("Service", headless_name(pool_name(name, r))) for r in (None, PREFILL, DECODE)]
        if with_lws:
            shapes.append(("LeaderWorkerSet", name))
        out += [s for s in shapes if s not in have]
    if had_gateway and not (with_gateway and spec.gateway is not None):
        out += [("Deployment", picker_name(name)), ("Service", picker_name(name))]
        if with_gateway:
            out.append(("InferencePool", name))
    if spec.routing.policy is None:
        out.append(("Deployment", router_name(name)))
    if spec.autoscaling is None or with_keda:
        out.append(("HorizontalPodAutoscaler", name))
    if with_keda and spec.autoscaling is None:
        out.append(("ScaledObject", name))
    return out
