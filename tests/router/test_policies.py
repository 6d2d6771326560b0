"""Each routing policy on hand-built replica states (router/policies.py)."""

from __future__ import annotations

import pytest
from pagoda.router.index import BlockIndex
from pagoda.router.policies import Candidate, Router

CHAIN = [f"{i:064x}" for i in range(1, 9)]  # 8 blocks of 16 tokens
TOKENS = 8 * 16 + 5


def cand(name: str, load: int = 0, **tiers: list[str]) -> Candidate:
    idx = BlockIndex()
    for tier, hashes in tiers.items():
        idx.tiers[tier] = set(hashes)
    return Candidate(
        name,
        load=load,
        index=idx,
        block_size=16,
        prefill_tps=1000.0,
        load_tps={"host": 50_000.0, "disk": 4_000.0},
    )


def test_round_robin_takes_turns():
    r = Router("roundRobin")
    cs = [cand("a"), cand("b"), cand("c")]
    assert [r.choose(cs, CHAIN, TOKENS).name for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_least_loaded_picks_the_lowest_load_and_shares_ties():
    r = Router("leastLoaded")
    assert r.choose([cand("a", 3), cand("b", 1), cand("c", 2)], CHAIN, TOKENS).name == "b"
    names = {r.choose([cand("a", 1), cand("b", 1), cand("c", 5)], CHAIN, TOKENS).name for _ in range(4)}
    assert names == {"a", "b"}


def test_prefix_prefers_the_longest_device_prefix_within_the_load_bound():
    r = Router("prefix", load_slack=2)
    a = cand("a", 0, device=CHAIN[:2])
    b = cand("b", 2, device=CHAIN[:6])
    d = r.choose([a, b], CHAIN, TOKENS)
    assert (d.name, d.reason, d.predicted_cached_tokens) == ("b", "prefix_hit", 96)
    b.load = 3  # now beyond least load + slack: the cache hit is not worth the queue
    d = r.choose([a, b], CHAIN, TOKENS)
    assert (d.name, d.reason) == ("a", "load_bound")  # a's 2 blocks taken, b's 6 given up for load
    a.index.tiers["device"] = set(CHAIN[:6])  # the bound cost nothing: an equal prefix within it
    assert r.choose([a, b], CHAIN, TOKENS).reason == "prefix_hit"
    # a hole in the chain ends the prefix: c holds blocks 0, 1 and 3..7 -> only 2 count
    c = cand("c", 0, device=CHAIN[:2] + CHAIN[3:])
    e = cand("e", 0, device=CHAIN[:3])
    assert r.choose([c, e], CHAIN, TOKENS).name == "e"


def test_prefix_ignores_lower_tiers_and_falls_back_to_least_loaded():
    r = Router("prefix")
    d = r.choose([cand("a", 1, host=CHAIN), cand("b", 0)], CHAIN, TOKENS)
    assert (d.name, d.reason) == ("b", "no_prefix")


def test_the_last_token_is_never_counted_cached():
    r = Router("prefix")
    exact = 4 * 16  # the prompt is exactly 4 full blocks: the engine recomputes the last one
    d = r.choose([cand("a", 0, device=CHAIN)], CHAIN[:4], exact)
    assert d.predicted_cached_tokens == 3 * 16


def test_tier_aware_prices_tiers_by_measured_rates():
    r = Router("tierAware")
    host = cand("host", 0, host=CHAIN)
    disk = cand("disk", 0, disk=CHAIN)
    cold = cand("cold", 0)
    d = r.choose([cold, disk, host], CHAIN, TOKENS)
    assert (d.name, d.reason, d.tiers) == ("host", "tier_hit", {"host": 8})
    # cost = 5 missing / 1000 + 128 / 50000
    assert d.cost_s == pytest.approx(5 / 1000 + 128 / 50_000)
    # a disk read slower than prefill makes recomputing cheaper: the cold replica wins
    disk.load_tps = {"disk": 500.0}
    assert r.choose([cold, disk], CHAIN, TOKENS).name == "cold"
    # device beats host beats disk for the same prefix length
    dev = cand("dev", 0, device=CHAIN)
    d = r.choose([disk, host, dev], CHAIN, TOKENS)
    assert (d.name, d.reason) == ("dev", "device_hit")


def test_tier_aware_prefers_a_longer_disk_prefix_over_a_shorter_device_one():
    r = Router("tierAware")
    dev = cand("dev", 0, device=CHAIN[:2])
    warm = cand("warm", 0, disk=CHAIN)  # restarted warm from its NVMe volume
    d = r.choose([dev, warm], CHAIN, TOKENS)
    assert d.name == "warm" and d.predicted_cached_tokens == 128
    assert Router("prefix").choose([dev, warm], CHAIN, TOKENS).name == "dev"


def test_tier_aware_is_bounded_by_load():
    r = Router("tierAware", load_slack=1)
    d = r.choose([cand("a", 5, device=CHAIN), cand("b", 0)], CHAIN, TOKENS)
    assert (d.name, d.reason) == ("b", "load_bound")
    d = r.choose([cand("a", 5), cand("b", 0)], CHAIN, TOKENS)  # nothing given up: an ordinary miss
    assert (d.name, d.reason) == ("b", "no_prefix")


def test_predictions_count_as_device_until_they_expire():
    r = Router("prefix")
    a, b = cand("a", 0), cand("b", 0)
    b.index.predict(CHAIN[:3], now=0.0)  # long expired
    a.index.predict(CHAIN[:3])
    d = r.choose([a, b], CHAIN, TOKENS)
    assert (d.name, d.predicted_cached_tokens) == ("a", 48)


def test_no_candidate_is_an_error():
    with pytest.raises(LookupError):
        Router("tierAware").choose([], CHAIN, TOKENS)


def test_tier_aware_spreads_cold_requests_despite_noisy_rates():
    r = Router("tierAware")
    a, b, c = cand("a", 0), cand("b", 1), cand("c", 0)
    a.prefill_tps, b.prefill_tps, c.prefill_tps = 1100.0, 1000.0, 900.0  # within the 25% tie
    names = [r.choose([a, b, c], CHAIN, TOKENS).name for _ in range(4)]
    assert set(names) == {"a", "c"}  # least loaded among equals, in turn; never only the fastest


def test_a_replica_that_has_not_measured_its_rate_gets_the_others():
    """The replica holding the prefix measured a slow prefill (a busy machine); the other has measured
    nothing yet. The default rate (2,000 tokens/s) would make a full prefill there look cheaper than the
    missing block here; the replicas' median rate does not."""
    r = Router("tierAware")
    home, fresh = cand("home", 0, device=CHAIN[:7]), cand("fresh", 0)
    home.prefill_tps, fresh.prefill_tps = 100.0, None
    for _ in range(3):
        d = r.choose([fresh, home], CHAIN, TOKENS)
        assert (d.name, d.reason) == ("home", "device_hit")
    slow, fast = cand("slow", 0, device=CHAIN[:7]), cand("fast", 0)
    slow.prefill_tps, fast.prefill_tps = 100.0, 10_000.0  # clamped to 2x of the median (10,000)
    assert r.choose([fast, slow], CHAIN, TOKENS).name == "slow"
