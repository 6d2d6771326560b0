"""Prefill/decode KV transfer inside one process: the block stores, the TCP protocol, the record checks, and
two engine cores (producer, consumer) giving the same greedy tokens as one engine, with the consumer
computing only what the transfer did not bring."""

from __future__ import annotations

import json
import random
import socket
import threading
import time

import pytest
import torch
from pagoda.engine.config import EngineConfig
from pagoda.engine.core.engine_core import EngineCore
from pagoda.engine.core.messages import EngineCoreRequest
from pagoda.engine.kv_cache.hashing import BlockHash
from pagoda.engine.kv_transfer.blocks import HeldBlocks, StagedBlocks
from pagoda.engine.kv_transfer.remote import (
    KVTransferServing,
    RemotePrefill,
    checked_prefix,
    split_host_port,
)
from pagoda.engine.kv_transfer.wire import BlockServer, TransferError, fetch_blocks
from pagoda.engine.offload.disk_tier import decode_block, encode_block
from pagoda.engine.sampling_params import SamplingParams
from pagoda_testkit.processes import free_port
from pagoda_testkit.tiny_llama import tiny_llama


def h(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 32)


def block(value: float, shape=(2, 2, 4, 2, 8)) -> torch.Tensor:
    return torch.full(shape, value, dtype=torch.float32)


# -- stores ------------------------------------------------------------------------------------------------
def test_held_blocks_are_fetched_once_and_released_after_their_time() -> None:
    held = HeldBlocks(hold_seconds=0.2, max_bytes=1 << 20)
    held.put("a", [(h(1), block(1.0))])
    held.put("b", [(h(2), block(2.0))])
    got = held.take("a")
    assert got is not None and torch.equal(got[0][1], block(1.0))
    assert held.take("a") is None  # released by the fetch
    time.sleep(0.3)
    assert held.take("b") is None and held.expired == 1 and held.used_bytes == 0


def test_held_blocks_drop_the_oldest_past_the_budget() -> None:
    one = block(1.0).numel() * 4
    held = HeldBlocks(hold_seconds=60, max_bytes=2 * one)
    for i in range(3):
        held.put(str(i), [(h(i), block(float(i)))])
    assert held.take("0") is None and held.take("1") is not None and held.take("2") is not None
    assert held.used_bytes == 0


def test_staged_blocks_stay_within_their_budget() -> None:
    one = block(1.0).numel() * 4
    staged = StagedBlocks(max_bytes=2 * one)
    for i in range(3):
        staged.put(h(i), block(float(i)))
    assert h(0) not in staged and h(1) in staged and h(2) in staged and staged.used_bytes == 2 * one


# -- records and the wire ----------------------------------------------------------------------------------
def test_a_record_fails_on_any_flipped_payload_byte_and_on_another_identity() -> None:
    data = torch.randn(2, 2, 4, 2, 8)
    raw = encode_block("model-a", h(7), data)
    key, back = decode_block(raw, "model-a", tuple(data.shape), torch.float32)
    assert key == h(7) and torch.equal(back, data)
    for pos in (len(raw) - 1, len(raw) - data.numel() * 4):
        bad = bytearray(raw)
        bad[pos] ^= 0x10
        with pytest.raises(ValueError, match="checksum"):
            decode_block(bytes(bad), "model-a", tuple(data.shape), torch.float32)
    with pytest.raises(ValueError, match="identity"):
        decode_block(raw, "model-b", tuple(data.shape), torch.float32)
    with pytest.raises(ValueError, match="truncated"):
        decode_block(raw[:-4], "model-a", tuple(data.shape), torch.float32)


def test_the_server_side_checksum_pass_keeps_the_records_before_the_first_bad_one() -> None:
    records = [encode_block("id", h(i), block(float(i))) for i in range(4)]
    assert checked_prefix(records) == (records, 0, None)
    bad = bytearray(records[2])
    bad[-1] ^= 0x80
    good, dropped, why = checked_prefix([*records[:2], bytes(bad), records[3]])
    assert good == records[:2] and dropped == 2 and "checksum" in why
    # what it let through still gets the header checks in the core (without hashing again)
    with pytest.raises(ValueError, match="identity"):
        decode_block(records[0], "other", (2, 2, 4, 2, 8), torch.float32, checksum=False)


