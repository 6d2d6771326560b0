"""The sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router, top-k experts per token, grouped GEMMs.

Routing: router logits -> softmax over the experts in float32 (or a sigmoid per expert where config.json's
scoring_func says, as DeepSeek-V3-style routers score) -> the k largest, renormalised to sum to one where the
config says (`norm_topk_prob`; Mixtral always), times routed_scaling_factor where set. The (token, expert) slots are then sorted by
expert and each projection is one grouped computation over the sorted rows: on the GPU the Triton kernel
(pagoda.kernels.fused_moe), on the CPU torch's grouped matmul (`torch._grouped_mm`, one call per projection
over the whole step), or where it is missing or refuses the shape (rows must be a multiple of 16 bytes long,
which a tensor-parallel slice may not be) batched matmuls over the experts the step chose, each one's rows
padded to the busiest one's count. Neither loops over experts in Python.

The CPU paths' timings against the per-expert loop are in docs/models.md (Mixture of experts).

Weights: every expert's gate and up rows are stacked in ``w13`` [E, 2I, H] and its down in ``w2`` [E, H, I];
the checkpoint's per-expert tensors (Qwen3-MoE `mlp.experts.{e}.gate_proj/up_proj/down_proj`, Mixtral
`block_sparse_moe.experts.{e}.w1/w3/w2`) or transformers' in-memory 3-D ones (`experts.gate_up_proj`,
`experts.down_proj`) are copied into them, and the router (`gate.weight`) into ``router``.

Tensor parallelism: each rank holds every expert, with a 1/tp slice of each expert's intermediate dimension
(gate/up rows, down columns), as the dense MLP is split. Routing is computed identically on every rank
(the router is replicated), each rank's experts give partial sums of the output, and one all-reduce adds
them: no token is sent between ranks, and the traffic is that of a dense layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pagoda.engine.distributed.parallel_state import all_reduce, shard_range
from pagoda.engine.models import cpu_ops
from pagoda.engine.sizing.model_config import ModelConfig
from torch import nn

HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")

# checkpoint names of an expert's projections -> (ours, part): gate and up are halves of w13
_EXPERT_PARTS = {
    "gate_proj": ("w13", 0),
    "up_proj": ("w13", 1),
    "down_proj": ("w2", None),
    "w1": ("w13", 0),
    "w3": ("w13", 1),
    "w2": ("w2", None),
}
MOE_PREFIXES = ("mlp.", "block_sparse_moe.")  # where a layer's sparse block lives in the checkpoint


SCORING_FUNCS = ("softmax", "sigmoid")


def route(
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
    correction_bias: torch.Tensor | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64) from router logits [T, E].

    ``scoring``: softmax over the experts, or sigmoid per expert (DeepSeek-V3-style routers, whose scores do
    not compete, so they are renormalised over the chosen k where the config says). ``correction_bias`` [E]
    (DeepSeek-V3's e_score_correction_bias) shifts which experts are chosen, not their weights; ``scale``
    (routed_scaling_factor) multiplies the final weights."""
    if scoring == "softmax":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    elif scoring == "sigmoid":
        probs = torch.sigmoid(logits.float())
    else:
        raise ValueError(f"scoring_func {scoring!r} is not supported ({', '.join(SCORING_FUNCS)})")
    if correction_bias is None:
        weights, ids = torch.topk(probs, top_k, dim=-1)
    else:
        ids = torch.topk(probs + correction_bias.float(), top_k, dim=-1).indices
        weights = probs.gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights * scale if scale != 1.0 else weights), ids


