"""Shared fixtures for the engine tests: the default model's converted directory and tiny random models."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from pagoda_testkit.native import cpu_variant  # noqa: F401 (a fixture: each CPU kernel variant)

torch.set_num_threads(2)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from pagoda.engine.loader import resolve_model

    return Path(resolve_model(None))


def make_tiny_model(tmp: Path, family: str, tokenizer_src: Path, seed: int = 0, **overrides) -> Path:
    """A random-weight HF checkpoint of one Llama-family architecture, saved as safetensors (``overrides``
    change the common config, e.g. num_key_value_heads=1)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )  # fmt: skip
    common.update(overrides)
    if family == "llama":
        cfg = transformers.LlamaConfig(
            **common,
            rope_theta=10000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64},
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(cfg)
    elif family == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=24)
        model = transformers.MistralForCausalLM(cfg)
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**{**common, "tie_word_embeddings": True})
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        raise ValueError(family)
    # Larger random weights than the default init so the logits are not flat and ties are rare.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    out = tmp / "-".join([family, *(f"{k}{v}" for k, v in sorted(overrides.items()))])
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_src / name).exists():
            shutil.copy(tokenizer_src / name, out / name)
    return out


@pytest.fixture
def tiny_model(tmp_path, default_model_dir):
    """A factory: tiny_model("llama" | "mistral" | "qwen2") -> checkpoint directory."""
    return lambda family, seed=0, **overrides: make_tiny_model(
        tmp_path, family, default_model_dir, seed, **overrides
    )


@pytest.fixture(scope="module")
def module_tiny_model(tmp_path_factory, default_model_dir):
    """tiny_model for module-scoped fixtures (a model several tests of one module share)."""
    tmp = tmp_path_factory.mktemp("tiny")
    return lambda family, seed=0, **overrides: make_tiny_model(
        tmp, family, default_model_dir, seed, **overrides
    )
