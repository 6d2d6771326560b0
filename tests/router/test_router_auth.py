"""A replica started with --api-key behind a router given the key as the operator gives it (the
PAGODA_API_KEY environment variable): clients need the key at the router, the router's own calls to the
replica (health, metrics, router info, KV events and snapshots, the proxied requests) carry it."""

from __future__ import annotations

import httpx
import pytest
from openai import AuthenticationError, OpenAI

pytestmark = pytest.mark.timeout(300)

MODEL = "SmolLM2-135M-Instruct"
KEY = "router-e2e-key"
MESSAGES = [
    {"role": "system", "content": "You are a terse assistant for a shipping company. " * 12},
    {"role": "user", "content": "Where is my parcel?"},
]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, kit):
    log_dir = tmp_path_factory.mktemp("keyed")
    replica = kit.wait_healthy(kit.start_replica(log_dir, "--api-key", KEY))
    router = None
    try:
        router = kit.start_router(
            log_dir,
            [replica.url],
            *kit.FAST,
            env={"PAGODA_API_KEY": KEY},
        )
        yield replica, router
    finally:
        if router is not None:
            router.stop()
        replica.stop()


def test_the_replica_really_wants_the_key(keyed):
    replica, _ = keyed
    assert httpx.get(replica.url + "/v1/router_info").status_code == 401
    assert httpx.get(replica.url + "/health").status_code == 200


def test_the_router_follows_a_keyed_replica(keyed, kit):
    _, router = keyed
    (b,) = kit.wait_synced(router, api_key=KEY)
    # router info and the KV snapshot are behind the key: both were fetched
    assert b["healthy"] and b["synced"] and b["info"]["block_size"] > 0, b


def test_clients_need_the_key_at_the_router(keyed):
    _, router = keyed
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-API-Key": "wrong"}):
        r = httpx.get(router.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=router.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(router.url + "/health").status_code == 200  # open, as the replicas' is
    assert httpx.get(router.url + "/metrics").status_code == 200
    assert httpx.get(router.url + "/livez").json() == {"status": "ok", "routable": 1}  # the pod's probes
    assert httpx.get(router.url + "/v1/models", headers={"X-API-Key": KEY}).status_code == 200


def test_requests_with_the_key_are_served_and_routed_by_prefix(keyed, kit):
    replica, router = keyed
    kit.wait_synced(router, api_key=KEY)
    c = OpenAI(base_url=router.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    assert [m.id for m in c.models.list().data] == [MODEL]
    first = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert first.usage.completion_tokens >= 1
    stream = c.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [ch.usage for ch in stream if ch.usage][-1]
    # the second request found the first one's blocks: the replica served both, with the router's key
    assert usage.prompt_tokens_details.cached_tokens >= 16 * (first.usage.prompt_tokens // 16 - 1)
    state = httpx.get(router.url + "/router/state", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert state["backends"][0]["blocks"]["device"] > 0  # KV events were read with the key
    assert router.metric("pagoda:router_requests_total", code="200") == 2
    assert httpx.get(router.url + "/router/state").status_code == 401  # the router's own state too
