"""An InferenceDeployment's spec as typed dataclasses, which are also the CRD's schema.

Every field is declared once with `prop` (operator/schema.py): its CRD name, type, bounds, enum, default and
description, and the CEL rules next to it. crds/ is generated from these classes (operator/crd.py), and
`parse_spec` checks the same declarations, so the operator never trusts that the API server did (older
servers, `pagoda render` with no server): a violation names its field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pagoda.engine.config import BLOCK_SIZES, KV_CACHE_DTYPES
from pagoda.engine.sizing import architectures
from pagoda.operator.quantity import parse_quantity
from pagoda.operator.schema import (
    Bool,
    Int,
    IntOrAuto,
    ListOf,
    Num,
    Obj,
    QuantityOrAuto,
    Raw,
    Rule,
    SpecError,
    Str,
    parse_object,
    prop,
    spec_fields,
)

__all__ = ["SpecError", "InferenceSpec", "parse_spec"]

KV_DTYPES = KV_CACHE_DTYPES
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
DEFAULT_IDLE_SECONDS = 900
DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS_SUBDOMAIN = rf"{DNS_LABEL}(\.{DNS_LABEL})*"
# An s3:// prefix: any characters but spaces, with no `..` in it (every dot is followed by another character
# than a dot, or ends it): RE2 has no look-ahead.
S3_PREFIX = r"([^.\s]|\.[^.\s])*\.?"
# One regular expression for the API server (CEL `matches`, RE2) and the operator (Python `re`).
SOURCE_PATTERN = (
    r"^(default|hf://[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?"
    rf"|s3://[a-z0-9][a-z0-9.-]{{1,61}}[a-z0-9](/{S3_PREFIX})?"
    rf"|pvc://{DNS_LABEL}/\S+|file:///\S+)$"
)
ENV_NAME = r"[-._a-zA-Z][-._a-zA-Z0-9]*"
ADAPTER_SOURCE_PATTERN = SOURCE_PATTERN.replace("^(default|", "^(")
# No source may hold `..`: downloads write under the model cache by the source's names and a pvc:// path is
# mounted as a subPath (operator/download/paths.py refuses such names again, whatever started the download).
NO_DOTDOT_RULE = "!self.contains('..')"
NO_DOTDOT_MESSAGE = (
    "source must not contain '..' (a path that leads out of its bucket, repo, claim or directory)"
)
ADAPTER_NAME = r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}"  # the engine's rule (pagoda.engine.lora.registry)
MAX_ADAPTERS = 64


def _has(obj: dict[str, Any], *path: str) -> Any:
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return None
        obj = obj[key]
    return obj


# -- the model ----------------------------------------------------------------------------------------------


# config.json model_type values of the families the engine runs (the architecture table's)
MODEL_TYPES = tuple(t for a in architectures.ARCHITECTURES for t in a.model_types)


@dataclass
class ShapeSpec:
    """The model's shape, for a model the operator does not know by name (pvc://, s3:// and file:// sources).
    Read it from the model's config.json (num_hidden_layers, num_attention_heads, num_key_value_heads,
    head_dim, hidden_size, intermediate_size, vocab_size, max_position_embeddings, torch_dtype, model_type)."""

    # field names are config.json's keys, which the engine and sizing read
    num_hidden_layers: int | None = prop(Int(1), "numLayers", required=True, reason="InvalidModelShape")
    num_attention_heads: int | None = prop(
        Int(1), "numAttentionHeads", required=True, reason="InvalidModelShape"
    )
    num_key_value_heads: int | None = prop(Int(1), "numKvHeads", "default numAttentionHeads")
    head_dim: int | None = prop(Int(1), "headDim", "default hiddenSize / numAttentionHeads")
    hidden_size: int | None = prop(Int(1), "hiddenSize", required=True, reason="InvalidModelShape")
    intermediate_size: int | None = prop(Int(1), "intermediateSize", "default 4 x hiddenSize")
    vocab_size: int | None = prop(Int(1), "vocabSize", required=True, reason="InvalidModelShape")
    max_position_embeddings: int | None = prop(Int(1), "maxPositionEmbeddings")
    num_parameters: int | None = prop(Int(1), "numParams", "parameter count")
    torch_dtype: str | None = prop(Str(enum=("float16", "bfloat16", "float32")), "dtype")
    model_type: str | None = prop(
        Str(enum=MODEL_TYPES),
        "modelType",
        "config.json's model_type: the family's rules apply (Gemma's sliding layers, no float16); unset: a "
        "Llama-shaped decoder",
        reason="UnsupportedModel",  # a model_type outside the engine's architecture table
    )

    def config(self) -> dict[str, Any]:
        """The shape as config.json keys (only those given)."""
        return {
            f.name: getattr(self, f.name) for f in spec_fields(ShapeSpec) if getattr(self, f.name) is not None
        }


# spec.model.shape (the CRD's names) -> the config.json keys the engine and sizing read
SHAPE_KEYS = {f.metadata["name"]: f.name for f in spec_fields(ShapeSpec)}


@dataclass
class SecretRef:
    name: str | None = prop(Str(min_length=1), "name", required=True)


@dataclass
class ModelCacheSpec:
    """Where downloaded weights (hf:// and s3:// sources) are kept. The operator fills the volume once with a
    download Job and mounts it read-only into the engine pods."""

    claim_name: str | None = prop(
        Str(pattern=DNS_SUBDOMAIN),
        "claimName",
        "An existing PersistentVolumeClaim to download into (the operator mounts it read-write into the "
        "download Job); unset: the operator creates NAME-model-cache, owned by this InferenceDeployment.",
    )
    size: int | None = prop(
        QuantityOrAuto(),
        "size",
        "Size of the claim the operator creates: a Quantity, or auto (the weights' bytes x 1.2 + 2Gi).",
        default="auto",
    )
    storage_class: str | None = prop(Str(), "storageClassName", "Storage class of the claim it creates.")
    access_mode: str = prop(
        Str(enum=("auto", "ReadWriteOnce", "ReadWriteMany", "ReadOnlyMany")),
        "accessMode",
        "Access mode of the claim it creates; auto: ReadWriteOnce when at most one engine may run, else "
        "ReadWriteMany (engine pods on several nodes mount it at once).",
        default="auto",
    )
    per_pod: bool = prop(
        Bool(),
        "perPod",
        "Download into a volume of each pod (a volumeClaimTemplate) from an init container, for storage "
        "without ReadWriteMany; every pod then downloads once.",
        default=False,
    )


@dataclass
class ModelSpec:
    source: str = prop(
        Str(),
        "source",
        "Where the weights come from: `default` (the engine's embedded small model), `hf://org/name[@revision]` "
        "(downloaded from the Hugging Face hub into the model cache volume before the engine starts), "
        "`s3://bucket/prefix` (downloaded from S3 or an S3-compatible store), `pvc://claim/path` (a directory "
        "on a PersistentVolumeClaim) or `file:///path` (baked into the image). A `pvc://` source mounts "
        "(read-only) any PersistentVolumeClaim of the namespace that the creator names: whoever may create an "
        "InferenceDeployment can read every claim in its namespace this way.",
        default="default",
        reason="InvalidModelSource",
        rules=[
            Rule(NO_DOTDOT_RULE, NO_DOTDOT_MESSAGE, lambda v: ".." not in v, reason="InvalidModelSource"),
            Rule(
                f"self.matches(r'{SOURCE_PATTERN}')",
                "source must be default, hf://org/name[@revision], s3://bucket/prefix, pvc://claim/path or "
                "file:///path",
                lambda v: re.fullmatch(SOURCE_PATTERN, v) is not None,
                reason="InvalidModelSource",
            ),
        ],
    )
    served_model_name: str = prop(
        Str(),
        "servedModelName",
        "The model name clients send in the OpenAI API; defaults to the source's name.",
    )
    revision: str | None = prop(
        Str(min_length=1),
        "revision",
        "The Hugging Face revision (branch, tag or commit) of an hf:// source (or write hf://org/name@revision): "
        "the download fetches that snapshot and the engine serves it (`pagoda serve --revision`). Other sources "
        "refuse a revision.",
    )
    secret_ref: SecretRef | None = prop(
        Obj(SecretRef, optional=True),
        "secretRef",
        "A Secret of the namespace with the download's credentials: HF_TOKEN for hf:// (gated or private "
        "models); AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and optionally AWS_SESSION_TOKEN, AWS_REGION and "
        "AWS_ENDPOINT_URL (an S3-compatible store) for s3://. Only the download Job sees it, as environment "
        "variables; the operator never reads it.",
    )
    cache: ModelCacheSpec = prop(Obj(ModelCacheSpec), "cache")
    shape: ShapeSpec | None = prop(Obj(ShapeSpec, optional=True), "shape")

    @property
    def kind(self) -> str:
        return self.source.split("://", 1)[0] if "://" in self.source else "default"

    @property
    def location(self) -> str:
        """The source without its scheme and without an `@revision`."""
        rest = self.source.split("://", 1)[-1]
        return rest.split("@", 1)[0] if self.kind == "hf" else rest

    @property
    def model_id(self) -> str:
        """What identifies the model's shape: `org/name` for hf://, the last path part otherwise."""
        if self.kind == "hf":
            return self.location
        if self.kind == "default":
            return DEFAULT_MODEL_ID
        return self.location.rstrip("/").rsplit("/", 1)[-1]

    @property
    def downloads(self) -> bool:
        """Whether the weights are downloaded into the model cache before the engine starts."""
        return self.kind in ("hf", "s3")


@dataclass
class AdapterSpec:
    """A LoRA adapter (a PEFT directory: adapter_config.json + adapter_model.safetensors) served with the model;
    clients pick it by its name in `model`."""

    name: str = prop(
        Str(pattern=ADAPTER_NAME),
        "name",
        "The name clients send in `model` (and /v1/models lists, with the model as its parent).",
        required=True,
        reason="InvalidAdapter",
    )
    source: str = prop(
        Str(),
        "source",
        "Where the adapter comes from, as for the model: `hf://org/name[@revision]` and `s3://bucket/prefix` are "
        "downloaded into the model cache volume by the model's download Job (with spec.model.secretRef's "
        "credentials), `pvc://claim/path` is mounted read-only, `file:///path` is in the image.",
        required=True,
        reason="InvalidAdapter",
        rules=[
            Rule(NO_DOTDOT_RULE, NO_DOTDOT_MESSAGE, lambda v: ".." not in v, reason="InvalidAdapter"),
            Rule(
                f"self.matches(r'{ADAPTER_SOURCE_PATTERN}')",
                "source must be hf://org/name[@revision], s3://bucket/prefix, pvc://claim/path or file:///path",
                lambda v: re.fullmatch(ADAPTER_SOURCE_PATTERN, v) is not None,
                reason="InvalidAdapter",
            ),
        ],
    )

    @property
    def kind(self) -> str:
        return self.source.split("://", 1)[0]

    @property
    def location(self) -> str:
        return self.source.split("://", 1)[1]

    @property
    def downloads(self) -> bool:
        return self.kind in ("hf", "s3")


# -- GPUs, engine, workload, offload ------------------------------------------------------------------------

TOLERATION = {
    "type": "object",
    "properties": {
        "key": {"type": "string"},
        "operator": {"type": "string", "enum": ["Exists", "Equal"]},
        "value": {"type": "string"},
        "effect": {"type": "string", "enum": ["", "NoSchedule", "PreferNoSchedule", "NoExecute"]},
        "tolerationSeconds": {"type": "integer"},
    },
}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}