def test_the_block_server_hands_a_request_its_blocks_once() -> None:
    held = HeldBlocks()
    server = BlockServer(held, "id", "127.0.0.1", 0)
    try:
        blocks = [(h(1), block(1.0)), (h(2), block(2.0))]
        held.put("req-1", blocks)
        records = fetch_blocks("127.0.0.1", server.port, "req-1", timeout=10)
        got = [decode_block(r, "id", (2, 2, 4, 2, 8), torch.float32) for r in records]
        assert [k for k, _ in got] == [h(1), h(2)] and torch.equal(got[1][1], block(2.0))
        with pytest.raises(TransferError, match="no blocks held"):
            fetch_blocks("127.0.0.1", server.port, "req-1", timeout=10)
        assert server.sent_blocks == 2 and server.misses == 1
    finally:
        server.close()
    with pytest.raises(OSError):  # nothing listens any more
        fetch_blocks("127.0.0.1", server.port, "req-1", timeout=5)


def test_the_block_server_releases_unfetched_blocks_on_time() -> None:
    held = HeldBlocks(hold_seconds=0.2)
    server = BlockServer(held, "id", "127.0.0.1", 0)
    try:
        held.put("never-fetched", [(h(1), block(1.0))])
        deadline = time.monotonic() + 10
        while len(held) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(held) == 0 and held.used_bytes == 0 and held.expired == 1
    finally:
        server.close()


def test_a_peer_that_is_not_a_block_server_is_a_transfer_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]

        def answer() -> None:
            conn, _ = s.accept()
            conn.recv(1024)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            conn.close()

        t = threading.Thread(target=answer)
        t.start()
        with pytest.raises(TransferError, match="magic"):
            fetch_blocks("127.0.0.1", port, "x", timeout=10)
        t.join()


# -- the server side's parsing -----------------------------------------------------------------------------
def test_prefiller_addresses_and_which_requests_go_remote() -> None:
    assert split_host_port("10.0.0.5:8000") == ("10.0.0.5", 8000)
    assert split_host_port("[fd00::1]:8000") == ("fd00::1", 8000)
    for bad in ("10.0.0.5", ":80", "host:0", "host:http"):
        with pytest.raises(ValueError):
            split_host_port(bad)

    class Engine:
        class info:  # noqa: N801 - an EngineInfo stand-in
            kv_transfer = {"kv_role": "kv_consumer", "kv_port": None}

    serving = KVTransferServing(Engine())
    assert serving.consumes and not serving.produces
    assert serving.remote_of({}, None) is None
    assert serving.remote_of({"x-prefiller-host-port": "bad"}, None) is None
    remote = serving.remote_of({"x-prefiller-host-port": "p:8000"}, None)
    assert remote == RemotePrefill(("p", 8000), None) and not remote.fetch_ready
    body = {"do_remote_prefill": True, "remote_host": "p", "remote_port": 14579, "remote_request_id": "r"}
    assert serving.remote_of({}, body).fetch_ready
    assert not serving.exports({"do_remote_decode": True})  # a consumer holds nothing for others


# -- two engine cores ---------------------------------------------------------------------------------------
def _core(model, role: str | None = None, port: int = 0, async_scheduling: bool = False) -> EngineCore:
    kv = None
    if role is not None:
        kv = json.dumps({"kv_role": role, "kv_port": port or 1, "kv_ip": "127.0.0.1"})
    cfg = EngineConfig(
        model=str(model), device="cpu", dtype="float32", max_model_len=256, kv_cache_memory_bytes=4 << 20,
        kv_transfer_config=kv, async_scheduling=async_scheduling,
    )  # fmt: skip
    return EngineCore(cfg)


