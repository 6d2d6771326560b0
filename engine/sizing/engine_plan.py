"""The engine's start-up plan as one pure function, shared by LLMEngine and `pagoda serve --dry-run`.

The engine measures three things at start-up (weights on the device, the activation peak of one profiled
step, the device's free memory); everything it then decides from them (max_model_len, the number of KV
blocks, the per-step token budget, or a refusal) is arithmetic, and lives here. The dry run feeds the same
arithmetic estimates instead of measurements, so both refuse the same configurations with the same words.

No torch here: the operator imports this module to check every pod it renders.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from pagoda.engine.sizing.errors import StartupFitError
from pagoda.engine.sizing.fit import fit_max_model_len
from pagoda.engine.sizing.kv_dtypes import BF16_MIN_COMPUTE, DTYPE_ALIASES
from pagoda.engine.sizing.kv_split import SlidingLayout, split_kv_blocks

DEFAULT_BATCHED_TOKENS = 2048  # vLLM's server default with chunked prefill


@dataclass(frozen=True)
class MemoryProfile:
    """One rank's memory at start-up: measured by the engine, or estimated by a dry run (`measured`)."""

    device: str  # "cpu" or "cuda"
    weights_bytes: int
    activation_peak_bytes: int
    kv_cache_bytes: int  # what the KV cache was given (the fit budget)
    kv_allocated_bytes: int = 0  # blocks x bytes per block; 0 when start-up failed before allocating
    device_total_bytes: int | None = None
    device_free_bytes: int | None = None  # free when measured (after the weights were loaded)
    other_bytes: int | None = None  # taken by the CUDA context and other processes
    gpu_memory_utilization: float | None = None
    measured: bool = True
    source: str = ""  # where the device figures came from: cuda, host, catalogue:<GPU>, flag, none
    rank_kv_cache_bytes: list[int] | None = None  # tensor parallel: each rank's budget; all take the least
    cuda_graph_bytes: int = 0  # what the decode CUDA graphs were measured to take (left out of the KV cache)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryProfile:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class EnginePlan:
    """What the engine runs with, decided from a memory profile."""

    max_model_len: int
    num_blocks: int
    block_size: int
    kv_bytes_per_token: int  # per rank
    max_num_batched_tokens: int
    profile: MemoryProfile
    # A window group (windows.split_kv_blocks): the sliding layers' pool and window; 0 / None / (): one pool.
    num_window_blocks: int = 0
    window: int | None = None
    window_layers: tuple[int, ...] = ()
    sequences_at_max_len: int = 0  # sequences of max_model_len tokens both pools hold at once

    @property
    def max_model_len_fitted(self) -> int:
        """Tokens the whole KV cache holds: the longest one sequence could ever be."""
        return self.num_blocks * self.block_size

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["max_model_len_fitted"] = self.max_model_len_fitted
        return out


_last_profile: MemoryProfile | None = None


def last_profile() -> MemoryProfile | None:
    """The profile of the latest plan made in this process (what a start-up failure after it reports)."""
    return _last_profile


def forget_last_profile() -> None:
    """Start a new start-up: no earlier plan's profile may be reported for it."""
    global _last_profile
    _last_profile = None


_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this host's CPU multiplies bfloat16 natively (AVX512-BF16 or AMX-BF16, as /proc/cpuinfo lists)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return any(flag in flags for flag in _CPU_BF16_FLAGS)
    except OSError:
        pass
    return False


