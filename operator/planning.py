"""From a spec and the GPU pools on the nodes to one engine plan: which GPU, which settings, and why.

Sizing rules live in `pagoda.engine.sizing`; this module picks the GPU, turns the spec into sizing hints,
and applies the user's explicit engine settings on top of the plan (checking they can be served).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pagoda.engine.sizing import (
    GPUInfo,
    Hints,
    ModelShape,
    Plan,
    SizingError,
    UnsupportedGPUError,
    plan,
    shape_from_config,
    well_known_shape,
)
from pagoda.engine.sizing.errors import UnsupportedModelError, UnsupportedOnGPU
from pagoda.engine.sizing.kv_dtypes import check_kv_cache_dtype
from pagoda.engine.sizing.planner import HOST_LIMIT_SHARE
from pagoda.engine.sizing.shapes import check_published_config
from pagoda.operator import refit as refitting
from pagoda.operator.discovery import (
    RENDERED_NODE,
    GPUPool,
    NodeGPUs,
    matching_pools,
    pools,
    unidentified,
    unidentified_message,
)
from pagoda.operator.quantity import format_quantity
from pagoda.operator.spec import MAX_NODES, InferenceSpec, SpecError, resolved_parallelism

UNSUPPORTED_MODEL = "UnsupportedModel"  # the condition reason of a model the engine does not run
KiB = 1 << 10
GiB = 1 << 30
CPU_DEFAULT_MEMORY = 4 * GiB  # a CPU pod with no memory limit gets this much (the KV cache lives in it)
# Engine pod CPU and memory where spec.resources leaves them out, one rule for every GPU pod (docs/operator.md,
# "Pod resources"): a front end (API server, tokenizer, scheduler) plus one process per tensor-parallel rank.
#   cpu    = 2 + 2 x TP
#   memory = 6 GiB + TP x (3 GiB + max(1 GiB, 10% of the rank's weights)) + /dev/shm + the host KV tier
#   /dev/shm = 2 GiB x TP (NCCL's buffers between ranks; a memory-backed emptyDir, so it counts against
#              the pod's memory limit and is part of the request)
FRONT_END_CPU, RANK_CPU = 2, 2
FRONT_END_MEMORY = 6 * GiB  # the API server, tokenizer and scheduler process and the Python runtime
RANK_MEMORY = 3 * GiB  # per rank: torch and the CUDA runtime's host allocations, pinned staging buffers
LOAD_SHARE, LOAD_MIN = 0.10, 1 * GiB  # per rank: host buffers while its share of the weights loads
SHM_PER_RANK = 2 * GiB
CPU_SHM = (
    256 << 20
)  # CPU pods: one process, /dev/shm is only what libraries ask for; inside CPU_DEFAULT_MEMORY
DISK_FS_SHARE = 0.95
# --max-num-queued-reqs (docs/operator.md): requests waiting beyond two full batches only add latency a client
# cannot see, where a 503 + Retry-After lets it go to another replica; and each waiting request holds its
# prompt (text, token ids, block hashes: about 64 bytes per token at worst) plus its request state and buffers.
QUEUE_BATCHES = 2
QUEUED_BYTES_PER_TOKEN = 64
QUEUED_BYTES_PER_REQUEST = 16 * KiB
QUEUE_MEMORY_DIVISOR = 16  # the queue may hold 1/16 of the memory the RAM-resident KV leaves in the pod


@dataclass
class Decision:
    """The chosen GPU and plan for one InferenceDeployment."""

    plan: Plan
    gpu: GPUInfo | None  # None: CPU pods
    product_label: str | None = None
    node_selector: dict[str, str] = field(default_factory=dict)  # places the engine pods on the chosen GPUs
    nodes: list[str] = field(default_factory=list)
    gpu_reason: str = ""
    nvme_bytes: int | None = None  # the per-pod PVC size when NVMe offload is on
    disk_tier_bytes: int = 0
    memory_limit_bytes: int | None = None  # the user's (spec.resources), or the CPU default
    pod_memory_bytes: int = 0  # what the pod may use: the user's limit, else what the operator requests
    pod_cpu: int = 1  # cores the engine pod requests unless spec.resources says
    shm_bytes: int = 0  # /dev/shm (memory-backed: part of pod_memory_bytes)
    max_num_queued_reqs: int = 1
    queue_reason: str = ""
    shape: ModelShape | None = None  # what the plan was sized for (the engine's dry run checks it)
    # One replica's split (spec.parallelism, or a model that needs more GPUs than a node has): stages, and
    # the pods they run on (above 1: a LeaderWorkerSet group); pod_gpus: GPUs of each pod
    pipeline_parallel_size: int = 1
    nnodes: int = 1
    pod_gpus: int = 0
    parallel_reason: str = ""

    @property
    def multi_node(self) -> bool:
        """Whether a replica is a group of pods (a LeaderWorkerSet) rather than one pod."""
        return self.nnodes > 1

    def status_plan(self) -> dict[str, Any]:
        """The engine plan as status.plan shows it, the operator's own choices included."""
        out = self.plan.to_dict()
        out["max_num_queued_reqs"] = self.max_num_queued_reqs
        out["reasons"] = {**out.get("reasons", {}), "max_num_queued_reqs": self.queue_reason}
        if self.pipeline_parallel_size > 1 or self.nnodes > 1:
            out["pipeline_parallel_size"] = self.pipeline_parallel_size
            out["nnodes"] = self.nnodes
            out["reasons"]["pipeline_parallel_size"] = out["reasons"]["nnodes"] = self.parallel_reason
        return out

    @property
    def weights_label(self) -> str:
        """The weight format the plan was sized for, short, as the Planned event names it: the dtype of a
        float checkpoint, else the quantized format seen (and "dequantized" where the engine expands it)."""
        if self.shape is None:
            return self.plan.weight_format or "unknown"
        if not self.shape.weight_format:
            return "float32" if self.gpu is None else self.shape.dtype
        if (
            self.gpu is None
            and self.plan.quantization != "gguf"
            or self.gpu is not None
            and not (self.shape.quantized_by_default)
        ):
            return f"{self.shape.weight_format_label}, dequantized at load"
        return self.shape.weight_format_label

    def status_gpu(self, count: int) -> dict[str, Any]:
        if self.gpu is None:
            return {"product": "cpu", "count": 0, "nodes": [], "reason": self.gpu_reason}
        major, minor = self.gpu.compute_capability
        return {
            "product": self.product_label or self.gpu.product_label,
            "memoryMiB": self.gpu.memory_mib,
            "computeCapability": f"{major}.{minor}",
            "count": count,
            "nodes": list(self.nodes),
            "reason": self.gpu_reason,
        }


