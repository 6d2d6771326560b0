"""Speculative decoding in the engine: greedy output with speculation is greedy output without it, token
for token (the default model; random prompts on a tiny model with preemption and prefix caching), sampled
output keeps its distribution, opted-out requests never speculate, and no rejected token reaches the
prefix cache."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagoda.engine import SamplingParams
from pagoda.engine.config import EngineConfig
from pagoda.engine.core.stats import IterationStats, SchedulerStats
from pagoda.engine.frontend.llm_engine import LLMEngine
from pagoda.engine.kv_cache.hashing import hash_full_blocks
from pagoda_testkit.chi_square import chi_square_p
from pagoda_testkit.prompts import MIXED_PROMPTS

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
EDIT_PROMPT = (
    "Fix the spelling in this sentence and write it out again. Sentence: The quick brown fox jumpd over "
    "the lazy dog and ran into the forrest. Corrected sentence: The quick brown fox jumped"
)


class Counts:
    """A stat logger that adds up the speculative decoding counters."""

    def __init__(self) -> None:
        self.drafts = self.draft_tokens = self.accepted = 0
        self.per_pos: list[int] = []

    def record(self, scheduler_stats: SchedulerStats, it: IterationStats) -> None:
        spec = it.spec_decoding
        if spec is None:
            return
        self.drafts += spec.num_drafts
        self.draft_tokens += spec.num_draft_tokens
        self.accepted += spec.num_accepted_tokens
        self.per_pos.extend([0] * (len(spec.num_accepted_tokens_per_pos) - len(self.per_pos)))
        for i, n in enumerate(spec.num_accepted_tokens_per_pos):
            self.per_pos[i] += n


def run(eng: LLMEngine, prompts: list, params: list[SamplingParams], every: int = 1) -> list[list[int]]:
    """Each request's tokens (one request added every ``every`` steps), checking the engine's invariants
    after every step."""
    tokens: dict[str, list[int]] = {}
    pending = list(enumerate(zip(prompts, params, strict=True)))
    step = 0
    while pending or eng.has_unfinished_requests():
        if pending and step % every == 0:
            i, (prompt, p) = pending.pop(0)
            if isinstance(prompt, str):
                eng.add_request(str(i), prompt, p)
            else:
                eng.add_request(str(i), None, p, prompt_token_ids=prompt)
        for delta in eng.step():
            for c in delta.outputs:
                tokens.setdefault(delta.request_id, []).extend(c.token_ids)
        eng.scheduler.check_invariants()
        step += 1
    assert eng.kv.num_free_blocks == eng.core.num_blocks
    return [tokens[str(i)] for i in range(len(prompts))]


def assert_cache_holds_only_real_tokens(eng: LLMEngine, sequences: list[list[int]]) -> int:
    """Every block in the prefix cache hashes a block of some real sequence (prompt + output) the engine
    ever ran: no rejected proposal was ever hashed."""
    kv = eng.kv
    real = eng.__dict__.setdefault("real_hashes", set())
    for seq in sequences:
        real.update(hash_full_blocks(seq, kv.block_size, kv.extra_key_bytes))
    cached = set(kv.block_pool.cached)
    assert cached <= real
    return len(cached)


# ---- the default model ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol() -> dict[bool, LLMEngine]:
    base = dict(device="cpu", dtype="float32", max_model_len=320, kv_cache_memory_bytes=48 << 20)
    counts = Counts()
    engines = {
        False: LLMEngine(EngineConfig(**base)),
        True: LLMEngine(EngineConfig(**base, speculative_config=json.dumps(NGRAM)), stat_loggers=[counts]),
    }
    engines[True].counts = counts
    yield engines
    for eng in engines.values():
        eng.core.close()


def test_greedy_with_speculation_is_greedy_without_on_the_default_model(smol):
    greedy = dict(temperature=0.0, ignore_eos=True)
    prompts = [EDIT_PROMPT, MIXED_PROMPTS[2], EDIT_PROMPT]
    params = [
        SamplingParams(max_tokens=12, **greedy),
        SamplingParams(max_tokens=10, min_tokens=6, **greedy),
        SamplingParams(max_tokens=12, stop_token_ids=[2887], **greedy),
    ]
    plain = run(smol[False], prompts, params, every=2)
    spec = run(smol[True], prompts, params, every=2)
    assert spec == plain
    counts = smol[True].counts
    assert counts.drafts > 0 and 0 < counts.accepted <= counts.draft_tokens
    assert counts.accepted == sum(counts.per_pos)
    assert all(a >= b for a, b in zip(counts.per_pos, counts.per_pos[1:], strict=False))
    tokenizer = smol[True].tokenizer
    full = [tokenizer.encode(p) + out for p, out in zip(prompts, spec, strict=True)]
    assert assert_cache_holds_only_real_tokens(smol[True], full) > 0


def test_requests_that_cannot_be_verified_opt_out(smol):
    eng = smol[True]
    before = eng.counts.drafts
    opted_out = [
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, stop=["zzz"]),
        SamplingParams(temperature=0.8, max_tokens=5, ignore_eos=True, n=2, seed=3),
    ]
    got = run(eng, [EDIT_PROMPT] * 4, opted_out)
    assert eng.counts.drafts == before
    assert got[:1] == run(smol[False], [EDIT_PROMPT], opted_out[:1])


# ---- a tiny model: random prompts, preemption, prefix caching -----------------------------------------------
TINY_VOCAB = 64


@pytest.fixture(scope="module")
def tiny_engines(tmp_path_factory, default_model_dir):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("engine_conftest", Path(__file__).with_name("conftest.py"))
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    path = conftest.make_tiny_model(
        tmp_path_factory.mktemp("spec"), "llama", default_model_dir, seed=3, vocab_size=TINY_VOCAB
    )
    base = dict(
        model=str(path), device="cpu", dtype="float32", max_model_len=96, block_size=8, max_num_seqs=6,
        kv_cache_memory_bytes=28 * 8 * 512, skip_tokenizer_init=True, enable_prefix_caching=True,
    )  # fmt: skip
    spec = {**NGRAM, "num_speculative_tokens_per_batch_size": [[1, 64, 4]]}
    counts = Counts()
    engines = {
        False: LLMEngine(EngineConfig(**base)),
        True: LLMEngine(EngineConfig(**base, speculative_config=json.dumps(spec)), stat_loggers=[counts]),
    }
    engines[True].counts = counts
    yield engines
    for eng in engines.values():
        eng.core.close()


@st.composite
def workloads(draw):
    """3-5 requests: a repeated motif (n-gram hits) or noise, some sharing a prefix with the one before."""
    n = draw(st.integers(3, 5))
    prompts, params = [], []
    for i in range(n):
        motif = draw(st.lists(st.integers(3, TINY_VOCAB - 1), min_size=2, max_size=6))
        body = (motif * 8)[: draw(st.integers(4, 30))]
        if i and draw(st.booleans()):
            body = prompts[-1][:16] + body
        prompts.append(body)
        params.append(SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=draw(st.integers(4, 32))))
    return prompts, params


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workloads(), st.integers(1, 3))
def test_greedy_equality_property_with_preemption_and_prefix_caching(tiny_engines, workload, every):
    prompts, params = workload
    plain = run(tiny_engines[False], prompts, params, every)
    spec = run(tiny_engines[True], prompts, params, every)
    assert spec == plain
    assert_cache_holds_only_real_tokens(
        tiny_engines[True], [p + o for p, o in zip(prompts, spec, strict=True)]
    )


def test_the_property_workload_preempts_and_speculates(tiny_engines):
    """The property test is only worth something if its engines preempt and accept proposals."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(3)] * 8 for _ in range(5)]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=40) for _ in prompts]
    eng = tiny_engines[True]
    preempted = eng.scheduler.total_preemptions
    assert run(eng, prompts, params) == run(tiny_engines[False], prompts, params)
    assert eng.scheduler.total_preemptions > preempted
    assert eng.counts.accepted > 0