@dataclass
class GPUSpec:
    product: str = prop(
        Str(),
        "product",
        "A GPU Feature Discovery product label (NVIDIA-H100-80GB-HBM3) or a short name (H100); empty lets the "
        "operator choose among the nodes.",
        default="",
        show_default=False,
    )
    count: int = prop(Int(0, 16), "count", "GPUs per pod (tensor parallel size); 0 runs CPU pods.", default=1)
    node_selector: dict[str, str] = prop(
        Raw(STRING_MAP, dict), "nodeSelector", default={}, show_default=False
    )
    tolerations: list[dict[str, Any]] = prop(
        Raw({"type": "array", "items": TOLERATION}, list), "tolerations", default=[], show_default=False
    )


def _strings(value: list[Any]) -> None:
    if not all(isinstance(a, str) for a in value):
        raise ValueError("must be a list of strings")


@dataclass
class SpeculativeSpec:
    """Speculative decoding (the engine's --speculative-config): n-gram prompt lookup, which needs no extra
    weights, or a draft model sharing the target's tokenizer. Greedy output is unchanged token for token;
    n-gram pays off where outputs copy their input (editing, summarising, code); both turn themselves off
    as the batch fills."""

    method: str = prop(Str(enum=("ngram", "draft_model")), "method", default="ngram")
    num_speculative_tokens: int = prop(
        Int(1, 16), "numSpeculativeTokens", "Tokens proposed per sequence and step.", default=4
    )
    prompt_lookup_min: int | None = prop(Int(1), "promptLookupMin", "Shortest n-gram matched (default 5).")
    prompt_lookup_max: int | None = prop(Int(1), "promptLookupMax", "Longest n-gram matched (default 5).")
    model: str | None = prop(
        Str(),
        "model",
        "The draft model (method draft_model): a checkpoint directory inside the engine pod or a Hugging "
        "Face name in its cache, with the target's tokenizer.",
    )
    RULES = (
        Rule(
            "self.method != 'draft_model' || (has(self.model) && self.model != '')",
            "method draft_model needs model",
            lambda s: s.get("method", "ngram") != "draft_model" or bool(s.get("model")),
            field_path=".model",
        ),
        Rule(
            "self.method == 'draft_model' || !has(self.model)",
            "model is for method draft_model",
            lambda s: s.get("method", "ngram") == "draft_model" or "model" not in s,
            field_path=".model",
        ),
        Rule(
            "self.method != 'draft_model' || (!has(self.promptLookupMin) && !has(self.promptLookupMax))",
            "promptLookupMin/Max are for method ngram",
            lambda s: (
                s.get("method", "ngram") != "draft_model"
                or ("promptLookupMin" not in s and "promptLookupMax" not in s)
            ),
            field_path=".promptLookupMin",
        ),
    )

    def to_json(self) -> str:
        """The engine's --speculative-config value (vLLM's keys)."""
        obj = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.model is not None:
            obj["model"] = self.model
        if self.prompt_lookup_min is not None:
            obj["prompt_lookup_min"] = self.prompt_lookup_min
        if self.prompt_lookup_max is not None:
            obj["prompt_lookup_max"] = self.prompt_lookup_max
        return json.dumps(obj, separators=(",", ":"))