def check_model(spec: InferenceSpec) -> None:
    """Refuse a model the engine does not run before anything is downloaded: the published config.json of a
    catalogue model (or of a quantized checkpoint named after one: Qwen/Qwen3-8B-AWQ) read by the engine's
    own strict reader, so the operator, `pagoda serve` and `pagoda plan` refuse the same models."""
    try:
        check_published_config(spec.model.model_id)
    except UnsupportedModelError as exc:
        raise SpecError(
            "model.source", f"the engine does not run this model: {exc}", UNSUPPORTED_MODEL
        ) from None


def model_shape(spec: InferenceSpec) -> ModelShape:
    """The model's shape: given in the spec, or known by name; otherwise the spec cannot be sized. A model the
    engine does not run is refused first (check_model, reason UnsupportedModel)."""
    check_model(spec)
    if spec.model.shape:
        try:
            return shape_from_config(
                spec.model.shape.config(), name=spec.model.model_id, where="spec.model.shape"
            )
        except SizingError as exc:
            raise SpecError("model.shape", str(exc), reason="InvalidModelShape") from None
    shape = well_known_shape(spec.model.model_id)
    if shape is None:
        raise SpecError(
            "model.shape",
            f"the operator does not know the shape of {spec.model.model_id!r}: copy num_hidden_layers, "
            "num_attention_heads, num_key_value_heads, hidden_size, intermediate_size, vocab_size and "
            "max_position_embeddings from its config.json into spec.model.shape as numLayers, "
            "numAttentionHeads, numKvHeads, hiddenSize, intermediateSize, vocabSize and maxPositionEmbeddings",
            reason="UnknownModel",
        )
    return shape