def resolve_dtype_name(
    name: str,
    device: str,
    checkpoint_dtype: str | None,
    compute_capability: tuple[int, int] | None = None,
    float16: bool = True,
) -> str:
    """The compute dtype the engine uses for ``--dtype name``. ``auto``: on CUDA the checkpoint's (bfloat16 for
    float32), float16 below compute capability 8.0 (no bfloat16 there, see gpus.check_dtypes); on a CPU with
    native bfloat16 products (AVX512-BF16 / AMX), bfloat16 as vLLM's CPU build picks (faster at a negligible
    accuracy cost there: docs/benchmarks.md); on other CPUs float32, their fastest and most exact choice.

    ``float16=False``: the family overflows float16 (the architecture table's `float16`, Gemma 2/3): auto picks
    bfloat16 instead (float32 below compute capability 8.0), an explicit float16 is a ValueError, as in vLLM."""
    if name != "auto":
        resolved = DTYPE_ALIASES[name]
        if resolved == "float16" and not float16:
            raise ValueError(
                "--dtype float16 is refused for this architecture: its activations overflow float16 (it was "
                "trained in bfloat16); use --dtype bfloat16 or float32"
            )
        return resolved
    if device == "cpu":
        return "bfloat16" if cpu_has_native_bf16() else "float32"
    if compute_capability is not None and tuple(compute_capability) < BF16_MIN_COMPUTE:
        return "float16" if float16 else "float32"
    checkpoint = DTYPE_ALIASES.get(str(checkpoint_dtype or "").removeprefix("torch."))
    return checkpoint if checkpoint in ("float16", "bfloat16") and float16 else "bfloat16"


