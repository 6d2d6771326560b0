"""Building blocks of Llama-family decoders: RMSNorm, rotary embeddings, SiLU MLP, uninitialised linears.

Parameters are allocated with `torch.empty` (no random init): weights always come from a checkpoint, and
initialising a billion parameters only to overwrite them costs seconds.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pagoda.engine.distributed.parallel_state import all_reduce, shard_range, tp_rank, tp_size
from pagoda.engine.models import cpu_linear, cpu_ops
from torch import nn


class Linear(nn.Module):
    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device), False)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), False) if bias else None
        )
        self.packed = cpu_linear.PackedWeight()
        self.lora = None  # pagoda.engine.lora.layers.LoRALinear when the engine serves LoRA adapters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = cpu_linear.linear(x, self.weight, self.bias, self.packed)
        if self.lora is not None:
            self.lora.apply(x, y)
        return y


class RMSNorm(nn.Module):
    """Normalises in float32 and scales in the activation dtype, as the reference checkpoints were trained.

    ``triton``: the model runs the Triton attention backend (the GPU path), and the norm (with the residual
    add) is one Triton launch (pagoda.kernels.rms_norm); otherwise the CPU's C kernel or torch."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device, triton: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device), False)
        self.eps = eps
        self.triton = triton

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.triton:
            from pagoda.kernels.rms_norm import add_rms_norm

            return add_rms_norm(x, None, self.weight, self.eps)
        fused = cpu_ops.add_rms_norm(x, None, self.weight, self.eps)
        return fused if fused is not None else self._torch(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(residual + x), residual + x): the residual add fused with the next norm. The residual
        tensor may be updated in place."""
        if self.triton:
            from pagoda.kernels.rms_norm import add_rms_norm

            return add_rms_norm(x, residual, self.weight, self.eps), residual
        fused = cpu_ops.add_rms_norm(x, residual, self.weight, self.eps)
        if fused is not None:
            return fused, residual
        residual = residual + x
        return self._torch(residual), residual

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class SiluMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul.

    Under tensor parallelism each rank holds a slice of the intermediate dimension (gate/up column-parallel,
    down row-parallel): the partial outputs are summed over the ranks and down's bias lives on rank 0.
    ``triton``: silu-and-mul is one Triton launch (the GPU path, see RMSNorm)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        triton: bool = False,
    ):
        super().__init__()
        lo, hi = shard_range(intermediate)
        self.intermediate = hi - lo
        self.gate_up_proj = Linear(hidden, 2 * self.intermediate, bias, dtype, device)
        self.down_proj = Linear(self.intermediate, hidden, bias and tp_rank() == 0, dtype, device)
        self.triton = triton

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.triton:
            from pagoda.kernels.activation import silu_mul

            return all_reduce(self.down_proj(silu_mul(gate_up)))
        act = cpu_ops.silu_mul(gate_up)
        if act is None:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            act = F.silu(gate) * up
        return all_reduce(self.down_proj(act))


class VocabParallelEmbedding(nn.Module):
    """Token embeddings, each tensor-parallel rank holding an equal slice of the vocabulary's rows."""

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.vocab_start, self.vocab_end = shard_range(vocab)
        rows = self.vocab_end - self.vocab_start
        self.weight = nn.Parameter(torch.empty(rows, hidden, dtype=dtype, device=device), False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(mine, ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(out)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies (float32), with llama3 or linear scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type")
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_len / low
        high_freq_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported")


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embeddings from a cos/sin table indexed by absolute positions.

    The table grows on demand (doubling) up to what a step needs, so a 128k-context config does not
    allocate a 128k-row table to serve short prompts.
    """

    def __init__(
        self, head_dim: int, theta: float, scaling: dict | None, max_positions: int, device: torch.device
    ):
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling).to(device), persistent=False)
        self._cos = torch.empty(0, head_dim, device=device)
        self._sin = torch.empty(0, head_dim, device=device)
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def _ensure(self, n: int) -> None:
        if n <= self._cos.shape[0]:
            return
        size = max(n, min(max(4096, 2 * self._cos.shape[0]), max(self.max_positions, n)))
        pos = torch.arange(size, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = emb.cos(), emb.sin()
        self._cast = {}

    def cos_sin(self, positions: torch.Tensor, max_position: int, dtype: torch.dtype):
        """cos, sin [T, 1, head_dim] of ``positions`` (``max_position``: their largest, known on the host)."""
        if max_position >= self.max_positions:
            return self._cos_sin_past_table(positions, dtype)
        self._ensure(max_position + 1)
        cos, sin = self._table(dtype)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    def _table(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype not in self._cast:
            self._cast[dtype] = (self._cos.to(dtype), self._sin.to(dtype))
        return self._cast[dtype]

    def _cos_sin_past_table(self, positions: torch.Tensor, dtype: torch.dtype):
        """Positions past the model's trained length come only from attention sinks, whose positions go on
        counting past evicted tokens (relative distances stay within the cache). Those rows are computed,
        in float64 reduced modulo 2 pi (a float32 product loses the angle's fraction there), so the table
        stays bounded; the rows below still come from the table, so a sequence's rotary does not depend on
        what else is in its batch."""
        self._ensure(self.max_positions)
        inside = positions < self.max_positions
        cos_t, sin_t = self._table(dtype)
        at = positions.clamp(max=self.max_positions - 1)
        freqs = torch.remainder(positions.double()[:, None] * self.inv_freq.double()[None, :], 2 * math.pi)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = torch.where(inside[:, None], cos_t[at], emb.cos().float().to(dtype))
        sin = torch.where(inside[:, None], sin_t[at], emb.sin().float().to(dtype))
        return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
