"""The tiers inside the engine, on the default model with a device pool of ten blocks so evictions happen:
greedy tokens must not change whichever floor of the pagoda a prefix comes from."""

from __future__ import annotations

import gc
import json
import logging
import os
import struct
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import torch
from pagoda.engine.frontend.llm import LLM
from pagoda.engine.kv_cache.hashing import hash_full_blocks
from pagoda.engine.offload.disk_tier import MAGIC
from pagoda.engine.sampling_params import SamplingParams

torch.set_num_threads(2)

BLOCK = 46080 * 16  # bytes of one block of SmolLM2-135M in float32 (30 layers, 3 kv heads, 64)
# float32: BLOCK is a float32 block, and the workloads below are sized in such blocks
COMMON = dict(
    device="cpu", dtype="float32", max_model_len=128, max_num_seqs=4, kv_cache_memory_bytes=10 * BLOCK
)
SHORT = SamplingParams(max_tokens=4, temperature=0)
LONG = SamplingParams(max_tokens=40, temperature=0)  # 2 x (50 + 40) tokens need 12 of the 10 blocks

TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting each step aloud. "
    "Down in the harbour the fishing boats rocked gently while gulls argued over scraps on the pier. "
    "Far beyond the breakwater a storm was gathering, its clouds stacked like grey cathedrals. "
    "In the village the baker pulled the last loaves from the oven and the school bell rang twice. "
    "Children raced along the sea wall, their kites dipping and soaring in the salty wind. "
    "An old map in the museum showed islands that no sailor had seen for a hundred years. "
)


class Tally:
    """A stat logger that adds up where cached prompt tokens came from, and preemptions."""

    def __init__(self) -> None:
        self.sources: Counter[str] = Counter()
        self.preemptions = 0

    def record(self, scheduler_stats, it) -> None:
        self.sources.update(it.cached_tokens_by_source)
        self.preemptions += it.num_preemptions


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def make_llm(**kw) -> tuple[LLM, Tally]:
    llm = LLM(**COMMON, **kw)
    tally = Tally()
    llm.engine.add_stat_logger(tally)
    return llm, tally


def run(llm: LLM, prompts, params=SHORT) -> list[list[int]]:
    return tokens(llm.generate(prompts, params, use_tqdm=False))


@pytest.fixture(scope="module")
def workload():
    llm, tally = make_llm()  # offload off, preemption by recompute: the reference
    ids = llm.get_tokenizer()(" ".join(f"Part {k}. {TEXT}" for k in range(5))).input_ids
    assert len(ids) >= 8 * 50
    a = [ids[i * 50 : (i + 1) * 50] for i in range(4)]  # four prompts of three full blocks and a bit
    b = [ids[200 + i * 50 : 250 + i * 50] for i in range(4)]
    swap = [ids[i * 50 + 7 : (i + 1) * 50 + 7] for i in range(2)]
    ref = {"a": run(llm, a), "b": run(llm, b), "swap": run(llm, swap, LONG)}
    assert tally.preemptions > 0, "the swap workload must force preemption"
    extra = llm.engine.kv.extra_keys
    del llm
    gc.collect()
    return {"a": a, "b": b, "swap": swap, "ref": ref, "extra": extra}


def test_host_tier_same_tokens_and_host_hits(workload):
    llm, tally = make_llm(kv_offload_host_bytes=40 * BLOCK)
    w = workload
    assert run(llm, w["a"]) == w["ref"]["a"]
    assert run(llm, w["b"]) == w["ref"]["b"]  # pushes a's blocks out of the ten-block pool
    assert run(llm, w["a"]) == w["ref"]["a"]
    assert tally.sources["host"] >= 16
    snap = llm.engine.get_scheduler_stats().offload["host"]
    assert snap["hits"] == tally.sources["host"] and 0 < snap["bytes_used"] <= snap["bytes_capacity"]


def test_swap_preemption_gives_the_same_tokens_as_recompute(workload):
    llm, tally = make_llm(kv_offload_host_bytes=40 * BLOCK, preemption_mode="swap")
    assert run(llm, workload["swap"], LONG) == workload["ref"]["swap"]
    assert tally.preemptions > 0
    assert tally.sources["host"] > 0  # the preempted request's blocks came back from the host tier


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("nvme")


def first_block_file(directory: Path, prompt: list[int], extra) -> Path:
    return directory / f"{hash_full_blocks(prompt, 16, extra)[0].hex()}.kv"


@pytest.fixture(scope="module")
def host_and_disk(workload, disk_dir):
    """Host tier of three blocks over a disk tier: a's blocks sink to disk while b runs."""
    llm, tally = make_llm(kv_offload_host_bytes=3 * BLOCK, kv_offload_disk_dir=str(disk_dir),
                          kv_offload_disk_bytes=200 * BLOCK)  # fmt: skip
    w = workload
    got = [run(llm, w["a"]), run(llm, w["b"])]
    llm.engine.offload.flush()
    got.append(run(llm, w["a"]))
    snap = llm.engine.get_scheduler_stats().offload
    llm.engine.close()  # writes what the device and host still hold, releases the directory lock
    del llm
    gc.collect()
    return got, tally, snap


