"""gpt-oss (20b, 120b): a Llama-shaped decoder with learned attention sinks and biased experts.

What differs from the Llama blocks, each implemented here so the shared modules stay as they are:
- attention: bias on q, k, v and o (config.json's attention_bias), one learned sink logit per query head that
  joins the softmax's denominator (every backend takes ``sinks``: the CPU C kernels, the torch formulation, the
  Triton kernels). It only takes probability mass; nothing is cached for it (it is not a StreamingLLM sink);
- layers alternate a 128-token sliding window and full attention (config.json's layer_types; a cache with a
  window group gives the sliding layers their small pool as for Gemma);
- RoPE with YaRN scaling (the shared rotary, truncate: false);
- the router has a bias; a token's experts are the top-k logits, weighted by the softmax over those k, which is
  the full softmax's top-k renormalised (`moe.route` with renormalize);
- experts with biases and a clamped SwiGLU: gate clamped above at `swiglu_limit`, up clamped to +-limit,
  out = (up + 1) * gate * sigmoid(alpha * gate). The checkpoint interleaves gate and up columns (even: gate,
  odd: up); the loader splits them into our [gate rows; up rows] stack, so the grouped GEMMs are the MoE
  layer's;
- experts stored as MXFP4 (`*_blocks`, `*_scales`) are dequantized at load (engine/models/mxfp4.py says why).

Tensor parallelism as for the other MoE models: every rank holds every expert with a 1/tp slice of its
intermediate size, the routing replicated; down's bias is added on rank 0 only (the all-reduce sums the
ranks). Each rank holds the sinks of its query heads.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from pagoda.engine.attention.base import AttentionBackend
from pagoda.engine.attention.bound import BoundBackend
from pagoda.engine.distributed.parallel_state import all_reduce, tp_rank
from pagoda.engine.models.layers import RMSNorm
from pagoda.engine.models.llama import Attention, DecoderLayer, LlamaForCausalLM, uses_triton_kernels
from pagoda.engine.models.moe import HAS_GROUPED_MM, SparseMoE, _grouped_mm_strides, pad_by_expert, route
from pagoda.engine.models.mxfp4 import dequantize_mxfp4
from pagoda.engine.sizing.model_config import ModelConfig
from torch import nn


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation over [.., 2I] (gate columns, then up columns) -> [.., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _grouped_linear(rows: torch.Tensor, w: torch.Tensor, expert: torch.Tensor, counts: torch.Tensor):
    """Expert-sorted ``rows`` [S, K] times their expert's ``w`` [E, N, K] transposed: one torch._grouped_mm
    call, or where it refuses the strides, one bmm over the chosen experts' rows padded to the busiest's."""
    if HAS_GROUPED_MM and _grouped_mm_strides(rows.element_size(), w.shape[2], w.shape[1]):
        return torch._grouped_mm(rows, w.transpose(1, 2), offs=counts.cumsum(0).to(torch.int32))
    padded, used, batch, within = pad_by_expert(rows, expert, counts)
    return torch.bmm(padded, w.index_select(0, used).transpose(1, 2))[batch, within]


def biased_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    b13: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    weights: torch.Tensor,
    ids: torch.Tensor,
    alpha: float,
    limit: float,
    triton: bool = False,
) -> torch.Tensor:
    """sum over a token's k experts of weight * (down(swiglu(gate_up(x) + b13) ) + b2): x [T, H], w13 [E, 2I, H]
    (gate rows then up rows), b13 [E, 2I], w2 [E, H, I], b2 [E, H] or None (a rank other than 0), weights and
    ids [T, k] -> [T, H]. Slots sorted by expert, one grouped product per projection: the Triton grouped GEMM
    on the GPU, torch's grouped matmul on the CPU; biases and the activation as torch ops between them."""
    t, top_k = ids.shape
    if t == 0:
        return torch.zeros_like(x)
    flat = ids.reshape(-1)
    if triton:
        from pagoda.kernels.fused_moe import expert_tiles, fused_moe_config, grouped_gemm
        from pagoda.kernels.runtime import device_limits, dtype_name

        config = fused_moe_config(device_limits(x.device), dtype_name(x.dtype))
        tiles = expert_tiles(ids, w13.shape[0], config.block_m)
        order = tiles.order
        expert = flat[order]
        gate_up = grouped_gemm(x, w13, tiles, a_rows=order // top_k)
        act = clamped_swiglu(gate_up + b13[expert], alpha, limit)
        y = grouped_gemm(act, w2, tiles, out_dtype=torch.float32)
    else:
        order = torch.argsort(flat, stable=True)
        expert = flat[order]
        counts = torch.bincount(flat, minlength=w13.shape[0])
        rows = x.index_select(0, order // top_k)
        gate_up = _grouped_linear(rows, w13, expert, counts) + b13[expert]
        act = clamped_swiglu(gate_up, alpha, limit)
        y = _grouped_linear(act, w2, expert, counts).float()
    if b2 is not None:
        y = y + b2[expert].float()
    per_slot = torch.empty((t * top_k, x.shape[1]), dtype=torch.float32, device=x.device)
    per_slot[order] = y * weights.reshape(-1)[order, None]
    return per_slot.view(t, top_k, -1).sum(dim=1).to(x.dtype)


def biased_experts_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    b13: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """The twin: one gathered weight per (token, chosen expert), float32, no sorting."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    rows = x.float().repeat_interleave(k, dim=0)
    gate_up = torch.einsum("sk,snk->sn", rows, w13.float()[flat]) + b13.float()[flat]
    y = torch.einsum("sk,snk->sn", clamped_swiglu(gate_up, alpha, limit), w2.float()[flat]) + b2.float()[flat]
    return (y * weights.reshape(-1, 1).float()).view(t, k, -1).sum(dim=1).to(x.dtype)


class GptOssMoE(SparseMoE):
    """The experts of one layer: ``forward(x [T, H]) -> [T, H]`` (summed over tensor-parallel ranks)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, triton: bool = False):
        super().__init__(config, dtype, device, triton)
        experts, hidden = config.num_experts, config.hidden_size
        self.renormalize = True  # softmax over the top-k logits
        self.alpha = config.swiglu_alpha
        self.limit = config.swiglu_limit
        self.router_bias = nn.Parameter(torch.empty(experts, dtype=dtype, device=device), False)
        self.b13 = nn.Parameter(
            torch.empty(experts, 2 * self.intermediate, dtype=dtype, device=device), False
        )
        self.b2 = nn.Parameter(torch.empty(experts, hidden, dtype=dtype, device=device), False)
        self._packed: dict[
            str, torch.Tensor
        ] = {}  # an MXFP4 weight's blocks or scales, until the other comes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(F.linear(x, self.router, self.router_bias), self.top_k, True)
        b2 = self.b2 if tp_rank() == 0 else None
        y = biased_experts(
            x, self.w13, self.b13, self.w2, b2, weights, ids, self.alpha, self.limit, self.triton
        )
        return all_reduce(y)

    # ---- weights ------------------------------------------------------------------------------------

    def load(self, sub: str, tensor: torch.Tensor, name: str = "") -> tuple[nn.Parameter, float]:
        """Copy one checkpoint tensor (the name after `mlp.`: router.weight/bias, experts.gate_up_proj
        [E, H, 2I] with gate and up columns interleaved, experts.gate_up_proj_bias [E, 2I], experts.down_proj
        [E, I, H], experts.down_proj_bias [E, H], or an MXFP4 pair experts.<proj>_blocks/_scales in the
        [E, out, in] layout) into this rank's part of our parameters; (parameter, experts completed)."""
        experts, hidden = self.w13.shape[0], self.w13.shape[2]
        lo, hi, full = self.inter_lo, self.inter_hi, self.full_intermediate
        label = name or sub
        if sub == "router.weight":
            self._check(tensor, (experts, hidden), label)
            self.router.copy_(tensor)
            return self.router, experts
        if sub == "router.bias":
            self._check(tensor, (experts,), label)
            self.router_bias.copy_(tensor)
            return self.router_bias, experts
        if sub == "experts.gate_up_proj_bias":
            self._check(tensor, (experts, 2 * full), label)
            self.b13.copy_(torch.cat((tensor[:, 0::2][:, lo:hi], tensor[:, 1::2][:, lo:hi]), dim=1))
            return self.b13, experts
        if sub == "experts.down_proj_bias":
            self._check(tensor, (experts, hidden), label)
            self.b2.copy_(tensor)
            return self.b2, experts
        if sub == "experts.gate_up_proj":  # [E, H, 2I], columns gate0 up0 gate1 up1 ...
            self._check(tensor, (experts, hidden, 2 * full), label)
            self._copy_gate_up(tensor.transpose(1, 2))
            return self.w13, experts
        if sub == "experts.down_proj":  # [E, I, H]
            self._check(tensor, (experts, full, hidden), label)
            self.w2.copy_(tensor[:, lo:hi].transpose(1, 2))
            return self.w2, experts
        for proj, param in (("gate_up_proj", self.w13), ("down_proj", self.w2)):
            for part, other in (("_blocks", "_scales"), ("_scales", "_blocks")):
                if sub == f"experts.{proj}{part}":
                    pending = self._packed.pop(proj + other, None)
                    if pending is None:
                        self._packed[proj + part] = tensor
                        return param, 0
                    blocks, scales = (tensor, pending) if part == "_blocks" else (pending, tensor)
                    self._load_mxfp4(proj, blocks, scales, label)
                    return param, experts
        raise KeyError(sub)

    def _copy_gate_up(self, w: torch.Tensor) -> None:
        """w: [E, 2I, H] rows interleaved (gate, up, gate, ...) -> this rank's [gate rows; up rows]."""
        lo, hi, inter = self.inter_lo, self.inter_hi, self.intermediate
        self.w13[:, :inter].copy_(w[:, 0::2][:, lo:hi])
        self.w13[:, inter:].copy_(w[:, 1::2][:, lo:hi])

    def _load_mxfp4(self, proj: str, blocks: torch.Tensor, scales: torch.Tensor, label: str) -> None:
        """Dequantize an MXFP4 weight [E, out, in] one expert at a time (a whole layer's float copy of a 120b
        model's experts would be gigabytes) straight into our stacks."""
        experts, hidden, full = self.w13.shape[0], self.w13.shape[2], self.full_intermediate
        rows, cols = (2 * full, hidden) if proj == "gate_up_proj" else (hidden, full)
        want_blocks, want_scales = (experts, rows, cols // 32, 16), (experts, rows, cols // 32)
        if cols % 32 or tuple(blocks.shape) != want_blocks or tuple(scales.shape) != want_scales:
            raise ValueError(
                f"MXFP4 tensor {label!r}: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}, expected "
                f"{want_blocks} and {want_scales} (rows of {cols} values, a multiple of 32)"
            )
        lo, hi, inter = self.inter_lo, self.inter_hi, self.intermediate
        for e in range(experts):
            w = dequantize_mxfp4(blocks[e], scales[e], torch.float32)  # [out, in]
            if proj == "gate_up_proj":
                self.w13[e, :inter].copy_(w[0::2][lo:hi])
                self.w13[e, inter:].copy_(w[1::2][lo:hi])
            else:
                self.w2[e].copy_(w[:, lo:hi])

    def finish_loading(self) -> None:
        """A blocks tensor without its scales (or the reverse) is a broken checkpoint."""
        if self._packed:
            raise ValueError(f"MXFP4 tensors without their other half: {', '.join(sorted(self._packed))}")


class GptOssAttention(Attention):
    """Llama attention (biased q/k/v/o) whose softmax has a learned sink per query head (float32, this rank's
    heads)."""

    def __init__(self, config: ModelConfig, layer: int, backend: AttentionBackend, dtype, device):
        super().__init__(config, layer, backend, dtype, device)
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32, device=device), False)
        self.backend = BoundBackend(backend, sinks=self.sinks)


class GptOssDecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, layer: int, backend: AttentionBackend, dtype, device):
        nn.Module.__init__(self)
        triton = uses_triton_kernels(backend)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, triton)
        self.self_attn = GptOssAttention(config, layer, backend, dtype, device)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype, device, triton
        )
        self.mlp = GptOssMoE(config, dtype, device, triton)
        self.residual_multiplier = 1.0


class GptOssForCausalLM(LlamaForCausalLM):
    """`model(input_ids[T], positions[T], kv_caches, meta) -> hidden[T, H]`; `compute_logits` -> float32.
    The Llama model with gpt-oss's layers; checkpoint names as the hub's (and transformers 5's)."""

    decoder_layer = GptOssDecoderLayer

    def _target(self, name: str):
        parts = name.removeprefix("model.").split(".")
        if len(parts) == 4 and parts[0] == "layers" and parts[2:] == ["self_attn", "sinks"]:
            attn = self.layers[int(parts[1])].self_attn
            heads = list(range(*attn.q_heads))
            return (attn.sinks, 0, attn.num_heads, (0, heads))
        return super()._target(name)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The Llama loader; once the tensors are read (before its check for missing ones), any MXFP4 half
        left without its other half is named."""

        def then_check() -> Iterable[tuple[str, torch.Tensor]]:
            yield from weights
            for layer in self.layers:
                layer.mlp.finish_loading()

        super().load_weights(then_check())
