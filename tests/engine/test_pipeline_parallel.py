"""Pipeline parallelism on CPU: stages of gloo ranks (processes on this machine) give the greedy tokens of
one rank, alone (PP=2) and with tensor parallelism inside each stage (PP=2 x TP=2); each stage holds the KV
of its own layers only; the dry run prints each stage's KV per rank; a rank that dies makes the engine
report itself dead; and a replica spread over two `pagoda serve` processes (--nnodes 2, the second
--headless) on loopback serves the same tokens.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from pagoda.engine import LLM, SamplingParams
from pagoda.engine.config import EngineConfig
from pagoda.engine.sizing.stages import host_ranks, max_stage_layers, stage_layers
from pagoda.engine.worker.pipeline import split_step
from pagoda.engine.worker.step_input import StepInput

PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], [42] * 20]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _greedy(path: str, pp: int, tp: int = 1, prompts=PROMPTS) -> tuple[list[list[int]], LLM]:
    llm = LLM(
        path,
        device="cpu",
        dtype="float32",
        max_model_len=256,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        kv_cache_memory_bytes=4 << 20,
    )
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)], llm


@pytest.fixture(scope="module")
def llama3(module_tiny_model) -> str:
    """A tiny random Llama of 3 layers (stages of 1 + 2 at PP=2), shared by the tests of this file."""
    return str(module_tiny_model("llama", num_hidden_layers=3))


@pytest.fixture(scope="module")
def llama3_pp1(llama3) -> tuple[list[list[int]], list[str]]:
    """PP=1's greedy tokens and texts of PROMPTS on `llama3` (what every pipeline must give)."""
    llm = LLM(llama3, device="cpu", dtype="float32", max_model_len=256, kv_cache_memory_bytes=4 << 20)
    out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.engine.close()
    return [o.outputs[0].token_ids for o in out], [o.outputs[0].text for o in out]


def test_stages_split_layers_contiguously_and_evenly():
    assert stage_layers(4, 2) == [(0, 2), (2, 4)]
    # extra layers go to the stages after stage 0 (whose rank also schedules and samples)
    assert stage_layers(3, 2) == [(0, 1), (1, 3)]
    assert stage_layers(10, 4) == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert max_stage_layers(126, 4) == 32 and max_stage_layers(5, 1) == 5
    assert list(host_ranks(8, 2, 1)) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        stage_layers(2, 3)


def test_a_step_splits_into_micro_batches_of_equal_tokens():
    # three sequences of 5, 3 and 20 new tokens; the first two sample, the third is a prefill chunk
    step = StepInput(
        input_ids=np.arange(28),
        positions=np.arange(28) + 100,
        query_lens=np.array([5, 3, 20]),
        context_lens=np.array([0, 4, 32]),
        block_tables=np.array([[1, 0, 0], [2, 3, 0], [4, 5, 6]], dtype=np.int32),
        sample_idx=np.array([4, 7]),
    )
    first, second = split_step(step, 2)
    # 14 tokens each: the chunk of 20 splits 6 + 14, its second piece with the first as context
    assert list(first.query_lens) == [5, 3, 6] and list(first.context_lens) == [0, 4, 32]
    assert list(second.query_lens) == [14] and list(second.context_lens) == [38]
    assert list(first.sample_idx) == [4, 7] and len(second.sample_idx) == 0
    assert list(second.input_ids) == list(range(14, 28)) and list(second.positions) == list(range(114, 128))
    assert second.block_tables.tolist() == [[4, 5, 6]] and first.block_tables.shape == (3, 3)
    decode = StepInput(np.arange(4), np.arange(4), np.ones(4, int), np.full(4, 9), np.zeros((4, 1), np.int32),
                       np.arange(4))  # fmt: skip
    halves = split_step(decode, 2)  # a decode step splits between sequences
    assert [list(p.sample_idx) for p in halves] == [[0, 1], [0, 1]]
    assert [list(p.input_ids) for p in halves] == [[0, 1], [2, 3]]
    assert len(split_step(decode, 8)) == 4  # never an empty micro-batch
    decode.logprob_idx = np.array([0])
    assert split_step(decode, 2) == [decode]  # prompt-logprob rows: one micro-batch


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_pp2_matches_pp1_and_each_stage_holds_its_own_layers(tiny_model, llama3, llama3_pp1, family):
    """Three layers over two stages (1 + 2); qwen2 ties the LM head to the embedding (the last stage keeps a
    copy). The decode steps run as two micro-batches."""
    if family == "llama":
        path, one = llama3, llama3_pp1[0]
    else:
        path = str(tiny_model(family, num_hidden_layers=3))
        one, _ = _greedy(path, 1)
    two, llm = _greedy(path, 2)
    try:
        assert two == one
        engine = llm.engine.core
        assert len(engine.runner.kv_caches) == 1  # stage 0: layer 0
        per_layer = 2 * 2 * 16 * 4  # K and V, 2 KV heads of 16 dims, float32
        assert engine.kv_bytes_per_token == 2 * per_layer  # the largest stage (2 layers) sizes the blocks
        times = engine.runner.pipeline.times
        assert times.micro_batches > times.steps  # several sequences: more micro-batches than steps
        model = engine.runner.model
        assert model.embed_tokens is not None and model.lm_head_weight is None
        assert sum(p.numel() for p in model.layers[1:].parameters()) == 0
    finally:
        llm.engine.close()
    assert not any(p.is_alive() for p in llm.engine.workers.procs), "close() leaves no rank running"