def hints(spec: InferenceSpec, gpu_count: int | None) -> Hints:
    w = spec.workload
    memory = spec.memory_limit_bytes
    if memory is None and gpu_count is None:
        memory = CPU_DEFAULT_MEMORY
    if memory is not None and gpu_count is None:
        memory = max(memory - CPU_SHM, 0)  # /dev/shm is memory the KV cache cannot have
    return Hints(
        target_context=spec.engine.max_model_len or w.target_context,
        min_concurrency=w.min_concurrency or 1,
        p50_prompt_tokens=w.p50_prompt_tokens,
        p50_output_tokens=w.p50_output_tokens,
        p99_prompt_tokens=w.p99_prompt_tokens,
        p99_output_tokens=w.p99_output_tokens,
        quality_first=w.quality_first,
        prefer_capacity=w.prefer_capacity,
        kv_cache_dtype="int8" if spec.engine.kv_cache_dtype == "int8" else None,  # sized as INT8
        memory_limit_bytes=memory,
        nvme_bytes=None,
        gpu_count=gpu_count,
    )


def _apply_overrides(spec: InferenceSpec, p: Plan, gpu: GPUInfo | None) -> Plan:
    """The user's explicit engine settings win over the plan, when they can be served."""
    reasons = dict(p.reasons)
    changes: dict[str, Any] = {}
    e = spec.engine
    if e.kv_cache_dtype != "auto" and e.kv_cache_dtype != p.kv_cache_dtype:
        try:  # the engine's one rule (a CPU pod has no FP8), in the engine's words
            check_kv_cache_dtype(
                e.kv_cache_dtype,
                "CPU pods" if gpu is None else gpu.name,
                None if gpu is None else gpu.compute_capability,
            )
        except UnsupportedOnGPU as exc:
            raise SpecError("engine.kvCacheDtype", str(exc), reason="UnsupportedKVCacheDtype") from None
        changes["kv_cache_dtype"] = e.kv_cache_dtype
        reasons["kv_cache_dtype"] = f"set by spec.engine.kvCacheDtype ({gpu.name} supports FP8)"
    elif e.kv_cache_dtype != "auto":
        reasons["kv_cache_dtype"] = f"set by spec.engine.kvCacheDtype; {p.reasons.get('kv_cache_dtype', '')}"
    if e.max_model_len is not None:
        if e.max_model_len > p.max_model_len:
            raise SpecError(
                "engine.maxModelLen",
                f"{e.max_model_len} tokens do not fit: at most {p.max_model_len} fits "
                f"({p.reasons.get('max_model_len', '')}); lower maxModelLen, use more or larger GPUs, or set "
                "maxModelLen: auto",
                reason="ContextTooLong",
            )
        changes["max_model_len"] = e.max_model_len
        reasons["max_model_len"] = f"set by spec.engine.maxModelLen (up to {p.max_model_len} would fit)"
    if e.block_size is not None and e.block_size != p.block_size:
        changes["block_size"] = e.block_size
        changes["num_gpu_blocks"] = p.num_gpu_blocks * p.block_size // e.block_size
        reasons["block_size"] = "set by spec.engine.blockSize"
    if e.gpu_memory_utilization is not None and gpu is not None:
        changes["gpu_memory_utilization"] = e.gpu_memory_utilization
        reasons["gpu_memory_utilization"] = (
            f"set by spec.engine.gpuMemoryUtilization (the plan chose {p.gpu_memory_utilization}); the engine "
            "re-measures free memory at start-up and refuses a context that cannot fit"
        )
    if e.max_num_seqs is not None:
        changes["max_num_seqs"] = e.max_num_seqs
        reasons["max_num_seqs"] = "set by spec.engine.maxNumSeqs"
    if gpu is not None and spec.gpu.count > p.tensor_parallel_size:
        reasons["tensor_parallel_size"] = (
            f"spec.gpu.count asks for {spec.gpu.count} GPUs per pod; the model needs at least "
            f"{p.tensor_parallel_size} ({p.reasons.get('tensor_parallel_size', '')})"
        )
        changes["tensor_parallel_size"] = spec.gpu.count
    changes["reasons"] = reasons
    return dataclasses.replace(p, **changes)


