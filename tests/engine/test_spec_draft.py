"""The draft-model proposer: greedy output with a draft model is greedy output without, token for token (the
default model with a draft cut to its first layers; random prompts on a tiny model with preemption and
prefix caching), sampled output keeps its distribution with the draft's real q, the draft's own cache
catches up, truncates and frees, and a draft of another vocabulary is refused."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagoda.engine import SamplingParams
from pagoda.engine.config import EngineConfig
from pagoda.engine.frontend.llm_engine import LLMEngine
from pagoda.engine.spec_decode.acceptance import accept_sampled
from pagoda.engine.spec_decode.draft_cache import DraftCache
from pagoda.engine.spec_decode.layer_draft import write_layer_draft
from pagoda_testkit.chi_square import chi_square_p
from pagoda_testkit.prompts import MIXED_PROMPTS

TINY_VOCAB = 64


def _sibling(name: str):
    """A module of this folder (the tests import in importlib mode: the folder is not on sys.path)."""
    spec = importlib.util.spec_from_file_location(f"engine_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _conftest():
    return _sibling("conftest")


_ngram = _sibling("test_spec_decode")  # the n-gram tests' engine driver and checks, shared
EDIT_PROMPT, SpecCounts, run = _ngram.EDIT_PROMPT, _ngram.Counts, _ngram.run
assert_cache_holds_only_real_tokens = _ngram.assert_cache_holds_only_real_tokens


class Counts(SpecCounts):
    """The speculative counters, and the target's prefix-cache hits (tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.prefix_hits = 0

    def record(self, scheduler_stats, it) -> None:
        super().record(scheduler_stats, it)
        self.prefix_hits += it.prefix_cache_hits


def draft_config(path: Path, k: int, **extra) -> str:
    return json.dumps({"method": "draft_model", "model": str(path), "num_speculative_tokens": k, **extra})


def assert_draft_cache_empty(eng: LLMEngine) -> None:
    """Every request finished: no sequence holds draft blocks (retired ones may stay), none leaked."""
    cache = eng.scheduler.proposer.cache
    cache.check()
    assert cache.num_live == 0


# ---- units: rejection sampling with a real q, the draft cache ------------------------------------------------
def test_rejection_sampling_with_a_real_draft_distribution_keeps_the_target_distribution():
    """Proposals drawn from q, accepted with min(1, p/q), the residual (p - q)+ on rejection: the first
    emitted token is distributed as p0, and given the first proposal was accepted, the second as p1."""
    gen = torch.Generator().manual_seed(5)
    vocab = 6
    probs = torch.softmax(torch.randn(3, vocab, generator=gen) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(2, vocab, generator=gen) * 1.5, dim=-1)
    q[0, 1] = 0.0  # q may leave out tokens p has: the residual must bring them back
    q[0] /= q[0].sum()
    trials = 6000
    first, second = [0] * vocab, [0] * vocab
    accepted = 0
    for _ in range(trials):
        draft = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        out = accept_sampled(probs, draft, gen, q)
        first[out[0]] += 1
        if out[0] == draft[0] and len(out) > 1:
            accepted += 1
            second[out[1]] += 1
    assert chi_square_p(first, [trials * float(p) for p in probs[0]]) > 1e-3
    assert chi_square_p(second, [accepted * float(p) for p in probs[1]]) > 1e-3
    assert first[1] > 0  # only the residual emits token 1
    # the acceptance rate of a real q is sum(min(p, q)), above a point mass's p(argmax q) here
    expected = float(torch.minimum(probs[0], q[0]).sum())
    assert abs(accepted / trials - expected) < 0.03


def test_rejection_sampling_with_q_equal_to_p_accepts_everything():
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(3, 8, generator=gen), dim=-1)
    for _ in range(50):
        draft = [int(torch.multinomial(probs[i], 1, generator=gen)) for i in range(2)]
        assert accept_sampled(probs, draft, gen, probs[:2])[:2] == draft


def test_draft_cache_keeps_the_common_prefix_and_evicts_the_least_recent():
    cache = DraftCache(num_blocks=4, block_size=4)
    assert cache.sync("a", [1, 2, 3]) == 0
    assert cache.reserve("a", 6)
    cache.append("a", [1, 2, 3], real=True)
    cache.append("a", [9, 9, 9], real=False)  # proposals
    # the sequence accepted the first proposal only: 4 tokens of KV stay, the rest goes (a block back)
    assert cache.sync("a", [1, 2, 3, 9, 7, 5]) == 4
    assert cache.num_tokens("a") == 4 and len(cache.table("a")) == 1
    assert cache.reserve("b", 8) and cache.reserve("c", 4)
    cache.append("b", list(range(8)), real=True)
    assert cache.num_free_blocks == 0
    # "d" needs 2 blocks: "a" (least recently used) goes, then "b" ("c" is protected)
    assert cache.reserve("d", 8, protect=["c"])
    assert cache.sync("a", [1, 2, 3]) == 0 and cache.num_tokens("b") == 0
    with pytest.raises(ValueError, match="past its reserved"):
        cache.append("c", [1, 2, 3, 4, 5], real=True)
    assert not cache.reserve("e", 100)
    for s in "abcde":
        cache.free(s)
    cache.check()
    assert cache.num_free_blocks == 4