def test_host_and_disk_same_tokens(workload, host_and_disk):
    got, _, _ = host_and_disk
    assert got == [workload["ref"]["a"], workload["ref"]["b"], workload["ref"]["a"]]


def test_prefix_evicted_to_disk_is_served_with_disk_hits(host_and_disk):
    _, tally, snap = host_and_disk
    assert tally.sources["disk"] >= 16
    assert snap["disk"]["hits"] == tally.sources["disk"]
    assert snap["disk"]["load_bytes"] > 0 and snap["disk"]["verification_failures"] == 0
    assert snap["host"]["bytes_used"] <= 3 * BLOCK


def _rewrite_identity(path: Path) -> None:
    raw = path.read_bytes()
    (hlen,) = struct.unpack_from("<I", raw, len(MAGIC))
    meta = json.loads(raw[len(MAGIC) + 4 : len(MAGIC) + 4 + hlen])
    meta["identity"] = "some-other-model" + meta["identity"][meta["identity"].index("|") :]
    new = json.dumps(meta).encode()
    path.write_bytes(MAGIC + struct.pack("<I", len(new)) + new + raw[len(MAGIC) + 4 + hlen :])


def _flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    path.write_bytes(bytes(raw))


@pytest.fixture(scope="module")
def restarted(workload, host_and_disk, disk_dir):
    """A new engine on the same directory after damaging the first block of three of a's prompts."""
    w = workload
    damage = {0: _flip, 1: lambda p: p.write_bytes(p.read_bytes()[:-1000]), 2: _rewrite_identity}
    for i, fn in damage.items():
        path = first_block_file(disk_dir, w["a"][i], w["extra"])
        assert path.exists(), "the first engine left its blocks on disk"
        fn(path)
    llm, tally = make_llm(kv_offload_host_bytes=3 * BLOCK, kv_offload_disk_dir=str(disk_dir),
                          kv_offload_disk_bytes=200 * BLOCK)  # fmt: skip
    start_loads = llm.engine.get_scheduler_stats().offload["disk"]["load_bytes"]
    got = run(llm, w["a"])
    snap = llm.engine.get_scheduler_stats().offload["disk"]
    llm.engine.close()
    return got, tally, snap, start_loads


def test_restart_serves_old_prefixes_from_disk_with_the_same_tokens(workload, restarted):
    got, tally, snap, start_loads = restarted
    assert start_loads == 0  # indexing at start reads no block
    assert got == workload["ref"]["a"]
    assert tally.sources["disk"] >= 48  # the undamaged prompt: its three full blocks


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "change the fingerprint"])
def test_damaged_blocks_are_misses_with_correct_tokens(workload, restarted, disk_dir, damage):
    got, _, snap, _ = restarted
    i = ["flip a byte", "truncate", "change the fingerprint"].index(damage)
    assert got[i] == workload["ref"]["a"][i]
    assert snap["verification_failures"] == 3
    # The damaged file was removed, then rewritten whole once the block was recomputed and evicted.
    path = first_block_file(disk_dir, workload["a"][i], workload["extra"])
    assert (
        not path.exists()
        or path.stat().st_size
        == first_block_file(disk_dir, workload["a"][3], workload["extra"]).stat().st_size
    )


def test_read_only_directory_disables_the_tier_and_serving_goes_on(workload, tmp_path, caplog):
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o555)
    if os.geteuid() == 0:  # root ignores permissions: make the directory immutable instead
        subprocess.run(["chattr", "+i", str(ro)], check=True)
    try:
        with caplog.at_level(logging.WARNING, logger="pagoda.engine.offload"):
            llm, tally = make_llm(kv_offload_host_bytes=3 * BLOCK, kv_offload_disk_dir=str(ro),
                                  kv_offload_disk_bytes=200 * BLOCK)  # fmt: skip
            w = workload
            assert [run(llm, w["a"]), run(llm, w["b"]), run(llm, w["a"])] == [
                w["ref"]["a"],
                w["ref"]["b"],
                w["ref"]["a"],
            ]
        snap = llm.engine.get_scheduler_stats().offload
        assert snap["disk"]["disabled"] == 1.0 and snap["disk"]["write_errors"] == 1
        assert snap["disk"]["bytes_used"] == 0 and tally.sources["disk"] == 0
        assert caplog.text.count("disk KV tier disabled") == 1
        assert snap["host"]["store_bytes"] > 0  # the host tier still works (3 blocks: b pushes a out of it)
        llm.engine.close()
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(ro)], check=False)
        os.chmod(ro, 0o755)
