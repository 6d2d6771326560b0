"""The quantization scheme of a checkpoint, as the engine holds its weights, and its bytes per weight.

Pure Python (no torch): the planner and the operator size quantized checkpoints from it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Bytes of one block and weights in it, per ggml tensor type (llama.cpp's ggml-common.h block structs).
_GGUF_BLOCKS: dict[str, tuple[int, int]] = {
    "F32": (4, 1),
    "F16": (2, 1),
    "BF16": (2, 1),
    "Q8_0": (34, 32),
    "Q4_0": (18, 32),
    "Q4_1": (20, 32),
    "Q5_0": (22, 32),
    "Q5_1": (24, 32),
    "Q2_K": (84, 256),
    "Q3_K": (110, 256),
    "Q4_K": (144, 256),
    "Q5_K": (176, 256),
    "Q6_K": (210, 256),
    "Q8_K": (292, 256),
}

# Our fused linears and the checkpoint modules they hold, for `ignored` (a fused linear is unquantized only
# when all its parts are).
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


@dataclass(frozen=True)
class QuantScheme:
    """What the checkpoint's quantized linears are.

    ``group_size``: int4: 128, 32 ...; -1 = one group per output channel. fp8: 0 = per-tensor scale, -1 =
    per-channel, 128 = block-wise (with ``block``). ``ignore``: module names (or compressed-tensors' "re:"
    patterns) the checkpoint left unquantized, as its config says."""

    format: str  # "fp8" | "int4" | "gguf"
    source: str  # "compressed-tensors" | "gptq" | "awq" | "fp8" (vLLM/HF plain fp8) | "gguf"
    group_size: int = 0
    block: tuple[int, int] | None = None  # fp8 block-wise (rows, cols) of the weight
    symmetric: bool = True  # int4: no zero point
    act_dynamic: bool = True  # fp8: activations quantized per token at run time
    ignore: tuple[str, ...] = ()
    # gptq only: qzeros stored one below the zero point (the original GPTQ format; "gptq_v2" stores it as is)
    zero_offset: int = 0

    @property
    def label(self) -> str:
        """Short human name, e.g. "int4 (awq, group 128, asymmetric)", "fp8 (compressed-tensors, block
        128x128, dynamic activations)" for logs, plans and refusals."""
        if self.format == "gguf":
            return "gguf"
        if self.format == "int4":
            group = "per-channel" if self.group_size == -1 else f"group {self.group_size}"
            sym = "symmetric" if self.symmetric else "asymmetric"
            return f"int4 ({self.source}, {group}, {sym})"
        if self.block is not None:
            weights = f"block {self.block[0]}x{self.block[1]}"
        else:
            weights = "per-channel" if self.group_size == -1 else "per-tensor"
        acts = "dynamic activations" if self.act_dynamic else "static activations"
        return f"fp8 ({self.source}, {weights}, {acts})"


def weight_bits(scheme: QuantScheme | None, in_features: int = 4096, dense_bits: float = 16.0) -> float:
    """Bits per weight element of a quantized linear as the engine holds it on a GPU, scales and zero points
    included (``dense_bits`` for None: the caller's dtype). fp8 holds float32 scales (per-tensor ones
    expanded per row at load); int4 holds 16-bit scales and uint8 zero points per group. GGUF types vary per
    tensor: use `bits_per_weight_gguf`."""
    if scheme is None:
        return float(dense_bits)
    if scheme.format == "fp8":
        if scheme.block is not None:
            return 8.0 + 32.0 / (scheme.block[0] * scheme.block[1])
        return 8.0 + 32.0 / in_features  # one float32 scale per row
    if scheme.format == "int4":
        group = in_features if scheme.group_size in (-1, 0) else scheme.group_size
        return 4.0 + (16.0 + 8.0) / group
    if scheme.format == "gguf":
        raise ValueError("GGUF bits depend on each tensor's ggml type: use bits_per_weight_gguf(type)")
    raise ValueError(f"unknown quantization format {scheme.format!r}")


def bits_per_weight_gguf(ggml_type: str) -> float:
    """Bits per weight of a ggml tensor type by name ("Q4_K", "Q8_0", "F16" ...), block scales included."""
    try:
        nbytes, weights = _GGUF_BLOCKS[ggml_type.upper()]
    except KeyError:
        raise ValueError(f"unknown ggml type {ggml_type!r} ({', '.join(_GGUF_BLOCKS)})") from None
    return 8.0 * nbytes / weights


def ignored(scheme: QuantScheme | None, name: str) -> bool:
    """Whether the module ``name`` (e.g. "model.layers.0.self_attn.o_proj", "lm_head"; our fused
    "...qkv_proj" stands for its checkpoint parts) stays unquantized: no scheme, or the checkpoint's ignore
    list names it (exactly, as a dotted suffix, or by a "re:" pattern). A fused linear whose parts disagree is
    an error: it cannot be half quantized."""
    if scheme is None:
        return True
    stem, _, leaf = name.rpartition(".")
    parts = FUSED_PARTS.get(leaf)
    if parts is None:
        return _listed(scheme.ignore, name)
    verdicts = {_listed(scheme.ignore, f"{stem}.{p}" if stem else p) for p in parts}
    if len(verdicts) > 1:
        raise ValueError(f"{name}: the checkpoint quantizes some of {', '.join(parts)} and not the others")
    return verdicts.pop()


def _listed(patterns: tuple[str, ...], name: str) -> bool:
    bare = name.removeprefix("model.")
    for p in patterns:
        if p.startswith("re:"):
            if re.fullmatch(p[3:], name) or re.fullmatch(p[3:], bare):
                return True
        elif name == p or bare == p or name.endswith("." + p) or p.endswith("." + bare):
            return True
    return False
