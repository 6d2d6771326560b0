"""Model implementations: Llama-family decoders over a paged KV cache."""

from __future__ import annotations

from pagoda.engine.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from pagoda.engine.models.llama import LlamaForCausalLM


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    """Llama, Mistral, Qwen2 and SmolLM share one implementation; the config switches their differences."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return LlamaForCausalLM


__all__ = ["ModelConfig", "LlamaForCausalLM", "get_model_class", "SUPPORTED_ARCHITECTURES"]