def test_the_draft_pool_holds_the_speculating_sequences_but_never_more_than_the_target():
    from pagoda.engine.spec_decode.config import parse_speculative_config
    from pagoda.engine.worker.draft_runner import draft_pool_blocks

    spec = parse_speculative_config(draft_config(Path("/m"), 4))  # the default schedule: up to 4 sequences
    assert draft_pool_blocks(spec, 32, 512, 16, 10**6) == 4 * 33  # ceil((512 + 4 + 1) / 16) each
    assert draft_pool_blocks(spec, 2, 512, 16, 10**6) == 2 * 33  # no more sequences than max_num_seqs
    assert draft_pool_blocks(spec, 32, 512, 16, 1024) == 64 + 4 * 2  # the target's 1024 tokens + proposals
    assert draft_pool_blocks(spec, 32, 512, 16, 16) == 33  # one full-length sequence at least


def test_a_finished_sequences_draft_kv_is_adopted_by_one_that_starts_the_same():
    cache = DraftCache(num_blocks=6, block_size=4)
    assert cache.reserve("a", 9)
    cache.append("a", [1, 2, 3, 4, 5, 6], real=True)
    cache.append("a", [7, 8], real=False)
    a_blocks = list(cache.table("a"))
    cache.retire("a")  # its 6 real tokens (2 blocks) stay, the proposals' third block goes back
    assert cache.num_live == 0 and cache.num_free_blocks == 4
    cache.check()
    # a new sequence sharing 5 tokens takes the 2 blocks, holding 5 tokens (the 6th is overwritten)
    assert cache.adopt("b", [1, 2, 3, 4, 5, 9, 9]) == 5
    assert cache.table("b") == a_blocks[:2] and cache.num_tokens("b") == 5
    assert cache.adopt("b", [1, 2, 3]) == 0  # only a sequence holding nothing adopts
    cache.free("b")
    # nothing in common: nothing adopted; retired blocks are the first the pool takes back
    assert cache.reserve("c", 8)
    cache.append("c", [5, 5, 5], real=True)
    cache.retire("c")
    assert cache.adopt("d", [6, 6]) == 0
    assert cache.reserve("d", 24)  # all 6 blocks: the retired two are freed for it
    cache.free("d")
    cache.check()
    assert cache.num_free_blocks == 6


