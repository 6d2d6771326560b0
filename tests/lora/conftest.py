"""Shared fixtures of the LoRA tests: PEFT adapters of several ranks and targets for the default model (made
once per session with peft), the transformers + peft model that runs them, and one engine serving them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pagoda_testkit.lora import AdapterSpec, make_peft_adapter, peft_reference

torch.set_num_threads(2)

SPECS = (
    AdapterSpec("alpha", rank=4, targets=("q_proj", "v_proj"), seed=1, std=0.2),
    AdapterSpec("beta", rank=8, seed=2),
    AdapterSpec("gamma", rank=16, targets=("o_proj", "up_proj", "down_proj"), seed=3, use_rslora=True),
)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from pagoda.engine.loader import resolve_model

    return Path(resolve_model(None))


@pytest.fixture(scope="session")
def adapters(tmp_path_factory, default_model_dir) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("lora")
    return {spec.name: make_peft_adapter(default_model_dir, out, spec) for spec in SPECS}


@pytest.fixture(scope="session")
def reference(default_model_dir, adapters):
    return peft_reference(default_model_dir, adapters)


@pytest.fixture(scope="session")
def lora_llm(adapters):
    """The default model with the three adapters and two slots (so a batch of all three swaps)."""
    from pagoda.engine import LLM

    return LLM(
        dtype="float32",
        device="cpu",
        kv_cache_memory_bytes=64 << 20,
        max_model_len=256,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        lora_modules=[f"{name}={path}" for name, path in adapters.items()],
    )
