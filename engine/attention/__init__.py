"""Attention backends over the paged KV layout of `base.py`: `torch` (CPU, reference) and `triton` (GPU)."""

from __future__ import annotations

import torch
from pagoda.engine.attention.base import AttentionBackend, AttentionMetadata, LayerKVCache

BACKENDS = ("auto", "torch", "triton")


def get_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """`auto` picks triton on CUDA and torch elsewhere."""
    device = torch.device(device)
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from pagoda.engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    from pagoda.engine.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


__all__ = ["AttentionBackend", "AttentionMetadata", "LayerKVCache", "get_attention_backend", "BACKENDS"]
