"""What replicas tell the router is checked before it is used (router/backends.py, router/index.py): rates
and loads that are not finite non-negative numbers are ignored, and a replica's block index stays within
its bound however many blocks it reports."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer
from pagoda.router.backends import Backend, BackendPool
from pagoda.router.config import RouterConfig
from pagoda.router.index import BlockIndex
from pagoda.router.policies import Router

CHAIN = [f"{i:064x}" for i in range(1, 9)]
TOKENS = 8 * 16 + 5
HONEST = {"prefill_tokens_per_s": 2000.0, "load_tokens_per_s": {"host": 100_000.0}}
REPORTS = {  # replica -> (router info rates, /metrics text)
    "honest": (HONEST, "vllm:num_requests_running 1\n"),
    "negative": (
        {"prefill_tokens_per_s": -1e9, "load_tokens_per_s": {"host": float("nan"), "disk": 5.0}},
        "vllm:num_requests_running -40\nvllm:num_requests_waiting NaN\n",
    ),
    "text": (
        {"prefill_tokens_per_s": "fast", "load_tokens_per_s": ["host"]},
        "vllm:num_requests_running 0\n",
    ),
}


def replica_app() -> web.Application:
    """Three replicas behind one server, one path prefix each (the router appends /health etc. to a URL)."""

    def answer(text: str, content_type: str = "text/plain"):
        async def handler(_: web.Request) -> web.Response:
            return web.Response(text=text, content_type=content_type)

        return handler

    app = web.Application()
    for name, (rates, metrics) in REPORTS.items():
        info = {"block_size": 16, "extra_keys": ["m", "float32", "16"], "epoch": "e", **rates}
        body = json.dumps(info)  # NaN as JSON's NaN token, which Python's json reads back as nan
        app.router.add_get(f"/{name}/health", answer(""))
        app.router.add_get(f"/{name}/metrics", answer(metrics))
        app.router.add_get(f"/{name}/v1/router_info", answer(body, "application/json"))
    return app


async def checked_backends() -> dict[str, Backend]:
    server = TestServer(replica_app())
    await server.start_server()
    try:
        base = f"http://127.0.0.1:{server.port}"
        pool = BackendPool(RouterConfig(backends=[f"{base}/{n}" for n in REPORTS]).validate())
        pool.session = aiohttp.ClientSession()
        try:
            await pool.check_all()
        finally:
            await pool.session.close()
        return {url.rsplit("/", 1)[1]: b for url, b in pool.backends.items()}
    finally:
        await server.close()


def test_bad_rates_and_loads_are_ignored_and_cannot_win_or_break_routing():
    backends = asyncio.run(checked_backends())
    honest, negative, text = backends["honest"], backends["negative"], backends["text"]
    assert all(b.healthy and b.info for b in backends.values())
    assert honest.info["prefill_tokens_per_s"] == 2000.0 and honest.scraped_load == 1
    # a negative, NaN or non-numeric figure is dropped (the defaults apply), the sane ones are kept
    assert negative.info["prefill_tokens_per_s"] is None
    assert negative.info["load_tokens_per_s"] == {"disk": 5.0}
    assert negative.scraped_load == 0
    assert text.info["prefill_tokens_per_s"] is None and text.info["load_tokens_per_s"] == {}
    honest.index.tiers["device"] = set(CHAIN)
    router = Router("tierAware", load_slack=2)
    for _ in range(3):  # a negative rate made a negative cost that won every route; a string raised
        d = router.choose([b.candidate() for b in (negative, text, honest)], CHAIN, TOKENS)
        assert (d.name, d.reason) == (honest.url, "device_hit")


def test_the_block_index_keeps_its_bound_and_gives_lower_tiers_up_first():
    idx = BlockIndex(max_blocks=4)
    h = [f"{i:064x}" for i in range(20)]
    idx.load_snapshot({"seq": 1, "epoch": "e", "tiers": {"device": h[:2], "host": h[2:4], "disk": h[4:9]}})
    assert idx.counts() == {"device": 2, "host": 2, "disk": 0} and idx.forgotten == 5

    def stored(seq: int, tier: str, *hashes: str) -> bool:
        batch = {"seq": seq, "ts": 0, "events": [["stored", tier, x] for x in hashes]}
        return idx.apply({"epoch": "e", "resync": False, "batches": [batch]})

    assert stored(2, "device", h[10], h[11])  # device blocks push host ones out
    assert idx.counts() == {"device": 4, "host": 0, "disk": 0}
    assert stored(3, "device", h[12]) and stored(4, "disk", h[13])  # nothing below: not recorded
    assert idx.counts() == {"device": 4, "host": 0, "disk": 0} and idx.forgotten == 9
    assert idx.tiers["device"] == {h[0], h[1], h[10], h[11]}
    # malformed events are skipped, the rest of the batch still applies
    batch = {
        "seq": 5,
        "ts": 0,
        "events": [["stored", "device", ["x"]], ["bogus"], ["removed", "device", h[0]]],
    }
    assert idx.apply({"epoch": "e", "resync": False, "batches": [batch]})
    assert h[0] not in idx.tiers["device"] and idx.malformed == 2
    idx.predict(h[:6])  # predictions are bounded by the same figure
    idx.predict(h[6:12])
    assert len(idx.predicted) <= 4