def test_sampled_tokens_keep_their_distribution(tiny_engines):
    """Sampling with and without speculation: the second and third output tokens' distributions (after
    tokens that may have been accepted proposals) agree by a two-sample chi-square test, and proposals were
    both accepted and rejected. Every token occurs in the prompt, so every sampled token finds a match and
    a proposal follows."""
    prompt = list(range(3, TINY_VOCAB)) + list(range(3, 12))
    trials = 160
    samples = {}
    for mode, eng in tiny_engines.items():
        params = [
            SamplingParams(temperature=0.7, max_tokens=3, ignore_eos=True, seed=s) for s in range(trials)
        ]
        before = (eng.counts.accepted, eng.counts.draft_tokens) if mode else None
        outs = run(eng, [prompt] * trials, params)
        samples[mode] = [(o[1], o[2]) for o in outs]
        if mode:
            accepted, proposed = eng.counts.accepted - before[0], eng.counts.draft_tokens - before[1]
            assert 0 < accepted < proposed
    for pos in (0, 1):
        a = [[s[pos] for s in samples[False]].count(t) for t in range(TINY_VOCAB)]
        b = [[s[pos] for s in samples[True]].count(t) for t in range(TINY_VOCAB)]
        pooled = [(x + y) / 2 for x, y in zip(a, b, strict=True)]
        assert chi_square_p(b, pooled) > 1e-3
        assert sum(1 for x in a if x) > 1  # a real distribution, not a point mass
