"""GGUF's quantized blocks decoded in float64 with torch: the reference the C kernels of
kernels/cpu/quant_gguf.c are tested against, and the one place here that spells out each block layout.

Every scale is a float16 (exact in float64) times small integers, so float64 holds each weight exactly; the
float32 values the gguf package and the kernels use differ from these by at most one rounding.

A weight of N rows and K columns is a uint8 tensor [N, K / block_elems * block_bytes]: each row a run of
blocks, as a GGUF file stores it.
"""

from __future__ import annotations

import torch

# ggml type numbers (gguf.GGMLQuantizationType)
Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K = 2, 3, 6, 8, 12, 14
# type -> (weights per block, bytes per block)
BLOCKS: dict[int, tuple[int, int]] = {
    Q4_0: (32, 18),
    Q4_1: (32, 20),
    Q5_0: (32, 22),
    Q8_0: (32, 34),
    Q4_K: (256, 144),
    Q6_K: (256, 210),
}
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q8_0: "Q8_0", Q4_K: "Q4_K", Q6_K: "Q6_K"}


def row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of one weight row of ``k`` elements; ValueError for a type without blocks here or a ragged K."""
    if ggml_type not in BLOCKS:
        raise ValueError(f"no GGUF block layout for ggml type {ggml_type}")
    qk, nbytes = BLOCKS[ggml_type]
    if k % qk:
        raise ValueError(f"{NAMES[ggml_type]} rows hold multiples of {qk} weights, not {k}")
    return k // qk * nbytes


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 from the last dimension's two bytes, as float64."""
    return b.contiguous().view(torch.float16).to(torch.float64).squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 values: the low nibbles first, then the high ones (Q4_0 / Q4_1 / Q5_0 order)."""
    return torch.cat([qs & 15, qs >> 4], dim=-1).to(torch.float64)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2])[:, None] * b[:, 2:].contiguous().view(torch.int8).to(torch.float64)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2])[:, None] * (_nibbles(b[:, 2:]) - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2])[:, None] * _nibbles(b[:, 4:]) + _f16(b[:, 2:4])[:, None]


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    qh = b[:, 2:6].to(torch.int64)
    bits = (qh[:, 0] | qh[:, 1] << 8 | qh[:, 2] << 16 | qh[:, 3] << 24)[:, None] >> torch.arange(32)
    return _f16(b[:, :2])[:, None] * (_nibbles(b[:, 6:]) + 16 * (bits & 1).to(torch.float64) - 16)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, :2])[:, None], _f16(b[:, 2:4])[:, None]
    s = b[:, 4:16].to(torch.int64)
    # sub-blocks 0-3: six bits of bytes 0-3 (scales) and 4-7 (mins); 4-7: a nibble of bytes 8-11 and the top
    # two bits of bytes 0-3 (scales) / 4-7 (mins)
    sc = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 15) | (s[:, 0:4] >> 6) << 4], dim=1)
    mn = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | (s[:, 4:8] >> 6) << 4], dim=1)
    qs = b[:, 16:].reshape(n, 4, 32)
    q = torch.stack([qs & 15, qs >> 4], dim=2).reshape(n, 8, 32).to(torch.float64)  # sub-block 2g, 2g + 1
    return ((d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 64).to(torch.int64)
    qh = b[:, 128:192].reshape(n, 2, 32).to(torch.int64)
    sc = b[:, 192:208].contiguous().view(torch.int8).to(torch.float64)
    d = _f16(b[:, 208:210])[:, None]
    lo = torch.cat([ql & 15, ql >> 4], dim=2)  # [n, 2, 128]: positions 0-63 low nibbles, 64-127 high
    hi = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=2)  # positions 32 j + l: bits 2j of byte l
    q = (lo | hi << 4).reshape(n, 256).to(torch.float64) - 32
    return (d * sc).repeat_interleave(16, dim=1) * q


_DECODERS = {Q8_0: _q8_0, Q4_0: _q4_0, Q4_1: _q4_1, Q5_0: _q5_0, Q4_K: _q4_k, Q6_K: _q6_k}


def dequantize_gguf(blocks: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """uint8 blocks [N, row_bytes] -> the weight as float64 [N, k]."""
    nbytes = row_bytes(ggml_type, k)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != nbytes:
        raise ValueError(
            f"expected uint8 [N, {nbytes}] {NAMES[ggml_type]} blocks, got {blocks.dtype} {tuple(blocks.shape)}"
        )
    qk, bb = BLOCKS[ggml_type]
    n = blocks.shape[0]
    flat = blocks.reshape(n * (k // qk), bb)
    return _DECODERS[ggml_type](flat).reshape(n, k)
