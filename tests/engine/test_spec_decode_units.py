"""Speculative decoding's parts on their own: the config at the door, n-gram lookup, acceptance (greedy by
equality; sampled by rejection sampling, checked with a chi-square test), and giving back rejected slots."""

from __future__ import annotations

import json

import pytest
import torch
from pagoda.engine.config import EngineConfig
from pagoda.engine.kv_cache.manager import KVCacheManager
from pagoda.engine.spec_decode.acceptance import accept_greedy, accept_sampled
from pagoda.engine.spec_decode.config import DEFAULT_MAX_BATCH, parse_speculative_config
from pagoda.engine.spec_decode.ngram import propose_ngram
from pagoda_testkit.chi_square import chi_square_p


# ---- config ----------------------------------------------------------------------------------------------
def test_ngram_config_defaults_and_bounds():
    spec = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 3)
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)  # vLLM's default when neither is given
    assert parse_speculative_config({"model": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    one = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (2, 2)
    assert spec.tokens_for_batch(1) == 3 and spec.tokens_for_batch(DEFAULT_MAX_BATCH) == 3
    assert spec.tokens_for_batch(DEFAULT_MAX_BATCH + 1) == 0  # turned down as the batch fills
    sched = parse_speculative_config(
        {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "num_speculative_tokens_per_batch_size": [[1, 2, 4], [3, 16, 2]],
        }
    )
    assert [sched.tokens_for_batch(b) for b in (1, 2, 3, 16, 17)] == [4, 4, 2, 2, 0]
    assert parse_speculative_config(None) is None and parse_speculative_config("") is None


@pytest.mark.parametrize(
    "raw, words",
    [
        ("not json", "must be JSON"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of"),
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "from 1 to"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "<="),
        ('{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}', "unsupported key(s) typo"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs model"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[3, 1, 2]]}', "rows"),
    ],
)  # fmt: skip
def test_bad_configs_are_refused_with_the_reason(raw, words):
    with pytest.raises(ValueError) as exc:
        parse_speculative_config(raw)
    assert words in str(exc.value)


NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 2})


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"async_scheduling": True}, "async_scheduling"),
        ({"enable_lora": True}, "enable_lora"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ],
)  # fmt: skip
def test_engine_config_refuses_what_speculation_does_not_do(extra, words):
    with pytest.raises(ValueError) as exc:
        EngineConfig(**{"speculative_config": NGRAM, **extra})
    assert "speculative_config" in str(exc.value) and words in str(exc.value)


def test_engine_config_takes_a_dict_as_json():
    cfg = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert json.loads(cfg.speculative_config)["num_speculative_tokens"] == 3
    assert cfg.speculative.num_speculative_tokens == 3


# ---- n-gram lookup ---------------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_earliest_match():
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 2, 3]
    # suffix [2, 3] first occurs at 1: what follows is 4, 5, 9
    assert propose_ngram(tokens, 3, 1, 2) == [4, 5, 9]
    # the longest suffix wins: [4, 2, 3] never occurred before, [3] ... size 2 is tried first
    assert propose_ngram([*tokens, 4], 2, 2, 3) == [5, 9]  # [2, 3, 4] at 1 -> 5, 9
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []  # nothing repeats
    assert propose_ngram([7, 7], 4, 1, 1) == [7]  # only what exists after the match
    assert propose_ngram([5, 1, 2, 8, 1, 2], 0, 1, 2) == []
    assert propose_ngram([1, 2, 1, 2], 5, 3, 3) == []  # min size 3 does not match


# ---- acceptance ------------------------------------------------------------------------------------------
def test_greedy_acceptance_keeps_the_matching_prefix_and_the_targets_next_token():
    target = [3, 4, 7, 1]  # the argmax at each scored position
    assert accept_greedy(target, [3, 4, 5]) == [3, 4, 7]  # 5 rejected: the target's 7 instead
    assert accept_greedy(target, [3, 4, 7]) == [3, 4, 7, 1]  # all accepted, plus the bonus token
    assert accept_greedy(target, [9, 4, 7]) == [3]
    assert accept_greedy(target[:1], []) == [3]


