"""A loader pass: the quantized linears' checkpoint tensors (GPTQ, AWQ, compressed-tensors, FP8) in the
canonical layouts and names of engine/quantization/packing.py, before the model maps names to parameters.

Each tensor converts on its own (a checkpoint's shards may hold a module's tensors in any order), except a
quantized LM head: the model keeps its head dense, so its tensors are gathered and dequantized to the compute
dtype. A GPTQ / compressed-tensors g_idx in group order is dropped; an act-order one (desc_act, actorder
"group") goes to the linear, which sorts its columns by group once loaded (Int4Linear.finish_loading).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from pagoda.engine.quantization import packing
from pagoda.engine.quantization.scheme import QuantScheme

# AWQ (GEMM) packs 8 output columns per int32 in this order: nibble i holds column ORDER[i] of its eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_int32_nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 [..] with eight 4-bit values per word, nibble i = bits 4i..4i+3, unpacked along ``dim``
    (0: each word holds 8 consecutive rows; 1: 8 consecutive columns) -> uint8 values 0..15."""
    nibbles = (packed.to(torch.int32).unsqueeze(-1) >> _SHIFTS) & 0xF  # [R, C, 8]
    if dim == 1:
        return nibbles.reshape(packed.shape[0], -1).to(torch.uint8)
    return nibbles.permute(0, 2, 1).reshape(-1, packed.shape[1]).to(torch.uint8)


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's int32 [R, C / 8] -> uint8 [R, C] in column order."""
    nib = unpack_int32_nibbles(packed, 1).reshape(packed.shape[0], -1, 8)
    order = torch.tensor(AWQ_ORDER)
    out = torch.empty_like(nib)
    out[:, :, order] = nib
    return out.reshape(packed.shape[0], -1)


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
                return "qweight", packing.pack_int4(unpack_int32_nibbles(t, 0).T)
            if kind == "qzeros":  # [G, N / 8]; the original format stores zero - 1
                z = (unpack_int32_nibbles(t, 1) + s.zero_offset) & 0xF
                return "zeros", z.T.contiguous()
            if kind == "scales":
                return "scales", t.T.contiguous()
            if kind == "g_idx":
                return _g_idx(t, s.group_size)
            return kind, t
        if s.source == "awq":
            if kind == "qweight":  # [K, N / 8]
                return "qweight", packing.pack_int4(_awq_columns(t).T)
            if kind == "qzeros":
                return "zeros", _awq_columns(t).T.contiguous()
            if kind == "scales":
                return "scales", t.T.contiguous()
            return kind, t
        # compressed-tensors pack-quantized: signed values stored +8, so the nibbles are already 0..15
        if kind == "weight_packed":  # [N, K / 8]
            return "qweight", packing.pack_int4(unpack_int32_nibbles(t, 1))
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