TP_NO_TIERS = "the engine runs no KV offload tiers with tensor parallelism yet"
PP_NO_TIERS = "the engine runs no KV offload tiers with pipeline parallelism yet"


def _offload(spec: InferenceSpec, p: Plan, pipeline: int = 1) -> tuple[Plan, int | None, int]:
    reasons = dict(p.reasons)
    if p.tensor_parallel_size > 1 or pipeline > 1:  # render no tier (nor PVC) the engine would switch off
        why = TP_NO_TIERS if p.tensor_parallel_size > 1 else PP_NO_TIERS
        warnings = list(p.warnings)
        if spec.offload.host_bytes or spec.offload.nvme_enabled:
            warnings.append(f"spec.offload is ignored: {why}")
        reasons["kv_offload_host_bytes"] = reasons["kv_offload_disk_bytes"] = f"off: {why}"
        reasons.pop("pvc_size", None)
        new = dataclasses.replace(
            p,
            kv_offload_host_bytes=0,
            kv_offload_disk_bytes=0,
            pvc_size="",
            reasons=reasons,
            warnings=warnings,
        )
        return new, None, 0
    if p.num_window_blocks:  # the planner chose the window group, which runs without tiers: keep it so
        warnings = list(p.warnings)
        if spec.offload.host_bytes or spec.offload.nvme_bytes:
            warnings.append(f"spec.offload is ignored: {p.reasons['kv_offload_host_bytes']}")
        reasons.pop("pvc_size", None)
        new = dataclasses.replace(
            p,
            kv_offload_host_bytes=0,
            kv_offload_disk_bytes=0,
            pvc_size="",
            reasons=reasons,
            warnings=warnings,
        )
        return new, None, 0
    host = p.kv_offload_host_bytes
    limit = spec.memory_limit_bytes
    if spec.offload.host_bytes is None and p.device != "cpu" and limit is not None:
        # The host tier gets what the pod's limit leaves after the engine's own memory (the rule above).
        runtime = runtime_memory_bytes(p)
        host = max(0, int(limit * HOST_LIMIT_SHARE) - runtime) // GiB * GiB
        reasons["kv_offload_host_bytes"] = (
            f"{HOST_LIMIT_SHARE:.0%} of the pod memory limit {format_quantity(limit)} minus "
            f"{format_quantity(runtime)} for the engine's processes, loading buffers and /dev/shm, whole GiB"
            + ("; too small for a host tier" if host == 0 else "")
        )
    if spec.offload.host_bytes is not None:
        host = 0 if p.device == "cpu" else spec.offload.host_bytes
        reasons["kv_offload_host_bytes"] = (
            "CPU pod: the KV cache already lives in host RAM"
            if p.device == "cpu"
            else "set by spec.offload.host.size"
        )
    if not spec.offload.nvme_enabled:
        reasons["kv_offload_disk_bytes"] = "spec.offload.nvme.enabled is false: no disk tier"
        reasons.pop("pvc_size", None)
        return (
            dataclasses.replace(
                p, kv_offload_host_bytes=host, kv_offload_disk_bytes=0, pvc_size="", reasons=reasons
            ),
            None,
            0,
        )
    if spec.offload.nvme_bytes is not None:
        pvc = spec.offload.nvme_bytes
        disk = int(pvc * DISK_FS_SHARE) // GiB * GiB
        reasons["pvc_size"] = "set by spec.offload.nvme.size"
        reasons["kv_offload_disk_bytes"] = (
            f"{DISK_FS_SHARE:.0%} of the {format_quantity(pvc)} volume, whole GiB"
        )
    else:
        pvc = int(p.pvc_size.removesuffix("Gi")) * GiB
        disk = p.kv_offload_disk_bytes
    new = dataclasses.replace(
        p,
        kv_offload_host_bytes=host,
        kv_offload_disk_bytes=disk,
        pvc_size=format_quantity(pvc),
        reasons=reasons,
    )
    return new, pvc, disk