@dataclass
class EngineSpec:
    max_model_len: int | None = prop(IntOrAuto(minimum=16), "maxModelLen", default="auto")
    block_size: int | None = prop(IntOrAuto(choices=BLOCK_SIZES), "blockSize", default="auto")
    gpu_memory_utilization: float | None = prop(
        Num(),
        "gpuMemoryUtilization",
        "Share of GPU memory the engine may use; unset means auto (sized by the operator).",
        rules=[
            Rule("self > 0.0 && self <= 1.0", "gpuMemoryUtilization must be in (0, 1]", lambda v: 0 < v <= 1)
        ],
    )
    kv_cache_dtype: str = prop(
        Str(enum=KV_CACHE_DTYPES),
        "kvCacheDtype",
        "auto = the operator decides (FP8 where the GPU has it; INT8 with workload.preferCapacity where it "
        "has not); int8 = per-token scaled INT8, any GPU or CPU.",
        default="auto",
    )
    enable_prefix_caching: bool = prop(Bool(), "enablePrefixCaching", default=True)
    max_num_seqs: int | None = prop(Int(1), "maxNumSeqs", "Unset means sized by the operator.")
    max_loras: int | None = prop(
        Int(1, MAX_ADAPTERS),
        "maxLoras",
        "With spec.adapters: how many adapters one engine step may mix (device slots; the others wait in host "
        "memory and are swapped in, least recently used out). Unset: one per adapter, at most 8.",
    )
    max_lora_rank: int = prop(
        Int(1, 512),
        "maxLoraRank",
        "With spec.adapters: the largest LoRA rank an adapter may have (each slot is this wide); an adapter "
        "of a higher rank stops the engine at start with a message naming this field.",
        default=16,
    )
    speculative: SpeculativeSpec | None = prop(Obj(SpeculativeSpec, optional=True), "speculative")
    extra_args: list[str] = prop(
        Raw({"type": "array", "items": {"type": "string"}}, list, check=_strings),
        "extraArgs",
        "More `pagoda serve` flags, after the operator's (the engine keeps the last value of a flag).",
        default=[],
        show_default=False,
    )


