"""Sampling: seeded reproducibility inside batches, n > 1, stop handling, logprobs, bad input, and what
top-k / top-p / min-p actually keep (the sampler on known distributions, over many seeds)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from pagoda.engine import LLM, SamplingParams
from pagoda.engine.worker.sampler import SamplingRow, sample

# A known next-token distribution over a 10-token vocabulary, most likely first.
PROBS = [0.30, 0.25, 0.15, 0.10, 0.08, 0.05, 0.04, 0.02, 0.007, 0.003]
DRAWS = 3000


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", dtype="float32", max_model_len=512, kv_cache_memory_bytes=48 << 20)


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
    from pagoda.engine.frontend.detokenizer import Detokenizer, SeqText

    seq = SeqText.for_prompt([tok("Say:").input_ids[0]])
    detok = Detokenizer(tok)
    pieces = []
    for t in ids:
        seq.token_ids.append(t)
        pieces.append(detok.append(seq, SamplingParams()))
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


# ---------------------------------------------------------------- filters, on a known distribution


def draw(params: SamplingParams, draws: int = DRAWS) -> Counter:
    """Sample `draws` times from PROBS, one seed per row, and count the tokens drawn."""
    logits = torch.tensor([math.log(p) for p in PROBS]).repeat(draws, 1)
    rows = [
        SamplingRow(params, [1], [], torch.Generator().manual_seed(seed), stop_ids=[])
        for seed in range(draws)
    ]
    return Counter(sample(logits, rows).token_ids)


def assert_draws_follow(counts: Counter, kept: list[int], temperature: float = 1.0) -> None:
    """Only `kept` tokens appear, each of them does, at the renormalised probability (within 4 sigma)."""
    assert set(counts) <= set(kept), f"sampled outside the kept set {kept}: {sorted(set(counts) - set(kept))}"
    weights = {t: PROBS[t] ** (1.0 / temperature) for t in kept}
    total = sum(weights.values())
    n = sum(counts.values())
    for t in kept:
        p = weights[t] / total
        sigma = math.sqrt(p * (1 - p) / n)
        assert abs(counts[t] / n - p) <= 4 * sigma + 1e-9, (t, counts[t] / n, p)


@pytest.mark.parametrize(("top_k", "kept"), [(1, [0]), (3, [0, 1, 2]), (5, [0, 1, 2, 3, 4])])
def test_top_k_never_samples_outside_the_k_most_likely(top_k, kept):
    assert_draws_follow(draw(SamplingParams(temperature=1.0, top_k=top_k)), kept)


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (0.29, [0]),  # the first token alone holds 0.30
        (0.54, [0, 1]),  # 0.30 + 0.25 = 0.55 already reaches it: token 2 is outside the nucleus
        (0.56, [0, 1, 2]),
        (0.78, [0, 1, 2, 3]),  # 0.30 + 0.25 + 0.15 = 0.70 < 0.78, so token 3 is needed
    ],
)
def test_top_p_never_samples_outside_the_nucleus(top_p, kept):
    assert_draws_follow(draw(SamplingParams(temperature=1.0, top_p=top_p)), kept)


@pytest.mark.parametrize(
    ("min_p", "kept"),
    [
        (0.30, [0, 1, 2, 3]),  # threshold 0.09: 0.10 stays, 0.08 goes
        (0.60, [0, 1]),  # threshold 0.18
        (1.00, [0]),
    ],
)
def test_min_p_never_samples_below_the_threshold(min_p, kept):
    assert_draws_follow(draw(SamplingParams(temperature=1.0, min_p=min_p)), kept)


def test_filters_compose_after_temperature():
    # At temperature 0.5 the distribution sharpens to p^2 renormalised (0.09, 0.0625, 0.0225, ... over
    # 0.196; over 0.191 once top_k=5 cut the tail): token 0 holds 0.47, tokens 0-1 hold 0.80, so top_p
    # 0.75 keeps exactly {0, 1}; at temperature 1 it would keep {0, 1, 2, 3}.
    counts = draw(SamplingParams(temperature=0.5, top_p=0.75, top_k=5))
    assert_draws_follow(counts, [0, 1], temperature=0.5)
    # top-k first, then top-p on what is left: with k = 2 the nucleus of 0.99 is still {0, 1}.
    counts = draw(SamplingParams(temperature=1.0, top_k=2, top_p=0.99))
    assert_draws_follow(counts, [0, 1])


def test_unfiltered_sampling_reaches_the_tail():
    counts = draw(SamplingParams(temperature=1.0), draws=6000)
    assert_draws_follow(counts, list(range(10)))


# ---------------------------------------------------------------- token ids outside the vocabulary


@pytest.mark.parametrize("bad", [49152, 2**31 - 1, -1])
def test_validate_token_ids_names_the_field(bad):
    params = SamplingParams(stop_token_ids=[2, bad], min_tokens=1)
    with pytest.raises(ValueError, match=r"^stop_token_ids contains .*\[0, 49152\)"):
        params.validate_token_ids(49152)
    SamplingParams(stop_token_ids=[0, 49151]).validate_token_ids(49152)  # the edges are fine
