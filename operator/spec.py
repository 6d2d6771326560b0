"""An InferenceDeployment's spec as a plain dataclass, with the CRD's defaults and rules applied.

The API server applies the CRD defaults and CEL rules too, but the operator must not trust that (older
servers, `pagoda render` with no server): every rule is checked here and a violation names its field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pagoda.operator.quantity import parse_quantity

KV_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
BLOCK_SIZES = (8, 16, 32, 64, 128)
# spec.model.shape (the CRD's names) -> the config.json keys the engine and sizing read
SHAPE_KEYS = {
    "numLayers": "num_hidden_layers",
    "numAttentionHeads": "num_attention_heads",
    "numKvHeads": "num_key_value_heads",
    "headDim": "head_dim",
    "hiddenSize": "hidden_size",
    "intermediateSize": "intermediate_size",
    "vocabSize": "vocab_size",
    "maxPositionEmbeddings": "max_position_embeddings",
    "numParams": "num_parameters",
    "dtype": "torch_dtype",
}
ROUTING_POLICIES = ("roundRobin", "leastLoaded", "prefix", "tierAware")
NO_ROUTER = "none"
DEFAULT_POLICY = "tierAware"  # when more than one replica may run and spec.routing.policy is unset
# spec.autoscaling.metric -> (lowest target exclusive, highest target inclusive, default target)
AUTOSCALING_METRICS: dict[str, tuple[float, float, float]] = {
    "kvCacheUsage": (0.0, 1.0, 0.8),  # share of the KV cache in use, averaged over the engine pods
    "waitingRequests": (0.0, 10000.0, 4.0),  # requests waiting per engine pod
    "ttftP90": (0.0, 600.0, 2.0),  # seconds: the deployment's p90 time to first token
}
MAX_REPLICAS_LIMIT = 1000
DEFAULT_DRAIN_SECONDS = 60
_SOURCE = re.compile(r"^(default|hf://[^/\s]+/[^/\s]+|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/\S+|file:///\S+)$")


class SpecError(ValueError):
    """A spec the operator cannot serve; `reason` is the condition reason, `field` the spec path."""

    def __init__(self, field: str, message: str, reason: str = "InvalidSpec") -> None:
        super().__init__(f"spec.{field}: {message}")
        self.field = field
        self.reason = reason


@dataclass
class ModelSpec:
    source: str = "default"
    served_model_name: str = ""
    revision: str | None = None
    shape: dict[str, Any] | None = None
    cache_volume_claim: str = "pagoda-model-cache"

    @property
    def kind(self) -> str:
        return self.source.split("://", 1)[0] if "://" in self.source else "default"

    @property
    def model_id(self) -> str:
        """What identifies the model's shape: `org/name` for hf://, the last path part otherwise."""
        if self.kind == "hf":
            return self.source[len("hf://") :]
        if self.kind == "default":
            return "HuggingFaceTB/SmolLM2-135M-Instruct"
        return self.source.rstrip("/").rsplit("/", 1)[-1]


@dataclass
class GPUSpec:
    product: str = ""
    count: int = 1
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class EngineSpec:
    max_model_len: int | None = None  # None = auto
    block_size: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    max_num_seqs: int | None = None
    extra_args: list[str] = field(default_factory=list)


@dataclass
class WorkloadSpec:
    target_context: int | None = None
    min_concurrency: int | None = None
    p50_prompt_tokens: int | None = None
    p99_prompt_tokens: int | None = None
    p50_output_tokens: int | None = None
    p99_output_tokens: int | None = None
    quality_first: bool = False
    prefer_capacity: bool = False  # kvCacheDtype auto: INT8 KV where the GPU has no FP8


@dataclass
class OffloadSpec:
    host_bytes: int | None = None  # None = auto
    nvme_enabled: bool = False
    nvme_storage_class: str | None = None
    nvme_bytes: int | None = None  # None = auto


@dataclass
class RoutingSpec:
    """The router in front of the engines; `policy` None means no router (plain Service to the engines)."""

    policy: str | None = None
    explicit: bool = False  # the spec named the policy (else the default applied)