@dataclass
class WorkloadSpec:
    """Hints the sizing uses to trade context length against concurrency."""

    target_context: int | None = prop(Int(1), "targetContext")
    min_concurrency: int | None = prop(Int(1), "minConcurrency")
    p50_prompt_tokens: int | None = prop(Int(1), "p50PromptTokens")
    p99_prompt_tokens: int | None = prop(Int(1), "p99PromptTokens")
    p50_output_tokens: int | None = prop(Int(1), "p50OutputTokens")
    p99_output_tokens: int | None = prop(Int(1), "p99OutputTokens")
    quality_first: bool = prop(
        Bool(),
        "qualityFirst",
        "Never trade precision (FP8 KV) for capacity.",
        default=False,
        show_default=False,
    )
    prefer_capacity: bool = prop(
        Bool(),
        "preferCapacity",
        "Trade a little precision for KV capacity even on GPUs without FP8 (an INT8 KV cache, about half the "
        "bytes); kvCacheDtype auto only.",
        default=False,
        show_default=False,
    )
    RULES = (
        Rule(
            "!(has(self.qualityFirst) && self.qualityFirst && has(self.preferCapacity) && self.preferCapacity)",
            "preferCapacity contradicts qualityFirst (never quantise the KV cache); set one",
            lambda w: not (w.get("qualityFirst") is True and w.get("preferCapacity") is True),
            field_path=".preferCapacity",
        ),
    )


@dataclass
class HostTierSpec:
    size: int | None = prop(
        QuantityOrAuto(), "size", "Host-RAM KV tier, a Quantity (0 turns it off) or auto (from the plan).",
        default="auto",
    )  # fmt: skip


@dataclass
class NvmeTierSpec:
    enabled: bool = prop(Bool(), "enabled", default=False)
    storage_class: str | None = prop(Str(), "storageClassName")
    size: int | None = prop(
        QuantityOrAuto(), "size", "The per-pod PVC size, a Quantity or auto (from the plan).", default="auto"
    )
    RULES = (
        Rule(
            "!has(self.enabled) || !self.enabled || !has(self.size) || type(self.size) == string || self.size > 0",
            "size must be more than 0 when enabled is true",
            lambda n: (
                not n.get("enabled") or n.get("size") in (None, "auto") or _positive_quantity(n["size"])
            ),
            field_path=".size",
        ),
    )


def _positive_quantity(value: Any) -> bool:
    try:
        return parse_quantity(value) > 0
    except ValueError:
        return True  # the size's own check names the problem


@dataclass
class OffloadSpec:
    host: HostTierSpec = prop(Obj(HostTierSpec), "host")
    nvme: NvmeTierSpec = prop(Obj(NvmeTierSpec), "nvme")

    @property
    def host_bytes(self) -> int | None:
        return self.host.size

    @property
    def nvme_enabled(self) -> bool:
        return self.nvme.enabled

    @property
    def nvme_storage_class(self) -> str | None:
        return self.nvme.storage_class or None

    @property
    def nvme_bytes(self) -> int | None:
        return self.nvme.size


# -- pods, routing, autoscaling ------------------------------------------------------------------------------


def _resources(value: dict[str, Any]) -> None:
    for kind in ("requests", "limits"):
        part = value.get(kind) or {}
        if not isinstance(part, dict):
            raise ValueError(f"{kind} must be an object")
        if "memory" in part:
            try:
                parse_quantity(part["memory"])
            except ValueError as exc:
                raise ValueError(f"{kind}.memory: {exc}") from None


QUANTITY_MAP = {"type": "object", "additionalProperties": {"x-kubernetes-int-or-string": True}}
PRESERVE = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def _env_list(value: list[Any]) -> None:
    for i, item in enumerate(value):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ValueError(f"item {i} must be an object with a name")
        if not re.fullmatch(ENV_NAME, item["name"]):
            raise ValueError(f"item {i}: {item['name']!r} is not a valid environment variable name")


def _named_list(value: list[Any]) -> None:
    for i, item in enumerate(value):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            raise ValueError(f"item {i} must be an object with a name")


def _affinity(value: dict[str, Any]) -> None:
    unknown = set(value) - {"nodeAffinity", "podAffinity", "podAntiAffinity"}
    if unknown:
        raise ValueError(
            f"unknown field(s) {', '.join(sorted(unknown))}: nodeAffinity, podAffinity, podAntiAffinity"
        )


