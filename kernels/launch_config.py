"""Launch configurations of the Triton kernels: tiles, warps and stages from what the device allows.

One pure function per kernel of (compute capability, shared memory per block, dtypes, head dim, GQA
group): no torch, no Triton, no GPU, so every catalogue GPU's choice is tested without one (and compiled
for it by `pagoda kernels warm`, which checks the compiled kernels against these numbers). A kernel takes
the first tile of its preference list whose shared memory fits the device's opt-in limit per block.

Shared memory of an attention tile, counted as Triton lays it out (measured on the compiled kernels, see
docs/engine.md): the query tile Q [M, D], the key and value tiles K, V [N, D] and the probabilities
P [M, N] staged for the second product, in the compute dtype (an FP8 or INT8 cache is widened to it).
Ampere and Ada (8.x) stage Q once; Turing, Hopper and Blackwell stage it twice in 16-bit dtypes. M is
the prefill's query tile, or the decode's query heads of one KV head (padded to 16, tl.dot's least M).
"""

from __future__ import annotations

from dataclasses import dataclass

SCRATCH_SHARED_MEMORY = 1024  # reductions and barriers on top of the tiles; all a tile-less kernel takes
DOT_MIN = 16  # tl.dot's smallest M, N and K


@dataclass(frozen=True)
class DeviceLimits:
    compute_capability: tuple[int, int]
    shared_memory_per_block: int  # bytes a block may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin)
    interpreter: bool = False  # Triton's CPU interpreter: smallest tiles (speed), no memory to fit


INTERPRETER = DeviceLimits((0, 0), 0, interpreter=True)


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int  # query tokens per program
    block_n: int  # keys per step of the walk
    num_warps: int
    num_stages: int
    shared_memory: int = 0  # bytes per block, as counted above


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int  # keys per step of the walk
    num_warps: int
    num_stages: int
    merge_warps: int  # the split-KV merge kernel
    shared_memory: int = 0