def shm_bytes(p: Plan, gpu: GPUInfo | None) -> int:
    """/dev/shm of an engine pod (a memory-backed emptyDir's sizeLimit)."""
    return CPU_SHM if gpu is None else SHM_PER_RANK * p.tensor_parallel_size


def pod_cpu(p: Plan, gpu: GPUInfo | None) -> int:
    """Cores an engine pod requests: one front end, one process per rank (CPU pods: the cores it computes on
    are the user's resources.requests.cpu, else 1)."""
    return 1 if gpu is None else FRONT_END_CPU + RANK_CPU * p.tensor_parallel_size


def runtime_memory_bytes(p: Plan) -> int:
    """A GPU pod's memory besides the host KV tier: front end, ranks with their loading buffers, /dev/shm."""
    tp = p.tensor_parallel_size
    per_rank = RANK_MEMORY + max(LOAD_MIN, int(LOAD_SHARE * p.weights_bytes_per_gpu))
    return FRONT_END_MEMORY + tp * (per_rank + SHM_PER_RANK)


def needed_memory_bytes(p: Plan, gpu: GPUInfo | None) -> int:
    """What the rule above gives a GPU pod (CPU pods: the default, which the KV cache is sized into)."""
    if gpu is None:
        return CPU_DEFAULT_MEMORY
    total = runtime_memory_bytes(p) + (p.kv_offload_host_bytes or 0)
    return -(-total // GiB) * GiB


def pod_memory_bytes(spec: InferenceSpec, p: Plan, gpu: GPUInfo | None) -> int:
    """The engine pod's memory: the user's limit (or request), else what the operator will request."""
    if spec.memory_limit_bytes is not None:
        return spec.memory_limit_bytes
    return needed_memory_bytes(p, gpu)


def queue_limit(p: Plan, pod_memory: int) -> tuple[int, str]:
    """--max-num-queued-reqs: two batches deep, as far as the pod's memory holds their prompts."""
    ram_kv = (p.kv_cache_memory_bytes or 0) if p.device == "cpu" else (p.kv_offload_host_bytes or 0)
    budget = max(pod_memory - ram_kv, 0) // QUEUE_MEMORY_DIVISOR
    per_request = p.max_model_len * QUEUED_BYTES_PER_TOKEN + QUEUED_BYTES_PER_REQUEST
    by_memory = budget // per_request
    by_batches = QUEUE_BATCHES * p.max_num_seqs
    limit = max(1, min(by_batches, by_memory))
    where = "KV cache" if p.device == "cpu" else "host KV tier"
    why = (
        f"{QUEUE_BATCHES} x max_num_seqs ({by_batches})"
        if by_batches <= by_memory
        else f"1/{QUEUE_MEMORY_DIVISOR} of the {format_quantity(max(pod_memory - ram_kv, 0))} the {where} leaves "
        f"in the pod holds {by_memory} waiting prompts of up to {p.max_model_len} tokens "
        f"({per_request} B each)"
    )
    return limit, f"{why}; more waiting requests get 503 with Retry-After"


def _finish(decision: Decision, spec: InferenceSpec, shape: ModelShape) -> Decision:
    decision.shape = shape
    if not decision.pod_gpus:
        decision.pod_gpus = spec.gpu.count
    # the pod's resources follow the ranks it runs (tensor x pipeline / nodes), not the replica's
    ranks = decision.plan.tensor_parallel_size * decision.pipeline_parallel_size // decision.nnodes
    per_pod = dataclasses.replace(decision.plan, tensor_parallel_size=max(ranks, 1))
    decision.pod_memory_bytes = pod_memory_bytes(spec, per_pod, decision.gpu)
    decision.pod_cpu = pod_cpu(per_pod, decision.gpu)
    decision.shm_bytes = shm_bytes(per_pod, decision.gpu)
    need = needed_memory_bytes(per_pod, decision.gpu)
    if decision.gpu is not None and decision.pod_memory_bytes < need:
        decision.plan.warnings.append(
            f"spec.resources gives the pod {format_quantity(decision.pod_memory_bytes)} of memory; the operator's "
            f"rule asks {format_quantity(need)} for {decision.plan.tensor_parallel_size} rank(s), their weights' "
            f"loading, {format_quantity(decision.shm_bytes)} of /dev/shm (which counts against the limit) and the "
            "host KV tier: the pod may be OOM-killed"
        )
    decision.max_num_queued_reqs, decision.queue_reason = queue_limit(
        decision.plan, decision.pod_memory_bytes
    )
    return decision


def _refitted(p: Plan, refit: dict[str, Any] | None, gpu: GPUInfo | None) -> Plan:
    """The plan with the re-fit settings of status.refit (refit.py) applied, if any."""
    settings = (refit or {}).get("settings") or {}
    why = f"re-fit after {(refit or {}).get('attempts', 0)} out-of-memory failure(s)"
    return refitting.apply(p, settings, gpu.memory_bytes if gpu is not None else None, why)


def decide(
    spec: InferenceSpec, available: dict[str, GPUPool], refit: dict[str, Any] | None = None
) -> Decision:
    """The GPU and the plan for `spec` on the nodes' `available` pools, with the re-fit settings of `refit`
    (status.refit of this generation) applied; raises SpecError when unservable."""
    shape = model_shape(spec)
    split = resolved_parallelism(spec) if spec.parallelism is not None else None
    if split is not None and split[1] > shape.num_layers:
        raise SpecError(
            "parallelism.pipeline",
            f"{split[1]} stages for {shape.num_layers} layers: at most one stage per layer",
            reason="InvalidParallelism",
        )
    if spec.gpu.count == 0:
        try:
            p = plan(shape, None, hints(spec, None))
        except SizingError as exc:
            raise SpecError("resources.limits.memory", str(exc), reason="ModelTooLarge") from None
        p = _apply_overrides(spec, p, None)
        pipeline = split[1] if split else 1
        if split:
            p = _with_split(p, split, "set by spec.parallelism")
        p, nvme, disk = _offload(spec, p, pipeline)
        p = _refitted(p, refit, None)
        memory = spec.memory_limit_bytes or CPU_DEFAULT_MEMORY
        decision = Decision(p, None, gpu_reason="gpu.count is 0: CPU pods", nvme_bytes=nvme,
                            disk_tier_bytes=disk, memory_limit_bytes=memory)  # fmt: skip
        if split:
            decision.pipeline_parallel_size, decision.nnodes = split[1], split[2]
            decision.parallel_reason = _split_reason(split, "set by spec.parallelism")
        return _finish(decision, spec, shape)

    if spec.gpu.product:
        try:
            candidates = matching_pools(spec.gpu.product, available)
        except SizingError as exc:
            raise SpecError("gpu.product", str(exc), reason="UnknownGPUProduct") from None
        if not candidates:
            seen = ", ".join(sorted(available)) or "none"
            raise SpecError(
                "gpu.product",
                f"no schedulable node has {spec.gpu.product} GPUs (GPU products on the nodes: {seen}); the "
                "operator re-plans when one appears",
                reason="NoMatchingNodes",
            )
        why_pool = f"spec.gpu.product is {spec.gpu.product}"
    else:
        candidates = list(available.values())
        if not candidates:
            raise SpecError(
                "gpu.product",
                "no schedulable node carries GPU Feature Discovery labels (nvidia.com/gpu.product); install "
                "the NVIDIA GPU Operator or GFD, or set gpu.count: 0 for CPU pods",
                reason="NoGPUNodes",
            )
        why_pool = "spec.gpu.product is empty"

    plans: list[tuple[GPUPool, Plan]] = []
    failures: list[str] = []
    unsupported = 0  # pools whose GPU the engine image's torch build cannot run
    # GPUs of one replica (the planner sizes them as one tensor-parallel group: per-GPU weights and KV of
    # tensor x pipeline ranks, conservative where the KV heads are fewer than the ranks) and of each pod
    replica_gpus = split[0] * split[1] if split else spec.gpu.count
    pod_gpus = replica_gpus // split[2] if split else spec.gpu.count
    for pool in candidates:
        if pool.gpus_per_node < pod_gpus:
            failures.append(
                f"{pool.product_label}: nodes have {pool.gpus_per_node} GPUs, "
                + (
                    f"spec.parallelism puts {pod_gpus} in each pod"
                    if split
                    else f"spec.gpu.count is {pod_gpus}"
                )
            )
            continue
        info = dataclasses.replace(pool.info, count=replica_gpus)
        try:
            p = plan(shape, info, hints(spec, replica_gpus))
        except SizingError as exc:
            failures.append(f"{pool.product_label}: {exc}")
            unsupported += isinstance(exc, UnsupportedGPUError)
            continue
        plans.append((pool, p))
    if not plans and unsupported == len(candidates):
        raise SpecError("gpu.product", "; ".join(failures), reason="UnsupportedGPU")
    auto_split = None
    if not plans and split is None:  # more GPUs than a node has: a group of nodes per replica
        found = _multi_node(spec, shape, candidates)
        if found is not None:
            pool, p, auto_split = found
            plans.append((pool, p))
            split, pod_gpus = auto_split, auto_split[0] * auto_split[1] // auto_split[2]
    if not plans:
        raise SpecError("model.source", f"{shape.name} cannot be served on the GPUs present: " + "; ".join(failures),
                        reason="ModelTooLarge")  # fmt: skip

    # Most KV capacity wins (longest context x concurrency), then the label, for a stable choice.
    plans.sort(
        key=lambda pp: (
            -pp[1].num_gpu_blocks * pp[1].block_size * pp[1].tensor_parallel_size,
            pp[0].product_label,
        )
    )
    pool, p = plans[0]
    if len(candidates) > 1:
        others = ", ".join(f"{q.product_label} ({pl.kv_capacity_tokens} tokens)" for q, pl in plans[1:])
        reason = f"{why_pool}: {pool.product_label} holds the most KV ({p.kv_capacity_tokens} tokens)"
        reason += f" over {others}" if others else ""
        if failures:
            reason += "; ruled out: " + "; ".join(failures)
    else:
        reason = f"{why_pool}: {pool.product_label} on {len(pool.nodes)} node(s)"
    why = "set by spec.parallelism"
    if auto_split is not None:  # the planner's words where it staged the model itself
        why = p.reasons.get("pipeline_parallel_size") or _auto_reason(pool, auto_split)
    if split is None:
        p = _apply_overrides(spec, p, pool.info)
    else:
        p = _with_split(_apply_overrides(spec, p, pool.info), split, why)
    p, nvme, disk = _offload(spec, p, split[1] if split else 1)
    p = _refitted(p, refit, pool.info)
    if pool.source != "GPU Feature Discovery":
        reason += f"; the GPU was identified from {pool.source} (no GPU Feature Discovery labels)"
    info = dataclasses.replace(pool.info, count=pod_gpus)
    decision = Decision(p, info, pool.product_label, dict(pool.selector), list(pool.nodes), reason, nvme, disk,
                        spec.memory_limit_bytes)  # fmt: skip
    if auto_split is not None and spec.disaggregation is not None:
        raise SpecError(
            "disaggregation",
            f"{shape.name} needs more GPUs than a node has ({decision.gpu_reason}; {why}), "
            "and pools of LeaderWorkerSet groups are not rendered: serve it without disaggregation",
            reason="InvalidDisaggregation",
        )
    if split is not None:
        decision.pipeline_parallel_size, decision.nnodes, decision.pod_gpus = split[1], split[2], pod_gpus
        decision.parallel_reason = _split_reason(split, why)
    return _finish(decision, spec, shape)


def _split_reason(split: tuple[int, int, int], why: str) -> str:
    tensor, pipeline, nodes = split
    return f"{why}: {pipeline} stage(s) of {tensor} tensor-parallel rank(s) on {nodes} pod(s) per replica"


def _auto_reason(pool: GPUPool, split: tuple[int, int, int]) -> str:
    tensor, pipeline, nodes = split
    return (
        f"the model needs {tensor * pipeline} {pool.product_label} GPUs, a node has {pool.gpus_per_node}: one "
        f"pipeline stage per node"
    )


def _with_split(p: Plan, split: tuple[int, int, int], why: str) -> Plan:
    """The plan with the stage's tensor-parallel size (the planner sized the replica's GPUs as one group)."""
    reasons = {
        **p.reasons,
        "tensor_parallel_size": f"{_split_reason(split, why)}; {p.reasons.get('tensor_parallel_size', '')}",
    }
    return dataclasses.replace(p, tensor_parallel_size=split[0], reasons=reasons)


def node_limit(pool: GPUPool) -> int:
    """How many nodes of a pool one replica may span: the pool's nodes (a render without a cluster: any)."""
    return MAX_NODES if RENDERED_NODE in pool.nodes else len(pool.nodes)


def _multi_node(
    spec: InferenceSpec, shape: ModelShape, candidates: list[GPUPool]
) -> tuple[GPUPool, Plan, tuple[int, int, int]] | None:
    """A plan across nodes for a model no one node's GPUs hold: the planner's smallest tensor-parallel group
    over the pool's GPUs, split into stages of a node's GPUs (tensor = the GPUs of a node, the largest power
    of two that divides the group), one stage per pod; the pool holding the most KV wins. None where no pool
    has the nodes."""
    found: list[tuple[GPUPool, Plan, tuple[int, int, int]]] = []
    for pool in candidates:
        nodes = node_limit(pool)
        if nodes < 2 or pool.gpus_per_node < 1:
            continue
        staged = _planner_stages(spec, shape, pool, nodes)
        if staged is not None:
            split = (staged.tensor_parallel_size, staged.pipeline_parallel_size, staged.nnodes)
            found.append((pool, staged, split))
            continue
        total = pool.gpus_per_node * nodes
        try:
            p = plan(shape, dataclasses.replace(pool.info, count=total), hints(spec, total))
        except SizingError:
            continue
        group = p.tensor_parallel_size
        tensor = 1
        while tensor * 2 <= pool.gpus_per_node and group % (tensor * 2) == 0:
            tensor *= 2
        pipeline = group // tensor
        if pipeline < 2 or pipeline > nodes or pipeline > shape.num_layers:
            continue
        found.append((pool, p, (tensor, pipeline, pipeline)))
    if not found:
        return None
    found.sort(key=lambda f: (-f[1].num_gpu_blocks * f[1].block_size, f[0].product_label))
    return found[0]


def _planner_stages(spec: InferenceSpec, shape: ModelShape, pool: GPUPool, nodes: int) -> Plan | None:
    """The planner's own stages across nodes, sized per stage (Hints.max_nodes); None where the planner finds
    no staging (then the group is sized as one tensor-parallel group of the same GPUs, above)."""
    count = pool.gpus_per_node
    try:
        p = plan(
            shape,
            dataclasses.replace(pool.info, count=count),
            dataclasses.replace(hints(spec, count), max_nodes=nodes),
        )
    except SizingError:
        return None
    return p if p.pipeline_parallel_size > 1 else None


def decide_on_nodes(
    spec: InferenceSpec, nodes: list[NodeGPUs], refit: dict[str, Any] | None = None
) -> Decision:
    """`decide` on the nodes' GPUs; where no GPU fits and some nodes have GPUs nobody could name, the spec
    gets a condition that names those nodes and the label to add (reason GPUUnidentified)."""
    try:
        return decide(spec, pools(nodes), refit)
    except SpecError as err:
        unknown = unidentified(nodes)
        if unknown and err.reason in ("NoGPUNodes", "NoMatchingNodes"):
            raise SpecError("gpu.product", unidentified_message(unknown), reason="GPUUnidentified") from None
        raise
