"""A decode-graph recording that fails while start-up measures the graphs' memory leaves the engine eager
with a warning, on every rank (issue 34 item 11): before, the error went up through the KV budget and
ended start-up, a pod in a crash loop. Driven on the CPU with the Triton interpreter, graphs recorded by
an emulation that fails on purpose (pagoda_testkit.captures)."""

from __future__ import annotations

import logging

import pytest
import torch
from pagoda.engine import LLM, SamplingParams
from pagoda.engine.worker.rank_messages import Profile
from pagoda_testkit.captures import FailingCapture

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
FAILED = "recording failed while measuring their memory: RuntimeError: operation not permitted when stream is capturing"


def _llm(model_dir, tensor_parallel_size=1):
    return LLM(
        model=str(model_dir), attention_backend="triton", device="cpu", dtype="float32", block_size=16,
        kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=64, max_model_len=128, max_num_seqs=4,
        tensor_parallel_size=tensor_parallel_size,
    )  # fmt: skip


def _profile(capture) -> Profile:
    return Profile(64, 16, torch.float32, 0.9, graph_sizes=(1, 2, 4), max_model_len=128, capture=capture)


def test_a_recording_that_fails_while_measuring_graph_memory_leaves_the_engine_eager(tiny_llama, caplog):
    llm = _llm(tiny_llama())
    runner = llm.engine.runner
    caches = runner.kv_caches
    expected = [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)]
    with caplog.at_level(logging.WARNING):
        budget = runner.measure_kv_budget(_profile(FailingCapture()))
    assert budget.device_memory["cuda_graph_bytes"] == 0 and budget.kv_bytes > 0
    assert runner.graphs_off == FAILED
    assert "CUDA graphs will be off, decode runs eagerly" in caplog.text
    assert runner.kv_caches is caches  # the scratch cache is gone, the engine's own is back
    # The later capture does not try again: graphs stay off, decode is eager and gives the same tokens.
    recorder = FailingCapture(rank=-1)  # would record: it fails on no rank
    assert runner.capture_decode_graphs(4, 128, capture=recorder) == FAILED
    assert recorder.recorded == [] and runner.decode_graphs is None
    assert [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)] == expected


def test_a_recording_that_succeeds_while_measuring_keeps_graphs_on(tiny_llama):
    runner = _llm(tiny_llama()).engine.runner
    recorder = FailingCapture(rank=-1)
    runner.measure_kv_budget(_profile(recorder))
    assert runner.graphs_off is None and recorder.recorded == [4, 1]
    assert runner.capture_decode_graphs(4, 128, capture=recorder) is None and runner.decode_graphs is not None


@pytest.mark.timeout(300)
def test_graphs_stay_off_on_every_rank_when_one_rank_cannot_record_them(tiny_llama):
    """Rank 1's recording fails while measuring, rank 0's succeeds: both turn graphs off (a rank recording
    alone would wait in its first all-reduce for one that does not) and TP=2 still decodes."""
    llm = _llm(tiny_llama(), tensor_parallel_size=2)
    try:
        runner = llm.engine.runner
        budget = runner.measure_kv_budget(_profile(FailingCapture(rank=1)))
        assert budget.device_memory["cuda_graph_bytes"] == 0
        assert runner.graphs_off == "tensor-parallel rank 1 could not record them"
        recorder = FailingCapture(rank=-1)
        assert runner.capture_decode_graphs(4, 128, capture=recorder) == runner.graphs_off
        assert recorder.recorded == [] and runner.decode_graphs is None
        out = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.engine.close()
