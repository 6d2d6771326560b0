"""A loader pass: the quantized linears' checkpoint tensors (GPTQ, AWQ, compressed-tensors, FP8) in the
canonical layouts and names of engine/quantization/packing.py, before the model maps names to parameters.

Each tensor converts on its own (a checkpoint's shards may hold a module's tensors in any order), except a
quantized LM head: the model keeps its head dense, so its tensors are gathered and dequantized to the compute
dtype. A GPTQ / compressed-tensors g_idx in group order is dropped; an act-order one (desc_act, actorder
"group") goes to the linear, which sorts its columns by group once loaded (Int4Linear.finish_loading).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator

import torch
from pagoda.engine.quantization import packing
from pagoda.engine.quantization.scheme import QuantScheme

# AWQ (GEMM) packs 8 output columns per int32 in this order: nibble i holds column ORDER[i] of its eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Every format here packs nibble i of a word in bits 4i..4i+3, so on a little-endian host a word's bytes hold
# nibbles (0, 1), (2, 3), (4, 5), (6, 7), low nibble first: the canonical uint8 pairs. Converting reads bytes.
assert sys.byteorder == "little", "the INT4 converters read int32 words as their little-endian bytes"


def int32_bytes(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, 4C]: each word's bytes, the first holding nibbles 0 (low) and 1 (high)."""
    return packed.to(torch.int32).contiguous().view(torch.uint8)


def unpack_int32_nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 [..] with eight 4-bit values per word, nibble i = bits 4i..4i+3, unpacked along ``dim``
    (0: each word holds 8 consecutive rows; 1: 8 consecutive columns) -> uint8 values 0..15."""
    if dim == 0:
        return unpack_int32_nibbles(packed.T, 1).T.contiguous()
    return packing.unpack_int4(int32_bytes(packed))


def _canonical_from_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [K / 8, N], 8 input rows per word (GPTQ's qweight) -> canonical uint8 [N, K / 2]: the transposed
    words' bytes are already the canonical pairs."""
    return int32_bytes(packed.T)


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's int32 [R, C / 8] -> uint8 [R, C] in column order."""
    nib = unpack_int32_nibbles(packed, 1).reshape(packed.shape[0], -1, 8)
    return nib[:, :, list(_AWQ_INVERSE)].reshape(packed.shape[0], -1)


_AWQ_INVERSE = tuple(AWQ_ORDER.index(c) for c in range(8))  # column c sits in nibble _AWQ_INVERSE[c]


def _g_idx(g_idx: torch.Tensor, group_size: int) -> tuple[str, torch.Tensor] | None:
    """An act-order g_idx (columns not in group order) for the linear to sort by; None (dropped) in order."""
    k = g_idx.numel()
    expected = torch.zeros(k, dtype=torch.int64) if group_size <= 0 else torch.arange(k) // group_size
    g_idx = g_idx.to(torch.int64)
    return None if torch.equal(g_idx, expected) else ("g_idx", g_idx)


