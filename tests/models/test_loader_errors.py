"""Model resolution and config parsing: clear errors naming what is wrong, no downloads, no pickles."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from pagoda.engine.loader import ModelNotFoundError, model_fingerprint, resolve_model, weights_nbytes
from pagoda.engine.models import ModelConfig, get_model_class
from pagoda.engine.sizing.engine_plan import kv_bytes_per_token
from safetensors.torch import save_file

TINY = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 32,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


def _write_tiny(path):
    import json

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY))
    save_file(
        {"model.norm.weight": torch.ones(16), "lm_head.weight": torch.zeros(32, 16, dtype=torch.bfloat16)},
        str(path / "model.safetensors"),
    )
    return path


def test_unknown_path_names_it(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match="no-such-model") as err:
        resolve_model(str(missing))
    assert "does not exist" in str(err.value)
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model("./relative/missing-dir")


def test_hub_id_without_local_copy_says_where_to_put_files(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("HuggingFaceTB/SmolLM2-360M-Instruct")
    message = str(err.value)
    assert "HuggingFaceTB/SmolLM2-360M-Instruct" in message
    assert str(tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-360M-Instruct") in message
    assert "never downloads" in message and "config.json" in message
    assert isinstance(err.value, ValueError)


def test_hub_id_found_in_local_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    repo = tmp_path / "hub" / "models--org--tiny"
    snap = _write_tiny(repo / "snapshots" / "abc123")
    _write_tiny(repo / "snapshots" / "older")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123\n")
    assert resolve_model("org/tiny") == snap


def test_pickled_weights_are_refused(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ValueError, match="pytorch_model.bin") as err:
        resolve_model(tmp_path)
    assert "unpickle" in str(err.value) and "safetensors" in str(err.value)


def test_directory_without_config_or_weights(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(tmp_path)
    import json

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    with pytest.raises(ValueError, match="safetensors"):
        resolve_model(tmp_path)


def test_non_gguf_file_is_refused(tmp_path):
    f = tmp_path / "weights.pt"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="weights.pt"):
        resolve_model(f)


def test_fingerprint_is_stable_across_processes(tmp_path):
    path = _write_tiny(tmp_path / "m")
    assert resolve_model(path) == path.resolve()
    code = "import sys; from pagoda.engine.loader import model_fingerprint; print(model_fingerprint(sys.argv[1]))"
    other = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    assert other.stdout.strip() == model_fingerprint(path)
    assert weights_nbytes(path) == 16 * 4 + 32 * 16 * 2


# ---- ModelConfig ------------------------------------------------------------------------------------


def test_kv_bytes_per_token_reference_models():
    llama31_8b = {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "max_position_embeddings": 131072,
        "eos_token_id": [128001, 128008, 128009],
        "torch_dtype": "bfloat16",
    }
    cfg = ModelConfig.from_hf_config(llama31_8b)
    assert kv_bytes(cfg, 2) == 131072 and kv_bytes(cfg, 1) == 65536
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.eos_token_ids == [128001, 128008, 128009] and cfg.torch_dtype == "bfloat16"
    qwen25_7b = {
        "model_type": "qwen2",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "sliding_window": 131072,
        "use_sliding_window": False,
        "max_window_layers": 28,
    }
    cfg = ModelConfig.from_hf_config(qwen25_7b)
    assert kv_bytes(cfg, 2) == 57344
    assert cfg.attention_bias and cfg.sliding_window is None


def kv_bytes(cfg: ModelConfig, element_bytes: int) -> int:
    """The one KV formula (engine_plan.kv_bytes_per_token) for a config, one rank."""
    return kv_bytes_per_token(
        cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, element_bytes
    )


def test_sliding_window_and_rope_variants():
    mistral = {**TINY, "model_type": "mistral", "sliding_window": 4096}
    assert ModelConfig.from_hf_config(mistral).sliding_window == 4096
    assert ModelConfig.from_hf_config({**mistral, "sliding_window": None}).sliding_window is None
    qwen = {
        **TINY,
        "model_type": "qwen2",
        "num_hidden_layers": 4,
        "use_sliding_window": True,
        "sliding_window": 8,
        "max_window_layers": 2,
    }
    cfg = ModelConfig.from_hf_config(qwen)
    assert [cfg.layer_sliding_window(i) for i in range(4)] == [None, None, 8, 8]
    linear = ModelConfig.from_hf_config({**TINY, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert linear.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    new_style = ModelConfig.from_hf_config(
        {**TINY, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}
    )
    assert new_style.rope_theta == 1e6 and new_style.rope_scaling is None
    smol = ModelConfig.from_hf_config({**TINY, "head_dim": None})
    assert smol.head_dim == 8 and smol.architecture == "llama"


def test_bad_configs_name_the_field():
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        ModelConfig.from_hf_config({**TINY, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_hf_config({k: v for k, v in TINY.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.from_hf_config({**TINY, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf_config({**TINY, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        get_model_class("gpt2")
