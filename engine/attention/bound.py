"""An attention backend with some of its keyword arguments fixed for every call.

The Llama attention block calls its backend with scale and window only; a family whose attention needs more
(Gemma 2's soft-cap, gpt-oss's learned sinks) wraps its layers' backend in one of these instead of a block of
its own.
"""

from __future__ import annotations

from typing import Any

import torch
from pagoda.engine.attention.base import AttentionBackend, AttentionMetadata, LayerKVCache


class BoundBackend:
    def __init__(self, backend: AttentionBackend, **fixed: Any):
        self.backend = backend
        self.fixed = fixed
        self.name = getattr(backend, "name", None)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        return self.backend.forward(q, k, v, cache, meta, scale, sliding_window, **self.fixed)