class _Converter:
    def __init__(self, scheme: QuantScheme, dtype: torch.dtype):
        self.scheme = scheme
        self.dtype = dtype

    def __call__(self, stem: str, kind: str, t: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """(canonical kind, tensor), or None to drop the tensor."""
        s = self.scheme
        if s.format == "fp8":
            if kind == "weight" and t.dtype == torch.float8_e4m3fn:
                return "weight", t
            if kind in ("weight_scale", "weight_scale_inv"):
                return "weight_scale", t.float().reshape(-1) if s.block is None else t.float()
            if kind == "input_scale":
                return None  # activations are quantized per token at run time
            if kind == "weight" and t.dtype.is_floating_point and t.element_size() == 1:
                raise ValueError(f"{stem}.weight: FP8 format {t.dtype} (float8_e4m3fn is supported)")
            return kind, t
        if s.source == "gptq":
            if kind == "qweight":  # [K / 8, N], 8 rows (input features) per word
                return "qweight", _canonical_from_rows(t)
            if kind == "qzeros":  # [G, N / 8]; the original format stores zero - 1
                z = (unpack_int32_nibbles(t, 1) + s.zero_offset) & 0xF
                return "zeros", z.T.contiguous()
            if kind == "scales":
                return "scales", t.T.contiguous()
            if kind == "g_idx":
                return _g_idx(t, s.group_size)
            return kind, t
        if s.source == "awq":
            if kind == "qweight":  # [K, N / 8]: input rows paired (2j, 2j + 1) into bytes, then transposed
                q = _awq_columns(t)
                return "qweight", (q[0::2] | (q[1::2] << 4)).T.contiguous()
            if kind == "qzeros":
                return "zeros", _awq_columns(t).T.contiguous()
            if kind == "scales":
                return "scales", t.T.contiguous()
            return kind, t
        # compressed-tensors pack-quantized: signed values stored +8, so the nibbles are already 0..15
        if kind == "weight_packed":  # [N, K / 8]: its bytes are the canonical pairs
            return "qweight", int32_bytes(t)
        if kind == "weight_scale":
            return "scales", t
        if kind == "weight_zero_point":
            if t.dtype == torch.int32:  # packed along the output rows
                return "zeros", unpack_int32_nibbles(t, 0)
            return "zeros", (t.to(torch.int16) + 8).to(torch.uint8)
        if kind == "weight_g_idx":
            return _g_idx(t, s.group_size)
        if kind == "weight_shape":
            return None
        return kind, t


_QUANT_KINDS = {
    "qweight",
    "qzeros",
    "scales",
    "g_idx",
    "weight_packed",
    "weight_scale",
    "weight_scale_inv",
    "weight_zero_point",
    "weight_g_idx",
    "weight_shape",
    "input_scale",
}


# Attention's static scales in checkpoints quantized with a KV-cache scheme (llm-compressor's FP8 KV, vLLM).
_KV_CACHE_SCALES = frozenset({"k_scale", "v_scale", "q_scale", "prob_scale"})


def canonical_tensors(
    weights: Iterable[tuple[str, torch.Tensor]], scheme: QuantScheme, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a quantized checkpoint with its quantized linears' tensors converted to the canonical
    layouts (names: qweight, scales, zeros / weight, weight_scale); a quantized lm_head dequantized to
    ``dtype`` as `lm_head.weight`; every other tensor as it was."""
    convert = _Converter(scheme, dtype)
    head: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        stem, _, kind = name.rpartition(".")
        if kind in _KV_CACHE_SCALES:
            continue  # a checkpoint's static KV-cache scales: the engine's KV cache dtype is its own setting
        if stem.endswith("lm_head") and (kind in _QUANT_KINDS or tensor.dtype == torch.float8_e4m3fn):
            out = convert(stem, kind, tensor)
            if out is not None:
                head[out[0]] = out[1]
            continue
        out = convert(stem, kind, tensor)
        if out is not None:
            yield f"{stem}.{out[0]}", out[1]
    if head:
        yield "lm_head.weight", _dequantized_head(head, scheme, dtype)


def _dequantized_head(
    parts: dict[str, torch.Tensor], scheme: QuantScheme, dtype: torch.dtype
) -> torch.Tensor:
    if scheme.format == "fp8":
        if "weight" not in parts or "weight_scale" not in parts:
            raise ValueError("checkpoint's quantized lm_head lacks its weight or weight_scale")
        return packing.dequantize_fp8(parts["weight"], parts["weight_scale"], scheme.block, dtype)
    if "qweight" not in parts or "scales" not in parts:
        raise ValueError("checkpoint's quantized lm_head lacks its packed weight or scales")
    zeros = parts.get("zeros")
    if zeros is None:
        zeros = torch.full(parts["scales"].shape, 8, dtype=torch.uint8)
    if "g_idx" in parts:  # act-order: each column's own group
        q = packing.unpack_int4(parts["qweight"]).float()
        g = parts["g_idx"]
        return ((q - zeros.float()[:, g]) * parts["scales"].float()[:, g]).to(dtype)
    return packing.dequantize_int4(parts["qweight"], parts["scales"], zeros, dtype)