def _run(
    core: EngineCore, rid: str, prompt: list[int], n: int, export: bool = False
) -> tuple[list[int], int]:
    """Greedy tokens of one request run alone, and the prompt tokens it found cached."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    core.add_request(EngineCoreRequest(rid, prompt, params, n, time.monotonic(), kv_export=export))
    tokens, cached = [], 0
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            if out.request_id == rid and out.seqs:
                tokens += out.seqs[0].token_ids
                cached = out.num_cached_tokens
    return tokens, cached


@pytest.fixture(scope="module")
def cores(tmp_path_factory, default_model_dir):
    model = tiny_llama(tmp_path_factory.mktemp("kvt") / "llama", default_model_dir)
    port = free_port()
    made = {
        "plain": _core(model),
        "producer": _core(model, "kv_producer", port),
        "port": port,
        "model": model,
    }
    made["consumer"] = _core(model, "kv_consumer")
    made["async_port"] = free_port()
    made["async_producer"] = _core(model, "kv_producer", made["async_port"], async_scheduling=True)
    yield made
    for key in ("plain", "producer", "consumer", "async_producer"):
        made[key].close()


def test_split_prefill_gives_the_unsplit_tokens_and_the_consumer_computes_only_the_rest(cores) -> None:
    rng = random.Random(1)
    prompt = [rng.randrange(3, 500) for _ in range(70)]  # 4 usable full blocks of 16, 6 tokens more
    ref, ref_cached = _run(cores["plain"], "ref", prompt, 12)
    assert ref_cached == 0
    first, _ = _run(cores["producer"], "p1", prompt, 1, export=True)
    assert first == ref[:1]
    assert cores["producer"].info.kv_transfer == {"kv_role": "kv_producer", "kv_port": cores["port"]}
    records = fetch_blocks("127.0.0.1", cores["port"], "p1", timeout=10)
    assert len(records) == 4
    assert cores["consumer"].kv_transfer_stage(records) == {"staged": 4, "rejected": 0, "error": None}
    tokens, cached = _run(cores["consumer"], "c1", prompt, 12)
    assert tokens == ref
    assert cached == 64  # the transferred blocks were loaded, not computed
    cores["consumer"].scheduler.check_invariants()


def test_a_corrupt_block_is_computed_and_the_tokens_do_not_change(cores) -> None:
    rng = random.Random(2)
    prompt = [rng.randrange(3, 500) for _ in range(50)]  # 3 usable blocks
    ref, _ = _run(cores["plain"], "ref2", prompt, 10)
    _run(cores["producer"], "p2", prompt, 1, export=True)
    records = fetch_blocks("127.0.0.1", cores["port"], "p2", timeout=10)
    bad = bytearray(records[1])
    bad[-3] ^= 0x01
    records[1] = bytes(bad)
    result = cores["consumer"].kv_transfer_stage(records)
    assert result["staged"] == 2 and result["rejected"] == 1 and "checksum" in result["error"]
    tokens, cached = _run(cores["consumer"], "c2", prompt, 10)
    assert tokens == ref
    assert cached == 16  # block 0 came over; block 1 failed, so block 2 (chained after it) is not used


def test_blocks_of_other_tokens_are_never_used(cores) -> None:
    """A producer that prefilled a different prompt (another tokenization, say) sends blocks whose hashes
    the consumer's prompt never reaches: a miss, not wrong KV."""
    rng = random.Random(3)
    prompt = [rng.randrange(3, 500) for _ in range(40)]
    other = [7, *prompt[1:]]
    ref, _ = _run(cores["plain"], "ref3", prompt, 8)
    _run(cores["producer"], "p3", other, 1, export=True)
    records = fetch_blocks("127.0.0.1", cores["port"], "p3", timeout=10)
    assert cores["consumer"].kv_transfer_stage(records)["staged"] == 2
    tokens, cached = _run(cores["consumer"], "c3", prompt, 8)
    assert tokens == ref and cached == 0


def test_an_async_scheduling_producer_holds_the_same_blocks(cores) -> None:
    """With --async-scheduling the blocks are read after the finishing step's results, before the next step
    is submitted: the same records as a synchronous producer's."""
    rng = random.Random(4)
    prompt = [rng.randrange(3, 500) for _ in range(60)]
    _run(cores["producer"], "s4", prompt, 1, export=True)
    _run(cores["async_producer"], "a4", [*prompt], 1, export=True)
    sync = fetch_blocks("127.0.0.1", cores["port"], "s4", timeout=10)
    asyn = fetch_blocks("127.0.0.1", cores["async_port"], "a4", timeout=10)
    assert len(sync) == 3 and sync == asyn


def test_an_engine_that_cannot_use_transferred_blocks_ignores_the_flag(cores) -> None:
    """Without prefix caching a received block has nowhere to go: the engine says so and prefills itself."""
    cfg = EngineConfig(
        model=str(cores["model"]), device="cpu", dtype="float32", max_model_len=256, kv_cache_memory_bytes=4 << 20,
        kv_transfer_config=json.dumps({"kv_role": "kv_consumer"}), enable_prefix_caching=False,
    )  # fmt: skip
    core = EngineCore(cfg)
    try:
        assert core.kv_transfer is None and core.info.kv_transfer is None
        assert core.scheduler.remote_blocks is None
        with pytest.raises(ValueError, match="no --kv-transfer-config"):
            core.kv_transfer_stage([])
    finally:
        core.close()