def test_a_layer_draft_is_the_checkpoints_first_layers(tmp_path):
    src = _conftest().make_tiny_model(tmp_path, "llama", Path("/nonexistent"), num_hidden_layers=3)
    draft = write_layer_draft(src, tmp_path / "draft", 1)
    from safetensors import safe_open

    with safe_open(draft / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert any(k.startswith("model.layers.0.") for k in keys)
    assert not any(k.startswith(("model.layers.1.", "model.layers.2.")) for k in keys)
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= keys
    assert json.loads((draft / "config.json").read_text())["num_hidden_layers"] == 1
    with pytest.raises(ValueError, match="1 to 3"):
        write_layer_draft(src, tmp_path / "bad", 4)


def test_engine_config_takes_a_draft_model():
    cfg = EngineConfig(speculative_config=draft_config(Path("/m"), 3))
    assert (cfg.speculative.method, cfg.speculative.model) == ("draft_model", "/m")
    assert cfg.speculative.quantization is None
    gguf = EngineConfig(speculative_config=draft_config(Path("/m.gguf"), 3, quantization="gguf"))
    assert gguf.speculative.quantization == "gguf"
    for bad in (
        draft_config(Path("/m"), 3, quantization="awq"),
        json.dumps({"method": "ngram", "num_speculative_tokens": 2, "quantization": "gguf"}),
    ):
        with pytest.raises(ValueError, match="quantization is the draft model's"):
            EngineConfig(speculative_config=bad)


# ---- the default model with a draft of its first layers -------------------------------------------------------
@pytest.fixture(scope="module")
def smol(tmp_path_factory, default_model_dir) -> dict[bool, LLMEngine]:
    draft = write_layer_draft(default_model_dir, tmp_path_factory.mktemp("smol-draft"), 12)
    base = dict(device="cpu", dtype="float32", max_model_len=320, kv_cache_memory_bytes=48 << 20)
    counts = Counts()
    engines = {
        False: LLMEngine(EngineConfig(**base)),
        True: LLMEngine(
            EngineConfig(**base, speculative_config=draft_config(draft, 3)), stat_loggers=[counts]
        ),
    }
    engines[True].counts = counts
    yield engines
    for eng in engines.values():
        eng.core.close()


def test_greedy_with_a_draft_model_is_greedy_without_on_the_default_model(smol):
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
    tokenizer = smol[True].tokenizer
    full = [tokenizer.encode(p) + out for p, out in zip(prompts, spec, strict=True)]
    assert assert_cache_holds_only_real_tokens(smol[True], full) > 0
    assert_draft_cache_empty(smol[True])


# ---- a tiny model: random prompts, preemption, prefix caching -----------------------------------------------
@pytest.fixture(scope="module")
def tiny_engines(tmp_path_factory, default_model_dir):
    tmp = tmp_path_factory.mktemp("spec-draft")
    path = _conftest().make_tiny_model(
        tmp, "llama", default_model_dir, seed=3, vocab_size=TINY_VOCAB, num_hidden_layers=3
    )
    draft = write_layer_draft(path, tmp / "draft", 2)
    base = dict(
        model=str(path), device="cpu", dtype="float32", max_model_len=96, block_size=8, max_num_seqs=6,
        kv_cache_memory_bytes=28 * 8 * 768, skip_tokenizer_init=True, enable_prefix_caching=True,
    )  # fmt: skip
    spec = draft_config(draft, 4, num_speculative_tokens_per_batch_size=[[1, 64, 4]])
    counts = Counts()
    engines = {
        False: LLMEngine(EngineConfig(**base)),
        True: LLMEngine(EngineConfig(**base, speculative_config=spec), stat_loggers=[counts]),
    }
    engines[True].counts = counts
    engines["path"] = path
    yield engines
    for eng in (engines[False], engines[True]):
        eng.core.close()


@st.composite
def workloads(draw):
    """3-5 requests of random tokens, some sharing a prefix with the one before."""
    n = draw(st.integers(3, 5))
    prompts, params = [], []
    for i in range(n):
        body = draw(st.lists(st.integers(3, TINY_VOCAB - 1), min_size=4, max_size=30))
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
    assert_draft_cache_empty(tiny_engines[True])


def test_the_property_workload_preempts_hits_the_prefix_cache_and_speculates(tiny_engines):
    """The property test is only worth something if its engines preempt, hit the target's prefix cache
    (the draft then catches up on tokens it never saw) and accept proposals."""
    rng = random.Random(0)
    shared = [rng.randrange(3, TINY_VOCAB) for _ in range(24)]
    prompts = [shared + [rng.randrange(3, TINY_VOCAB) for _ in range(4)] for _ in range(5)]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=40) for _ in prompts]
    eng = tiny_engines[True]
    preempted, accepted = eng.scheduler.total_preemptions, eng.counts.accepted
    hits = eng.counts.prefix_hits
    assert run(eng, prompts, params) == run(tiny_engines[False], prompts, params)
    assert eng.scheduler.total_preemptions > preempted
    assert eng.counts.accepted > accepted
    assert eng.counts.prefix_hits > hits
    assert_draft_cache_empty(eng)


def test_sampled_tokens_keep_their_distribution_with_the_drafts_q(tiny_engines):
    """Sampling with and without the draft model: the second and third output tokens' distributions (after
    tokens that may have been accepted proposals) agree by a chi-square test; proposals were both accepted
    and rejected, and the sampled proposals carried the draft's q (not a point mass)."""
    prompt = [5, 9, 13, 17, 21, 25, 29, 33]
    trials = 160
    eng = tiny_engines[True]
    seen_q = []
    scheduler = eng.scheduler
    original = scheduler.proposer.probs

    def spy(seq, n):
        q = original(seq, n)
        seen_q.append(q)
        return q

    scheduler.proposer.probs = spy
    samples = {}
    try:
        for mode in (False, True):
            params = [
                SamplingParams(temperature=0.9, max_tokens=3, ignore_eos=True, seed=s) for s in range(trials)
            ]
            before = (eng.counts.accepted, eng.counts.draft_tokens)
            outs = run(tiny_engines[mode], [prompt] * trials, params)
            samples[mode] = [(o[1], o[2]) for o in outs]
            if mode:
                accepted, proposed = eng.counts.accepted - before[0], eng.counts.draft_tokens - before[1]
                assert 0 < accepted < proposed
    finally:
        del scheduler.proposer.probs
    assert seen_q and all(q is not None and q.shape[1] >= TINY_VOCAB for q in seen_q)
    assert all(torch.allclose(q.sum(dim=-1), torch.ones(q.shape[0]), atol=1e-4) for q in seen_q)
    for pos in (0, 1):
        a = [[s[pos] for s in samples[False]].count(t) for t in range(TINY_VOCAB)]
        b = [[s[pos] for s in samples[True]].count(t) for t in range(TINY_VOCAB)]
        pooled = [(x + y) / 2 for x, y in zip(a, b, strict=True)]
        assert chi_square_p(b, pooled) > 1e-3
        assert sum(1 for x in a if x) > 1  # a real distribution, not a point mass
    assert_draft_cache_empty(eng)