def shard_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of a rank's share: equal shares, the first `total % size` ranks one more
    (9 heads over 2 ranks: 5 and 4)."""
    if total < size:
        raise ValueError(f"{total} cannot be split over {size} tensor-parallel ranks")
    per, extra = divmod(total, size)
    start = rank * per + min(rank, extra)
    return start, start + per + (1 if rank < extra else 0)


def kv_heads_of_rank(num_heads: int, num_kv_heads: int, rank: int, size: int) -> list[int]:
    """The KV heads one tensor-parallel rank keeps in its cache, one entry per local KV head, in order.

    A rank keeps the KV heads its contiguous share of query heads reads. When that share covers whole
    query groups (or sits inside one), each needed KV head is kept once and the grouping stays uniform;
    otherwise every query head gets its own copy, so the rank runs plain multi-head attention (9 query over
    3 KV heads on 2 ranks: 5 and 4 copies).
    """
    if size <= 1:
        return list(range(num_kv_heads))
    lo, hi = shard_range(num_heads, rank, size)
    group = num_heads // num_kv_heads
    needed = [h // group for h in range(lo, hi)]
    distinct = sorted(set(needed))
    local = hi - lo
    if local % len(distinct) == 0 and all(
        needed[i] == distinct[i // (local // len(distinct))] for i in range(local)
    ):
        return distinct
    return needed


def kv_heads_per_rank(num_heads: int, num_kv_heads: int, tp: int, rank: int = 0) -> int:
    """How many KV heads rank ``rank`` keeps (see kv_heads_of_rank)."""
    return len(kv_heads_of_rank(num_heads, num_kv_heads, rank, tp))


def max_kv_heads_per_rank(num_heads: int, num_kv_heads: int, tp: int) -> int:
    """The most KV heads any rank keeps: every rank allocates the same number of blocks, so this rank's
    bytes size them all (28 query over 4 KV heads on 8 ranks: rank 0 keeps 1, rank 1 keeps 4 copies)."""
    return max(kv_heads_per_rank(num_heads, num_kv_heads, tp, rank) for rank in range(max(tp, 1)))


def kv_bytes_per_token(
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    element_bytes: int,
    tp: int = 1,
    scale_bytes: int = 0,
) -> int:
    """KV bytes per token on the rank with the most KV heads (the rank that sizes every rank's cache):
    2 (K and V) x layers x KV heads x (head_dim x element bytes + scale bytes), ``scale_bytes`` per KV head
    and K|V for caches that keep per-token scales (INT8). The one KV formula: the engine, the dry run, the
    planner and the model shapes all count with it (element and scale bytes from kv_dtypes)."""
    heads = max_kv_heads_per_rank(num_heads, num_kv_heads, tp)
    return 2 * num_layers * heads * (head_dim * element_bytes + scale_bytes)


def check_tensor_parallel(num_heads: int, tp: int) -> None:
    """Refuse a tensor-parallel size the model's attention heads cannot be split over."""
    if num_heads < tp:
        raise ValueError(f"tensor_parallel_size {tp} exceeds the model's {num_heads} attention heads")


def profile_tokens(
    max_num_batched_tokens: int | None,
    model_max_len: int,
    *,
    enable_chunked_prefill: bool = True,
    max_model_len: int | str | None = None,
) -> int:
    """Tokens of the one step the engine profiles for its activation peak: the largest step the scheduler may
    build. Without chunked prefill and without a budget a whole prompt of up to max_model_len is one step
    (the planned length is not known yet: the model's, or a smaller --max-model-len)."""
    batched = max_num_batched_tokens
    if batched is None and not enable_chunked_prefill:
        max_len = min(model_max_len, max_model_len) if isinstance(max_model_len, int) else model_max_len
        batched = max(DEFAULT_BATCHED_TOKENS, max_len)
    return min(batched or DEFAULT_BATCHED_TOKENS, model_max_len)


def gpu_kv_budget(
    total: int, free: int, reserved: int, utilization: float, weights: int, activation: int, graphs: int = 0
) -> tuple[int, int]:
    """(KV cache bytes, bytes others hold) on a GPU: `utilization` of the card, less what other processes
    and the CUDA context hold (total - free - what this process's allocator reserved), the weights, the
    activation peak and the decode CUDA graphs (recorded after the cache is allocated)."""
    others = total - free - reserved
    return max(int(total * utilization - others - weights - activation - graphs), 0), others


def engine_plan(
    config: Any,
    *,
    model_max_len: int,
    kv_bytes_per_token: int,
    kv_memory_bytes: int,
    weights_bytes: int = 0,
    activation_bytes: int = 0,
    device: str = "cpu",
    device_total_bytes: int | None = None,
    device_free_bytes: int | None = None,
    other_bytes: int | None = None,
    measured: bool = True,
    source: str = "",
    rank_kv_cache_bytes: list[int] | None = None,
    cuda_graph_bytes: int = 0,
    sliding: SlidingLayout | None = None,
) -> EnginePlan:
    """max_model_len, KV blocks and the token budget for `config` (an EngineConfig, read only) in
    `kv_memory_bytes` of KV cache; raises StartupFitError (a SizingError) saying what fits otherwise,
    SizingError or ValueError for a configuration no memory would fix. ``sliding``: the window group
    (windows.engine_sliding_layout), whose pool takes its share of the blocks (windows.split_kv_blocks)."""
    global _last_profile
    block_size = config.block_size
    profile = MemoryProfile(
        device=device,
        weights_bytes=int(weights_bytes),
        activation_peak_bytes=int(activation_bytes),
        kv_cache_bytes=max(int(kv_memory_bytes), 0),
        device_total_bytes=device_total_bytes,
        device_free_bytes=device_free_bytes,
        other_bytes=other_bytes,
        gpu_memory_utilization=config.gpu_memory_utilization
        if device == "cuda" and config.kv_cache_memory_bytes is None
        else None,
        measured=measured,
        source=source,
        rank_kv_cache_bytes=rank_kv_cache_bytes,
        cuda_graph_bytes=int(cuda_graph_bytes),
    )
    _last_profile = profile
    try:
        max_model_len = fit_max_model_len(
            config.max_model_len,
            model_max_len,
            kv_bytes_per_token,
            kv_memory_bytes,
            block_size,
            weights_bytes=weights_bytes,
            activation_bytes=activation_bytes,
            device=device,
        )
    except StartupFitError as exc:
        raise StartupFitError(str(exc), profile) from None
    batched = config.max_num_batched_tokens
    if batched is None:
        batched = (
            DEFAULT_BATCHED_TOKENS
            if config.enable_chunked_prefill
            else max(DEFAULT_BATCHED_TOKENS, max_model_len)
        )
    elif not config.enable_chunked_prefill and batched < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens ({batched}) must be at least max_model_len "
            f"({max_model_len}) when chunked prefill is off"
        )
    split = split_kv_blocks(
        kv_memory_bytes, kv_bytes_per_token, block_size, max_model_len, config.max_num_seqs, batched, sliding
    )
    profile = replace(profile, kv_allocated_bytes=split.allocated_bytes)
    _last_profile = profile
    window = sliding if split.num_window_blocks else None
    return EnginePlan(
        max_model_len,
        split.num_blocks,
        block_size,
        kv_bytes_per_token,
        batched,
        profile,
        num_window_blocks=split.num_window_blocks,
        window=window.window if window else None,
        window_layers=window.sliding if window else (),
        sequences_at_max_len=split.sequences,
    )
