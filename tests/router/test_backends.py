"""Replica bookkeeping (router/backends.py): load from /metrics text, ejection after failed checks."""

from __future__ import annotations

import asyncio
import socket

from pagoda.router.backends import Backend, BackendPool, parse_load
from pagoda.router.config import RouterConfig
from pagoda.router.policies import Router

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting_by_priority{engine="0"} 7.0
vllm:num_preemptions_total{engine="0"} 9.0
"""


def test_load_is_running_plus_waiting():
    assert parse_load(METRICS) == 5
    b = Backend("http://a", healthy=True, scraped_load=5, inflight=2)
    assert b.load == 7 and b.routable


def test_the_routers_own_requests_count_once():
    """The replica's running + waiting already includes the router's open requests: the load is the other
    clients' share of the scrape plus what the router has open now, not the scrape plus the open ones."""
    b = Backend("http://a", healthy=True, scraped_load=5, inflight=2, inflight_at_scrape=2)
    assert b.load == 5  # 3 from other clients, 2 of ours
    b.inflight = 4  # two more sent since the scrape
    assert b.load == 7
    b.inflight = 0  # all of ours finished: the scrape is stale, the other clients' 3 remain
    assert b.load == 3
    b.scraped_load, b.inflight_at_scrape, b.inflight = 1, 2, 1  # ours not yet counted by the replica
    assert b.load == 1


def test_a_replica_busy_only_with_the_routers_requests_keeps_its_prefix():
    """Two requests open at the replica that holds the prefix (and scraped there) against an idle one: the
    load gap is 2, within the default slack of 2, so the conversation stays. Counting them twice made it 4
    and sent the turn to a replica without its history (a full prefill)."""
    chain = [f"{i:064x}" for i in range(1, 9)]
    warm = Backend("http://warm", healthy=True, scraped_load=2, inflight=2, inflight_at_scrape=2)
    warm.index.tiers["device"] = set(chain)
    cold = Backend("http://cold", healthy=True)
    d = Router("prefix", load_slack=2).choose([warm.candidate(), cold.candidate()], chain, 8 * 16 + 5)
    assert (d.name, d.reason) == ("http://warm", "prefix_hit")


def test_one_slow_check_keeps_a_replica_two_eject_it_a_refusal_ejects_at_once():
    b = Backend("http://a", healthy=True)
    b.check_failed("timeout")
    assert b.routable
    b.check_failed("timeout")
    assert not b.routable and b.last_error == "timeout"
    c = Backend("http://c", healthy=True)
    c.check_failed("connection refused", refused=True)
    assert not c.routable
    d = Backend("http://d", healthy=True, draining=True)
    assert not d.routable


def test_backend_dns_follows_the_services_records(monkeypatch):
    """--backend-dns: every A/AAAA record of the headless Service is a replica; records that appear (scale
    up) are added, records that go (scale down) are dropped, a failed lookup keeps the last known set, and
    a static --backend is never dropped by DNS."""
    config = RouterConfig(
        backends=["http://10.0.0.9:8000"], backend_dns=["llm-headless.ns.svc:8000"]
    ).validate()
    pool = BackendPool(config)
    records: list = []

    async def getaddrinfo(host, port, type=0, **_):  # noqa: A002 - the name asyncio uses
        assert (host, port, type) == ("llm-headless.ns.svc", 8000, socket.SOCK_STREAM)
        if records is None:
            raise socket.gaierror("temporary failure in name resolution")
        return [
            (fam, socket.SOCK_STREAM, 6, "", (ip, port) if fam == socket.AF_INET else (ip, port, 0, 0))
            for fam, ip in records
        ]

    async def resolve(new) -> set[str]:
        nonlocal records
        records = new
        monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", getaddrinfo)
        await pool.resolve_dns()
        return set(pool.backends)

    async def scenario() -> None:
        v4 = socket.AF_INET
        got = await resolve([(v4, "10.0.0.5"), (v4, "10.0.0.6")])
        assert got == {"http://10.0.0.9:8000", "http://10.0.0.5:8000", "http://10.0.0.6:8000"}
        kept = pool.backends["http://10.0.0.5:8000"]
        got = await resolve([(v4, "10.0.0.5"), (v4, "10.0.0.6"), (socket.AF_INET6, "fd00::7")])
        assert "http://[fd00::7]:8000" in got and pool.backends["http://10.0.0.5:8000"] is kept
        got = await resolve(None)  # DNS down: nothing changes
        assert "http://[fd00::7]:8000" in got and len(got) == 4
        got = await resolve([(v4, "10.0.0.6"), (v4, "10.0.0.9")])  # scaled down; the static one is in DNS
        assert got == {"http://10.0.0.9:8000", "http://10.0.0.6:8000"}
        got = await resolve([(v4, "10.0.0.6")])  # ... and leaves it again: it stays, being static
        assert got == {"http://10.0.0.9:8000", "http://10.0.0.6:8000"}

    asyncio.run(scenario())


def test_an_adapters_requests_go_to_the_replicas_that_have_it_with_its_chain():
    from pagoda.engine.kv_cache.hashing import adapter_chain_root, hash_full_blocks
    from pagoda.router.backends import adapter_holders, checked_info
    from pagoda.router.chain import chain_of

    root = adapter_chain_root("sql-weights")
    info = {"block_size": 4, "extra_keys": ["m"], "lora_adapters": {"sql": root.hex()}}
    holder = Backend("http://a", healthy=True, info=checked_info(info, "http://a"))
    other = Backend("http://b", healthy=True, info=checked_info({"block_size": 4, "extra_keys": ["m"]}, "b"))
    assert adapter_holders([holder, other], "sql") == ([holder], root)
    assert adapter_holders([holder, other], "base-model") == ([holder, other], None)
    assert adapter_holders([other], "sql") == ([other], None)  # nobody has it: every replica (it answers 404)
    ids = list(range(10))
    assert chain_of(ids, 4, ("m",), root) == [h.hex() for h in hash_full_blocks(ids, 4, ("m",), parent=root)]
    assert chain_of(ids, 4, ("m",), root) != chain_of(ids, 4, ("m",))
    # a malformed adapter list is ignored, the rest of the answer kept
    bad = checked_info({**info, "lora_adapters": {"sql": "not-a-hash"}}, "http://c")
    assert bad["lora_adapters"] == {} and bad["block_size"] == 4