def test_a_draft_of_another_vocabulary_is_refused(tiny_engines, tmp_path, default_model_dir):
    other = _conftest().make_tiny_model(tmp_path, "llama", default_model_dir, vocab_size=TINY_VOCAB * 2)
    cfg = EngineConfig(
        model=str(tiny_engines["path"]), device="cpu", dtype="float32", max_model_len=64,
        kv_cache_memory_bytes=1 << 20, skip_tokenizer_init=True, speculative_config=draft_config(other, 2),
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"vocabulary of 128 tokens and the target 64.*share the target's"):
        LLMEngine(cfg)
    short = _conftest().make_tiny_model(
        tmp_path, "llama", default_model_dir, vocab_size=TINY_VOCAB, max_position_embeddings=32
    )
    cfg.speculative_config = draft_config(short, 2)
    with pytest.raises(ValueError, match="has 32 positions, fewer than max_model_len 64"):
        LLMEngine(cfg)


# ---- the CRD: spec.engine.speculative with a draft model -------------------------------------------------------
def test_the_operator_renders_a_draft_model_and_refuses_one_without_a_model():
    from pagoda.engine.spec_decode.config import parse_speculative_config
    from pagoda.operator.spec import SpecError, parse_spec
    from pagoda_testkit import example

    body = example("llama-3.1-8b-h100-nvme.yaml")
    body["spec"].setdefault("engine", {})["speculative"] = {
        "method": "draft_model",
        "model": "/models/draft",
        "numSpeculativeTokens": 3,
    }
    value = parse_spec(body["spec"]).engine.speculative.to_json()
    parsed = parse_speculative_config(value)
    assert (parsed.method, parsed.model, parsed.num_speculative_tokens) == ("draft_model", "/models/draft", 3)
    for bad, words in (
        ({"method": "draft_model"}, "needs model"),
        ({"method": "ngram", "model": "/models/draft"}, "model is for method draft_model"),
        ({"method": "draft_model", "model": "/m", "promptLookupMin": 2}, "are for method ngram"),
    ):
        body["spec"]["engine"]["speculative"] = bad
        with pytest.raises(SpecError, match=words):
            parse_spec(body["spec"])


def test_a_proposal_made_twice_for_the_same_tokens_is_the_same(tiny_engines):
    """A sequence proposed for but not scheduled (the step's budget ran out) is asked again with the same
    tokens: the draft feeds its last token again and proposes the same, its proposals' KV dropped."""
    from types import SimpleNamespace

    proposer = tiny_engines[True].scheduler.proposer
    req = SimpleNamespace(params=SamplingParams(temperature=0.0))
    seq = SimpleNamespace(seq_id="twice", token_ids=[5, 9, 13, 17, 21, 25], generator=None)
    seq.num_tokens = len(seq.token_ids)
    proposer.prepare([(req, seq, 3)])
    first = proposer(seq, 3)
    assert len(first) == 3 and proposer.cache.num_tokens("twice") == 6 + 2
    proposer.prepare([(req, seq, 3)])
    assert proposer(seq, 3) == first and proposer.cache.num_tokens("twice") == 6 + 2
    proposer.free(seq)
    assert_draft_cache_empty(tiny_engines[True])


def test_a_new_sequence_adopts_a_finished_ones_draft_kv_and_computes_only_the_rest(tiny_engines):
    from types import SimpleNamespace

    proposer = tiny_engines[True].scheduler.proposer
    req = SimpleNamespace(params=SamplingParams(temperature=0.0))

    def seq(seq_id: str, tokens: list[int]) -> SimpleNamespace:
        return SimpleNamespace(seq_id=seq_id, token_ids=tokens, num_tokens=len(tokens), generator=None)

    first = seq("first", [7, 11, 15, 19, 23, 27, 31])
    proposer.prepare([(req, first, 2)])
    proposer.free(first)
    fed = []
    forward = proposer._forward
    proposer._forward = lambda ids, chunks, starts: (
        fed.append([len(c) for c in chunks]) or forward(ids, chunks, starts)
    )
    try:
        before = proposer.cache.adopted_tokens
        second = seq("second", [*first.token_ids, 40, 41])
        proposer.prepare([(req, second, 2)])
    finally:
        del proposer._forward
    assert proposer.cache.adopted_tokens - before == 7
    assert fed == [[2], [1]]  # the two new tokens, then one proposal fed
    assert len(proposer(second, 2)) == 2
    proposer.free(second)
    assert_draft_cache_empty(tiny_engines[True])