@dataclass
class PodSpec:
    """Fields passed through to the engine (and router) pods as they are, for what real clusters need.
    Environment variables the operator sets itself (PAGODA_API_KEY, HF_HUB_OFFLINE, HF_HOME, ...) are
    refused in env; in envFrom they lose to the operator's (an explicit env wins over envFrom)."""

    image_pull_secrets: list[dict[str, Any]] = prop(
        Raw({"type": "array", "items": {"type": "object", "required": ["name"],
                                        "properties": {"name": {"type": "string"}}}}, list, check=_named_list),
        "imagePullSecrets", "Secrets to pull the engine image with.", default=[], show_default=False,
    )  # fmt: skip
    env: list[dict[str, Any]] = prop(
        Raw({"type": "array", "items": {"type": "object", "required": ["name"], "x-kubernetes-preserve-unknown-fields": True,
                                        "properties": {"name": {"type": "string"}}}}, list, check=_env_list),
        "env", "More environment variables of the engine container (Kubernetes EnvVar objects).",
        default=[], show_default=False,
    )  # fmt: skip
    env_from: list[dict[str, Any]] = prop(
        Raw({"type": "array", "items": PRESERVE}, list),
        "envFrom", "ConfigMaps or Secrets whose keys become environment variables (Kubernetes EnvFromSource).",
        default=[], show_default=False,
    )  # fmt: skip
    affinity: dict[str, Any] = prop(
        Raw(PRESERVE, dict, check=_affinity),
        "affinity",
        "Kubernetes Affinity of the engine pods; on GPU pods it adds to the operator's GPU nodeSelector.",
        default={},
        show_default=False,
    )
    priority_class_name: str | None = prop(Str(pattern=DNS_SUBDOMAIN, max_length=253), "priorityClassName")
    runtime_class_name: str | None = prop(
        Str(pattern=DNS_SUBDOMAIN, max_length=253),
        "runtimeClassName",
        "The RuntimeClass of the engine pods (e.g. nvidia, where the NVIDIA container runtime is not the "
        "node's default).",
    )


@dataclass
class SecretKeyRef:
    name: str | None = prop(Str(min_length=1), "name", required=True)
    key: str = prop(Str(min_length=1), "key", default="api-key")


@dataclass
class ServiceMonitorSpec:
    enabled: bool = prop(Bool(), "enabled", default=True)
    interval: str = prop(Str(), "interval", default="30s")


@dataclass
class RoutingSpec:
    """The router in front of the engine pods (`pagoda router`, a Deployment from the engine image): the
    InferenceDeployment's Service then points at the router, which finds the engines through the headless
    Service and sends each request to the replica best placed to serve it."""

    policy: str | None = prop(
        Str(enum=(*ROUTING_POLICIES, NO_ROUTER)),
        "policy",
        "roundRobin; leastLoaded (running + waiting requests); prefix (the replica holding the longest cached "
        "prefix, bounded by load); tierAware (the cost of serving the prefix from each replica's device, host "
        "or disk tier); none (no router: the Service selects the engines). Unset: tierAware when more than one "
        "engine may run (replicas or autoscaling.maxReplicas above 1) or autoscaling.minReplicas is 0, none "
        "otherwise.",
        reason="InvalidRouting",
    )
    explicit: bool = False  # resolved by parse_spec: the spec named the policy (else the default applied)


DEFAULT_PICKER_PORT = 9002  # the Gateway API Inference Extension's conventional endpoint-picker port
ROUTER_HTTP_PORT = (
    8000  # the router's own HTTP port (render.ROUTER_PORT), which the picker port must not take
)


@dataclass
class GatewaySpec:
    """Behind a Gateway (the Gateway API Inference Extension): an InferencePool
    (inference.networking.k8s.io/v1) named as this object, selecting its engine pods, and our router as the
    pool's endpoint picker (`pagoda router --ext-proc-port`, a Deployment and Service NAME-epp). Rendered where
    the cluster serves that API; an HTTPRoute whose backendRef is the pool sends a Gateway's traffic to it."""

    picker_port: int = prop(
        Int(1, 65535),
        "pickerPort",
        "The endpoint picker's gRPC (Envoy ext_proc) port, in its Service and the pool's endpointPickerRef.",
        default=DEFAULT_PICKER_PORT,
        reason="InvalidGateway",
        rules=[
            Rule(
                f"self != {ROUTER_HTTP_PORT}",
                f"pickerPort must not be {ROUTER_HTTP_PORT}, the router's HTTP port",
                lambda v: v != ROUTER_HTTP_PORT,
                reason="InvalidGateway",
            )
        ],
    )
    failure_mode: str = prop(
        Str(enum=("FailClose", "FailOpen")),
        "failureMode",
        "What the gateway does while the picker does not answer: FailClose (refuse the request) or FailOpen "
        "(send it to a pod of its own choosing).",
        default="FailClose",
        reason="InvalidGateway",
    )


