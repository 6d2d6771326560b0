"""The planner: (model shape, GPU, workload hints) -> engine settings, each with the reason it was chosen.

Memory model of one GPU (per tensor-parallel rank), with vLLM's meaning of the flag, which the engine uses:

    gpu_memory_utilization x memory = CUDA context (+ NCCL with TP) + activation peak + weights / TP + KV cache
    (1 - gpu_memory_utilization) x memory = margin the engine never touches

The engine measures the context and the activation peak at start-up and gives the KV cache the rest of the
budget. The planner estimates the same two (the "reserve") from the model and the per-step token budget and
sets the utilisation to memory minus that reserve, so the margin outside the budget is as large as the
reserve itself (fragmentation, CUDA graphs, estimate error) and follows the card and the model instead of
being a fixed constant; it is capped. The activation reserve is a budget that grows smoothly with memory (a
share of it, between what the smallest and the largest token budget need); the token budget is then the
largest power of two whose activations fit. A smooth reserve keeps plans monotone: more memory never means
less KV cache. max_model_len keeps a slack of blocks so the engine's own measurement cannot push the planned
length out of the cache.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from pagoda.engine.sizing.engine_plan import max_kv_heads_per_rank
from pagoda.engine.sizing.errors import SizingError
from pagoda.engine.sizing.gpus import GPUInfo, check_engine_runs_on
from pagoda.engine.sizing.kv_dtypes import BF16_MIN_COMPUTE
from pagoda.engine.sizing.kv_split import KVSplit, split_kv_blocks
from pagoda.engine.sizing.shapes import ModelShape, dtype_bytes, kv_scale_bytes
from pagoda.engine.sizing.stages import max_stage_layers, stage_weight_bytes
from pagoda.engine.sizing.units import GiB, MiB, gib_ceil, gib_floor, human_bytes
from pagoda.engine.sizing.weight_format import held_quantized
from pagoda.engine.sizing.windows import shape_layout, sliding_layers, window_capacity

BLOCK_SIZE = 16  # vLLM's default; the vLLM paper measured under 4% waste at this size
UTILIZATION_CAP = 0.95  # keep 5% for allocator fragmentation and estimate error, whatever the reserve says
CUDA_CONTEXT_BASE = 512 * MiB  # CUDA context + cuBLAS workspaces
CUDA_CONTEXT_SHARE = 0.015  # ... plus CUDA graphs and caching-allocator slack, which grow with the card
NCCL_BYTES = 256 * MiB  # communicator buffers when tensor-parallel
ACTIVATION_SHARE = 0.04  # share of GPU memory the activation reserve may grow to
ACTIVATION_SAFETY = 1.2  # the estimate below counts the big tensors only
MIN_BATCHED_TOKENS, MAX_BATCHED_TOKENS = 2048, 16384
MAX_NUM_SEQS = 1024
DEFAULT_TARGET_CONTEXT = 4096  # KV every plan must hold for at least one sequence when no hint says more
CPU_RUNTIME_BYTES = 1 * GiB  # Python, torch, tokenizer and the HTTP server in a CPU pod
HOST_RUNTIME_BYTES = 4 * GiB  # the same in a GPU pod, plus CUDA host allocations and pinned staging buffers
HOST_LIMIT_SHARE = 0.9  # never plan the last 10% of a pod's memory limit: the OOM killer does not warn
DISK_CACHE_MULTIPLE = 4  # default disk tier: this many times the GPU + host KV (a prefix-cache working set)
DISK_MIN_GIB = 10
DISK_FS_SHARE = 0.95  # filesystem metadata and the tier's index live on the same volume
TP_SIZES = (1, 2, 4, 8, 16, 32, 64)
FIT_SLACK = 0.9  # GPU plans size max_model_len on 90% of the estimated blocks


@dataclass
class Hints:
    """What the user knows about the workload; every field optional."""

    target_context: int | None = None  # tokens one request may use (prompt + output)
    min_concurrency: int = 1  # full-length sequences that must fit in the KV cache at once
    p50_prompt_tokens: int | None = None
    p50_output_tokens: int | None = None
    p99_prompt_tokens: int | None = None
    p99_output_tokens: int | None = None
    quality_first: bool = False  # never quantise the KV cache
    prefer_capacity: bool = False  # quantise the KV cache even where FP8 is missing (INT8), for more tokens
    kv_cache_dtype: str | None = None  # "int8": size for an INT8 KV cache whatever the GPU (set explicitly)
    memory_limit_bytes: int | None = None  # the pod's memory limit (host tier; CPU pods: the KV cache too)
    nvme_bytes: int | None = None  # local NVMe capacity for the disk tier
    gpu_count: int | None = None  # GPUs the pod may use (default: the node's count)
    # Nodes one replica may span (pipeline stages, a LeaderWorkerSet): a model that does not fit one node's
    # GPUs gets pipeline_parallel_size stages of one node each, up to this many (None / 1: one node)
    max_nodes: int | None = None
    quantization: str | None = (
        None  # "gguf": a GGUF model's linears kept in their blocks on CPU (serve's flag)
    )

    def validate(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if (
                f.name in ("quality_first", "prefer_capacity", "kv_cache_dtype", "quantization")
                or value is None
            ):
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise SizingError(f"hint {f.name} must be an integer, got {value!r}")
            low = 0 if f.name in ("memory_limit_bytes", "nvme_bytes") else 1
            if value < low:
                raise SizingError(f"hint {f.name} must be at least {low}, got {value}")
        if self.kv_cache_dtype not in (None, "auto", "int8"):
            raise SizingError(
                f"hint kv_cache_dtype must be auto or int8 (FP8 follows the GPU), got {self.kv_cache_dtype!r}"
            )
        if self.quantization not in (None, "gguf"):
            raise SizingError(
                f"hint quantization must be gguf (a GGUF model kept in its blocks on CPU) or unset, got "
                f"{self.quantization!r}; FP8 and INT4 checkpoints are detected from their config.json"
            )
        if self.quality_first and self.prefer_capacity:
            raise SizingError(
                "hints quality_first and prefer_capacity contradict each other: the first never quantises "
                "the KV cache, the second asks for a quantised one; choose one"
            )


@dataclass
class Plan:
    """Engine settings for one pod. Sizes are per GPU (per tensor-parallel rank) unless named otherwise."""

    gpu_memory_utilization: float | None  # None on CPU, where kv_cache_memory_bytes is set instead
    max_model_len: int
    block_size: int
    kv_cache_dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int
    tensor_parallel_size: int
    num_gpu_blocks: int
    kv_cache_bytes: int
    kv_offload_host_bytes: int
    kv_offload_disk_bytes: int
    pvc_size: str
    kv_cache_memory_bytes: int | None = None
    device: str = "cuda"
    model: str = ""
    gpu: str | None = None
    kv_bytes_per_token: int = 0  # whole model, all ranks
    weights_bytes_per_gpu: int = 0
    reserve_bytes: int = 0  # CUDA context + activations (per GPU), or the runtime + activations on CPU
    # A sliding-window model: the engine's window group (engine/sizing/kv_split.py) of this many blocks for
    # its sliding layers, and the sequences of max_model_len tokens it admits at once (0: one pool)
    num_window_blocks: int = 0
    window_sequences: int = 0
    # The checkpoint's weight format as sized ("bfloat16", "int4 (awq, group 128, asymmetric): ..."), and
    # serve's --quantization where the plan sets it ("gguf")
    weight_format: str = ""
    quantization: str | None = None
    # A model that does not fit one node's GPUs: pipeline stages of tensor_parallel_size GPUs each, one stage
    # per node (the operator renders a LeaderWorkerSet of nnodes pods); sizes above are per GPU of the largest
    # stage. Not among engine_settings: the renderer adds them with each host's --node-rank.
    pipeline_parallel_size: int = 1
    nnodes: int = 1
    reasons: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **({"indent": 2} | kwargs))

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def engine_settings(self) -> dict[str, Any]:
        """The plan as EngineConfig fields, in the order `pagoda plan` and the operator render them (flags by
        engine/cli's naming: serve_args.to_argv); None: not set (the engine's default)."""
        return {
            "gpu_memory_utilization": None
            if self.gpu_memory_utilization is None
            else f"{self.gpu_memory_utilization:.2f}",
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            "kv_cache_dtype": self.kv_cache_dtype,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "tensor_parallel_size": self.tensor_parallel_size,
            # Sized for float32: a node's CPU may or may not multiply bfloat16 natively (the engine's `auto`
            # picks bfloat16 where it does), and the operator cannot see which CPU the pod lands on.
            "dtype": "float32" if self.device == "cpu" else None,
            "kv_offload_host_bytes": self.kv_offload_host_bytes or None,
            "kv_offload_disk_bytes": self.kv_offload_disk_bytes or None,
            **({"quantization": self.quantization} if self.quantization else {}),
        }


# ---------------------------------------------------------------------------------------------- estimates


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _rows_for(batched_tokens: int, min_concurrency: int) -> int:
    """Sequences a step may sample for: vLLM's pairs (2048 tokens, 256 seqs) and (8192, 1024)."""
    return max(min(MAX_NUM_SEQS, batched_tokens // 8), min_concurrency)


def activation_bytes(
    shape: ModelShape, batched_tokens: int, rows: int, tp: int = 1, dtype: str | None = None
) -> int:
    """Peak activations of one step: the large per-token tensors of one layer plus the sampled logits."""
    elem = dtype_bytes(dtype or shape.dtype)
    q = shape.num_attention_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    per_token = 4 * shape.hidden_size + (q + 2 * kv) // tp + 3 * shape.intermediate_size // tp
    logits = rows * shape.vocab_size * 4 * 2  # float32 logits and the probabilities sampled from them
    return int((batched_tokens * per_token * elem + logits) * ACTIVATION_SAFETY)


def cuda_context_bytes(gpu_memory_bytes: int, tp: int) -> int:
    return CUDA_CONTEXT_BASE + int(CUDA_CONTEXT_SHARE * gpu_memory_bytes) + (NCCL_BYTES if tp > 1 else 0)


def _token_budget(shape, memory, tp, min_conc, floor_tokens, dtype=None) -> tuple[int, int]:
    """(max_num_batched_tokens, activation reserve): the largest power of two fitting a smooth budget."""

    def act(t: int) -> int:
        return activation_bytes(shape, t, _rows_for(t, min_conc), tp, dtype)

    low = max(MIN_BATCHED_TOKENS, floor_tokens)
    budget = max(act(low), min(act(MAX_BATCHED_TOKENS), int(ACTIVATION_SHARE * memory)))
    tokens = low
    while tokens * 2 <= MAX_BATCHED_TOKENS and act(tokens * 2) <= budget:
        tokens *= 2
    return tokens, budget


def _fit_len(blocks: int, block_size: int, conc: int, slack: float = 1.0) -> int:
    """Longest length, in whole blocks, that `conc` sequences can each have at once."""
    return int(blocks * slack) // conc * block_size


def _kv_heads_per_rank(shape: ModelShape, tp: int) -> int:
    """KV heads of the rank that keeps the most (the engine sizes every rank's blocks by it)."""
    return max_kv_heads_per_rank(shape.num_attention_heads, shape.num_kv_heads, tp)


def kaito_kv_cache_bytes(gpu_memory_bytes: int, weights_bytes: int, *, a10: bool = False) -> int:
    """KV memory under KAITO's published rule of thumb, for comparison: a fixed 0.84 utilisation (0.82 on
    A10), weights x 1.02 for load overhead, 2.3 GiB for activations and the CUDA context, plus 5% overhead."""
    util = 0.82 if a10 else 0.84
    return int(util * gpu_memory_bytes - (1.02 * weights_bytes + 2.3 * GiB) * 1.05)


# ------------------------------------------------------------------------------------------------ planner


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def _seq_tokens(h: Hints) -> tuple[int | None, str]:
    if h.p50_prompt_tokens or h.p50_output_tokens:
        return (h.p50_prompt_tokens or 0) + (h.p50_output_tokens or 0), "p50 prompt + output"
    if h.p99_prompt_tokens or h.p99_output_tokens:
        return (h.p99_prompt_tokens or 0) + (h.p99_output_tokens or 0), "p99 prompt + output"
    return None, ""


def _offload(
    plan_kv_total: int, h: Hints, reasons: dict, *, cpu: bool, window: bool = False
) -> tuple[int, int, str]:
    if window:
        reasons["kv_offload_host_bytes"] = reasons["kv_offload_disk_bytes"] = (
            "off: the sliding layers' window group (more sequences in the device cache) runs without offload "
            "tiers, whose blocks hold every layer"
        )
        reasons["pvc_size"] = "the smallest volume: no disk tier runs beside the window group"
        return 0, 0, f"{DISK_MIN_GIB}Gi"
    if cpu:
        host = 0
        reasons["kv_offload_host_bytes"] = (
            "CPU pod: the KV cache already lives in host RAM, no separate host tier"
        )
    elif h.memory_limit_bytes is None:
        host = 0
        reasons["kv_offload_host_bytes"] = (
            "no pod memory limit given: host tier off (it is never sized from the node's total RAM)"
        )
    else:
        host = gib_floor(int(h.memory_limit_bytes * HOST_LIMIT_SHARE) - HOST_RUNTIME_BYTES)
        reasons["kv_offload_host_bytes"] = (
            f"{HOST_LIMIT_SHARE:.0%} of the pod memory limit {human_bytes(h.memory_limit_bytes)} minus "
            f"{human_bytes(HOST_RUNTIME_BYTES)} for the runtime and staging buffers, whole GiB"
            + ("; too small for a host tier" if host == 0 else "")
        )
    if h.nvme_bytes is not None:
        pvc = gib_floor(int(h.nvme_bytes * 0.9))
        reasons["pvc_size"] = f"90% of the {human_bytes(h.nvme_bytes)} NVMe capacity given, whole GiB"
    else:
        want = DISK_CACHE_MULTIPLE * (plan_kv_total + host)
        pvc = max(DISK_MIN_GIB * GiB, gib_ceil(int(want / DISK_FS_SHARE)))
        reasons["pvc_size"] = (
            f"no NVMe capacity given: {DISK_CACHE_MULTIPLE}x the device and host KV cache "
            f"({human_bytes(plan_kv_total + host)}) as a prefix-cache working set, at least {DISK_MIN_GIB}Gi"
        )
    disk = gib_floor(int(pvc * DISK_FS_SHARE))
    reasons["kv_offload_disk_bytes"] = (
        f"{DISK_FS_SHARE:.0%} of the {pvc // GiB}Gi volume, whole GiB (the rest is filesystem and index)"
        if disk
        else "volume too small for a disk tier"
    )
    return host, disk, f"{pvc // GiB}Gi"


def plan(shape: ModelShape, gpu: GPUInfo | None, hints: Hints | None = None) -> Plan:
    """Size the engine for `shape` on `gpu` (None or count 0: a CPU pod). Raises SizingError if unservable."""
    h = hints or Hints()
    h.validate()
    if gpu is None or (gpu.count == 0 and not h.gpu_count):
        return _plan_cpu(shape, h)
    return _plan_gpu(shape, gpu, h)


def _int4_alternative(shape: ModelShape, gpu: GPUInfo, h: Hints, available: int) -> str:
    """The other way to fit a float model that does not: a 4-bit checkpoint of it (the INT4 the engine runs on
    GPUs, group 128), planned the same way; "" where that would not help or does not run."""
    if shape.weight_format:
        return ""
    if shape.num_experts:
        return " (A quantized checkpoint of a mixture of experts does not run in Pagoda yet.)"
    from pagoda.engine.quantization.scheme import QuantScheme
    from pagoda.engine.sizing.weight_format import scheme_format

    scheme = QuantScheme(format="int4", source="gptq", group_size=128)
    quantized = shape.with_weight_format(scheme_format(scheme, shape.linears()))
    try:
        alt = _plan_gpu(quantized, replace(gpu, count=0), replace(h, gpu_count=TP_SIZES[-1]))
    except SizingError:
        return ""
    tp = alt.tensor_parallel_size
    where = (
        f"on the {available} GPU{'s' if available > 1 else ''} it has" if tp <= available else f"on {tp} GPUs"
    )
    return (
        f" Or a 4-bit checkpoint of it (INT4 group 128: AWQ, GPTQ or compressed-tensors; "
        f"{human_bytes(quantized.weight_bytes)} of weights) fits {where} at tensor_parallel_size={tp}."
    )


def _common_lengths(shape: ModelShape, h: Hints, warnings: list[str]) -> tuple[int, int | None]:
    limit = shape.max_position_embeddings
    target = h.target_context
    if target is not None and target > limit:
        warnings.append(
            f"target_context {target} is longer than the model's limit of {limit} tokens; using {limit}"
        )
        target = limit
    return limit, target


def _plan_gpu(shape: ModelShape, gpu: GPUInfo, h: Hints) -> Plan:
    check_engine_runs_on(gpu)
    reasons: dict[str, str] = {}
    warnings = list(gpu.warnings)
    memory = gpu.memory_bytes
    if memory <= 0:
        raise SizingError(f"GPU {gpu.name}: memory must be positive, got {gpu.memory_mib} MiB")
    available = h.gpu_count or gpu.count or 1
    if h.gpu_count and gpu.count and h.gpu_count > gpu.count:
        raise SizingError(
            f"gpu_count={h.gpu_count} but the node has {gpu.count} {gpu.name} GPUs (nvidia.com/gpu.count)"
        )
    limit, target = _common_lengths(shape, h, warnings)
    conc = h.min_concurrency
    block_size = BLOCK_SIZE

    cc = f"{gpu.compute_capability[0]}.{gpu.compute_capability[1]}"
    if not shape.float16 and (0, 0) < tuple(gpu.compute_capability) < BF16_MIN_COMPUTE:
        shape = shape.with_dtype("float32")  # what the engine's dtype `auto` runs it in (engine_plan)
        warnings.append(
            f"{shape.name} overflows float16 and compute capability {cc} has no bfloat16: the engine runs it in "
            "float32, twice the weight and KV bytes"
        )
    if h.kv_cache_dtype == "int8":
        kv_dtype = "int8"
        reasons["kv_cache_dtype"] = "set explicitly: " + int8_trade(shape, shape.dtype)
    elif gpu.fp8 and not h.quality_first:
        kv_dtype = "fp8"
        reasons["kv_cache_dtype"] = (
            f"compute capability {cc} has FP8: half the KV bytes of {shape.dtype}, twice the tokens"
        )
    elif h.prefer_capacity:
        kv_dtype = "int8"
        reasons["kv_cache_dtype"] = f"compute capability {cc} has no FP8; capacity preferred: " + int8_trade(
            shape, shape.dtype
        )
    else:
        kv_dtype = "auto"
        why = (
            "quality first: KV kept in the model's dtype"
            if gpu.fp8
            else f"compute capability {cc} is below 8.9: no FP8 KV cache on this GPU "
            "(prefer capacity for an INT8 cache)"
        )
        reasons["kv_cache_dtype"] = f"{why} ({shape.dtype})"
    kv_token = shape.kv_bytes_per_token(kv_dtype)

    want_len = target or min(limit, DEFAULT_TARGET_CONTEXT)
    floor_tokens = _pow2_at_least(h.p99_prompt_tokens) if h.p99_prompt_tokens else 0
    floor_tokens = min(floor_tokens, MAX_BATCHED_TOKENS)

    chosen = None
    tried: list[str] = []
    for tp in TP_SIZES:
        if shape.num_attention_heads % tp:
            continue
        weights = _ceil_div(shape.weight_bytes, tp)
        tokens, act = _token_budget(shape, memory, tp, conc, floor_tokens)
        ctx = cuda_context_bytes(memory, tp)
        util = min(UTILIZATION_CAP, math.floor((memory - ctx - act) / memory * 100) / 100)
        kv_mem = int(util * memory) - ctx - act - weights
        block_bytes = shape.kv_bytes_per_token(kv_dtype, tp) * block_size
        blocks = max(kv_mem, 0) // block_bytes
        candidate = (tp, weights, tokens, act, ctx, util, kv_mem, block_bytes, blocks)
        if _fit_len(blocks, block_size, conc, FIT_SLACK) >= want_len and util > 0:
            chosen = candidate
            break
        tried.append(f"TP={tp}: {human_bytes(weights)} weights + {human_bytes(ctx + act)} reserve per GPU "
                     f"leave {human_bytes(max(kv_mem, 0))} of KV ({blocks * block_size} tokens)")  # fmt: skip

    need = (
        f"{conc} x {want_len} tokens of KV ({human_bytes(conc * want_len * kv_token)} at {kv_token} B/token)"
    )
    pp = 1
    # more GPUs than the node has (not merely than the pod was given): stages across nodes
    if (
        (chosen is None or chosen[0] > available)
        and gpu.count
        and available == gpu.count
        and (h.max_nodes or 1) > 1
    ):
        staged = _pipeline_fit(
            shape, memory, available, kv_dtype, conc, floor_tokens, want_len, block_size, h.max_nodes
        )
        if staged is not None:
            pp, chosen = staged[0], staged[1:]
    if chosen is None:
        raise SizingError(
            f"{shape.name} ({human_bytes(shape.weight_bytes)} of {shape.held_as} weights) cannot hold {need} on "
            f"any tensor-parallel size up to {TP_SIZES[-1]} {gpu.name} GPUs; "
            + "; ".join(tried[-2:])
            + _int4_alternative(shape, gpu, h, available)
        )
    tp, weights, tokens, act, ctx, util, kv_mem, block_bytes, blocks = chosen
    if tp > available:
        raise SizingError(
            f"{shape.name} ({human_bytes(shape.weight_bytes)} of {shape.held_as} weights) does not fit on "
            f"{available} x {gpu.name} ({human_bytes(memory)} each) with room for {need}: "
            f"{tried[-1] if tried else ''}. It needs tensor_parallel_size={tp} ({tp} GPUs: "
            f"{human_bytes(weights)} of weights and {human_bytes(kv_mem)} of KV cache per GPU); "
            f"request {tp} GPUs (--gpus {tp} / gpu_count={tp})." + _int4_alternative(shape, gpu, h, available)
        )
    reasons["tensor_parallel_size"] = (
        f"smallest power of two whose per-GPU weights ({human_bytes(weights)}) leave room for {need}"
        + (f"; {available} GPUs available" if available > 1 else "")
    )
    if pp > 1:
        reasons["tensor_parallel_size"] = f"the node's {available} GPUs (at most) per pipeline stage"
        reasons["pipeline_parallel_size"] = (
            f"{shape.name} does not fit one node's {available} x {gpu.name}: {pp} stages of {tp} GPUs, one node "
            f"each, hold {human_bytes(weights)} of weights per GPU (the largest stage's share) and leave room "
            f"for {need}"
        )
    reasons["gpu_memory_utilization"] = (
        f"{human_bytes(memory)} minus {human_bytes(ctx)} CUDA context{' and NCCL' if tp > 1 else ''} and a "
        f"{human_bytes(act)} activation reserve for {tokens} tokens per step"
        + (f", capped at {UTILIZATION_CAP}" if util == UTILIZATION_CAP else ", rounded down")
        + "; the engine re-measures both inside this budget, the rest is margin"
    )
    capacity = blocks * block_size
    kv_bytes = blocks * block_bytes
    kaito = kaito_kv_cache_bytes(
        memory, shape.weight_bytes, a10=bool(gpu.spec and gpu.spec.name in ("A10", "A10G"))
    )
    reasons["num_gpu_blocks"] = (
        f"{human_bytes(kv_mem)} left after weights and reserve / {block_bytes} B per block of {block_size} tokens "
        f"= {capacity} tokens"
    )
    reasons["kv_cache_bytes"] = f"{blocks} blocks x {block_bytes} B per GPU" + (
        f"; KAITO's fixed rule would leave {human_bytes(max(kaito, 0))} ({human_bytes(kv_bytes - kaito)} less)"
        if tp == 1
        else ""
    )
    reasons["block_size"] = f"{block_size} tokens, vLLM's default: under 4% waste per sequence (vLLM paper)"
    reasons["weights_bytes_per_gpu"] = _weights_reason(shape, weights, tp)

    fit_len = _fit_len(blocks, block_size, conc, FIT_SLACK)
    max_len = min(limit, target or limit, fit_len)
    parts = [f"model limit {limit}"]
    if target:
        parts.append(f"target context {target}")
    parts.append(
        f"{fit_len} fits {conc} concurrent sequence{'s' if conc > 1 else ''} in {FIT_SLACK:.0%} of the blocks"
    )
    reasons["max_model_len"] = "min of " + ", ".join(parts)
    split = _window_split(shape, kv_bytes, block_bytes, block_size, max_len, tokens)
    if shape.sliding_window and max_len > shape.sliding_window:
        warnings.append(sliding_window_note(shape, kv_bytes, max_len, block_size, kv_dtype, tp, split))

    seq_capacity, seq_blocks = _sequence_pool(capacity, blocks, split, block_size)
    max_seqs, seq_reason = _max_num_seqs(seq_capacity, tokens, conc, h, seq_blocks)
    reasons["max_num_seqs"] = seq_reason + (_window_reason(split, max_len) if split else "")
    reasons["max_num_batched_tokens"] = (
        f"largest power of two (up to {MAX_BATCHED_TOKENS}) whose activations fit a {human_bytes(act)} reserve"
        + (
            f"; at least the p99 prompt ({h.p99_prompt_tokens}) so it prefills in one step"
            if floor_tokens
            else ""
        )
    )
    host, disk, pvc = _offload(kv_bytes * tp, h, reasons, cpu=False, window=split is not None)
    if pp > 1 and (host or disk):  # the engine runs no offload tier with several ranks
        host, disk, pvc = 0, 0, ""
        for name in ("kv_offload_host_bytes", "kv_offload_disk_bytes", "pvc_size"):
            reasons[name] = "no KV offload tiers with pipeline parallelism"
    return Plan(
        gpu_memory_utilization=util, max_model_len=max_len, block_size=block_size, kv_cache_dtype=kv_dtype,
        max_num_seqs=max_seqs, max_num_batched_tokens=tokens, tensor_parallel_size=tp, num_gpu_blocks=blocks,
        kv_cache_bytes=kv_bytes, kv_offload_host_bytes=host, kv_offload_disk_bytes=disk, pvc_size=pvc,
        device="cuda", model=shape.name, gpu=gpu.name, kv_bytes_per_token=kv_token, weights_bytes_per_gpu=weights,
        reserve_bytes=ctx + act, reasons=reasons, warnings=warnings,
        num_window_blocks=split.num_window_blocks if split else 0, window_sequences=split.sequences if split else 0,
        weight_format=shape.weights_in_words(), pipeline_parallel_size=pp, nnodes=pp,
    )  # fmt: skip


MAX_PIPELINE_STAGES = 8


def _pipeline_fit(
    shape: ModelShape,
    memory: int,
    available: int,
    kv_dtype: str,
    conc: int,
    floor_tokens: int,
    want_len: int,
    block_size: int,
    max_nodes: int,
) -> tuple | None:
    """The fewest pipeline stages (one node of ``available`` GPUs each, tensor parallel inside) that hold
    the model and ``conc`` x ``want_len`` tokens of KV: (stages, tp, weights, tokens, act, ctx, util, kv_mem,
    block_bytes, blocks) per GPU of the largest stage; None if no count up to MAX_PIPELINE_STAGES does."""
    tp = max((t for t in TP_SIZES if t <= available and shape.num_attention_heads % t == 0), default=1)
    for pp in range(2, min(max_nodes, MAX_PIPELINE_STAGES, shape.num_layers) + 1):
        stages = stage_weight_bytes(
            shape.weight_bytes, shape.num_layers, pp, shape.vocab_size, shape.hidden_size,
            dtype_bytes(shape.dtype), shape.tie_word_embeddings,
        )  # fmt: skip
        weights = _ceil_div(max(stages), tp)
        tokens, act = _token_budget(shape, memory, tp, conc, floor_tokens)
        ctx = cuda_context_bytes(memory, tp)
        util = min(UTILIZATION_CAP, math.floor((memory - ctx - act) / memory * 100) / 100)
        kv_mem = int(util * memory) - ctx - act - weights
        per_layer = shape.kv_bytes_per_token(kv_dtype, tp) // max(shape.num_layers, 1)
        block_bytes = per_layer * max_stage_layers(shape.num_layers, pp) * block_size
        blocks = max(kv_mem, 0) // block_bytes
        if util > 0 and _fit_len(blocks, block_size, conc, FIT_SLACK) >= want_len:
            return (pp, tp, weights, tokens, act, ctx, util, kv_mem, block_bytes, blocks)
    return None


def _window_split(
    shape: ModelShape, kv_bytes: int, block_bytes: int, block_size: int, max_len: int, tokens: int
) -> KVSplit | None:
    """The engine's split of ``kv_bytes`` (one GPU's KV budget) for a sliding-window model at ``max_len``, as
    `engine_plan` makes it (max_num_seqs not yet known: at most MAX_NUM_SEQS), or None for one pool."""
    layout = shape_layout(shape)
    split = split_kv_blocks(
        kv_bytes, block_bytes // block_size, block_size, max_len, MAX_NUM_SEQS, tokens, layout
    )
    return split if split.num_window_blocks else None


def _sequence_pool(capacity: int, blocks: int, split: KVSplit | None, block_size: int) -> tuple[int, int]:
    """(tokens, blocks) of the pool that bounds how many sequences run: the one pool, the full-attention
    layers' with a window group, or the window pool when every layer slides (the full group's blocks are
    bookkeeping, kv_split.bookkeeping_blocks)."""
    if split is None:
        return capacity, blocks
    if split.block_bytes == 0:
        return split.num_window_blocks * block_size, split.num_window_blocks
    return split.num_blocks * block_size, split.num_blocks


def _window_reason(split: KVSplit, max_len: int) -> str:
    if split.block_bytes == 0:  # every layer slides: the window pool is the whole cache
        return (
            f"; every layer keeps only its window (the engine's window group: {split.num_window_blocks} "
            f"blocks), so {split.sequences} sequences of {max_len} tokens fit at once"
        )
    return (
        f"; the sliding layers keep only their window (the engine's window group: {split.num_window_blocks} "
        f"blocks of theirs, {split.num_blocks} of the other layers), so {split.sequences} sequences of "
        f"{max_len} tokens fit at once"
    )


def sliding_window_note(
    shape: ModelShape,
    kv_bytes: int,
    max_len: int,
    block_size: int,
    kv_dtype: str,
    tp: int,
    split: KVSplit | None = None,
) -> str:
    """The note a sliding-window model's plan carries: how many sequences the engine's window group admits
    (``split``) against a full-attention layout of the same memory."""
    cap = window_capacity(shape, kv_bytes, max_len, block_size, kv_dtype=kv_dtype, tp=tp)
    held = split.sequences if split is not None else cap.full_attention_sequences
    return (
        f"{shape.name} uses a {shape.sliding_window}-token sliding window on {sliding_layers(shape)} of "
        f"{shape.num_layers} layers; the engine's KV cache keeps only the window's blocks for those layers: "
        f"{held} sequences of {max_len} tokens fit at once, against {cap.full_attention_sequences} in a "
        f"full-attention layout of the same memory (KV offload tiers would turn the window group off: the "
        f"plan leaves them out)"
        if split is not None
        else f"{shape.name} uses a {shape.sliding_window}-token sliding window on {sliding_layers(shape)} of "
        f"{shape.num_layers} layers; every layer keeps every block (no window group for this model): "
        f"{held} sequences of {max_len} tokens fit at once"
    )


def int8_trade(shape: ModelShape, dtype: str) -> str:
    """The INT8 KV trade in words: bytes and tokens won, what the scales cost, what is given up."""
    full, int8 = shape.kv_bytes_per_token(dtype), shape.kv_bytes_per_token("int8")
    scales = 2 * shape.num_layers * shape.num_kv_heads * kv_scale_bytes("int8")
    return (
        f"INT8 KV with a float32 scale per token and head, {int8} B/token instead of {full} ({dtype}, "
        f"{scales} B of it scales): {full / int8:.2f}x the tokens in the same memory, for a small accuracy "
        "cost (each K/V row rounded to 1/127 of its largest value; on SmolLM2-135M perplexity moved -0.01% "
        "against float32 KV where FP8 e4m3 moved +2.2%: `make bench-kv-accuracy`, docs/engine.md)"
    )


def _max_num_seqs(capacity: int, tokens: int, conc: int, h: Hints, blocks: int) -> tuple[int, str]:
    cap = _rows_for(tokens, conc)
    per_seq, what = _seq_tokens(h)
    if per_seq:
        by_kv = capacity // max(per_seq, 1)
        n = max(conc, min(cap, by_kv))
        return n, (
            f"KV capacity {capacity} tokens / {per_seq} tokens per request ({what}) = {by_kv}, "
            f"kept between the minimum concurrency {conc} and {cap} sampled rows per step"
        )
    n = max(conc, min(cap, blocks))
    return n, (
        f"{cap} sequences per step for a {tokens}-token budget (vLLM's 256 per 2048 tokens, at most "
        f"{MAX_NUM_SEQS})" + (f", limited to the {blocks} KV blocks" if blocks < cap else "")
    )


def _plan_cpu(shape: ModelShape, h: Hints) -> Plan:
    reasons: dict[str, str] = {}
    warnings: list[str] = []
    if h.memory_limit_bytes is None:
        raise SizingError(
            "a CPU plan needs the pod memory limit (memory_limit_bytes / --memory-limit): the KV cache lives "
            "in host RAM and is never sized from the node's total memory"
        )
    limit, target = _common_lengths(shape, h, warnings)
    conc = h.min_concurrency
    block_size = BLOCK_SIZE
    kept = held_quantized(shape.weight_format, "cpu", h.quantization)
    if h.quantization == "gguf" and shape.weight_format != "gguf":
        raise SizingError(
            f"quantization gguf keeps a GGUF file's blocks; {shape.name} is not a GGUF model with blocks the CPU "
            "kernels run (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K)"
        )
    cpu_shape = shape.with_dtype("float32", kept)  # the CPU engine computes in float32
    kv_dtype = "int8" if h.prefer_capacity or h.kv_cache_dtype == "int8" else "auto"
    kv_token = cpu_shape.kv_bytes_per_token(kv_dtype)
    weights = cpu_shape.weight_bytes
    tokens = MIN_BATCHED_TOKENS
    if h.p99_prompt_tokens:
        tokens = min(MAX_BATCHED_TOKENS, max(tokens, _pow2_at_least(h.p99_prompt_tokens)))
    act = activation_bytes(cpu_shape, tokens, _rows_for(tokens, conc), 1, "float32")
    usable = int(h.memory_limit_bytes * HOST_LIMIT_SHARE)
    kv_mem = (usable - CPU_RUNTIME_BYTES - weights - act) // MiB * MiB
    block_bytes = kv_token * block_size
    blocks = max(kv_mem, 0) // block_bytes
    want_len = target or min(limit, DEFAULT_TARGET_CONTEXT)
    if blocks * block_size < conc * want_len:
        need = CPU_RUNTIME_BYTES + weights + act + conc * want_len * kv_token
        raise SizingError(
            f"{shape.name} on CPU does not fit a {human_bytes(h.memory_limit_bytes)} memory limit with room for "
            f"{conc} x {want_len} tokens of KV: it needs about {human_bytes(need / HOST_LIMIT_SHARE)} "
            f"({human_bytes(weights)} of weights ({cpu_shape.weights_in_words('float32', kept)}), "
            f"{human_bytes(act)} activations, "
            f"{human_bytes(CPU_RUNTIME_BYTES)} runtime, {human_bytes(conc * want_len * kv_token)} KV); "
            "raise the memory limit or lower the target context"
        )
    capacity = blocks * block_size
    kv_bytes = blocks * block_bytes
    reasons["kv_cache_memory_bytes"] = (
        f"{HOST_LIMIT_SHARE:.0%} of the pod memory limit {human_bytes(h.memory_limit_bytes)} minus "
        f"{human_bytes(weights)} of weights, {human_bytes(act)} activations and "
        f"{human_bytes(CPU_RUNTIME_BYTES)} runtime"
    )
    reasons["gpu_memory_utilization"] = "CPU pod: not used (kv_cache_memory_bytes sizes the cache)"
    reasons["tensor_parallel_size"] = "CPU pod: one process"
    reasons["kv_cache_dtype"] = (
        "CPU, "
        + ("capacity preferred" if h.prefer_capacity else "set explicitly")
        + ": "
        + int8_trade(cpu_shape, "float32")
        if kv_dtype == "int8"
        else "CPU: KV in the engine's float32 compute dtype (no FP8 on CPU; prefer capacity for INT8)"
    )
    reasons["block_size"] = f"{block_size} tokens, vLLM's default: under 4% waste per sequence (vLLM paper)"
    reasons["num_gpu_blocks"] = f"{human_bytes(kv_mem)} / {block_bytes} B per block = {capacity} tokens"
    reasons["weights_bytes_per_gpu"] = _weights_reason(cpu_shape, weights, 1, "float32", kept)
    if kept:
        reasons["quantization"] = (
            "hint quantization gguf: the GGUF file's linear weights stay in their blocks (the CPU kernels run "
            "them); embeddings, norms and the LM head are dequantized to float32"
        )
    reasons["kv_cache_bytes"] = f"{blocks} blocks x {block_bytes} B"
    fit_len = _fit_len(blocks, block_size, conc)
    max_len = min(limit, target or limit, fit_len)
    parts = [f"model limit {limit}"] + ([f"target context {target}"] if target else [])
    parts.append(f"{fit_len} fits {conc} concurrent sequence{'s' if conc > 1 else ''}")
    reasons["max_model_len"] = "min of " + ", ".join(parts)
    split = _window_split(cpu_shape, kv_bytes, block_bytes, block_size, max_len, tokens)
    if cpu_shape.sliding_window and max_len > cpu_shape.sliding_window:
        warnings.append(sliding_window_note(cpu_shape, kv_bytes, max_len, block_size, kv_dtype, 1, split))
    seq_capacity, seq_blocks = _sequence_pool(capacity, blocks, split, block_size)
    max_seqs, reasons["max_num_seqs"] = _max_num_seqs(seq_capacity, tokens, conc, h, seq_blocks)
    if split is not None:
        reasons["max_num_seqs"] += _window_reason(split, max_len)
    reasons["max_num_batched_tokens"] = f"{tokens} tokens per step, vLLM's CPU server default" + (
        f" raised to the p99 prompt ({h.p99_prompt_tokens})" if tokens > MIN_BATCHED_TOKENS else ""
    )
    host, disk, pvc = _offload(kv_bytes, h, reasons, cpu=True, window=split is not None)
    return Plan(
        gpu_memory_utilization=None, max_model_len=max_len, block_size=block_size, kv_cache_dtype=kv_dtype,
        max_num_seqs=max_seqs, max_num_batched_tokens=tokens, tensor_parallel_size=1, num_gpu_blocks=blocks,
        kv_cache_bytes=kv_bytes, kv_offload_host_bytes=host, kv_offload_disk_bytes=disk, pvc_size=pvc,
        kv_cache_memory_bytes=kv_mem, device="cpu", model=shape.name, gpu=None, kv_bytes_per_token=kv_token,
        weights_bytes_per_gpu=weights, reserve_bytes=CPU_RUNTIME_BYTES + act, reasons=reasons, warnings=warnings,
        num_window_blocks=split.num_window_blocks if split else 0, window_sequences=split.sequences if split else 0,
        weight_format=cpu_shape.weights_in_words("float32", kept), quantization="gguf" if kept else None,
    )  # fmt: skip


def _weights_reason(
    shape: ModelShape, weights: int, tp: int, dtype: str | None = None, quantized: bool | None = None
) -> str:
    """Why the weights take the bytes the plan counts: the format seen and how the engine holds it."""
    per = f"{human_bytes(weights)} per GPU (tensor parallel {tp})" if tp > 1 else human_bytes(weights)
    return f"{per} of weights: {shape.weights_in_words(dtype, quantized)}"
