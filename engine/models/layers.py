"""Building blocks of Llama-family decoders: RMSNorm, rotary embeddings (and their scalings), SiLU MLP,
uninitialised linears, the final touches on logits.

Parameters are allocated with `torch.empty` (no random init): weights always come from a checkpoint, and
initialising a billion parameters only to overwrite them costs seconds.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from pagoda.engine.distributed.parallel_state import all_reduce, shard_range, tp_rank, tp_size
from pagoda.engine.models import cpu_linear, cpu_ops
from pagoda.engine.quantization.linear import quantized_linear
from pagoda.engine.quantization.scheme import QuantScheme, ignored
from torch import nn

if TYPE_CHECKING:
    from pagoda.engine.sizing.model_config import ModelConfig


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
        y = cpu_linear.step_linear(x, self.weight, self.bias, self.packed)
        if self.lora is not None:
            self.lora.apply(x, y)
        return y


def make_linear(
    in_features: int,
    out_features: int,
    bias: bool,
    dtype: torch.dtype,
    device: torch.device,
    scheme: QuantScheme | None,
    name: str,
) -> nn.Module:
    """The linear a checkpoint's module needs: a dense `Linear` without a scheme or where the checkpoint left
    ``name`` unquantized (its ignore list), else the quantized linear of the scheme's format
    (engine/quantization/linear.py)."""
    if ignored(scheme, name):
        return Linear(in_features, out_features, bias, dtype, device)
    return quantized_linear(in_features, out_features, bias, dtype, device, scheme)


def dequantize_linears(model: nn.Module) -> int:
    """On the CPU, swap each FP8 / INT4 linear for a dense `Linear` over its weights dequantized once to the
    compute dtype (the CPU's dense path, its oneDNN packing included, runs them); returns how many. GGUF
    linears stay quantized (their own CPU kernels), and so do linears on the Triton path (the interpreter
    runs the GPU kernels)."""
    swaps = [
        (parent, child_name, child)
        for parent in model.modules()
        for child_name, child in parent.named_children()
        if getattr(child, "dense_on_cpu", False)
        and not getattr(child, "triton", False)
        and next(child.parameters()).device.type == "cpu"
    ]
    for parent, child_name, q in swaps:
        dense = Linear(q.in_features, q.out_features, q.bias is not None, q.dtype, torch.device("cpu"))
        dense.weight.data = q.dequantize(q.dtype)
        if q.bias is not None:
            dense.bias.data = q.bias.data
        dense.lora = q.lora
        setattr(parent, child_name, dense)
    return len(swaps)


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
    ``triton``: silu-and-mul is one Triton launch (the GPU path, see RMSNorm). ``scheme``/``prefix``: a
    quantized checkpoint's scheme and the MLP's module name (`make_linear`)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        triton: bool = False,
        scheme: QuantScheme | None = None,
        prefix: str = "mlp",
    ):
        super().__init__()
        lo, hi = shard_range(intermediate)
        self.intermediate = hi - lo
        self.gate_up_proj = make_linear(
            hidden, 2 * self.intermediate, bias, dtype, device, scheme, f"{prefix}.gate_up_proj"
        )
        self.down_proj = make_linear(
            self.intermediate, hidden, bias and tp_rank() == 0, dtype, device, scheme, f"{prefix}.down_proj"
        )
        self.triton = triton

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)  # (.forward: see Attention.forward)
        if self.triton:
            from pagoda.kernels.activation import silu_mul

            return all_reduce(self.down_proj(silu_mul(gate_up)))
        act = cpu_ops.silu_mul(gate_up)
        if act is None:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            act = F.silu(gate) * up
        return all_reduce(self.down_proj.forward(act))


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


def rotary_dim(head_dim: int, partial_rotary_factor: float = 1.0) -> int:
    """How many leading dims of a head rotate (Phi-4-mini rotates 3/4 of them; the rest pass through)."""
    return int(head_dim * partial_rotary_factor)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies (float32) with the config's scaling applied (see `rope_frequencies`)."""
    return rope_frequencies(head_dim, theta, scaling)[0]


def longrope_uses_long(scaling: dict, max_model_len: int | None) -> bool:
    """LongRoPE's choice of factor set, made once per engine: the long factors when the engine may run
    sequences past the pretraining length (its max_model_len, else the model's), the short ones otherwise.

    transformers switches per forward call on the batch's longest position instead, so a sequence's rotary
    there depends on what runs beside it and changes once it passes the pretraining length (its earlier keys
    stay rotated the short way). Here every sequence of one engine rotates the same way: an engine that serves
    128k contexts uses the long factors for short prompts too (vLLM decides the same way); one started with
    --max-model-len at most original_max_position_embeddings matches transformers exactly."""
    original = int(scaling["original_max_position_embeddings"])
    return max_model_len is not None and max_model_len > original


def rope_frequencies(
    dim: int,
    theta: float,
    scaling: dict | None,
    max_positions: int | None = None,
    max_model_len: int | None = None,
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies of the ``dim`` rotated dims (float32), factor on cos and sin).

    Scalings: linear, llama3, yarn, longrope (``max_positions``: config.json's max_position_embeddings, which
    sets yarn's and LongRoPE's factor where the scaling gives none; ``max_model_len``: see
    `longrope_uses_long`)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (theta**exponents)
    if not scaling:
        return inv_freq, 1.0
    kind = scaling.get("rope_type")
    original = scaling.get("original_max_position_embeddings") or max_positions
    factor = scaling.get("factor")
    if factor is None and kind in ("yarn", "longrope") and original and max_positions:
        factor = max_positions / original
    factor = float(factor if factor is not None else 1.0)
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, factor, scaling), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, factor, int(original), scaling)
    if kind == "longrope":
        use_long = longrope_uses_long(
            {"original_max_position_embeddings": original},
            max_positions if max_model_len is None else max_model_len,
        )
        ext = torch.tensor(scaling["long_factor" if use_long else "short_factor"], dtype=torch.float32)
        if ext.shape != inv_freq.shape:
            raise ValueError(
                f"longrope factors have {ext.numel()} entries, the rotary {dim // 2} frequencies"
            )
        attention = scaling.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return 1.0 / (ext * theta**exponents), float(attention)
    raise ValueError(f"rope_scaling type {kind!r} is not supported")