@pytest.mark.timeout(300)
def test_pp2_tp2_matches_pp1(llama3, llama3_pp1):
    """Four ranks: two stages of two tensor-parallel ranks each."""
    one = llama3_pp1[0]
    four, llm = _greedy(llama3, 2, tp=2)
    try:
        assert four == one
        assert len(llm.engine.workers.procs) == 3
    finally:
        llm.engine.close()


@pytest.mark.timeout(200)
def test_a_rank_that_dies_makes_the_engine_report_itself_dead(llama3):
    _, llm = _greedy(llama3, 2, prompts=[[1, 2, 3]])
    workers = llm.engine.workers
    (rank1,) = workers.procs
    try:
        rank1.kill()
        rank1.join(5)
        deadline = time.monotonic() + 5
        while workers.dead_reason is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert workers.dead_reason == f"pipeline rank 1 exited (code {-signal.SIGKILL})"
        assert llm.engine.core.dead_reason == workers.dead_reason
        with pytest.raises(RuntimeError, match="pipeline rank 1 exited"):
            llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    finally:
        llm.engine.close()


def test_what_the_pipeline_does_not_support_is_refused():
    for flag in ({"enable_lora": True}, {"async_scheduling": True}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}):  # fmt: skip
        with pytest.raises(ValueError, match="not supported with pipeline parallelism"):
            EngineConfig(pipeline_parallel_size=2, **flag)


def test_the_dry_run_of_each_rank_prints_each_stage_kv(llama3):
    """What the operator renders for a group of two hosts (leader and headless worker) passes the dry run,
    which prints each stage's layers, ranks and KV per rank."""
    from pagoda.engine.cli.dry_run import check

    path = llama3
    common = [path, "-pp", "2", "--tensor-parallel-size", "2", "--nnodes", "2", "--device", "cpu", "--dtype",
              "float32", "--kv-cache-memory-bytes", "4MiB", "--max-model-len", "256", "--master-addr", "leader"]  # fmt: skip
    leader = check([*common, "--node-rank", "0"]).to_dict()
    worker = check([*common, "--node-rank", "1", "--headless"]).to_dict()
    per_layer = 2 * 1 * 16 * 4  # TP=2: one of the 2 KV heads per rank
    for report, mine in ((leader, 0), (worker, 1)):
        stages = report["pipeline"]["stages"]
        assert [s["layers"] for s in stages] == [[0, 1], [1, 3]]
        assert [s["ranks"] for s in stages] == [[0, 1], [2, 3]]
        assert [s["kv_bytes_per_token_per_rank"] for s in stages] == [per_layer, 2 * per_layer]
        blocks = report["plan"]["num_blocks"]
        assert report["plan"]["kv_bytes_per_token"] == 2 * per_layer
        assert blocks == (4 << 20) // (2 * per_layer * 16)
        assert [s["kv_cache_bytes_per_rank"] for s in stages] == [
            blocks * 16 * per_layer,
            blocks * 16 * 2 * per_layer,
        ]
        assert [s["ranks_on_this_host"] for s in stages][mine] == [2 * mine, 2 * mine + 1]
        assert report["pipeline"]["master"] == "leader:29501"


# ---------------------------------------------------------------- two hosts on loopback


