"""A replica that restarted warm from its disk tier (its NVMe volume in Kubernetes) is preferred by the
tier-aware router for the prefixes it holds there, over a cold replica: the router learns the disk tier from
the restarted replica's snapshot, prices reading it against prefilling, and the replica serves the prefix
from disk."""

from __future__ import annotations

import httpx
import pytest
from pagoda.router.chain import ChainHasher, chain_of, load_local_tokenizer

pytestmark = pytest.mark.timeout(300)

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You are the dispatcher of a harbour: berths, cranes, tides and manifests are your trade. " * 8


def chat(url: str, question: str) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 1,
    }
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def warm_and_cold(tmp_path_factory, kit):
    log_dir = tmp_path_factory.mktemp("warm")
    disk = ["--kv-offload-disk-dir", str(log_dir / "nvme"), "--kv-offload-disk-bytes", "256MiB"]
    first, cold = kit.start_replica(log_dir, *disk), kit.start_replica(log_dir)
    procs = [first, cold]
    try:
        kit.wait_healthy(first)
        kit.wait_healthy(cold)
        chat(first.url, "Which berth is free?")
        assert first.stop() == 0  # SIGTERM: the device's cached blocks are written to the disk tier
        warm = kit.wait_healthy(kit.start_replica(log_dir, *disk, port=first.port))
        procs.append(warm)
        yield warm, cold
    finally:
        for p in procs:
            p.stop()


def test_the_restarted_replica_is_chosen_for_its_disk_prefix(warm_and_cold, tmp_path_factory, kit):
    warm, cold = warm_and_cold
    info = httpx.get(warm.url + "/v1/router_info").json()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When is high tide?"}]
    ids = ChainHasher(load_local_tokenizer(None)).token_ids("/v1/chat/completions", {"messages": messages})
    chain = chain_of(ids, info["block_size"], tuple(info["extra_keys"]))
    system_blocks = chain[: len(chain) - 2]  # the system prompt's blocks, shared with the first question
    tiers = httpx.get(warm.url + "/v1/kv_snapshot").json()["tiers"]
    assert set(system_blocks) <= set(tiers["disk"]) and not set(chain) & set(tiers["device"])
    router = kit.start_router(
        tmp_path_factory.mktemp("router"),
        [cold.url, warm.url],  # the cold one first: the choice is not the list's order
        "--policy",
        "tierAware",
        *kit.FAST,
    )
    try:
        backends = {b["url"]: b for b in kit.wait_synced(router)}
        assert backends[warm.url]["blocks"]["disk"] >= len(system_blocks)
        out = httpx.post(
            router.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": messages, "max_tokens": 1},
            timeout=120,
        ).json()
        assert router.metric("pagoda:router_routed_total", backend=warm.url) == 1
        assert router.metric("pagoda:router_decisions_total", reason="tier_hit") == 1
        # served from the disk tier, not prefilled
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * len(system_blocks)
        assert warm.metric("pagoda:offload_hits_total", tier="disk") >= 16 * len(system_blocks)
    finally:
        router.stop()
