"""The architecture table: how each family is recognised, and that every reader takes its answer from it."""

from __future__ import annotations

import pytest
from pagoda.engine.sizing import architectures, shape_from_config
from pagoda.engine.sizing.architectures import ARCHITECTURES, SUPPORTED_ARCHITECTURES
from pagoda.engine.sizing.model_config import ModelConfig

SHAPE = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "vocab_size": 100}


@pytest.mark.parametrize("entry", ARCHITECTURES, ids=lambda a: a.name)
def test_every_family_is_found_by_each_of_its_names(entry: architectures.Architecture) -> None:
    for model_type in entry.model_types:
        assert architectures.from_hf_config({"model_type": model_type}) is entry
    for hf_name in entry.hf_architectures:
        assert architectures.from_hf_config({"architectures": [hf_name]}) is entry
    if entry.gguf_arch:
        assert architectures.from_gguf(entry.gguf_arch, "x.gguf") is entry
    config = ModelConfig.from_hf_config({**SHAPE, "model_type": entry.model_types[0]})
    assert config.architecture == entry.name and config.attention_bias == entry.qkv_bias


def test_unknown_families_are_refused_by_the_engine_and_sized_by_the_planner() -> None:
    falcon = {**SHAPE, "model_type": "falcon", "architectures": ["FalconForCausalLM"]}
    with pytest.raises(ValueError, match=f"model_type 'falcon'.*{', '.join(SUPPORTED_ARCHITECTURES)}"):
        ModelConfig.from_hf_config(falcon)
    assert shape_from_config(falcon).num_layers == 2  # sizing reads any Llama-shaped decoder
    supported = ", ".join(architectures.GGUF_ARCHITECTURES)
    assert supported.startswith("llama, mistral, qwen2")
    with pytest.raises(ValueError, match=f"architecture 'falcon'; supported: {supported}"):
        architectures.from_gguf("falcon", "falcon.gguf")


def test_the_planner_reads_the_engine_s_sliding_window() -> None:
    qwen = {**SHAPE, "model_type": "qwen2", "sliding_window": 32}
    assert shape_from_config(qwen).sliding_window is None  # Qwen2 slides only with use_sliding_window
    on = {**qwen, "use_sliding_window": True, "max_window_layers": 1}
    assert shape_from_config(on).sliding_window == 32
    assert ModelConfig.from_hf_config(on).layer_types == ["full_attention", "sliding_attention"]
    # the window the engine's kernels run with, even as long as the context
    assert (
        shape_from_config({**SHAPE, "model_type": "mistral", "sliding_window": 4096}).sliding_window == 4096
    )


@pytest.mark.parametrize(
    ("model_type", "tied"), [("gemma2", True), ("gemma3_text", True), ("llama", False), ("qwen3", False)]
)
def test_a_config_without_tie_word_embeddings_takes_the_familys_default(model_type: str, tied: bool) -> None:
    """transformers 4.x left tie_word_embeddings out of a Gemma config.json (its value equals the base
    class's); the published Gemma 2 files load with a tied head, a Llama's stays untied."""
    config = {
        "model_type": model_type,
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    }
    assert ModelConfig.from_hf_config(config).tie_word_embeddings is tied
    assert (
        ModelConfig.from_hf_config({**config, "tie_word_embeddings": not tied}).tie_word_embeddings
        is not tied
    )


def test_an_unsupported_quantized_checkpoint_is_refused_by_the_engine_and_by_sizing(tmp_path) -> None:
    """A bitsandbytes folder's tensors are not weights the engine runs: serve would fail at load and plan would
    size its packed integers as floats, so both refuse it up front with the same words (AWQ, GPTQ and FP8
    read with their scheme: tests/quantization)."""
    import json

    from pagoda.engine.sizing.errors import SizingError
    from pagoda.engine.sizing.shapes import shape_from_path

    config = {
        "model_type": "qwen2",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True},
    }
    for strict in (True, False):
        with pytest.raises(SizingError, match="'bitsandbytes'-quantized checkpoint .* not supported"):
            ModelConfig.from_hf_config(config, strict=strict)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SizingError, match="'bitsandbytes'-quantized"):
        shape_from_path(tmp_path)
    del config["quantization_config"]
    assert ModelConfig.from_hf_config(config).architecture == "qwen2"