@dataclass
class AutoscalingSpec:
    """An HPA (or KEDA ScaledObject) on the InferenceDeployment's scale subresource."""

    min_replicas: int
    max_replicas: int
    metric: str = "kvCacheUsage"
    target: float = 0.8


@dataclass
class InferenceSpec:
    model: ModelSpec
    replicas: int = 1
    gpu: GPUSpec = field(default_factory=GPUSpec)
    engine: EngineSpec = field(default_factory=EngineSpec)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    offload: OffloadSpec = field(default_factory=OffloadSpec)
    image: str | None = None
    resources: dict[str, dict[str, Any]] = field(default_factory=dict)
    api_key_secret: tuple[str, str] | None = None
    service_monitor: bool = True
    service_monitor_interval: str = "30s"
    routing: RoutingSpec = field(default_factory=RoutingSpec)
    autoscaling: AutoscalingSpec | None = None
    drain_seconds: int = DEFAULT_DRAIN_SECONDS

    @property
    def max_possible_replicas(self) -> int:
        """The most engine pods this spec may run: the autoscaler's maximum, else spec.replicas."""
        if self.autoscaling is not None:
            return max(self.autoscaling.max_replicas, self.replicas)
        return self.replicas

    @property
    def engine_replicas(self) -> int:
        """The StatefulSet's replicas: spec.replicas (the autoscaler writes it through the scale
        subresource), kept within the autoscaler's bounds so a stale value never fights them."""
        if self.autoscaling is None:
            return self.replicas
        return min(max(self.replicas, self.autoscaling.min_replicas), self.autoscaling.max_replicas)

    @property
    def memory_limit_bytes(self) -> int | None:
        limit = self.resources.get("limits", {}).get("memory") or self.resources.get("requests", {}).get(
            "memory"
        )
        return parse_quantity(limit) if limit is not None else None


def _obj(data: Any, path: str) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SpecError(path, f"must be an object, got {type(data).__name__}")
    return data


def _int(data: dict[str, Any], key: str, path: str, *, minimum: int = 0, auto: bool = False) -> int | None:
    value = data.get(key)
    where = f"{path}.{key}" if path else key
    if value is None or (auto and value == "auto"):
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        hint = " or auto" if auto else ""
        raise SpecError(where, f"must be an integer{hint}, got {value!r}")
    if value < minimum:
        raise SpecError(where, f"must be at least {minimum}, got {value}")
    return value


def _bool(data: dict[str, Any], key: str, path: str, default: bool) -> bool:
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise SpecError(f"{path}.{key}", f"must be true or false, got {value!r}")
    return value


def _size(data: dict[str, Any], key: str, path: str) -> int | None:
    value = data.get(key, "auto")
    if value == "auto" or value is None:
        return None
    try:
        return parse_quantity(value)
    except ValueError as exc:
        raise SpecError(f"{path}.{key}", f"{exc}, or auto") from None


