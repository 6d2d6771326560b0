"""Sampling: seeded reproducibility inside batches, n > 1, stop handling, logprobs, bad input."""

from __future__ import annotations

import pytest
from pagoda.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", max_model_len=512, kv_cache_memory_bytes=48 << 20)


def test_seeded_sampling_same_alone_and_in_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate(["Tell me a story about a dragon."], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (7, 25, 13)]
    batch = llm.generate(
        ["Write a poem.", "Tell me a story about a dragon.", "Count to ten.", "Hello!"],
        [others[0], seeded, others[1], others[2]],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate(["Tell me a story about a dragon."], seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone


def test_n_samples_share_the_prompt(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    out = llm.generate(["The weather today is"], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # independent samples
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_stop_strings_and_token_ids(llm):
    base = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[
        0
    ].outputs[0]
    assert " 6" in base.text
    stopped = llm.generate(
        ["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=20, stop=[" 6"]), use_tqdm=False
    )
    comp = stopped[0].outputs[0]
    assert comp.finish_reason == "stop" and comp.stop_reason == " 6"
    assert comp.text == base.text[: base.text.index(" 6")]
    first = base.token_ids[2]
    by_id = llm.generate(
        ["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[first]), use_tqdm=False
    )[0].outputs[0]
    assert by_id.token_ids == base.token_ids[:3] and by_id.stop_reason == first


def test_min_tokens_and_max_tokens(llm):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    short = llm.chat(chat, SamplingParams(temperature=0, max_tokens=50), use_tqdm=False)[0].outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 50
    longer = llm.chat(
        chat,
        SamplingParams(temperature=0, max_tokens=50, min_tokens=len(short.token_ids) + 5),
        use_tqdm=False,
    )
    assert len(longer[0].outputs[0].token_ids) >= len(short.token_ids) + 5
    capped = llm.generate(
        ["Hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False
    )
    assert capped[0].outputs[0].finish_reason == "length" and len(capped[0].outputs[0].token_ids) == 3


def test_logprobs(llm):
    out = llm.generate(
        ["The sky is"], SamplingParams(temperature=0, max_tokens=4, logprobs=3), use_tqdm=False
    )[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 4
    for tok, entry in zip(comp.token_ids, comp.logprobs, strict=True):
        assert entry[tok].rank == 1 and entry[tok].logprob <= 0
        assert len(entry) == 3
        assert all(e.logprob <= 0 and e.decoded_token is not None for e in entry.values())
    assert comp.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs, strict=True))
    )


def test_penalties_change_output(llm):
    plain = llm.generate(["a a a a a a a a"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    penalised = llm.generate(
        ["a a a a a a a a"], SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.8, frequency_penalty=1.0),
        use_tqdm=False,
    )[0]  # fmt: skip
    assert plain.outputs[0].token_ids != penalised.outputs[0].token_ids


def test_utf8_across_tokens(llm):
    tok = llm.get_tokenizer()
    text = "café 日本語 🙂"
    ids = tok(text).input_ids
    # Feed the text's own tokens as a forced continuation check of the incremental detokenizer.
    from pagoda.engine.detokenizer import Detokenizer
    from pagoda.engine.request import Request

    req = Request("u", None, [tok("Say:").input_ids[0]], SamplingParams(), 100, 0.0)
    seq = req.seqs[0]
    detok = Detokenizer(tok)
    pieces = []
    for t in ids:
        seq.token_ids.append(t)
        pieces.append(detok.append(seq, req.params))
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_prompt_longer_than_context(llm):
    with pytest.raises(ValueError, match=r"maximum context length is 512 tokens; the prompt has 600 tokens"):
        llm.generate([{"prompt_token_ids": [100] * 600}], SamplingParams(max_tokens=1), use_tqdm=False)
    # The engine keeps serving after bad input.
    assert llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_unknown_model_path():
    with pytest.raises(ValueError, match="/no/such/model"):
        LLM("/no/such/model", device="cpu")
