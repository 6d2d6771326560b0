"""CUDA graphs for decode steps, checked on the CPU through the Triton interpreter.

A recording is emulated (decode_graphs.RerunCapture) by a replay that calls the recorded closure again:
what a real graph freezes at capture (shapes, the metadata's Python lists and bounds, the padded batch
size) is frozen the same way, because the closure keeps the capture-time metadata and the static buffers. What only a GPU can show
(launches that are illegal while recording) is the GPU test's job at the end.
"""

import argparse
from collections import Counter

import numpy as np
import pytest
import torch
from pagoda.engine import LLM, SamplingParams
from pagoda.engine.worker.decode_graphs import DecodeGraphs, RerunCapture, capture_sizes
from pagoda.engine.worker.step_input import StepInput


def _llm(model_dir, kv_cache_dtype="auto", max_num_seqs=6, tensor_parallel_size=1):
    return LLM(
        model=str(model_dir), attention_backend="triton", device="cpu", dtype="float32", block_size=16,
        kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=64, max_model_len=128, max_num_seqs=max_num_seqs,
        kv_cache_dtype=kv_cache_dtype, tensor_parallel_size=tensor_parallel_size,
    )  # fmt: skip


def _decode_step(tables: list[list[int]], seq_lens: list[int], block_size: int = 16) -> StepInput:
    ctx = np.asarray(seq_lens, dtype=np.int64) - 1
    width = max(len(t) for t in tables)
    return StepInput(
        input_ids=np.arange(5, 5 + len(seq_lens), dtype=np.int64),
        positions=ctx.copy(),
        query_lens=np.ones(len(seq_lens), dtype=np.int64),
        context_lens=ctx,
        block_tables=np.asarray([t + [0] * (width - len(t)) for t in tables], dtype=np.int32),
        sample_idx=np.arange(len(seq_lens), dtype=np.int64),
    )


def test_capture_sizes_cover_every_batch_with_under_8_rows_of_padding():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    assert capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(1000)[-1] == 256
    sizes = capture_sizes(100)
    for n in range(1, 101):
        padded = min(s for s in sizes if s >= n)
        assert padded - n < 8


@pytest.mark.parametrize(("sliding_window", "kv_cache_dtype"), [(None, "auto"), (12, "auto"), (None, "int8")])
def test_replayed_decodes_give_the_eager_tokens(tiny_llama, sliding_window, kv_cache_dtype):
    model_dir = tiny_llama(sliding_window)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (3, 16, 29, 7, 40)]
    # different lengths, so the decode batch shrinks 5 -> 1 through padded (5 -> 6, 3 -> 4) and exact sizes
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (4, 9, 14, 19, 24)]
    eager = _llm(model_dir, kv_cache_dtype)
    expected = [list(o.outputs[0].token_ids) for o in eager.generate(prompts, params, use_tqdm=False)]
    del eager

    graphed = _llm(model_dir, kv_cache_dtype)
    engine = graphed.engine
    capture = RerunCapture()
    replays = capture.replays
    assert engine.runner.capture_decode_graphs(6, engine.max_model_len, capture=capture) is None
    replays.clear()  # the start-up check replayed once
    got = [list(o.outputs[0].token_ids) for o in graphed.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert [len(t) for t in got] == [4, 9, 14, 19, 24]
    # every batch size of the run went through a recording: 5 (padded to 6), 4, 3 (padded to 4), 2, 1
    assert set(replays) == {1, 2, 4, 6}
    assert replays[6] >= 2 and replays[1] >= 4


def test_padding_rows_write_no_kv_and_the_rows_match_the_eager_forward(tiny_llama):
    llm = _llm(tiny_llama(), max_num_seqs=4)
    runner = llm.engine.runner
    capture = RerunCapture()
    replays = capture.replays
    assert runner.capture_decode_graphs(4, 128, capture=capture) is None
    runner.run(_decode_step([[20], [21], [22], [23]], [3, 3, 3, 3]))  # four rows: the buffers hold real slots
    step = _decode_step([[7, 3], [9], [11, 12, 4]], [20, 5, 40])  # three sequences: padded to 4
    before = [c.kv.clone() for c in runner.kv_caches]
    replays.clear()
    replayed = runner.run(step).clone()
    assert replays == Counter({4: 1})
    written = [c.kv.clone() for c in runner.kv_caches]
    for old, new in zip(before, written, strict=True):
        changed = (old != new).any(dim=-1).any(dim=-1).nonzero().tolist()  # [kv, block, offset]
        slots = sorted({(b, o) for _, b, o in changed})
        assert slots == [(3, 19 - 16), (4, 39 - 32), (9, 4)]  # the three new tokens' slots, nothing else
    graphs, runner.decode_graphs = runner.decode_graphs, None
    eager = runner.run(step)
    runner.decode_graphs = graphs
    torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)


