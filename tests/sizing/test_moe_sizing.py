"""Sizing mixture-of-experts models: every expert's bytes for memory, the chosen experts' for speed."""

from __future__ import annotations

import pytest
from pagoda.engine.sizing import shape_from_config
from pagoda.engine.sizing.model_config import ModelConfig
from pagoda.engine.sizing.shapes import estimate_num_params, well_known_config, well_known_shape

# Model cards: Qwen3-30B-A3B 30.5B total, 3.3B activated; Mixtral-8x7B 46.7B total, 12.9B active per token.
PUBLISHED = {"Qwen3-30B-A3B": (30.53, 3.35), "Mixtral-8x7B": (46.70, 12.88)}
HUB_IDS = {
    "Qwen/Qwen3-30B-A3B": "Qwen3-30B-A3B",
    "Qwen/Qwen3-30B-A3B-Base": "Qwen3-30B-A3B",
    "mistralai/Mixtral-8x7B-v0.1": "Mixtral-8x7B",
    "mistralai/Mixtral-8x7B-Instruct-v0.1": "Mixtral-8x7B",
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_catalogue_counts_every_expert_for_memory_and_the_chosen_ones_for_speed(name: str) -> None:
    total, active = PUBLISHED[name]
    shape = well_known_shape(name)
    assert shape is not None and shape.num_experts > 0
    assert shape.num_params / 1e9 == pytest.approx(total, rel=2e-3)
    assert shape.weight_bytes == 2 * shape.num_params
    assert shape.active_params / 1e9 == pytest.approx(active, rel=5e-3)


def test_hub_ids_name_the_moe_rows() -> None:
    for hub_id, name in HUB_IDS.items():
        shape = well_known_shape(hub_id)
        assert shape is not None and shape.name == name, hub_id


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_catalogue_config_is_what_the_engine_reads(name: str) -> None:
    """The catalogue's config.json, read by the engine's strict reader, and sized back to the same shape."""
    config = well_known_config(name)
    cfg = ModelConfig.from_hf_config(config)
    shape = well_known_shape(name)
    assert cfg.architecture == shape.architecture and cfg.num_experts == shape.num_experts
    assert cfg.num_experts_per_tok == shape.experts_per_token and cfg.norm_topk_prob
    again = shape_from_config(config)
    assert again.num_params == shape.num_params and again.active_params == shape.active_params


def test_dense_layers_of_a_sparse_model_count_as_dense() -> None:
    """mlp_only_layers (Qwen3-MoE): those layers have one MLP of intermediate_size, not experts."""
    base = {
        "model_type": "qwen3_moe", "num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 64,
        "vocab_size": 100, "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8,
        "num_experts_per_tok": 2,
    }  # fmt: skip
    all_sparse = shape_from_config(base)
    one_dense = shape_from_config({**base, "mlp_only_layers": [1]})
    experts_mlp = 8 * 3 * 64 * 32 + 8 * 64  # experts and router
    assert all_sparse.num_params - one_dense.num_params == experts_mlp - 3 * 64 * 96
    dense = estimate_num_params(
        num_layers=4, num_attention_heads=4, num_kv_heads=4, head_dim=16, hidden_size=64,
        intermediate_size=96, vocab_size=100,
    )  # fmt: skip
    assert all_sparse.num_params == dense + 4 * (experts_mlp - 3 * 64 * 96)
    assert all_sparse.active_params == all_sparse.num_params - 4 * 6 * 3 * 64 * 32
