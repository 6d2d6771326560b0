"""INT8 KV blocks carry their scales through every floor: device copies, host tier, disk tier and back, on the
default model with a ten-block device pool; and a block written as INT8 is never read as another dtype."""

from __future__ import annotations

import gc

import pytest
import torch
from pagoda.engine.frontend.llm import LLM
from pagoda.engine.kv_cache.hashing import BlockHash
from pagoda.engine.kv_cache.ops import CopyBlock, LoadBlock, SaveBlock
from pagoda.engine.offload.disk_tier import DiskTier
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.worker.model_runner import ModelRunner

torch.set_num_threads(2)

INT8_BLOCK = 12240 * 16  # SmolLM2-135M: 30 layers x 2 x 3 kv heads x (64 int8 + 4 scale bytes) per token
FP32_BLOCK = 46080 * 16
SHORT = SamplingParams(max_tokens=4, temperature=0)
TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting each step aloud. "
    "Down in the harbour the fishing boats rocked gently while gulls argued over scraps on the pier. "
    "Far beyond the breakwater a storm was gathering, its clouds stacked like grey cathedrals. "
    "In the village the baker pulled the last loaves from the oven and the school bell rang twice. "
)


def _runner(num_blocks=4, block_size=4, kv_heads=2, head_dim=8, layers=2) -> ModelRunner:
    r = ModelRunner(torch.nn.Identity(), num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
                    device=torch.device("cpu"))  # fmt: skip
    r.allocate_kv_cache(num_blocks, block_size, torch.int8)
    gen = torch.Generator().manual_seed(0)
    for c in r.kv_caches:
        c.kv.copy_(torch.randint(-127, 128, c.kv.shape, generator=gen, dtype=torch.int8))
        c.scales.copy_(torch.rand(c.scales.shape, generator=gen))
    return r


def test_runner_copies_saves_and_loads_scales_with_their_blocks():
    r = _runner()
    assert r.block_shape == (2, 2, 4, 2, 8 + 4)
    assert r.kv_cache_bytes == 2 * 2 * 4 * 4 * 2 * (8 + 4)  # layers x K|V x blocks x slots x heads x row
    before = [(c.kv.clone(), c.scales.clone()) for c in r.kv_caches]
    saved = r.apply_kv_ops([SaveBlock(1, BlockHash(b"\x01" * 32)), SaveBlock(2, BlockHash(b"\x02" * 32))])
    assert [d.shape for _, d in saved] == [r.block_shape] * 2 and saved[0][1].dtype == torch.int8
    r.apply_kv_ops([CopyBlock(1, 3)])
    for (kv, sc), c in zip(before, r.kv_caches, strict=True):
        assert torch.equal(c.kv[:, 3], kv[:, 1]) and torch.equal(c.scales[:, 3], sc[:, 1])
    # load block 2's record into block 0: values and scales arrive, nothing else changes
    r.apply_kv_ops([LoadBlock(0, saved[1][1])])
    for (kv, sc), c in zip(before, r.kv_caches, strict=True):
        assert torch.equal(c.kv[:, 0], kv[:, 2]) and torch.equal(c.scales[:, 0], sc[:, 2])
        assert torch.equal(c.kv[:, 1:3], kv[:, 1:3]) and torch.equal(c.scales[:, 1:3], sc[:, 1:3])
    # a record of another layout (a float32 block) is refused, never reinterpreted
    with pytest.raises(ValueError, match="cannot load"):
        r.apply_kv_ops([LoadBlock(0, torch.zeros((2, 2, 4, 2, 8)))])


def test_disk_file_written_as_int8_is_a_miss_for_another_dtype(tmp_path):
    r = _runner()
    (h, data), = r.apply_kv_ops([SaveBlock(2, BlockHash(b"\x07" * 32))])  # fmt: skip
    tier = DiskTier(tmp_path, 1 << 20, identity="same-identity")
    tier.put(h, data)
    tier.flush()
    tier.close()
    tier = DiskTier(tmp_path, 1 << 20, identity="same-identity")  # a restart: nothing pending in memory
    got = tier.get(h, r.block_shape, torch.int8)
    assert got is not None and torch.equal(got, data)
    # same file, asked for as float32 (the shape a float32 block of the same bytes would have): a miss
    fp32_shape = (2, 2, 4, 2, 3)  # 2*2*4*2*3*4 bytes == 2*2*4*2*12 bytes: same payload size
    assert tier.get(h, fp32_shape, torch.float32) is None
    assert tier.verification_failures == 1 and h not in tier
    tier.close()


