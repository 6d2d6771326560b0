"""Every kernel variant the engine launches for one attention shape, compiled ahead (`pagoda kernels warm`).

The launchers are called as the Triton attention backend calls them, with meta tensors: one cache write,
one prefill, one unsplit and one split decode (whose merge kernel follows). Their variants depend on the
constexprs, dtypes and launch configuration only (see pagoda.kernels.runtime), so these four launches cover
every step of a deployment with this shape. A model's layers may differ in what the attention kernels
specialise on (a sliding window or none, Gemma 2's logit soft-cap): each kind of layer is a shape of its own
(`KernelPlan.attention_shapes`); the window's length and the cap's value are run-time arguments. The decoder layer's element-wise kernels (RMSNorm with and
without the residual add, rotary on q and k, silu-and-mul) follow: their variants depend on the dtype and
head dim, and on whether rows are whole 16-byte vectors, which every catalogue model's hidden and
intermediate sizes are (the sizes below are too). With LoRA on, each fused linear's shrink and expand
(qkv: three slices, gate_up: two, o and down: one) follow, their variants fixed by the dtype and the rank.
A plan whose checkpoint is quantized (`KernelPlan.quant_format`) adds each fused linear's quantized GEMM at
every row bucket (W4A16, or FP8 on the path the GPU takes); unquantized plans launch none of them.

`KernelPlan` is what decides the variant set of one engine; pagoda.engine.cli.kernels.kernel_plan derives it
from the model's shape, the GPU, the dtypes, the tensor-parallel size, the block size and LoRA (the one
function `pagoda kernels warm` and the operator's kernel step, which passes the engine's own serve flags, go
through); `launch_plan` launches every variant of a plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pagoda.kernels.aot import Compilation, compiling_for
from pagoda.kernels.launch_config import DeviceLimits

META = torch.device("meta")


@dataclass(frozen=True)
class AttentionShape:
    """What one rank's attention layers look like to the kernels."""

    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads this rank keeps
    head_dim: int
    block_size: int
    dtype: torch.dtype  # activations
    kv_dtype: torch.dtype  # the cache
    sliding_window: int | None = None
    logit_softcap: float | None = None  # Gemma 2's attention soft-cap (the SOFTCAP variants)
    sinks: bool = False  # learned per-head sink logits (gpt-oss: the SINKS variants; their values run-time)


def launch_all(shape: AttentionShape) -> None:
    """One launch of each kernel with this shape (inside `compiling_for`, one compilation of each)."""
    from pagoda.kernels.cache_write import reshape_and_cache
    from pagoda.kernels.paged_decode import paged_decode_attention
    from pagoda.kernels.paged_prefill import paged_prefill_attention

    h, kvh, d, bs = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.block_size
    tokens, num_blocks = 4, 8
    # q, k and v as the model leaves them: views into the fused qkv projection (q and k rotated in place)
    qkv = torch.empty((tokens, (h + 2 * kvh) * d), dtype=shape.dtype, device=META)
    q = qkv[:, : h * d].view(tokens, h, d)
    k = qkv[:, h * d : (h + kvh) * d].view(tokens, kvh, d)
    v = qkv[:, (h + kvh) * d :].view(tokens, kvh, d)
    kv_cache = torch.empty((2, num_blocks, bs, kvh, d), dtype=shape.kv_dtype, device=META)
    int8 = shape.kv_dtype == torch.int8
    scales = torch.empty(kv_cache.shape[:4], dtype=torch.float32, device=META) if int8 else None
    slots = torch.empty(tokens, dtype=torch.int64, device=META)
    tables = torch.empty((tokens, 2), dtype=torch.int32, device=META)
    seq_lens = torch.empty(tokens, dtype=torch.int32, device=META)
    qsl = torch.empty(tokens + 1, dtype=torch.int32, device=META)
    ids = torch.empty(tokens, dtype=torch.int32, device=META)
    sinks = torch.empty(h, dtype=torch.float32, device=META) if shape.sinks else None
    common = dict(
        kv_scales=scales, sliding_window=shape.sliding_window, logit_softcap=shape.logit_softcap, seq_ids=ids,
        sinks=sinks,
    )  # fmt: skip
    reshape_and_cache(k, v, kv_cache, slots, kv_scales=scales)
    paged_prefill_attention(q, kv_cache, qsl, seq_lens, tables, 0.1, max_query_len=tokens, **common)
    for splits in (1, 2):
        paged_decode_attention(
            q,
            kv_cache,
            tables,
            seq_lens,
            0.1,
            query_start_loc=qsl,
            max_seq_len=64,
            num_splits=splits,
            **common,
        )
    launch_layer_ops(shape, qkv)