def test_steps_no_recording_covers_run_eagerly(tiny_llama):
    llm = _llm(tiny_llama(), max_num_seqs=2)
    runner = llm.engine.runner
    capture = RerunCapture()
    replays = capture.replays
    assert runner.capture_decode_graphs(2, 128, capture=capture) is None
    replays.clear()
    too_many = _decode_step([[1], [2], [3]], [4, 5, 6])  # three decodes, largest recording is 2
    prefill = StepInput(
        input_ids=np.arange(3, 9, dtype=np.int64),
        positions=np.arange(6, dtype=np.int64),
        query_lens=np.asarray([6]),
        context_lens=np.asarray([0]),
        block_tables=np.asarray([[5]], dtype=np.int32),
        sample_idx=np.asarray([5]),
    )
    for step in (too_many, prefill):
        assert runner.run(step).shape[0] == len(step.sample_idx)
    assert replays == Counter()
    at_the_limit = _decode_step([list(range(8))], [128])  # a sequence reaching max_model_len still replays
    runner.run(at_the_limit)
    assert replays == Counter({1: 1})


def test_a_recording_that_fails_or_disagrees_leaves_the_engine_eager(tiny_llama):
    llm = _llm(tiny_llama(), max_num_seqs=2)
    runner = llm.engine.runner

    def failing(forward):
        raise RuntimeError("operation not permitted when stream is capturing")

    why = runner.capture_decode_graphs(2, 128, capture=failing)
    assert why is not None and "capture failed" in why and "not permitted" in why
    assert runner.decode_graphs is None
    why = runner.capture_decode_graphs(2, 128, capture=lambda forward: lambda: None)  # replays nothing
    assert why is not None and "disagrees" in why
    assert runner.decode_graphs is None
    out = llm.generate(
        [[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 3


def test_enforce_eager_is_a_flag_and_the_cpu_records_nothing(tiny_llama):
    from pagoda.engine.cli.engine_args import add_engine_args, engine_config_from_args
    from pagoda.engine.config import EngineConfig

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--enforce-eager"]))["enforce_eager"] is True
    assert EngineConfig().enforce_eager is False
    assert _llm(tiny_llama(), max_num_seqs=2).engine.runner.decode_graphs is None  # CPU: eager, no recording


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "fp8_e5m2", "int8"])
def test_cuda_graphs_on_a_gpu_give_the_eager_tokens(tiny_llama, kv_cache_dtype):
    if kv_cache_dtype.startswith("fp8") and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 KV needs compute capability 8.9")
    model_dir = tiny_llama()
    prompts = [[5 + i] * (3 + 7 * i) for i in range(5)]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 5 * i, ignore_eos=True) for i in range(5)]
    tokens = {}
    for eager in (True, False):
        llm = LLM(model=str(model_dir), device="cuda", dtype="float32", attention_backend="triton",
                  kv_cache_memory_bytes=64 << 20, max_model_len=256, enforce_eager=eager,
                  kv_cache_dtype=kv_cache_dtype)  # fmt: skip
        assert (llm.engine.runner.decode_graphs is None) == eager
        tokens[eager] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    assert tokens[False] == tokens[True]


