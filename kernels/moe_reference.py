"""Torch twins of the mixture-of-experts kernels: the definitions the fused paths are checked against.

Plain float32 math, one gathered weight per (token, chosen expert), no sorting or grouping: slow and memory
hungry, which is fine at test sizes and makes the twin obviously right. The result is rounded once to the
activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route_ref(
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
    correction_bias: torch.Tensor | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64), one token at a time: softmax over the experts in
    float32 (or 1 / (1 + exp(-logit)) per expert for sigmoid scoring), the k best by score (plus the correction
    bias where given), their scores divided by their sum when ``renormalize``, times ``scale``."""
    t = logits.shape[0]
    weights = torch.empty(t, top_k, dtype=torch.float32)
    ids = torch.empty(t, top_k, dtype=torch.int64)
    for i in range(t):
        row = logits[i].double()
        probs = torch.softmax(row, dim=-1) if scoring == "softmax" else 1.0 / (1.0 + torch.exp(-row))
        rank = probs + (correction_bias.double() if correction_bias is not None else 0.0)
        chosen = sorted(range(row.numel()), key=lambda e: -float(rank[e]))[:top_k]
        w = probs[chosen]
        if renormalize:
            w = w / w.sum()
        weights[i] = (w * scale).float()
        ids[i] = torch.tensor(chosen)
    return weights, ids


def grouped_gemm_ref(
    a: torch.Tensor, w: torch.Tensor, experts: torch.Tensor, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Row i of ``a`` [S, K] times expert ``experts[i]``'s matrix ``w`` [E, N, K] transposed, times
    ``scale[i]`` where given: [S, N] float32."""
    out = torch.einsum("sk,snk->sn", a.float(), w.float()[experts])
    return out if scale is None else out * scale.float()[:, None]


def fused_experts_ref(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = ids[t, j].

    x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; weights, ids [T, k] -> [T, H]."""
    t, k = ids.shape
    rows = x.float().repeat_interleave(k, dim=0)  # [T*k, H]: token t's row for each of its k experts
    flat = ids.reshape(-1)
    gate, up = grouped_gemm_ref(rows, w13, flat).chunk(2, dim=-1)
    y = grouped_gemm_ref(F.silu(gate) * up, w2, flat, weights.reshape(-1))
    return y.view(t, k, -1).sum(dim=1).to(x.dtype)