def _llama3_inv_freq(inv_freq: torch.Tensor, factor: float, scaling: dict) -> torch.Tensor:
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


def _yarn(dim: int, theta: float, factor: float, original: int, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN: dims that turn fewer than beta_slow times over the pretraining length are interpolated by
    `factor`, those turning more than beta_fast times kept, a linear ramp between; cos/sin grow by
    0.1 ln(factor) + 1 (or the config's attention_factor / mscale ratio)."""

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times over the original length
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate (slowed by factor)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention)


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embeddings from a cos/sin table indexed by absolute positions.

    The table grows on demand (doubling) up to what a step needs, so a 128k-context config does not
    allocate a 128k-row table to serve short prompts. ``head_dim`` is the width of the rotated part (the
    whole head unless the config sets partial_rotary_factor); a scaling's attention factor (yarn, LongRoPE)
    is folded into the table; ``max_model_len`` picks LongRoPE's factor set (`longrope_uses_long`).
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict | None,
        max_positions: int,
        device: torch.device,
        max_model_len: int | None = None,
    ):
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        inv_freq, self.attention_factor = rope_frequencies(
            head_dim, theta, scaling, max_positions, max_model_len
        )
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
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
        if self.attention_factor != 1.0:
            self._cos, self._sin = self._cos * self.attention_factor, self._sin * self.attention_factor
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
        scale = self.attention_factor
        cos = torch.where(inside[:, None], cos_t[at], (emb.cos().float() * scale).to(dtype))
        sin = torch.where(inside[:, None], sin_t[at], (emb.sin().float() * scale).to(dtype))
        return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, 1, rotary_dim]: the first rotary_dim dims of each head rotate,
    the others pass through (partial rotary)."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def finish_logits(logits: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """The config's last touches on float32 logits: divided by logits_scaling (Granite), then soft-capped
    c * tanh(x / c) by final_logit_softcapping (Gemma 2); the logits unchanged where neither is set."""
    if config.logits_scaling != 1.0:
        logits = logits / config.logits_scaling
    cap = config.final_logit_softcapping
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits
