"""Structured outputs, logit_bias and prompt logprobs in the engine (default model, CPU, float32).

Every output that stops (not on max_tokens) must parse and validate, whatever the batch does: n > 1,
preemption by recompute or swap, prefix caching, a grammar still compiling while others run.
"""

from __future__ import annotations

import json
from concurrent.futures import Future

import jsonschema
import pytest
import torch
from pagoda.engine import LLM, SamplingParams
from pagoda.engine.outputs import RequestOutput
from pagoda.engine.structured_output import GrammarSpec, TokenBitmask, apply_token_bitmask, check_spec

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
}
BYTES_PER_BLOCK16 = 46080 * 16  # SmolLM2-135M in fp32


def chat(llm: LLM, text: str) -> str:
    msgs = [{"role": "user", "content": text}]
    return llm.get_tokenizer().apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def llm_of(**kwargs) -> LLM:
    base = dict(device="cpu", dtype="float32", max_model_len=512, kv_cache_memory_bytes=32 << 20)
    return LLM(**{**base, **kwargs})


@pytest.fixture(scope="module")
def llm() -> LLM:
    return llm_of()


def valid_outputs(outs, schema: dict) -> int:
    """Every stopped output validates; returns how many stopped."""
    stopped = 0
    for out in outs:
        for c in out.outputs:
            if c.finish_reason == "length":
                continue
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.text), schema)
            stopped += 1
    return stopped


def test_json_schema_with_n_greedy_and_sampled(llm) -> None:
    spec = GrammarSpec.json_schema(PERSON)
    prompt = chat(llm, "Describe a person as JSON.")
    params = [
        SamplingParams(max_tokens=48, temperature=0, structured_outputs=spec),
        SamplingParams(max_tokens=48, temperature=1.0, seed=7, n=3, structured_outputs=spec),
    ]
    outs = llm.generate([prompt, prompt], params, use_tqdm=False)
    assert len(outs[1].outputs) == 3
    assert valid_outputs(outs, PERSON) == 4


def test_choice_regex_grammar_and_json_object(llm) -> None:
    prompt = chat(llm, "Answer.")
    specs = [
        GrammarSpec.choice(["red", "green", "blue"]),
        GrammarSpec("regex", r"[0-9]{3}-[a-z]{2}"),
        GrammarSpec("grammar", 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9]'),
        GrammarSpec("json_object"),
    ]
    params = [SamplingParams(max_tokens=24, temperature=0.8, seed=1, structured_outputs=s) for s in specs]
    out = [o.outputs[0] for o in llm.generate([prompt] * 4, params, use_tqdm=False)]
    assert out[0].text in ("red", "green", "blue") and out[0].finish_reason == "stop"
    assert out[1].text[:3].isdigit() and out[1].text[3] == "-" and len(out[1].text) == 6
    if out[2].finish_reason == "stop":
        assert out[2].text.startswith("(") and out[2].text.endswith(")")
    if out[3].finish_reason == "stop":
        assert isinstance(json.loads(out[3].text), dict)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_grammar_state_survives_preemption(mode) -> None:
    """Four sequences of up to 3 blocks in a pool of 6: they preempt each other mid-output."""
    kwargs = dict(kv_cache_memory_bytes=6 * BYTES_PER_BLOCK16, max_model_len=64, preemption_mode=mode)
    if mode == "swap":
        kwargs["kv_offload_host_bytes"] = 24 * BYTES_PER_BLOCK16
    llm = llm_of(**kwargs)
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 20}
    spec = GrammarSpec.json_schema(schema)
    prompts = [f"Digits {i}:" for i in range(4)]
    params = SamplingParams(max_tokens=32, temperature=0.9, seed=3, structured_outputs=spec)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.total_preemptions > 0
    assert valid_outputs(outs, schema) > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks


def test_prefix_cached_prompt_keeps_the_grammar(llm) -> None:
    prompt = chat(llm, "A person as JSON, please, with a short name and an age. " * 3)
    params = SamplingParams(max_tokens=48, temperature=0, structured_outputs=GrammarSpec.json_schema(PERSON))
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    valid_outputs([first], PERSON)


def test_a_compiling_grammar_never_holds_the_batch(llm) -> None:
    """The scheduler skips a request whose grammar is not compiled yet; the others run to the end."""
    engine = llm.engine
    sched = engine.scheduler
    pending: Future = Future()
    real_submit = sched.structured.submit
    sched.structured.submit = lambda spec: pending
    try:
        spec = GrammarSpec.json_schema(PERSON)
        engine.add_request(
            "g",
            chat(llm, "JSON person"),
            SamplingParams(max_tokens=40, temperature=0, structured_outputs=spec),
        )
        engine.add_request("plain", "The capital of France is", SamplingParams(max_tokens=4, temperature=0))
        whole: dict[str, RequestOutput] = {}

        def step() -> None:
            for out in engine.step():
                if out.request_id in whole:
                    whole[out.request_id].add(out)
                else:
                    whole[out.request_id] = out

        while "plain" not in whole or not whole["plain"].finished:
            step()
        assert "g" not in whole and sched.num_waiting == 1
        pending.set_result(real_submit(spec).result())
        while "g" not in whole or not whole["g"].finished:
            step()
    finally:
        sched.structured.submit = real_submit
    jsonschema.validate(json.loads(whole["g"].outputs[0].text), PERSON)


