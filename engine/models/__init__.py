"""Model implementations: Llama-family decoders over a paged KV cache."""

from __future__ import annotations

import importlib

from pagoda.engine.models.llama import LlamaForCausalLM
from pagoda.engine.sizing.architectures import SUPPORTED_ARCHITECTURES, architecture
from pagoda.engine.sizing.model_config import ModelConfig


def get_model_class(name: str) -> type:
    """The class that builds an architecture, as its entry in the architecture table names it (Llama,
    Mistral, Qwen2 and SmolLM share one implementation; the config switches their differences)."""
    entry = architecture(name)
    return getattr(importlib.import_module(f"{__name__}.{entry.module}"), entry.model_class)


__all__ = ["ModelConfig", "LlamaForCausalLM", "get_model_class", "SUPPORTED_ARCHITECTURES"]