def test_rejection_sampling_keeps_the_target_distribution():
    """Point-mass drafts: the first emitted token is distributed as p0 (whatever the draft), and given that
    the draft was accepted, the second as p1; a chi-square test against the exact distributions."""
    gen = torch.Generator().manual_seed(1)
    vocab = 6
    probs = torch.softmax(torch.randn(3, vocab, generator=gen) * 1.5, dim=-1)
    draft = [int(probs[0].argmax()), 0]
    trials = 6000
    first, second = [0] * vocab, [0] * vocab
    for _ in range(trials):
        out = accept_sampled(probs, draft, gen)
        first[out[0]] += 1
        if out[0] == draft[0]:
            second[out[1]] += 1
        assert 1 <= len(out) <= 3
    assert chi_square_p(first, [trials * float(p) for p in probs[0]]) > 1e-3
    kept = sum(second)
    assert chi_square_p(second, [kept * float(p) for p in probs[1]]) > 1e-3
    # a draft with target probability 0 is never accepted
    zero = torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]], dtype=torch.float64)
    assert all(accept_sampled(zero, [2], gen)[0] != 2 for _ in range(200))


def test_rejection_sampling_would_notice_a_biased_sampler():
    """The test above has teeth: always accepting the draft gives a distribution the chi-square refuses."""
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    trials = 4000
    biased = [0] * 4
    gen = torch.Generator().manual_seed(0)
    for _ in range(trials):  # "accept if u < 0.5 + p/2": too many acceptances of token 0
        u = float(torch.rand((), generator=gen))
        tok = 0 if u < 0.5 + 0.2 else int(torch.multinomial(probs, 1, generator=gen))
        biased[tok] += 1
    assert chi_square_p(biased, [trials * float(p) for p in probs]) < 1e-6


# ---- rejected slots --------------------------------------------------------------------------------------
def test_truncate_gives_back_whole_blocks_past_the_accepted_tokens_unhashed():
    kv = KVCacheManager(16, 4)
    tokens = list(range(100, 106))
    kv.get_computed_tokens("s", tokens)
    assert kv.allocate_slots("s", 6)
    kv.cache_blocks("s", tokens, 5)  # one full block of computed tokens
    assert kv.allocate_slots("s", 6 + 5)  # the next token and 5 proposed: 3 blocks
    free_before = kv.num_free_blocks
    table = kv.get_block_table("s")
    assert len(table) == 3
    kv.truncate("s", 7)  # 1 proposal accepted: 7 tokens hold KV
    assert kv.get_block_table("s") == table[:2] and kv.num_free_blocks == free_before + 1
    # only the block full of computed tokens was offered to the cache, never the rejected slots' ones
    assert [b.block_id for b in kv.block_pool.cached.values()] == table[:1]
    kv.check_invariants()
    with pytest.raises(ValueError):
        kv.truncate("s", 2)  # into a cached block: a caller bug


# ---- metrics ----------------------------------------------------------------------------------------------
def test_spec_decode_counters_are_vllms_names_and_values():
    from pagoda.engine.core.stats import IterationStats, SchedulerStats, SpecDecodingStats
    from pagoda.engine.metrics import PrometheusStatLogger
    from prometheus_client.parser import text_string_to_metric_families

    e = PrometheusStatLogger("m", max_model_len=64)
    e.record(SchedulerStats(), IterationStats(spec_decoding=SpecDecodingStats(3, 9, [3, 2])))
    e.record(SchedulerStats(), IterationStats(spec_decoding=SpecDecodingStats(1, 3, [1, 1, 1])))
    e.record(SchedulerStats(), IterationStats())  # a step that verified nothing
    got = {
        (s.name, s.labels.get("position")): s.value
        for family in text_string_to_metric_families(e.render().decode())
        for s in family.samples
        if s.name.startswith("vllm:spec_decode")
    }
    assert got == {
        ("vllm:spec_decode_num_drafts_total", None): 4,
        ("vllm:spec_decode_num_draft_tokens_total", None): 12,
        ("vllm:spec_decode_num_accepted_tokens_total", None): 8,
        ("vllm:spec_decode_num_accepted_tokens_per_pos_total", "0"): 4,
        ("vllm:spec_decode_num_accepted_tokens_per_pos_total", "1"): 3,
        ("vllm:spec_decode_num_accepted_tokens_per_pos_total", "2"): 1,
    }


def test_every_proposed_position_is_exported_at_zero_before_any_draft():
    """A dashboard's per-position panel has its series from the start (a labelled counter has no sample until
    its child exists); one position per token the config may propose, none without speculation."""
    from pagoda.engine.metrics import PrometheusStatLogger
    from prometheus_client.parser import text_string_to_metric_families

    def per_pos(e: PrometheusStatLogger) -> dict:
        return {
            s.labels["position"]: s.value
            for family in text_string_to_metric_families(e.render().decode())
            for s in family.samples
            if s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"
        }

    assert per_pos(PrometheusStatLogger("m", max_model_len=64, num_speculative_tokens=3)) == {
        "0": 0,
        "1": 0,
        "2": 0,
    }
    assert per_pos(PrometheusStatLogger("m", max_model_len=64)) == {}