def parse_spec(spec: Any) -> InferenceSpec:
    """The spec with defaults applied; raises SpecError naming the first bad field."""
    spec = _obj(spec, "")
    model = _obj(spec.get("model"), "model")
    source = model.get("source", "default")
    if not isinstance(source, str) or not _SOURCE.match(source):
        raise SpecError(
            "model.source",
            f"{source!r} is not a model source: use default, hf://org/name, pvc://claim/path or file:///path",
            reason="InvalidModelSource",
        )
    shape = model.get("shape")
    if shape is not None:
        shape = {SHAPE_KEYS.get(k, k): v for k, v in _obj(shape, "model.shape").items()}
    revision = model.get("revision")
    if revision is not None:
        if not isinstance(revision, str) or not revision:
            raise SpecError("model.revision", f"must be a branch, tag or commit name, got {revision!r}")
        if not source.startswith("hf://"):
            raise SpecError(
                "model.revision",
                f"applies to hf:// sources only (a Hugging Face cache holds revisions); {source!r} is served as "
                "it is",
            )
    model_spec = ModelSpec(
        source=source,
        revision=revision,
        shape=shape,
        cache_volume_claim=model.get("cacheVolumeClaim", "pagoda-model-cache"),
    )
    model_spec.served_model_name = model.get("servedModelName") or (
        "default" if model_spec.kind == "default" else model_spec.model_id
    )

    gpu = _obj(spec.get("gpu"), "gpu")
    product = gpu.get("product") or ""
    if not isinstance(product, str):
        raise SpecError("gpu.product", f"must be a string, got {product!r}")
    count = _int(gpu, "count", "gpu")
    count = 1 if count is None else count
    if product and count == 0:
        raise SpecError("gpu.count", "gpu.product needs gpu.count of at least 1 (count 0 means CPU pods)")
    node_selector = _obj(gpu.get("nodeSelector"), "gpu.nodeSelector")
    tolerations = gpu.get("tolerations") or []
    if not isinstance(tolerations, list):
        raise SpecError("gpu.tolerations", "must be a list")

    engine = _obj(spec.get("engine"), "engine")
    block_size = _int(engine, "blockSize", "engine", minimum=1, auto=True)
    if block_size is not None and block_size not in BLOCK_SIZES:
        raise SpecError("engine.blockSize", f"must be auto or one of {', '.join(map(str, BLOCK_SIZES))}")
    util = engine.get("gpuMemoryUtilization")
    if util == "auto":
        util = None
    if util is not None and (
        isinstance(util, bool) or not isinstance(util, int | float) or not 0 < util <= 1
    ):
        raise SpecError("engine.gpuMemoryUtilization", f"must be in (0, 1], got {util!r}")
    kv_dtype = engine.get("kvCacheDtype", "auto")
    if kv_dtype not in KV_DTYPES:
        raise SpecError("engine.kvCacheDtype", f"must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    if kv_dtype.startswith("fp8") and count == 0:
        raise SpecError("engine.kvCacheDtype", "an FP8 KV cache needs a GPU (gpu.count 0 means CPU pods)")
    extra = engine.get("extraArgs") or []
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        raise SpecError("engine.extraArgs", "must be a list of strings")
    engine_spec = EngineSpec(
        max_model_len=_int(engine, "maxModelLen", "engine", minimum=16, auto=True),
        block_size=block_size,
        gpu_memory_utilization=float(util) if util is not None else None,
        kv_cache_dtype=kv_dtype,
        enable_prefix_caching=_bool(engine, "enablePrefixCaching", "engine", True),
        max_num_seqs=_int(engine, "maxNumSeqs", "engine", minimum=1),
        extra_args=list(extra),
    )

    work = _obj(spec.get("workload"), "workload")
    workload = WorkloadSpec(
        target_context=_int(work, "targetContext", "workload", minimum=1),
        min_concurrency=_int(work, "minConcurrency", "workload", minimum=1),
        p50_prompt_tokens=_int(work, "p50PromptTokens", "workload", minimum=1),
        p99_prompt_tokens=_int(work, "p99PromptTokens", "workload", minimum=1),
        p50_output_tokens=_int(work, "p50OutputTokens", "workload", minimum=1),
        p99_output_tokens=_int(work, "p99OutputTokens", "workload", minimum=1),
        quality_first=_bool(work, "qualityFirst", "workload", False),
        prefer_capacity=_bool(work, "preferCapacity", "workload", False),
    )
    if workload.quality_first and workload.prefer_capacity:
        raise SpecError(
            "workload.preferCapacity",
            "contradicts workload.qualityFirst (never quantise the KV cache); set one",
        )

    offload = _obj(spec.get("offload"), "offload")
    host = _obj(offload.get("host"), "offload.host")
    nvme = _obj(offload.get("nvme"), "offload.nvme")
    offload_spec = OffloadSpec(
        host_bytes=_size(host, "size", "offload.host"),
        nvme_enabled=_bool(nvme, "enabled", "offload.nvme", False),
        nvme_storage_class=nvme.get("storageClassName") or None,
        nvme_bytes=_size(nvme, "size", "offload.nvme"),
    )
    if offload_spec.nvme_enabled and offload_spec.nvme_bytes == 0:
        raise SpecError("offload.nvme.size", "must be more than 0 when offload.nvme.enabled is true")

    resources = _obj(spec.get("resources"), "resources")
    for kind in ("requests", "limits"):
        for name, value in _obj(resources.get(kind), f"resources.{kind}").items():
            if name == "memory":
                try:
                    parse_quantity(value)
                except ValueError as exc:
                    raise SpecError(f"resources.{kind}.memory", str(exc)) from None

    secret = spec.get("apiKeySecretRef")
    api_key = None
    if secret is not None:
        secret = _obj(secret, "apiKeySecretRef")
        if not secret.get("name"):
            raise SpecError("apiKeySecretRef.name", "is required")
        api_key = (secret["name"], secret.get("key") or "api-key")

    monitor = _obj(spec.get("serviceMonitor"), "serviceMonitor")
    replicas = _int(spec, "replicas", "") if spec.get("replicas") is not None else 1
    autoscaling = parse_autoscaling(spec.get("autoscaling"))
    drain = _int(_obj(spec.get("drain"), "drain"), "timeoutSeconds", "drain")
    if drain is not None and drain > 3600:
        raise SpecError("drain.timeoutSeconds", f"must be at most 3600, got {drain}")
    return InferenceSpec(
        model=model_spec,
        replicas=replicas,
        gpu=GPUSpec(product=product, count=count, node_selector=dict(node_selector), tolerations=tolerations),
        engine=engine_spec,
        workload=workload,
        offload=offload_spec,
        image=spec.get("image") or None,
        resources={k: dict(v) for k, v in resources.items() if isinstance(v, dict)},
        api_key_secret=api_key,
        service_monitor=_bool(monitor, "enabled", "serviceMonitor", True),
        service_monitor_interval=str(monitor.get("interval", "30s")),
        routing=parse_routing(spec.get("routing"), replicas, autoscaling),
        autoscaling=autoscaling,
        drain_seconds=DEFAULT_DRAIN_SECONDS if drain is None else drain,
    )


def parse_autoscaling(data: Any) -> AutoscalingSpec | None:
    """spec.autoscaling, or None when absent; raises SpecError (InvalidAutoscaling) for a bad combination."""
    if data is None:
        return None
    data = _obj(data, "autoscaling")

    def bad(field: str, message: str) -> SpecError:
        return SpecError(f"autoscaling.{field}", message, reason="InvalidAutoscaling")

    try:
        low = _int(data, "minReplicas", "autoscaling", minimum=1)
        high = _int(data, "maxReplicas", "autoscaling", minimum=1)
    except SpecError as err:
        raise SpecError(err.field, str(err).split(": ", 1)[1], reason="InvalidAutoscaling") from None
    low = 1 if low is None else low
    if high is None:
        raise bad("maxReplicas", "is required when autoscaling is set")
    if high > MAX_REPLICAS_LIMIT:
        raise bad("maxReplicas", f"must be at most {MAX_REPLICAS_LIMIT}, got {high}")
    if low > high:
        raise bad("minReplicas", f"minReplicas {low} is more than maxReplicas {high}")
    metric = data.get("metric", "kvCacheUsage")
    if metric not in AUTOSCALING_METRICS:
        raise bad("metric", f"must be one of {', '.join(AUTOSCALING_METRICS)}, got {metric!r}")
    floor, ceiling, default = AUTOSCALING_METRICS[metric]
    target = data.get("target", default)
    if isinstance(target, bool) or not isinstance(target, int | float) or not floor < target <= ceiling:
        raise bad(
            "target", f"for {metric} must be more than {floor:g} and at most {ceiling:g}, got {target!r}"
        )
    return AutoscalingSpec(min_replicas=low, max_replicas=high, metric=metric, target=float(target))


def parse_routing(data: Any, replicas: int, autoscaling: AutoscalingSpec | None) -> RoutingSpec:
    """spec.routing: an explicit policy (or `none`), else tierAware when more than one engine may run."""
    data = _obj(data, "routing")
    policy = data.get("policy")
    if policy is None:
        most = max(replicas, autoscaling.max_replicas) if autoscaling is not None else replicas
        return RoutingSpec(DEFAULT_POLICY if most > 1 else None, explicit=False)
    if policy == NO_ROUTER:
        return RoutingSpec(None, explicit=True)
    if policy not in ROUTING_POLICIES:
        raise SpecError(
            "routing.policy",
            f"must be one of {', '.join((*ROUTING_POLICIES, NO_ROUTER))}, got {policy!r}",
            reason="InvalidRouting",
        )
    return RoutingSpec(policy, explicit=True)
