"""The embedded default model: GGUF -> converted directory (cached), tokenizer, chat template, and logits
that match Hugging Face transformers loaded from the same converted directory."""

from __future__ import annotations

import json
import time
from functools import partial

import pytest
import torch
from pagoda.engine import envs
from pagoda.engine.attention import get_attention_backend
from pagoda.engine.loader import load_model, load_tokenizer, model_fingerprint, resolve_model
from pagoda.engine.loader.resolve import default_model_gguf
from pagoda.engine.sizing.engine_plan import kv_bytes_per_token
from transformers import AutoModelForCausalLM


@pytest.fixture(scope="module")
def default_dir():
    # The real cache (PAGODA_CACHE or the user cache dir) so the whole suite converts at most once.
    return resolve_model(None)


@pytest.fixture(scope="module")
def ours(default_dir):
    return load_model(
        default_dir, torch.float32, "cpu", get_attention_backend("torch", "cpu"), progress=False
    )


def test_converted_layout(default_dir):
    assert default_dir.parent == envs.cache_root()
    assert default_dir.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (default_dir / name).is_file(), name
    config = json.loads((default_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert "chat_template" in json.loads((default_dir / "tokenizer_config.json").read_text())
    assert default_model_gguf().name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_second_resolve_reuses_the_conversion(default_dir):
    weights = default_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    start = time.monotonic()
    again = resolve_model(None)
    assert again == default_dir
    assert time.monotonic() - start < 5.0
    assert weights.stat().st_mtime_ns == before
    assert resolve_model(default_model_gguf()) == default_dir  # the same file by path: same cache entry


def test_model_config_matches_smollm2(ours):
    _, cfg = ours
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        "llama",
        30,
        9,
        3,
    )
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size) == (576, 1536, 64, 49152)
    assert cfg.rope_theta == 100000.0 and cfg.tie_word_embeddings
    per_token = partial(
        kv_bytes_per_token,
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    )
    assert per_token(2) == 23040 and per_token(4) == 46080  # REFERENCE.md (the one KV formula)
    assert cfg.eos_token_ids == [2]


def test_tokenizer_and_chat_template(default_dir):
    tok = load_tokenizer(default_dir)
    ids = tok("What is the capital of France?").input_ids
    assert ids == [1780, 314, 260, 3575, 282, 4649, 47]
    assert tok.decode(ids) == "What is the capital of France?"
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")
    assert len(model_fingerprint(default_dir)) == 32


def test_logits_match_hf_from_the_same_directory(default_dir, ours, paged, caches):
    """Prefill of a chat prompt, then greedy decodes through the paged cache; HF scores the same tokens in
    one full forward, and every position's logits (and so every greedy choice) must agree."""
    model, cfg = ours
    tok = load_tokenizer(default_dir)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tok(prompt).input_ids
    n, new_tokens = len(ids), 8
    batches = paged(num_blocks=16, block_size=16)
    kv = caches(cfg.num_hidden_layers, 16, 16, cfg.num_key_value_heads, cfg.head_dim)
    rows = [model.compute_logits(model(torch.tensor(ids), torch.arange(n), kv, batches.step([(0, 0, n)])))]
    tokens = list(ids)
    for _ in range(new_tokens):
        tokens.append(int(rows[-1][-1].argmax()))
        pos = len(tokens) - 1
        meta = batches.step([(0, pos, 1)])
        rows.append(model.compute_logits(model(torch.tensor(tokens[-1:]), torch.tensor([pos]), kv, meta)))
    ours_logits = torch.cat(rows)  # logits for positions 0 .. n + new_tokens - 1
    answer = tok.decode(tokens[n:])
    assert "Paris" in answer, answer  # the conversion is right, not just consistent with HF

    hf = AutoModelForCausalLM.from_pretrained(
        str(default_dir), dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0].float()
    torch.testing.assert_close(ours_logits, ref, atol=2e-3, rtol=1e-3)
    assert ref[n - 1 : -1].argmax(-1).tolist() == tokens[n:]
