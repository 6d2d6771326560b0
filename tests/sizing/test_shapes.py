"""Model shapes from config.json + safetensors headers, GGUF metadata, and well-known ids."""

import json
import struct
import subprocess

import pytest
from pagoda.engine.sizing import SizingError, shape_from_config, shape_from_path, well_known_shape

TINY = {
    "model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "hidden_size": 64, "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 512,
    "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}  # fmt: skip


def write_safetensors(path, tensors):
    """A safetensors file written by hand: 8-byte header length, JSON header, zero data."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = {"BF16": 2, "F16": 2, "F32": 4}[dtype]
        for d in shape:
            size *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def test_hf_directory_counts_bytes_from_headers(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    write_safetensors(
        tmp_path / "model-00001-of-00002.safetensors",
        {"model.embed_tokens.weight": ("BF16", [100, 64]), "lm_head.weight": ("BF16", [100, 64])},
    )
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"model.norm.weight": ("BF16", [64])})  # fmt: skip
    shape = shape_from_path(tmp_path)
    assert shape.num_params == 2 * 100 * 64 + 64
    assert shape.weight_bytes == 2 * shape.num_params
    assert shape.num_kv_heads == 2 and shape.head_dim == 16 and shape.max_position_embeddings == 512
    assert shape.kv_bytes_per_token() == 2 * 2 * 2 * 16 * 2
    assert shape.name == tmp_path.name


def test_config_without_dtype_takes_the_safetensors_dtype(tmp_path):
    cfg = {k: v for k, v in TINY.items() if k != "torch_dtype"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    write_safetensors(tmp_path / "model.safetensors", {"w": ("F32", [10, 10])})
    shape = shape_from_path(tmp_path)
    assert shape.dtype == "float32" and shape.weight_bytes == 400


def test_missing_config_field_is_named(tmp_path):
    cfg = {k: v for k, v in TINY.items() if k != "num_hidden_layers"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SizingError, match="missing 'num_hidden_layers'"):
        shape_from_path(tmp_path)


def test_damaged_inputs_are_clear_errors(tmp_path):
    with pytest.raises(SizingError, match="no such file"):
        shape_from_path(tmp_path / "nope")
    with pytest.raises(SizingError, match="no config.json"):
        shape_from_path(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SizingError, match="not valid JSON"):
        shape_from_path(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    (tmp_path / "model.safetensors").write_bytes(b"\x05")
    with pytest.raises(SizingError, match="not a safetensors file"):
        shape_from_path(tmp_path)


def test_sliding_window_and_text_config():
    mistral = shape_from_config({**TINY, "sliding_window": 128})
    assert mistral.sliding_window == 128
    qwen = shape_from_config({**TINY, "sliding_window": 128, "use_sliding_window": False})
    assert qwen.sliding_window is None
    wrapped = shape_from_config({"model_type": "llava", "text_config": TINY})
    assert wrapped.num_layers == 2


def test_gguf_metadata_of_the_default_model(default_gguf):
    shape = shape_from_path(default_gguf)
    known = well_known_shape("HuggingFaceTB/SmolLM2-135M-Instruct")
    for f in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "hidden_size",
              "intermediate_size", "vocab_size", "max_position_embeddings"):  # fmt: skip
        assert getattr(shape, f) == getattr(known, f), f
    assert shape.num_params == known.num_params  # tied embeddings counted once, as the estimate does
    assert shape.kv_bytes_per_token("float16") == 23_040


def test_gguf_reads_without_the_gguf_package_or_numpy(default_gguf, python):
    """The operator image has neither; the metadata walk is pure Python and quick."""
    code = (
        "import sys, time; sys.modules['gguf'] = None; sys.modules['numpy'] = None\n"
        "from pagoda.engine.sizing import shape_from_path\n"
        f"t = time.process_time(); s = shape_from_path({str(default_gguf)!r})\n"
        "print(s.num_layers, s.num_kv_heads, s.vocab_size, round(time.process_time() - t, 3))\n"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    layers, kv, vocab, cpu_seconds = out.stdout.split()
    assert (layers, kv, vocab) == ("30", "3", "49152"), out.stderr
    assert float(cpu_seconds) < 2.0


def test_damaged_gguf_is_a_clear_error(tmp_path, default_gguf):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(SizingError, match="not a GGUF file"):
        shape_from_path(bad)
    cut = tmp_path / "cut.gguf"
    with open(default_gguf, "rb") as f:
        cut.write_bytes(f.read(200_000))
    with pytest.raises(SizingError, match="GGUF"):
        shape_from_path(cut)


@pytest.mark.parametrize(
    "model_id, name",
    [("meta-llama/Llama-3.1-8B-Instruct", "Llama-3.1-8B"), ("meta-llama/Meta-Llama-3.1-70B-Instruct", "Llama-3.1-70B"),
     ("meta-llama/Llama-3.1-405B", "Llama-3.1-405B"), ("mistralai/Mistral-7B-Instruct-v0.3", "Mistral-7B-v0.3"),
     ("mistralai/Mistral-7B-v0.1", "Mistral-7B-v0.1"), ("Qwen/Qwen2.5-72B-Instruct", "Qwen2.5-72B"),
     ("HuggingFaceTB/SmolLM2-135M", "SmolLM2-135M"), ("Mistral-7B", "Mistral-7B-v0.3")],
)  # fmt: skip
def test_well_known_ids(model_id, name):
    assert well_known_shape(model_id).name == name


def test_unknown_id_is_none():
    assert well_known_shape("someone/unknown-model-3b") is None