def experts_cpu(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The CPU path of the experts (shapes as `pagoda.kernels.fused_moe.fused_experts`): slots sorted by
    expert, one grouped matmul per projection."""
    t, top_k = ids.shape
    if t == 0:
        return torch.zeros_like(x)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = x.index_select(0, order // top_k)
    scale = weights.reshape(-1)[order]
    counts = torch.bincount(flat, minlength=w13.shape[0])
    if HAS_GROUPED_MM and _grouped_mm_strides(x.element_size(), w13.shape[2], w2.shape[2]):
        offsets = counts.cumsum(0).to(torch.int32)
        gate_up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offsets)
        y = torch._grouped_mm(_silu_mul(gate_up), w2.transpose(1, 2), offs=offsets)
    else:
        y = _padded_bmm(rows, w13, w2, flat[order], counts)
    per_slot = torch.empty((t * top_k, x.shape[1]), dtype=torch.float32, device=x.device)
    per_slot[order] = y.float() * scale[:, None]
    return per_slot.view(t, top_k, -1).sum(dim=1).to(x.dtype)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    act = cpu_ops.silu_mul(gate_up)
    if act is None:
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) * up
    return act


def pad_by_expert(
    rows: torch.Tensor, expert: torch.Tensor, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert-sorted ``rows`` as [experts chosen this step, most rows of one expert, K], zero-padded, with the
    chosen experts' ids and each row's (batch, within) place: ``result[batch, within]`` reads the rows back."""
    used = torch.nonzero(counts).squeeze(1)
    slot_of = torch.zeros_like(counts)
    slot_of[used] = torch.arange(used.numel(), device=counts.device)
    starts = counts.cumsum(0) - counts
    within = torch.arange(rows.shape[0], device=rows.device) - starts[expert]
    batch = slot_of[expert]
    padded = rows.new_zeros((used.numel(), int(counts.max()), rows.shape[1]))
    padded[batch, within] = rows
    return padded, used, batch, within


def _padded_bmm(
    rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, expert: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Both projections of the expert-sorted ``rows`` as batched matmuls over [experts chosen this step,
    most tokens of one expert, H]: each chosen expert's rows padded to the busiest one's count (the experts
    no token chose are left out, which matters at decode with many experts)."""
    padded, used, batch, within = pad_by_expert(rows, expert, counts)
    if used.numel() < counts.numel():  # a copy of the chosen experts' weights
        w13, w2 = w13.index_select(0, used), w2.index_select(0, used)
    act = _silu_mul(torch.bmm(padded, w13.transpose(1, 2)))
    return torch.bmm(act, w2.transpose(1, 2))[batch, within]


def _grouped_mm_strides(element_size: int, hidden: int, intermediate: int) -> bool:
    """torch._grouped_mm takes rows a multiple of 16 bytes long only (a tensor-parallel slice of an
    intermediate size may not be); the other shapes take the bmm path."""
    return (hidden * element_size) % 16 == 0 and (intermediate * element_size) % 16 == 0


def experts_loop(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The per-expert Python loop the grouped paths replace (transformers' way): kept for the benchmark."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])
        out.index_add_(0, token, y.float() * weights[token, slot, None])
    return out.to(x.dtype)


class SparseMoE(nn.Module):
    """The MoE MLP of one decoder layer: ``forward(x [T, H]) -> [T, H]`` (summed over tensor-parallel ranks)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, triton: bool = False):
        super().__init__()
        experts, hidden = config.num_experts, config.hidden_size
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.scoring = config.scoring_func
        self.routed_scale = config.routed_scaling_factor
        self.full_intermediate = config.moe_intermediate_size
        self.inter_lo, self.inter_hi = shard_range(config.moe_intermediate_size)
        self.intermediate = self.inter_hi - self.inter_lo
        self.router = nn.Parameter(torch.empty(experts, hidden, dtype=dtype, device=device), False)
        self.w13 = nn.Parameter(
            torch.empty(experts, 2 * self.intermediate, hidden, dtype=dtype, device=device), False
        )
        self.w2 = nn.Parameter(
            torch.empty(experts, hidden, self.intermediate, dtype=dtype, device=device), False
        )
        self.triton = triton

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.router)
        weights, ids = route(logits, self.top_k, self.renormalize, self.scoring, scale=self.routed_scale)
        if self.triton:
            from pagoda.kernels.fused_moe import fused_experts

            y = fused_experts(x, self.w13, self.w2, weights, ids)
        else:
            y = experts_cpu(x, self.w13, self.w2, weights, ids)
        return all_reduce(y)

    # ---- weights ------------------------------------------------------------------------------------

    def load(self, sub: str, tensor: torch.Tensor, name: str = "") -> tuple[nn.Parameter, float]:
        """Copy the checkpoint tensor named ``sub`` (the name after the layer's sparse block, e.g.
        `experts.3.w1.weight`, `experts.gate_up_proj`, `gate.weight`) into this rank's part of our stacked
        parameters: (the parameter, how much of its first dimension that completed: halves of an expert for
        its gate or up rows; ``name``: the full name, for messages). A KeyError for a name that has no place, a ValueError for a wrong shape."""
        parts = sub.split(".")
        experts, hidden = self.w13.shape[0], self.w13.shape[2]
        lo, hi, inter, full = self.inter_lo, self.inter_hi, self.intermediate, self.full_intermediate
        if sub == "gate.weight":
            self._check(tensor, (experts, hidden), name or sub)
            self.router.copy_(tensor)
            return self.router, experts
        if parts[0] != "experts":
            raise KeyError(sub)
        if len(parts) == 2 and parts[1] == "gate_up_proj":  # [E, 2I, H]: gate rows then up rows
            self._check(tensor, (experts, 2 * full, hidden), name or sub)
            gate, up = tensor.chunk(2, dim=1)
            self.w13[:, :inter].copy_(gate[:, lo:hi])
            self.w13[:, inter:].copy_(up[:, lo:hi])
            return self.w13, experts
        if len(parts) == 2 and parts[1] == "down_proj":  # [E, H, I]
            self._check(tensor, (experts, hidden, full), name or sub)
            self.w2.copy_(tensor[:, :, lo:hi])
            return self.w2, experts
        if len(parts) != 4 or parts[3] != "weight" or parts[2] not in _EXPERT_PARTS:
            raise KeyError(sub)
        expert = int(parts[1])
        if not 0 <= expert < experts:
            raise KeyError(sub)
        ours, half = _EXPERT_PARTS[parts[2]]
        if ours == "w2":
            self._check(tensor, (hidden, full), name or sub)
            self.w2[expert].copy_(tensor[:, lo:hi])
            return self.w2, 1.0
        self._check(tensor, (full, hidden), name or sub)
        self.w13[expert, half * inter : (half + 1) * inter].copy_(tensor[lo:hi])
        return self.w13, 0.5

    @staticmethod
    def _check(tensor: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
        """The whole checkpoint tensor's shape (each rank then takes its slice of it)."""
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