def launch_layer_ops(shape: AttentionShape, qkv: torch.Tensor) -> None:
    """The decoder layer's element-wise kernels as the model launches them on ``qkv`` (meta)."""
    from pagoda.kernels.activation import silu_mul
    from pagoda.kernels.rms_norm import add_rms_norm
    from pagoda.kernels.rotary import rotary_

    tokens, d = qkv.shape[0], shape.head_dim
    hidden = shape.num_heads * d  # any multiple of 16 bytes' worth of elements compiles the same variants
    x = torch.empty((tokens, hidden), dtype=shape.dtype, device=META)
    weight = torch.empty(hidden, dtype=shape.dtype, device=META)
    add_rms_norm(x, None, weight, 1e-6)  # the first layer's input norm
    add_rms_norm(x, torch.empty_like(x), weight, 1e-6)  # every other norm, with the residual add
    table = torch.empty((tokens, d), dtype=shape.dtype, device=META)
    rotary_(qkv, shape.num_heads + shape.num_kv_heads, d, table, table)
    silu_mul(torch.empty((tokens, 2 * hidden), dtype=shape.dtype, device=META))


def launch_moe(plan: KernelPlan) -> None:
    """The experts' grouped GEMMs as the MoE layers launch them (engine/models/moe.py, gpt_oss.py): gate and up
    over the gathered token rows; down scaled by the routing weights into float32 after silu-and-mul, or for
    biased experts (gpt-oss, whose activation and biases are torch ops) unscaled into float32."""
    from pagoda.kernels.activation import silu_mul
    from pagoda.kernels.fused_moe import expert_tiles, fused_moe_config, grouped_gemm

    dtype, tokens, k = getattr(torch, plan.dtype), 4, min(2, plan.experts)
    e, h, i = plan.experts, plan.hidden_size, plan.moe_intermediate
    x = torch.empty((tokens, h), dtype=dtype, device=META)
    w13 = torch.empty((e, 2 * i, h), dtype=dtype, device=META)
    w2 = torch.empty((e, h, i), dtype=dtype, device=META)
    ids = torch.empty((tokens, k), dtype=torch.int64, device=META)
    tiles = expert_tiles(ids, e, fused_moe_config(plan.limits, plan.dtype).block_m)
    gate_up = grouped_gemm(x, w13, tiles, a_rows=tiles.order // k)
    if plan.expert_bias:
        act = torch.empty((tokens * k, i), dtype=dtype, device=META)
        grouped_gemm(act, w2, tiles, out_dtype=torch.float32)
    else:
        scale = torch.empty(tokens * k, dtype=torch.float32, device=META)
        grouped_gemm(silu_mul(gate_up), w2, tiles, scale=scale, out_dtype=torch.float32)


@dataclass(frozen=True)
class KernelPlan:
    """Everything that decides which Triton kernel variants one engine (all its ranks) launches."""

    compute_capability: tuple[int, int]
    shared_memory_per_block: int
    ranks: tuple[tuple[int, int], ...]  # distinct (query heads, KV heads) of the tensor-parallel ranks
    head_dim: int
    hidden_size: int
    intermediate_size: int
    block_size: int
    dtype: str  # torch's name of the activations' dtype ("bfloat16")
    kv_cache_dtype: str  # torch's name of what the cache holds ("float8_e4m3fn", "int8", or the dtype)
    sliding_window: int | None = None
    lora_rank: int | None = None  # --max-lora-rank when LoRA is on (every slot is this wide)
    attention: bool = True  # False with --attention-backend torch: no attention or layer kernels, LoRA only
    logit_softcap: float | None = None  # the model's attn_logit_softcapping (Gemma 2), on every layer
    quant_format: str = ""  # "int4" | "fp8": the checkpoint's quantized linears (their kernels); "" = none

    @property
    def limits(self) -> DeviceLimits:
        return DeviceLimits(self.compute_capability, self.shared_memory_per_block)

    def attention_shapes(self) -> list[AttentionShape]:
        """One per rank shape and kind of layer: a model with a sliding window may also have full-attention
        layers (Gemma 2 every other one, Gemma 3 one in six, Qwen2's max_window_layers), so both; a soft-cap
        applies to every layer of the model that has one."""
        windows = (self.sliding_window, None) if self.sliding_window else (None,)
        dtype, kv = getattr(torch, self.dtype), getattr(torch, self.kv_cache_dtype)
        return [
            AttentionShape(
                heads,
                kv_heads,
                self.head_dim,
                self.block_size,
                dtype,
                kv,
                window,
                self.logit_softcap,
                sinks=self.attention_sinks,
            )  # fmt: skip
            for heads, kv_heads in self.ranks
            for window in windows
        ]

    # Mixtures of experts and gpt-oss's attention: declared after the other fields (plans are built
    # positionally up to those; pagoda.engine.cli.kernels sets these by name).
    attention_sinks: bool = False  # learned sink logits on every layer (gpt-oss: the SINKS variants)
    experts: int = 0  # a mixture of experts' expert count (0: dense MLPs): the grouped-GEMM variants
    moe_intermediate: int = 0  # each expert's intermediate size on one rank
    expert_bias: bool = False  # gpt-oss's biased experts: an unscaled down GEMM (activation in torch)


def launch_lora(plan: KernelPlan) -> None:
    """Each fused linear's LoRA shrink and expand, as engine/lora/layers.py launches them (tensor
    parallelism is 1 with LoRA: the whole model's sizes)."""
    from pagoda.kernels.lora import lora_expand, lora_shrink

    dtype, r, tokens, slots = getattr(torch, plan.dtype), plan.lora_rank, 4, 2
    heads, kv_heads = plan.ranks[0]
    q, kv, hidden, inter = (
        heads * plan.head_dim,
        kv_heads * plan.head_dim,
        plan.hidden_size,
        plan.intermediate_size,
    )
    fused = [(hidden, [q, kv, kv]), (q, [hidden]), (hidden, [inter, inter]), (inter, [hidden])]
    seg = [torch.empty(1, dtype=torch.int32, device=META) for _ in range(3)]
    for in_features, slices in fused:
        x = torch.empty((tokens, in_features), dtype=dtype, device=META)
        a = torch.empty((slots, in_features, len(slices) * r), dtype=dtype, device=META)
        h = lora_shrink(x, a, *seg, tokens, out=torch.empty((tokens, len(slices) * r), device=META))
        y = torch.empty((tokens, sum(slices)), dtype=dtype, device=META)
        offset = 0
        for i, size in enumerate(slices):
            b = torch.empty((slots, r, size), dtype=dtype, device=META)
            lora_expand(h, b, y[:, offset : offset + size], *seg, tokens, h_offset=i * r)
            offset += size


# One step's rows in each row bucket of the quantized linears (launch_config.QUANT_ROW_BUCKETS): a decode
# to a prefill chunk; their variants differ by the row tile only (M itself is not specialised on).
QUANT_STEP_ROWS = (1, 32, 64, 256)
INT4_GROUPS = (128, -1)  # the group size and per channel
FP8_BLOCKS = (None, (128, 128))  # per row (per tensor expanded at load, or per channel) and block-wise


def quantized_linears(plan: KernelPlan) -> list[tuple[int, int, bool]]:
    """(in_features, out_features, bias) of each fused linear on a rank, as the engine holds them quantized:
    qkv (with and without a bias: Qwen2's has one), o, gate_up, down. Tensor parallelism is read back from
    the rank's heads (the sizes matter only through Triton's divisibility specialisation)."""
    d = plan.head_dim
    shapes = []
    for heads, kv_heads in plan.ranks:
        tp = max(1, plan.hidden_size // max(heads * d, 1))
        inter = plan.intermediate_size // tp
        qkv = (plan.hidden_size, (heads + 2 * kv_heads) * d)
        shapes += [(*qkv, False), (*qkv, True), (heads * d, plan.hidden_size, False),
                   (plan.hidden_size, 2 * inter, False), (inter, plan.hidden_size, False)]  # fmt: skip
    return list(dict.fromkeys(shapes))


def launch_quantized(plan: KernelPlan) -> None:
    """Each quantized linear's kernel at every row bucket: W4A16 for INT4 (group 128 and per channel),
    FP8 per row and 128 x 128 block-wise on the path the GPU takes (FP8 x FP8 from 8.9, else weight-only)."""
    from pagoda.kernels.quant_fp8 import fp8_linear
    from pagoda.kernels.quant_w4a16 import w4a16_linear

    dtype = getattr(torch, plan.dtype)
    for k, n, has_bias in quantized_linears(plan):
        bias = torch.empty(n, dtype=dtype, device=META) if has_bias else None
        for m in QUANT_STEP_ROWS:
            x = torch.empty((m, k), dtype=dtype, device=META)
            if plan.quant_format == "int4":
                qweight = torch.empty((n, (k + 1) // 2), dtype=torch.uint8, device=META)
                for group in INT4_GROUPS:
                    groups = 1 if group <= 0 else -(-k // group)
                    scales = torch.empty((n, groups), dtype=dtype, device=META)
                    zeros = torch.empty((n, groups), dtype=torch.uint8, device=META)
                    w4a16_linear(x, qweight, scales, zeros, group, bias)
            elif plan.quant_format == "fp8":
                weight = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=META)
                for block in FP8_BLOCKS:
                    shape = (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))
                    scale = torch.empty(shape, dtype=torch.float32, device=META)
                    fp8_linear(x, weight, scale, block, bias)


def launch_plan(plan: KernelPlan) -> None:
    """One launch of every variant of the plan (inside `compiling_for(plan.limits)`)."""
    for shape in dict.fromkeys(plan.attention_shapes() if plan.attention else []):
        launch_all(shape)
    if plan.attention and plan.experts:
        launch_moe(plan)
    if plan.lora_rank:
        launch_lora(plan)
    if plan.quant_format in ("int4", "fp8"):
        launch_quantized(plan)


def compile_plan(plan: KernelPlan) -> Compilation:
    with compiling_for(plan.limits) as compilation:
        launch_plan(plan)
    return compilation


def compile_shapes(limits: DeviceLimits, shapes: list[AttentionShape]) -> Compilation:
    """Compile every variant the shapes launch for a device with these limits (repeats compile once)."""
    with compiling_for(limits) as compilation:
        for shape in dict.fromkeys(shapes):
            launch_all(shape)
    return compilation