@dataclass(frozen=True)
class LoRAConfig:
    """Tiles of the LoRA shrink (x @ A over the input features) and expand (h @ B over the output features)
    kernels: tokens of one adapter's segment per program, output columns per program, the reduction step."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    shared_memory: int = 0


@dataclass(frozen=True)
class CacheWriteConfig:
    num_warps: int
    shared_memory: int = SCRATCH_SHARED_MEMORY


# Preference lists, largest tile first: (M or None, N, warps). Heads of 256 halve the tiles.
PREFILL_TILES = ((128, 64, 8), (64, 64, 4), (64, 32, 4), (32, 32, 4), (32, 16, 4), (16, 16, 4))
DECODE_TILES = (64, 32, 16)
LARGE_HEAD_DIM = 128  # above it, start from half the tile
NUM_STAGES = 2  # the K/V loads go through the block table, so deeper pipelines buy nothing


def element_bytes(dtype: str) -> int:
    """Bytes of a compute dtype ('float32', 'bfloat16', 'float16')."""
    return 4 if dtype == "float32" else 2


def group_pad(group: int) -> int:
    """Query heads of one KV head, padded to a power of two of at least 16 (tl.dot's smallest M)."""
    return max(DOT_MIN, 1 << max(group - 1, 0).bit_length())


def tile_shared_memory(m: int, n: int, head_dim: int, dtype: str, compute_capability: tuple[int, int]) -> int:
    """Bytes of shared memory an attention tile of M queries over N keys takes (an upper bound, see above)."""
    elem = element_bytes(dtype)
    q_copies = 1 if compute_capability[0] == 8 or elem == 4 else 2
    return (q_copies * m * head_dim + 2 * n * head_dim + m * n) * elem + SCRATCH_SHARED_MEMORY


def prefill_config(
    limits: DeviceLimits, dtype: str, kv_dtype: str, head_dim: int, group: int
) -> PrefillConfig:
    """Tiles of the prefill kernel: the largest of PREFILL_TILES that fits the device."""
    if limits.interpreter:
        return PrefillConfig(DOT_MIN, DOT_MIN, 4, 1)
    tiles = PREFILL_TILES if head_dim <= LARGE_HEAD_DIM else PREFILL_TILES[2:]
    for m, n, warps in tiles:
        smem = tile_shared_memory(m, n, head_dim, dtype, limits.compute_capability)
        if smem <= limits.shared_memory_per_block:
            return PrefillConfig(m, n, warps, NUM_STAGES, smem)
    raise _no_fit("prefill", limits, dtype, kv_dtype, head_dim, group)


def decode_config(limits: DeviceLimits, dtype: str, kv_dtype: str, head_dim: int, group: int) -> DecodeConfig:
    """Key tile of the decode kernel (its query tile is the group's heads): the largest that fits."""
    if limits.interpreter:
        return DecodeConfig(DOT_MIN, 4, 1, 4)
    tiles = DECODE_TILES if head_dim <= LARGE_HEAD_DIM else DECODE_TILES[1:]
    for n in tiles:
        smem = tile_shared_memory(group_pad(group), n, head_dim, dtype, limits.compute_capability)
        if smem <= limits.shared_memory_per_block:
            return DecodeConfig(n, 4, NUM_STAGES, 4, smem)
    raise _no_fit("decode", limits, dtype, kv_dtype, head_dim, group)


# LoRA: a segment is one adapter's tokens of a step (a few decodes, or a prompt chunk) and ranks are small,
# so a shrink tile covers a whole rank x slices where it can and walks the input features in BLOCK_K steps;
# an expand tile walks the rank. Preference lists, largest first.
LORA_BLOCK_M = 32
LORA_SHRINK_TILES = ((64, 64), (64, 32), (32, 32), (16, 16))  # (N, K)
LORA_EXPAND_TILES = ((128, 64), (64, 64), (64, 32), (32, 16), (16, 16))


def lora_config(limits: DeviceLimits, dtype: str, kind: str, rank_width: int) -> LoRAConfig:
    """Tiles of the LoRA ``kind`` ('shrink' or 'expand') kernel; ``rank_width`` is the shrink's output width
    (slices x rank) or the expand's reduction (the rank). The operand tiles [M, K] and [K, N] are staged
    twice (two stages): the shrink's in the compute dtype, the expand's in float32 (its h is float32)."""
    if kind not in ("shrink", "expand"):
        raise ValueError(f"kind must be 'shrink' or 'expand', got {kind!r}")
    width = max(DOT_MIN, 1 << max(rank_width - 1, 0).bit_length())  # the rank dimension, padded for tl.dot
    if limits.interpreter:
        return LoRAConfig(DOT_MIN, min(64, width) if kind == "shrink" else DOT_MIN, DOT_MIN, 4, 1)
    elem = element_bytes(dtype) if kind == "shrink" else 4
    for n, k in LORA_SHRINK_TILES if kind == "shrink" else LORA_EXPAND_TILES:
        n, k = (min(n, width), k) if kind == "shrink" else (n, min(k, width))
        smem = NUM_STAGES * (LORA_BLOCK_M * k + k * n) * elem + SCRATCH_SHARED_MEMORY
        if smem <= limits.shared_memory_per_block:
            return LoRAConfig(LORA_BLOCK_M, n, k, 4, NUM_STAGES, smem)
    major, minor = limits.compute_capability
    raise ValueError(
        f"no LoRA {kind} tile fits {limits.shared_memory_per_block} B of shared memory per block (compute "
        f"capability {major}.{minor})"
    )


def cache_write_config(limits: DeviceLimits) -> CacheWriteConfig:
    """One program per token: four warps cover every KV head of a token's row."""
    return CacheWriteConfig(4)


@dataclass(frozen=True)
class RowConfig:
    """The element-wise kernels of a decoder layer (RMSNorm with the residual add, rotary, silu-and-mul):
    ``block`` elements per step of a program's walk (rotary: heads per program), no tiles in shared memory
    beyond a reduction's scratch."""

    block: int
    num_warps: int
    shared_memory: int = SCRATCH_SHARED_MEMORY


# One RMSNorm program per row walks it in steps of this many elements: a Llama-3.1-8B row (4,096) in one
# step, 16 per thread with 8 warps; the interpreter takes small steps so tests cover rows of several.
RMS_NORM_BLOCK = 4096
SILU_MUL_BLOCK = 1024  # elements of one row per program
ROTARY_ELEMENTS = 1024  # heads x head_dim of one rotary program
INTERPRETER_BLOCK = 64


def rms_norm_config(limits: DeviceLimits) -> RowConfig:
    if limits.interpreter:
        return RowConfig(INTERPRETER_BLOCK, 1)
    return RowConfig(RMS_NORM_BLOCK, 8)


def silu_mul_config(limits: DeviceLimits) -> RowConfig:
    if limits.interpreter:
        return RowConfig(INTERPRETER_BLOCK, 1)
    return RowConfig(SILU_MUL_BLOCK, 4)


def rotary_config(limits: DeviceLimits, head_dim: int) -> RowConfig:
    """Heads of one token per program: about ROTARY_ELEMENTS values (two under the interpreter, so tests
    cover head counts that are not a multiple of it)."""
    if limits.interpreter:
        return RowConfig(2, 1)
    heads = max(1, ROTARY_ELEMENTS // head_dim)
    return RowConfig(1 << (heads.bit_length() - 1), 4)


def _no_fit(
    kernel: str, limits: DeviceLimits, dtype: str, kv_dtype: str, head_dim: int, group: int
) -> ValueError:
    major, minor = limits.compute_capability
    return ValueError(
        f"no {kernel} tile fits {limits.shared_memory_per_block} B of shared memory per block (compute "
        f"capability {major}.{minor}) for head_dim {head_dim}, {group} query heads per KV head, {dtype} "
        f"activations over a {kv_dtype} cache"
    )


@dataclass(frozen=True)
class QuantLinearConfig:
    """Tiles of the quantized linear kernels (W4A16, FP8): rows of x per program (M), output columns (N),
    the reduction step (K)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    shared_memory: int = 0


# The quantized GEMMs pick their row tile from the step's rows, so a decode (a few rows) does not pad to a
# prefill's tile: one variant per bucket, the smallest that holds M (M past the last takes the last).
QUANT_ROW_BUCKETS = (16, 32, 64, 128)
# (N, K) preference per row tile, largest first: a decode reads the weight in long K steps over narrow
# column tiles (more programs: a 4096-column layer gives 128, about an H100's 132 SMs), a prefill in square
# tiles. Weight tiles are loaded in their stored width (1 byte: INT4 read per byte, FP8) and widened
# to the operand dtype, so both forms are counted.
QUANT_TILES = {
    16: ((32, 256), (32, 128), (32, 64), (16, 32), (16, 16)),
    32: ((64, 128), (64, 64), (32, 64), (16, 32), (16, 16)),
    64: ((128, 64), (64, 64), (32, 32), (16, 16)),
    128: ((128, 64), (64, 64), (32, 32), (16, 16)),
}
QUANT_KINDS = ("w4a16", "fp8_weight_only", "fp8")


def quant_rows_bucket(m: int) -> int:
    """The row tile of a step with ``m`` rows (see QUANT_ROW_BUCKETS)."""
    return next((b for b in QUANT_ROW_BUCKETS if m <= b), QUANT_ROW_BUCKETS[-1])


def quant_linear_config(limits: DeviceLimits, dtype: str, kind: str, m: int) -> QuantLinearConfig:
    """Tiles of a quantized linear ``kind`` ('w4a16', 'fp8_weight_only', 'fp8': FP8 x FP8) for a step of
    ``m`` rows of ``dtype`` activations: the first tile of its row bucket whose stages fit the device (the
    interpreter: tl.dot's least tile, so tests cover several tiles and groups per row)."""
    if kind not in QUANT_KINDS:
        raise ValueError(f"kind must be one of {QUANT_KINDS}, got {kind!r}")
    least_k = 2 * DOT_MIN if kind == "w4a16" else DOT_MIN  # W4A16 splits a step into two dots of half
    if limits.interpreter:
        return QuantLinearConfig(DOT_MIN, DOT_MIN, least_k, 4, 1)
    bm = quant_rows_bucket(m)
    x_elem = 1 if kind == "fp8" else element_bytes(dtype)
    w_elem = 1 if kind == "fp8" else element_bytes(dtype)  # the widened weight tile
    stages = 3 if limits.compute_capability >= (8, 0) else 2
    for n, k in QUANT_TILES[bm]:
        k = max(k, least_k)
        # pipelined operand loads (x and the stored weight bytes) plus the widened weight tile the dot reads
        smem = stages * (bm * k * x_elem + k * n) + k * n * w_elem + SCRATCH_SHARED_MEMORY
        if smem <= limits.shared_memory_per_block:
            warps = 8 if bm >= 128 else 4
            return QuantLinearConfig(bm, n, k, warps, stages, smem)
    major, minor = limits.compute_capability
    raise ValueError(
        f"no {kind} tile fits {limits.shared_memory_per_block} B of shared memory per block (compute "
        f"capability {major}.{minor})"
    )


# The FP8 activation quantizer: one program per row (per row and group when block-wise) walks it twice (the
# amax, then the quantized values) in steps of up to this many columns.
FP8_QUANT_BLOCK = 1024
INTERPRETER_FP8_QUANT_BLOCK = 32


def fp8_act_quant_config(limits: DeviceLimits, group: int) -> RowConfig:
    """Columns per step of the activation quantizer for groups of ``group`` columns (a whole row per token:
    the row's width), four warps; the interpreter's small steps make tests cover groups of several."""
    if limits.interpreter:
        return RowConfig(INTERPRETER_FP8_QUANT_BLOCK, 1)
    block = 1 if group <= 1 else 1 << (group - 1).bit_length()
    return RowConfig(min(FP8_QUANT_BLOCK, max(block, DOT_MIN)), 4)
