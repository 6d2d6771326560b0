"""PEFT adapter directories: what is read (safetensors only, the PEFT scale rules) and what is refused, with
a message that names the problem."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from pagoda.engine.lora import AdapterError, LoRARegistry, ModuleShape, load_adapter
from safetensors.torch import save_file

SHAPES = {
    "q_proj": ModuleShape(8, 8),
    "k_proj": ModuleShape(8, 4),
    "v_proj": ModuleShape(8, 4),
    "o_proj": ModuleShape(8, 8),
    "gate_proj": ModuleShape(8, 16),
    "up_proj": ModuleShape(8, 16),
    "down_proj": ModuleShape(16, 8),
}
LAYERS = 2


def write_adapter(path: Path, config: dict | None = None, tensors: dict | None = None, r: int = 2) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": 4,
        "target_modules": ["q_proj", "down_proj"],
        "bias": "none",
    }
    cfg.update(config or {})
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is None:
        tensors = {}
        for layer in range(LAYERS):
            for parent, module in (("self_attn", "q_proj"), ("mlp", "down_proj")):
                shape = SHAPES[module]
                prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
                tensors[f"{prefix}.lora_A.weight"] = torch.full((r, shape.in_features), 0.5)
                tensors[f"{prefix}.lora_B.weight"] = torch.full((shape.out_features, r), 1.0)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def test_reads_matrices_and_folds_the_scale_into_b(tmp_path):
    adapter = load_adapter(write_adapter(tmp_path / "a"), LAYERS, SHAPES, max_rank=16)
    assert adapter.rank == 2 and set(adapter.modules) == {
        (0, "q_proj"),
        (0, "down_proj"),
        (1, "q_proj"),
        (1, "down_proj"),
    }
    a, b = adapter.modules[(1, "down_proj")]
    assert a.shape == (2, 16) and b.shape == (8, 2)
    assert torch.all(b == 2.0)  # lora_alpha / r = 4 / 2
    rs = load_adapter(write_adapter(tmp_path / "rs", {"use_rslora": True}), LAYERS, SHAPES, 16)
    assert torch.allclose(rs.modules[(0, "q_proj")][1], torch.full((8, 2), 4 / math.sqrt(2)))
    pattern = write_adapter(tmp_path / "p", {"alpha_pattern": {"down_proj": 8}})
    scaled = load_adapter(pattern, LAYERS, SHAPES, 16).modules
    assert torch.all(scaled[(0, "down_proj")][1] == 4.0) and torch.all(scaled[(0, "q_proj")][1] == 2.0)


def test_fingerprint_follows_the_weights_and_scale_not_the_path(tmp_path):
    one = load_adapter(write_adapter(tmp_path / "one"), LAYERS, SHAPES, 16)
    two = load_adapter(write_adapter(tmp_path / "two"), LAYERS, SHAPES, 16)
    alpha = load_adapter(write_adapter(tmp_path / "alpha", {"lora_alpha": 8}), LAYERS, SHAPES, 16)
    assert one.fingerprint == two.fingerprint != alpha.fingerprint


def test_pickled_weights_are_never_loaded(tmp_path):
    path = tmp_path / "pickled"
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4}))
    (path / "adapter_model.bin").write_bytes(b"\x80\x04 not to be unpickled")
    with pytest.raises(AdapterError, match=r"adapter_model.bin \(a pickle\).*safe_serialization=True"):
        load_adapter(path, LAYERS, SHAPES, 16)


def _tensor(layer, parent, module, which, shape):
    return {
        f"base_model.model.model.layers.{layer}.{parent}.{module}.lora_{which}.weight": torch.zeros(shape)
    }


@pytest.mark.parametrize(
    ("config", "tensors", "message"),
    [
        ({"use_dora": True}, None, "DoRA"),
        ({"bias": "all"}, None, "bias 'all'"),
        ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
        ({"peft_type": "IA3"}, None, "peft_type IA3"),
        ({"r": 0}, None, "r must be a positive number"),
        ({}, {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(2, 8)}, "not a LoRA matrix"),
        ({}, {**_tensor(0, "mlp", "q_proj", "A", (2, 8)), **_tensor(0, "mlp", "q_proj", "B", (8, 2))}, "not a supported target"),
        ({}, {**_tensor(5, "self_attn", "q_proj", "A", (2, 8)), **_tensor(5, "self_attn", "q_proj", "B", (8, 2))}, "layer 5 does not exist"),
        ({}, _tensor(0, "self_attn", "q_proj", "A", (2, 8)), "lora_A without its pair"),
        ({}, {**_tensor(0, "self_attn", "k_proj", "A", (2, 8)), **_tensor(0, "self_attn", "k_proj", "B", (8, 2))}, r"needs \[r, 8\] and \[4, r\]"),
        ({"r": 4}, {**_tensor(0, "self_attn", "q_proj", "A", (2, 8)), **_tensor(0, "self_attn", "q_proj", "B", (8, 2))}, "rank 2, its config says 4"),
    ],
)  # fmt: skip
def test_refusals_name_the_problem(tmp_path, config, tensors, message):
    with pytest.raises(AdapterError, match=message):
        load_adapter(write_adapter(tmp_path / "bad", config, tensors), LAYERS, SHAPES, 16)


def test_rank_above_the_engines_limit_says_which_flag(tmp_path):
    with pytest.raises(
        AdapterError, match="above --max-lora-rank 2; start the engine with --max-lora-rank 4"
    ):
        load_adapter(write_adapter(tmp_path / "r4", r=4), LAYERS, SHAPES, max_rank=2)


def test_registry_names_ids_and_unload(tmp_path):
    registry = LoRARegistry(LAYERS, SHAPES, 16, reserved_names=("base-model",))
    path = write_adapter(tmp_path / "a")
    first = registry.load("sql", path)
    with pytest.raises(AdapterError, match="already been loaded"):
        registry.load("sql", path)
    with pytest.raises(AdapterError, match="base model's name"):
        registry.load("base-model", path)
    with pytest.raises(AdapterError, match="must be 1-128 letters"):
        registry.load("bad name", path)
    with pytest.raises(AdapterError, match="not a PEFT adapter directory"):
        registry.load("empty", tmp_path)
    again = registry.load("sql-copy", path)
    assert again.id != first.id and again.cache_root == first.cache_root  # same weights, same KV
    assert [a.name for a in registry.adapters()] == ["sql", "sql-copy"]
    assert registry.unload("sql") is first and "sql" not in registry
    with pytest.raises(KeyError, match="cannot be found"):
        registry.unload("sql")
    assert registry.load("sql", path).id not in (first.id, again.id)
