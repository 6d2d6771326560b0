"""Model folders as vLLM reads them (issue 36 item 2): generation_config.json's extra eos ids stop generation
and its sampling values are the defaults of requests that leave them out (--generation-config auto|vllm|DIR);
--tokenizer reads the tokenizer from another folder; --max-logprobs refuses more in vLLM's words."""

from __future__ import annotations

import json
import shutil

import pytest
from pagoda.engine import LLM, SamplingParams
from pagoda.engine.frontend.input_processor import InputError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
PROMPT = [5, 6, 7, 8, 9]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def _llm(path, **kw) -> LLM:
    return LLM(str(path), device="cpu", kv_cache_memory_bytes=4 << 20, max_model_len=128, **kw)


def _write(folder, body) -> None:
    (folder / "generation_config.json").write_text(json.dumps(body))


def test_eos_ids_and_sampling_defaults_from_generation_config(tiny_model, tmp_path) -> None:
    path = tiny_model("llama")
    _write(path, {"eos_token_id": 2})
    plain = _llm(path).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    tokens = list(plain[0].outputs[0].token_ids)
    stop_at = next(i for i, t in enumerate(tokens) if t != 2 and i > 0 and t not in tokens[:i])
    extra = tokens[stop_at]

    _write(path, {"eos_token_id": [2, extra], "temperature": 0.0, "top_k": 7, "repetition_penalty": 1.0})
    llm = _llm(path)
    assert extra in llm.engine.info.eos_token_ids and 2 in llm.engine.info.eos_token_ids
    out = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == tokens[: stop_at + 1] and out.finish_reason == "stop"
    defaults = llm.get_default_sampling_params()
    assert defaults.temperature == 0.0 and defaults.top_k == 7 and defaults.top_p == 1.0
    # a request that gives no parameters is greedy: the file's temperature 0 applies
    again = llm.generate([PROMPT], use_tqdm=False)[0].outputs[0]
    assert list(again.token_ids) == tokens[: min(stop_at + 1, len(again.token_ids))]

    ignored = _llm(path, generation_config="vllm")  # vLLM's "vllm": the file is not read
    assert extra not in ignored.engine.info.eos_token_ids
    assert ignored.get_default_sampling_params().temperature == 1.0
    out = ignored.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) > stop_at + 1 or out.finish_reason == "length"

    elsewhere = tmp_path / "gen"
    elsewhere.mkdir()
    _write(elsewhere, {"eos_token_id": [extra], "top_p": 0.5})
    _write(path, {"eos_token_id": 2})
    from_dir = _llm(path, generation_config=str(elsewhere))
    assert extra in from_dir.engine.info.eos_token_ids
    assert from_dir.get_default_sampling_params().top_p == 0.5
    with pytest.raises(ValueError, match="generation_config"):
        _llm(path, generation_config=str(tmp_path / "missing"))


def test_tokenizer_from_another_folder_and_max_logprobs(tiny_model, tmp_path) -> None:
    path = tiny_model("llama")
    tok = tmp_path / "tokenizer"
    tok.mkdir()
    for name in TOKENIZER_FILES:
        if (path / name).exists():
            shutil.move(path / name, tok / name)
    with pytest.raises(ValueError, match="tokenizer.json"):
        _llm(path)
    llm = _llm(path, tokenizer=str(tok), max_logprobs=2)
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=2, ignore_eos=True)
    out = llm.generate([PROMPT], params, use_tqdm=False)
    assert out[0].outputs[0].text and len(out[0].outputs[0].token_ids) == 3  # decoded by the moved tokenizer
    with pytest.raises(
        InputError, match="Requested sample logprobs of 3, which is greater than max allowed: 2"
    ):
        llm.generate([PROMPT], SamplingParams(max_tokens=1, logprobs=3), use_tqdm=False)
    with pytest.raises(
        InputError, match="Requested prompt logprobs of 5, which is greater than max allowed: 2"
    ):
        llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=5), use_tqdm=False)