def _serve(args: list[str], log) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.Popen(
        [sys.executable, "-m", "pagoda.cli.main", "serve", *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )


@pytest.mark.timeout(400)
@pytest.mark.parametrize("split", [["-pp", "2"], ["--tensor-parallel-size", "2"]], ids=["pp2", "tp2"])
def test_two_hosts_on_loopback_serve_the_tokens_of_one(llama3, llama3_pp1, tmp_path, split):
    """`--nnodes 2 --node-rank 0` serves, a `--headless --node-rank 1` process runs stage 1 (or, with
    tensor parallelism alone, TP rank 1); the headless host exits once the leader is gone."""
    import httpx
    from pagoda_testkit.processes import free_port, wait_healthy

    path, one = llama3, llama3_pp1[1]
    http, master = free_port(), free_port()
    common = [path, *split, "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(master),
              "--device", "cpu", "--dtype", "float32", "--kv-cache-memory-bytes", "4MiB", "--max-model-len", "256"]  # fmt: skip
    logs = [open(tmp_path / name, "wb") for name in ("leader.log", "worker.log")]  # noqa: SIM115
    # the worker first: a headless host waits for its leader (pods of a group start in any order)
    worker = _serve([*common, "--node-rank", "1", "--headless"], logs[1])
    time.sleep(2)
    leader = _serve([*common, "--node-rank", "0", "--host", "127.0.0.1", "--port", str(http)], logs[0])
    url = f"http://127.0.0.1:{http}"

    def tail() -> str:
        return "".join(
            (tmp_path / n).read_text(errors="replace")[-3000:] for n in ("leader.log", "worker.log")
        )

    try:
        wait_healthy(leader, url, tail, 300, poll_s=1)
        got = []
        for prompt in PROMPTS:
            body = {"model": path, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["text"])
        assert got == one
        leader.send_signal(signal.SIGTERM)
        leader.wait(60)
        assert worker.wait(60) is not None, tail()
    finally:
        for proc in (leader, worker):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        for log in logs:
            log.close()


def test_the_planner_stages_a_model_over_nodes_only_when_allowed():
    """Llama-3.1-405B in bfloat16 needs more than one node of 8 x H100: with max_nodes the plan is 2
    stages of TP=8, one node each, its per-GPU weights the larger stage's share; without, a refusal."""
    from pagoda.engine.sizing import gpu_info
    from pagoda.engine.sizing.errors import SizingError
    from pagoda.engine.sizing.planner import Hints, plan
    from pagoda.engine.sizing.shapes import well_known_shape
    from pagoda.engine.sizing.stages import stage_weight_bytes

    shape = well_known_shape("meta-llama/Llama-3.1-405B-Instruct")
    node = gpu_info("H100-80GB", 8)
    with pytest.raises(SizingError, match="does not fit on 8 x H100"):
        plan(shape, node, Hints())
    p = plan(shape, node, Hints(max_nodes=4))
    assert (p.pipeline_parallel_size, p.nnodes, p.tensor_parallel_size) == (2, 2, 8)
    stages = stage_weight_bytes(shape.weight_bytes, 126, 2, shape.vocab_size, shape.hidden_size, 2, False)
    assert p.weights_bytes_per_gpu == -(-max(stages) // 8) and sum(stages) <= shape.weight_bytes
    assert p.num_gpu_blocks > 0 and "2 stages of 8 GPUs" in p.reasons["pipeline_parallel_size"]


def test_families_with_a_forward_of_their_own_are_refused():
    from types import SimpleNamespace

    from pagoda.engine.models.gemma import GemmaForCausalLM
    from pagoda.engine.models.llama import LlamaForCausalLM
    from pagoda.engine.worker.pp_workers import check_pipeline

    config = EngineConfig(pipeline_parallel_size=2)
    mc = SimpleNamespace(num_attention_heads=4, num_hidden_layers=4, architecture="Gemma2ForCausalLM")
    check_pipeline(config, mc, LlamaForCausalLM)
    with pytest.raises(ValueError, match="not supported for Gemma2ForCausalLM"):
        check_pipeline(config, mc, GemmaForCausalLM)
    with pytest.raises(ValueError, match="exceeds the model's 4 layers"):
        check_pipeline(EngineConfig(pipeline_parallel_size=5), mc, LlamaForCausalLM)


def test_pagoda_plan_prints_the_stages_and_their_flags(capsys):
    from pagoda.engine.cli.plan import main

    argv = ["--model", "meta-llama/Llama-3.1-405B-Instruct", "--gpu", "H100", "--gpus", "8"]
    assert main([*argv, "--max-nodes", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Llama-3.1-405B on 2 nodes of 8 x H100")
    assert "--tensor-parallel-size 8 --pipeline-parallel-size 2 --nnodes 2" in out
    assert main(argv) == 2  # one node is not enough