def _llm(**kw) -> LLM:
    return LLM(device="cpu", max_model_len=64, max_num_seqs=2, **kw)


def _run(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, SHORT, use_tqdm=False)]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """Two pairs of 40-token prompts (two full blocks and a bit each) and their tokens from an INT8 engine
    without tiers; then the same through a six-block pool over host and disk tiers."""
    llm = _llm(kv_cache_memory_bytes=6 * INT8_BLOCK, kv_cache_dtype="int8")
    ids = llm.get_tokenizer()(" ".join(f"Part {k}. {TEXT}" for k in range(3))).input_ids
    a = [ids[i * 40 : (i + 1) * 40] for i in range(2)]
    b = [ids[80 + i * 40 : 120 + i * 40] for i in range(2)]
    ref = {"a": _run(llm, a), "b": _run(llm, b)}
    del llm
    gc.collect()
    disk = tmp_path_factory.mktemp("int8-nvme")
    llm = _llm(kv_cache_memory_bytes=6 * INT8_BLOCK, kv_cache_dtype="int8", kv_offload_host_bytes=2 * INT8_BLOCK,
               kv_offload_disk_dir=str(disk), kv_offload_disk_bytes=100 * INT8_BLOCK)  # fmt: skip
    sources: dict[str, int] = {}

    class Tally:
        def record(self, scheduler_stats, it) -> None:
            for k, n in it.cached_tokens_by_source.items():
                sources[k] = sources.get(k, 0) + n

    llm.engine.add_stat_logger(Tally())
    got = [_run(llm, a), _run(llm, b)]  # b pushes a's blocks down to host, then disk
    llm.engine.offload.flush()
    got.append(_run(llm, a))
    snap = llm.engine.get_scheduler_stats().offload
    dtype = llm.engine.dtype
    llm.engine.close()
    del llm
    gc.collect()
    return {"a": a, "ref": ref, "got": got, "sources": sources, "snap": snap, "disk": disk, "dtype": dtype}


def test_int8_blocks_through_host_and_disk_give_the_same_tokens(prompts):
    p = prompts
    assert p["got"] == [p["ref"]["a"], p["ref"]["b"], p["ref"]["a"]]
    assert p["sources"].get("disk", 0) + p["sources"].get("host", 0) >= 32  # a's full blocks came back
    assert p["snap"]["disk"]["verification_failures"] == 0 and p["snap"]["disk"]["blocks"] > 0


def test_a_float32_engine_never_hits_int8_blocks_on_disk(prompts):
    fp32 = _llm(kv_cache_memory_bytes=6 * FP32_BLOCK, kv_offload_host_bytes=0,
                kv_offload_disk_dir=str(prompts["disk"]), kv_offload_disk_bytes=100 * INT8_BLOCK)  # fmt: skip
    assert (
        fp32.engine.offload.disk is not None and len(fp32.engine.offload.disk) > 0
    )  # the INT8 files are there
    got = _run(fp32, prompts["a"][:1])
    snap = fp32.engine.get_scheduler_stats().offload["disk"]
    fp32.engine.close()
    del fp32
    gc.collect()
    assert snap["hits"] == 0 and snap["load_bytes"] == 0  # INT8 blocks hash differently: a miss, recomputed
    want = _run(_llm(kv_cache_memory_bytes=6 * FP32_BLOCK), prompts["a"][:1])
    assert got == want


def test_an_engine_computing_in_another_dtype_never_hits_those_int8_blocks(prompts):
    """Same model, same INT8 cache format, another compute dtype: the blocks on disk hold other values."""
    other = "float32" if prompts["dtype"] == torch.bfloat16 else "bfloat16"
    llm = _llm(kv_cache_memory_bytes=6 * INT8_BLOCK, kv_cache_dtype="int8", dtype=other, kv_offload_host_bytes=0,
               kv_offload_disk_dir=str(prompts["disk"]), kv_offload_disk_bytes=100 * INT8_BLOCK)  # fmt: skip
    assert len(llm.engine.offload.disk) > 0
    _run(llm, prompts["a"][:1])
    snap = llm.engine.get_scheduler_stats().offload["disk"]
    llm.engine.close()
    assert snap["hits"] == 0 and snap["load_bytes"] == 0