@dataclass
class AutoscalingSpec:
    """Scale the engines on KV-bound signals: an autoscaling/v2 HorizontalPodAutoscaler on this object's scale
    subresource (metrics from the Prometheus Adapter, see docs/operator.md), or a KEDA ScaledObject where KEDA
    is installed. The autoscaler writes spec.replicas. minReplicas 0 (scale to zero) needs KEDA: the router
    holds requests while no engine is ready and KEDA starts one on the held requests."""

    min_replicas: int = prop(Int(0), "minReplicas", default=1, reason="InvalidAutoscaling")
    max_replicas: int = prop(
        Int(1, MAX_REPLICAS_LIMIT), "maxReplicas", required=True, reason="InvalidAutoscaling"
    )
    metric: str = prop(
        Str(enum=tuple(AUTOSCALING_METRICS)),
        "metric",
        "kvCacheUsage (share of the KV cache in use, per pod), waitingRequests (requests waiting per pod) or "
        "ttftP90 (the deployment's p90 time to first token, seconds).",
        default="kvCacheUsage",
        reason="InvalidAutoscaling",
    )
    target: float | None = prop(
        Num(),
        "target",
        "The value to hold the metric at: kvCacheUsage in (0, 1] (default 0.8), waitingRequests above 0, at "
        "most 10000 (default 4), ttftP90 seconds in (0, 600] (default 2).",
        reason="InvalidAutoscaling",
        rules=[Rule("self > 0.0 && self <= 10000.0", "target must be more than 0", lambda v: 0 < v <= 10000,
                    reason="InvalidAutoscaling")],
    )  # fmt: skip
    idle_seconds: int = prop(
        Int(30, 86400),
        "idleSeconds",
        "With minReplicas 0: how long the deployment must be idle (no request running, waiting or held by the "
        "router) before the last engine stops (KEDA's cooldownPeriod).",
        default=DEFAULT_IDLE_SECONDS,
        reason="InvalidAutoscaling",
    )
    RULES = (
        Rule(
            "!has(self.minReplicas) || self.minReplicas <= self.maxReplicas",
            "minReplicas must not be more than maxReplicas",
            lambda a: (
                not isinstance(a.get("maxReplicas"), int) or a.get("minReplicas", 1) <= a["maxReplicas"]
            ),
            field_path=".minReplicas",
            reason="InvalidAutoscaling",
        ),
        Rule(
            "!has(self.target) || (has(self.metric) && self.metric != 'kvCacheUsage') || self.target <= 1.0",
            "a kvCacheUsage target is a share of the KV cache, in (0, 1]",
            lambda a: (
                a.get("target") is None
                or a.get("metric", "kvCacheUsage") != "kvCacheUsage"
                or a["target"] <= 1
            ),
            field_path=".target",
            reason="InvalidAutoscaling",
        ),
        Rule(
            "!has(self.target) || !has(self.metric) || self.metric != 'ttftP90' || self.target <= 600.0",
            "a ttftP90 target is in seconds, at most 600",
            lambda a: a.get("target") is None or a.get("metric") != "ttftP90" or a["target"] <= 600,
            field_path=".target",
            reason="InvalidAutoscaling",
        ),
    )


MAX_NODES = 64  # hosts in one LeaderWorkerSet group


@dataclass
class ParallelismSpec:
    """How one model replica is split: tensor-parallel ranks per pipeline stage, pipeline stages, and the pods
    (hosts) the stages run on. More than one node renders a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1):
    one group of `nodes` pods per replica, started, restarted and scaled as one. Unset: the operator plans
    one pod per replica, or a group where the model needs more GPUs than a node has."""

    tensor: int | None = prop(
        Int(1, 64),
        "tensor",
        "Tensor-parallel ranks per pipeline stage (--tensor-parallel-size). Unset: what keeps gpu.count GPUs "
        "per pod (gpu.count x nodes / pipeline; 1 on CPU pods).",
        reason="InvalidParallelism",
    )
    pipeline: int = prop(
        Int(1, 64), "pipeline", "Pipeline stages per replica (--pipeline-parallel-size).", default=1,
        reason="InvalidParallelism",
    )  # fmt: skip
    nodes: int | None = prop(
        Int(1, MAX_NODES),
        "nodes",
        "Pods (hosts) per replica (--nnodes), each running tensor x pipeline / nodes ranks; above 1 the "
        "replica is a LeaderWorkerSet group. Unset: one pod per pipeline stage.",
        reason="InvalidParallelism",
    )


@dataclass
class PoolReplicasSpec:
    replicas: int = prop(Int(1, MAX_REPLICAS_LIMIT), "replicas", default=1, reason="InvalidDisaggregation")


@dataclass
class DisaggregationSpec:
    """Prefill/decode disaggregation: two engine pools from one object, prefill engines (KV producers) and
    decode engines (KV consumers that fetch a prompt's KV from a prefill engine over TCP), and the router
    sending each request to a prefill replica, then its decode replica. spec.replicas does not apply."""

    prefill: PoolReplicasSpec = prop(Obj(PoolReplicasSpec), "prefill")
    decode: PoolReplicasSpec = prop(Obj(PoolReplicasSpec), "decode")


@dataclass
class DrainSpec:
    """How engine pods stop (scale-down, rollouts) without failing requests."""

    timeout_seconds: int = prop(
        Int(0, 3600),
        "timeoutSeconds",
        "How long an engine may finish its in-flight requests after SIGTERM (--shutdown-grace-seconds); it "
        "answers /health 503 meanwhile so the router stops sending to it. The pod's "
        "terminationGracePeriodSeconds is this plus 15.",
        default=DEFAULT_DRAIN_SECONDS,
    )