def test_a_replayed_step_reaches_the_device_in_one_copy(tiny_llama):
    """The step's six inputs are written on the host and copied once (a pinned staging buffer on CUDA),
    padding rows included; the recorded forward reads them from the device side."""
    from torch.utils._python_dispatch import TorchDispatchMode

    runner = _llm(tiny_llama(), max_num_seqs=4).engine.runner
    graphs = DecodeGraphs(
        runner.model, runner.kv_caches, sizes=[1, 2, 4], max_model_len=128, block_size=16, hidden_size=128,
        dtype=torch.float32, device=torch.device("cpu"), capture=lambda forward: lambda: None,
    )  # fmt: skip

    class Writes(TorchDispatchMode):
        ops: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.is_mutable:
                self.ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    step = _decode_step([[7, 3], [9], [11, 12, 4]], [20, 5, 40])  # three sequences, padded to four
    with Writes() as writes:
        graphs.run(step)
    assert writes.ops == ["copy_.default"]
    assert graphs.input_ids[:4].tolist() == [5, 6, 7, 0] and graphs.positions[:4].tolist() == [19, 4, 39, 0]
    assert graphs.slot_mapping[:4].tolist() == [3 * 16 + 3, 9 * 16 + 4, 4 * 16 + 7, -1]
    assert graphs.seq_lens[:4].tolist() == [20, 5, 40, 1] and graphs.context_lens[:4].tolist() == [
        19,
        4,
        39,
        0,
    ]
    assert graphs.block_tables[:4, :3].tolist() == [[7, 3, 0], [9, 0, 0], [11, 12, 4], [0, 0, 0]]


def test_graph_memory_is_measured_before_the_cache_and_left_out_of_it(tiny_llama):
    """Start-up records the largest and the smallest batch size over a scratch cache (every rank does, in
    its Profile step) and the budget leaves their memory out: the pool the largest needs plus each other
    recording's own cost (the smallest's)."""
    from pagoda.engine.sizing.engine_plan import gpu_kv_budget
    from pagoda.engine.worker.rank_messages import Profile

    runner = _llm(tiny_llama(), max_num_seqs=8).engine.runner
    caches = runner.kv_caches
    capture = RerunCapture()
    request = Profile(
        64, 16, torch.float32, 0.9, graph_sizes=(1, 2, 4, 8), max_model_len=128, capture=capture
    )
    assert runner.profile_graph_bytes(request) == 0  # nothing to measure on the CPU
    assert capture.recorded == [8, 1] and runner.kv_caches is caches
    gib = 1 << 30
    assert gpu_kv_budget(80 * gib, 70 * gib, gib, 0.9, 16 * gib, 2 * gib) == (
        int(72 * gib - 9 * gib - 18 * gib),
        9 * gib,
    )
    with_graphs, _ = gpu_kv_budget(80 * gib, 70 * gib, gib, 0.9, 16 * gib, 2 * gib, graphs=gib // 2)
    assert with_graphs == int(72 * gib - 9 * gib - 18 * gib) - gib // 2


@pytest.mark.timeout(600)
def test_tensor_parallel_ranks_record_and_replay_together(tiny_llama):
    """Every rank records (rank 0 sends the others the request: alone, its recording would wait in its first
    all-reduce for ranks that never record) and replays the same batches: TP=2 replays give the eager
    tokens of one rank."""
    model_dir = tiny_llama()
    prompts = [[5, 6, 7], [9] * 20, [300, 4, 17, 8, 2, 99]]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    eager = _llm(model_dir, max_num_seqs=4)
    expected = [list(o.outputs[0].token_ids) for o in eager.generate(prompts, params, use_tqdm=False)]
    del eager
    llm = _llm(model_dir, max_num_seqs=4, tensor_parallel_size=2)
    try:
        capture = RerunCapture()
        assert llm.engine.runner.capture_decode_graphs(4, 128, capture=capture) is None
        capture.replays.clear()
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expected
        assert capture.replays[4] >= 4  # the decode steps of three sequences replayed (padded to 4)
    finally:
        llm.engine.close()