def test_a_grammar_that_fails_to_compile_ends_only_its_request(llm) -> None:
    engine = llm.engine
    sched = engine.scheduler
    failed: Future = Future()
    failed.set_exception(RuntimeError("compiler bug"))
    real_submit = sched.structured.submit
    sched.structured.submit = lambda spec: failed
    try:
        spec = GrammarSpec.json_schema(PERSON)
        engine.add_request("bad", "Hi", SamplingParams(max_tokens=4, n=2, structured_outputs=spec))
        engine.add_request("ok", "Hi", SamplingParams(max_tokens=2, temperature=0))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    finally:
        sched.structured.submit = real_submit
    assert [c.finish_reason for c in done["bad"].outputs] == ["abort"]
    assert done["ok"].outputs[0].finish_reason == "length"
    sched.check_invariants()


def test_bad_specs_are_refused_with_the_reason() -> None:
    for spec, words in [
        (GrammarSpec.json_schema({"type": "strin"}), "strin"),
        (GrammarSpec("regex", "([a-z"), "regex"),
        (GrammarSpec("grammar", "root ::= missing"), "missing"),
        (GrammarSpec("json", "{not json"), "JSON"),
        (GrammarSpec("choice", "[]"), "choice"),
        (GrammarSpec.json_schema({"type": "string", "minLength": 5000}), "5000 times"),
        (GrammarSpec("regex", "[a-z]{2000}"), "2000 times"),
    ]:
        with pytest.raises(ValueError, match=words):
            check_spec(spec)


@pytest.mark.parametrize("backend", ["auto", "torch_native"])
def test_mask_sets_exactly_the_disallowed_tokens_of_the_masked_rows(backend) -> None:
    """The sampler's call (the CPU kernel, and xgrammar's torch path, what a GPU without its kernels
    runs) against a bit-by-bit reference."""
    torch.manual_seed(0)
    vocab = 1000
    logits = torch.randn(4, vocab)
    bits = torch.randint(-(2**31), 2**31 - 1, (2, (vocab + 31) // 32), dtype=torch.int32)
    ours = logits.clone()
    apply_token_bitmask(ours, TokenBitmask([1, 3], bits), backend=backend)
    ref = logits.clone()
    for row, word_row in zip([1, 3], bits.tolist(), strict=True):
        for token in range(vocab):
            if not (word_row[token // 32] >> (token % 32)) & 1:
                ref[row, token] = float("-inf")
    assert torch.equal(ours, ref)
    assert bool(torch.isinf(ours[1]).any()) and bool(torch.isfinite(ours[1]).any())


def test_logit_bias_bans_and_forces_tokens(llm) -> None:
    prompt = "The capital of France is"
    plain = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0].outputs[0]
    banned = plain.token_ids[0]
    out = llm.generate(
        prompt, SamplingParams(max_tokens=4, temperature=0, logit_bias={banned: -100}), use_tqdm=False
    )[0].outputs[0]
    assert banned not in out.token_ids
    forced = llm.get_tokenizer().encode(" banana")[0]
    out = llm.generate(
        prompt,
        SamplingParams(max_tokens=3, temperature=0.7, seed=2, logit_bias={forced: 100}),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == [forced] * 3
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={10**7: 1}).validate_token_ids(49152)


def test_prompt_logprobs_agree_with_generation_chunks_and_the_prefix_cache() -> None:
    """A token's prompt logprob equals its logprob when it was generated; chunked prompts (past the
    256-token chunk for prompt logprobs) and a second, prefix-cached request give the same values."""
    llm = llm_of(max_num_batched_tokens=64)
    tok = llm.get_tokenizer()
    prompt = "The capital of France is"
    gen = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0, logprobs=0), use_tqdm=False)[0]
    ids = tok.encode(prompt) + gen.outputs[0].token_ids
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)
    out = llm.generate([ids], params, use_tqdm=False)[0]
    lps = out.prompt_logprobs
    assert len(lps) == len(ids) and lps[0] is None
    for pos, tid in enumerate(gen.outputs[0].token_ids):
        entry = lps[len(ids) - 2 + pos][tid]
        assert entry.logprob == pytest.approx(gen.outputs[0].logprobs[pos][tid].logprob, abs=1e-4)
        assert entry.rank == 1
    assert all(len(e) <= 3 and ids[i] in e for i, e in enumerate(lps) if e is not None)
    long_ids = (tok.encode(" Paris is a city in France.") * 50)[:300]
    first = llm.generate([long_ids], params, use_tqdm=False)[0]
    again = llm.generate([long_ids], params, use_tqdm=False)[0]
    assert len(first.prompt_logprobs) == 300 and again.prompt_logprobs == first.prompt_logprobs
    assert again.num_cached_tokens == 0  # computed again: cached KV has no logits
    cached = llm.generate([long_ids], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0]
    assert cached.num_cached_tokens > 0  # the same prompt without prompt logprobs uses the cache