@dataclass
class InferenceSpec:
    """A model served by Pagoda engine pods that the operator sizes for the GPUs it finds."""

    model: ModelSpec = prop(Obj(ModelSpec), "model")
    adapters: list[AdapterSpec] = prop(
        ListOf(AdapterSpec, key="name", max_items=MAX_ADAPTERS),
        "adapters",
        "LoRA adapters of the model, served by every engine next to it and loaded at start (this list is the "
        "source of truth: the engine's run-time load and unload routes stay off in the pods it renders).",
        default=[],
        show_default=False,
    )
    replicas: int = prop(Int(0), "replicas", default=1)
    gpu: GPUSpec = prop(Obj(GPUSpec), "gpu")
    engine: EngineSpec = prop(Obj(EngineSpec), "engine")
    workload: WorkloadSpec = prop(Obj(WorkloadSpec), "workload", show_default=False)
    offload: OffloadSpec = prop(Obj(OffloadSpec), "offload")
    image: str | None = prop(
        Str(),
        "image",
        "The engine image; defaults to the operator's engine image (localhost/pagoda-engine:<operator version>, "
        "its -cpu tag for a deployment without GPUs, unless the chart sets another). Whoever may create an InferenceDeployment runs any code they "
        "like this way, with the pod's API-key Secret, model volumes and GPUs. Cluster admins restrict it with "
        "the operator's image allow-list (Helm value engine.allowedImages); an image off the list gets "
        "Ready=False with reason ImageNotAllowed and an Event, and no pods.",
    )
    resources: dict[str, dict[str, Any]] = prop(
        Raw({"type": "object", "properties": {"requests": QUANTITY_MAP, "limits": QUANTITY_MAP}}, dict,
            check=_resources),
        "resources",
        "CPU and memory for each engine pod (GPUs come from gpu.count); unset ones are sized by the operator "
        "(docs/operator.md).",
        default={}, show_default=False,
    )  # fmt: skip
    pod: PodSpec = prop(Obj(PodSpec), "pod", show_default=False)
    api_key_ref: SecretKeyRef | None = prop(
        Obj(SecretKeyRef, optional=True),
        "apiKeySecretRef",
        "The Secret key holding the engine's API key (given to the engine as PAGODA_API_KEY). It may name any "
        "Secret in the namespace, and with spec.image the pod's code can read it: grant create on "
        "InferenceDeployments only to those who may read the namespace's Secrets.",
    )
    service_monitor_spec: ServiceMonitorSpec = prop(Obj(ServiceMonitorSpec), "serviceMonitor")
    routing: RoutingSpec = prop(Obj(RoutingSpec), "routing", show_default=False)
    autoscaling: AutoscalingSpec | None = prop(Obj(AutoscalingSpec, optional=True), "autoscaling")
    gateway: GatewaySpec | None = prop(Obj(GatewaySpec, optional=True), "gateway")
    drain: DrainSpec = prop(Obj(DrainSpec), "drain", show_default=False)
    parallelism: ParallelismSpec | None = prop(Obj(ParallelismSpec, optional=True), "parallelism")
    disaggregation: DisaggregationSpec | None = prop(Obj(DisaggregationSpec, optional=True), "disaggregation")
    RULES = (
        Rule(
            "!has(self.gpu) || !has(self.gpu.product) || self.gpu.product == '' || self.gpu.count > 0",
            "gpu.product needs gpu.count of at least 1 (count 0 means CPU pods)",
            lambda s: not _has(s, "gpu", "product") or _has(s, "gpu", "count") != 0,
            field_path=".gpu.count",
        ),
        Rule(
            "!has(self.gpu) || !has(self.gpu.count) || self.gpu.count > 0 || !has(self.engine) || "
            "!has(self.engine.kvCacheDtype) || !self.engine.kvCacheDtype.startsWith('fp8')",
            "an FP8 KV cache needs a GPU (gpu.count 0 means CPU pods)",
            lambda s: _has(s, "gpu", "count") != 0 or not str(_has(s, "engine", "kvCacheDtype") or "").startswith("fp8"),
            field_path=".engine.kvCacheDtype",
        ),
        Rule(
            "!has(self.model) || !has(self.model.revision) || (has(self.model.source) && "
            "self.model.source.startsWith('hf://') && !self.model.source.contains('@'))",
            "revision applies to hf:// sources only (written once: as revision or as hf://org/name@revision)",
            lambda s: _has(s, "model", "revision") is None
            or (str(_has(s, "model", "source") or "").startswith("hf://") and "@" not in s["model"]["source"]),
            field_path=".model.revision",
        ),
    )  # fmt: skip

    # -- derived ------------------------------------------------------------------------------------------
    @property
    def downloads(self) -> bool:
        """Whether a download fills the model cache volume (the model's weights, or an adapter's)."""
        return self.model.downloads or any(a.downloads for a in self.adapters)

    @property
    def max_loras(self) -> int:
        """engine.maxLoras, else one slot per adapter, at most 8."""
        return self.engine.max_loras or min(max(len(self.adapters), 1), 8)

    @property
    def api_key_secret(self) -> tuple[str, str] | None:
        return (self.api_key_ref.name, self.api_key_ref.key) if self.api_key_ref else None  # type: ignore[return-value]

    @property
    def service_monitor(self) -> bool:
        return self.service_monitor_spec.enabled

    @property
    def service_monitor_interval(self) -> str:
        return self.service_monitor_spec.interval

    @property
    def drain_seconds(self) -> int:
        return self.drain.timeout_seconds

    @property
    def max_possible_replicas(self) -> int:
        """The most engine pods this spec may run: the autoscaler's maximum, else spec.replicas."""
        if self.disaggregation is not None:
            return self.engine_replicas
        if self.autoscaling is not None:
            return max(self.autoscaling.max_replicas, self.replicas)
        return self.replicas

    @property
    def engine_replicas(self) -> int:
        """The StatefulSet's replicas: spec.replicas (the autoscaler writes it through the scale
        subresource), kept within the autoscaler's bounds so a stale value never fights them. Disaggregated:
        the replicas of both pools; a LeaderWorkerSet: its groups."""
        if self.disaggregation is not None:
            return self.disaggregation.prefill.replicas + self.disaggregation.decode.replicas
        if self.autoscaling is None:
            return self.replicas
        return min(max(self.replicas, self.autoscaling.min_replicas), self.autoscaling.max_replicas)

    @property
    def scales_to_zero(self) -> bool:
        return self.autoscaling is not None and self.autoscaling.min_replicas == 0

    @property
    def memory_limit_bytes(self) -> int | None:
        limit = self.resources.get("limits", {}).get("memory") or self.resources.get("requests", {}).get(
            "memory"
        )
        return parse_quantity(limit) if limit is not None else None


def parse_spec(spec: Any) -> InferenceSpec:
    """The spec with defaults applied; raises SpecError naming the first bad field."""
    out: InferenceSpec = parse_object(InferenceSpec, spec)
    model = out.model
    if model.kind == "hf" and "@" in model.source:
        model.revision = model.source.rsplit("@", 1)[1]
    if not model.served_model_name:
        model.served_model_name = "default" if model.kind == "default" else model.model_id
    auto = out.autoscaling
    if auto is not None and auto.target is None:
        auto.target = AUTOSCALING_METRICS[auto.metric][2]
    out.routing = resolve_routing(out.routing, out.replicas, auto)
    if out.disaggregation is not None:
        _check_disaggregation(out)
        if not out.routing.explicit:  # the router is what sends a request to a prefill, then a decode pool
            out.routing = RoutingSpec(DEFAULT_POLICY, explicit=False)
    if out.parallelism is not None:
        _check_parallelism(out)
    if out.scales_to_zero and out.routing.policy is None:
        raise SpecError(
            "routing.policy",
            "autoscaling.minReplicas 0 needs the router (it holds requests while no engine is ready): remove "
            "routing.policy none or set minReplicas to 1 or more",
            reason="InvalidAutoscaling",
        )
    return out


def resolve_routing(routing: RoutingSpec, replicas: int, autoscaling: AutoscalingSpec | None) -> RoutingSpec:
    """An explicit policy (or `none`), else tierAware when more than one engine may run or the deployment may
    scale to zero (the router holds requests while no engine is ready)."""
    if routing.policy is None:
        most = max(replicas, autoscaling.max_replicas) if autoscaling is not None else replicas
        to_zero = autoscaling is not None and autoscaling.min_replicas == 0
        return RoutingSpec(DEFAULT_POLICY if most > 1 or to_zero else None, explicit=False)
    if routing.policy == NO_ROUTER:
        return RoutingSpec(None, explicit=True)
    return RoutingSpec(routing.policy, explicit=True)


def _check_disaggregation(spec: InferenceSpec) -> None:
    """What two pools cannot be combined with (yet): each a SpecError naming the field."""
    why = {
        "routing.policy": spec.routing.explicit and spec.routing.policy is None,
        "autoscaling": spec.autoscaling is not None,
        "gateway": spec.gateway is not None,
        "parallelism.nodes": spec.parallelism is not None
        and (spec.parallelism.nodes or spec.parallelism.pipeline) > 1,
    }
    words = {
        "routing.policy": "needs the router (it sends each request to a prefill engine, then a decode "
        "engine): remove routing.policy none",
        "autoscaling": "scales by spec.replicas, which two pools do not have: set the pools' replicas",
        "gateway": "is not rendered for two pools yet (the InferencePool would select both)",
        "parallelism.nodes": "runs single-pod engines only: a pool of LeaderWorkerSet groups is not rendered",
    }
    for field_name, bad in why.items():
        if bad:
            raise SpecError(field_name, f"disaggregation {words[field_name]}", reason="InvalidDisaggregation")


def resolved_parallelism(spec: InferenceSpec) -> tuple[int, int, int]:
    """(tensor, pipeline, nodes) of spec.parallelism with its defaults: one pod per stage, and a tensor size
    that keeps gpu.count GPUs per pod (1 on CPU pods)."""
    par = spec.parallelism
    assert par is not None
    nodes = par.nodes or par.pipeline
    if par.tensor is not None:
        return par.tensor, par.pipeline, nodes
    if spec.gpu.count == 0:
        return 1, par.pipeline, nodes
    if (spec.gpu.count * nodes) % par.pipeline:
        raise SpecError(
            "parallelism.tensor",
            f"gpu.count {spec.gpu.count} x nodes {nodes} is not a multiple of pipeline {par.pipeline}: set "
            "tensor",
            reason="InvalidParallelism",
        )
    return spec.gpu.count * nodes // par.pipeline, par.pipeline, nodes


def _check_parallelism(spec: InferenceSpec) -> None:
    """The engine's rules for a replica's ranks, said in the spec's words."""
    tensor, pipeline, nodes = resolved_parallelism(spec)
    world = tensor * pipeline
    if world % nodes:
        raise SpecError(
            "parallelism.nodes",
            f"{nodes} nodes must divide the replica's {world} ranks (tensor x pipeline)",
            reason="InvalidParallelism",
        )
    if nodes > 1 and spec.model.cache.per_pod:
        raise SpecError(
            "model.cache.perPod",
            "a replica spanning nodes reads the weights from one shared claim: unset perPod",
            reason="InvalidParallelism",
        )
