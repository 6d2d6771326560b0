"""Tensor parallelism on CPU: two gloo ranks (two processes on this machine) give the greedy tokens of one.

Every rank holds its query heads, the KV heads they read, a slice of the MLP and of the vocabulary; the
default model's 9 query heads over 3 KV heads do not split evenly over 2 ranks, which exercises the
uneven split (5 + 4 heads, KV heads copied where a rank's heads straddle a group).
"""

from __future__ import annotations

import pytest
from pagoda.engine import LLM, SamplingParams
from pagoda.engine.distributed.parallel_state import kv_heads_of_rank, shard_range, shard_widths
from pagoda.engine.sizing.planner import _kv_heads_per_rank
from pagoda.engine.sizing.shapes import shape_from_path

PROMPTS = ["The capital of France is", "Write a haiku about the sea:", "1, 2, 3, 4,"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _greedy(model: str | None, tp: int, prompts=PROMPTS, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(model, device="cpu", dtype="float32", max_model_len=256, tensor_parallel_size=tp, **kw)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    return out, llm


def test_shares_and_kv_heads_of_ranks():
    assert [shard_range(9, r, 2) for r in range(2)] == [(0, 5), (5, 9)]
    assert shard_widths(49152, 2) == [24576, 24576] and shard_widths(7, 3) == [3, 2, 2]
    # Whole groups stay grouped; a rank inside one group keeps its one KV head (MQA over 2 ranks).
    assert kv_heads_of_rank(8, 2, 0, 2) == [0] and kv_heads_of_rank(8, 2, 1, 2) == [1]
    assert kv_heads_of_rank(4, 1, 1, 2) == [0]
    # 9 heads over 3 KV heads on 2 ranks: each query head gets its own copy of its KV head.
    assert kv_heads_of_rank(9, 3, 0, 2) == [0, 0, 0, 1, 1]
    assert kv_heads_of_rank(9, 3, 1, 2) == [1, 2, 2, 2]
    with pytest.raises(ValueError):
        shard_range(1, 0, 2)


def test_default_model_tp2_matches_tp1():
    one, _ = _greedy(None, 1, kv_cache_memory_bytes=64 << 20)
    two, llm = _greedy(None, 2, kv_cache_memory_bytes=64 << 20)
    try:
        assert two == one
    finally:
        llm.engine.close()
    assert not any(p.is_alive() for p in llm.engine.workers.procs), "close() leaves no rank running"


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("llama", {}),
        ("qwen2", {}),
        ("llama", {"num_key_value_heads": 1}),
        ("mistral", {"intermediate_size": 130}),
    ],
)
def test_tiny_models_tp2_match_tp1(tiny_model, family, overrides):
    """Llama (GQA), Qwen2 (q/k/v biases, tied embeddings), a single KV head (fewer KV heads than ranks) and
    an intermediate size that splits 65 + 65."""
    path = str(tiny_model(family, **overrides))
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300], [42] * 20]
    one, _ = _greedy(path, 1, prompts, kv_cache_memory_bytes=4 << 20)
    two, llm = _greedy(path, 2, prompts, kv_cache_memory_bytes=4 << 20)
    try:
        assert two == one
    finally:
        llm.engine.close()


def test_sizing_assumes_what_a_rank_allocates(tiny_model):
    """The planner's KV bytes per token per GPU and weights per GPU for TP=2 are what each rank holds
    (weights up to the norm vectors, which every rank keeps whole)."""
    path = tiny_model("llama")
    shape = shape_from_path(path)
    _, llm = _greedy(str(path), 2, [[1, 2, 3]], kv_cache_memory_bytes=4 << 20)
    try:
        engine = llm.engine
        planned_kv = 2 * shape.num_layers * _kv_heads_per_rank(shape, 2) * shape.head_dim * 4
        assert engine.kv_bytes_per_token == planned_kv
        planned_weights = -(-shape.weight_bytes // 2)
        norms = (2 * shape.num_layers + 1) * shape.hidden_size * 4
        assert abs(engine.runner.weights_bytes() - planned_weights) <= norms
    finally:
        llm.engine.close()


@pytest.mark.timeout(100)
def test_every_rank_profiles_and_the_least_budget_sizes_every_cache(tiny_model):
    """The start-up profiling forward runs on every rank at once (it meets the other ranks in its
    all-reduces: rank 0 alone waits there for a rank that waits for its cache: a hang) and every rank's
    cache takes the least budget any rank measured."""
    path = str(tiny_model("llama"))
    prompts = [[5, 6, 7, 8, 9], [42] * 20]
    one, _ = _greedy(path, 1, prompts, kv_cache_memory_bytes=4 << 20)
    two, llm = _greedy(path, 2, prompts, profile_on_cpu=True)
    try:
        engine = llm.engine
        profile = engine.core.plan.profile
        assert profile.source == "host" and len(profile.rank_kv_cache_bytes) == 2
        assert profile.kv_cache_bytes == min(profile.rank_kv_cache_bytes) > 0
        assert engine.num_blocks == profile.kv_cache_bytes // (engine.kv_bytes_per_token * 16)
        assert two == one  # the scratch cache of the profiling forward left nothing behind
    finally:
        llm.engine.close()


# ---------------------------------------------------------------- the ranks' lifetime

# A user's script: TP=2, a greedy generate, then either its end ("end") or generates until it is stopped.
SCRIPT = """
import sys
from pagoda.engine import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(sys.argv[1], device="cpu", dtype="float32", max_model_len=256, tensor_parallel_size=2,
              kv_cache_memory_bytes=4 << 20)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate([[5, 6, 7, 8]], greedy, use_tqdm=False)
    print("TOKENS", len(out[0].outputs[0].token_ids), flush=True)
    print("RANKS", *[p.pid for p in llm.engine.workers.procs], flush=True)
    if sys.argv[2] == "loop":
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        while True:
            llm.generate([[5, 6, 7, 8]] * 4, long, use_tqdm=False)
"""


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaps counts as gone: it holds nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start_script(tmp_path, model: str, mode: str):
    import signal
    import subprocess
    import sys

    script = tmp_path / "tp_script.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), model, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a script run from a terminal
        # and Ctrl-C's default action, as a terminal gives it: an ignored SIGINT is inherited through exec, and
        # a test earlier in the same pytest process may have left this one ignoring it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("RANKS"):
            return proc, [int(p) for p in line.split()[1:]], lines
    raise AssertionError("the script ended before its ranks started:\n" + "".join(lines))


def _assert_gone(pids: list[int], within: float) -> None:
    import time

    deadline = time.monotonic() + within
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "a tensor-parallel rank outlived its script"


@pytest.mark.timeout(120)
def test_a_script_with_tp2_exits_by_itself_when_it_ends(tiny_model, tmp_path):
    """No close() in the script: its end stops the ranks (multiprocessing's exit join waited forever on a
    rank waiting for a message)."""
    import os
    import signal

    proc, ranks, lines = _start_script(tmp_path, str(tiny_model("llama")), "end")
    try:
        assert len(ranks) == 1 and "TOKENS 4\n" in lines
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        _assert_gone(ranks, within=5)
    finally:
        for pid in [proc.pid, *ranks]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "sigkill"])
def test_a_script_with_tp2_interrupted_mid_generate_leaves_no_rank(tiny_model, tmp_path, how):
    """Ctrl-C (SIGINT to the script's whole process group, ranks included), a SIGTERM or a SIGKILL to the
    script while its ranks are busy in steps: the script ends and no rank is left behind."""
    import os
    import signal
    import time

    proc, ranks, _ = _start_script(tmp_path, str(tiny_model("llama")), "loop")
    time.sleep(1.0)  # inside the generate loop: the ranks meet rank 0 in every step's all-reduces
    try:
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        # Ctrl-C can leave rank 1 in a collective rank 0 left: the engine's shutdown then waits its 10 s join
        # before the SIGTERM, and the pipe closes only once every child holding it is gone (10-20 s here;
        # 30 s was exceeded once in a full run).
        out, _ = proc.communicate(timeout=60)
        expected = {"ctrl-c": -signal.SIGINT, "sigterm": -signal.SIGTERM, "sigkill": -signal.SIGKILL}[how]
        assert proc.returncode == expected, out
        if how == "ctrl-c":
            assert "KeyboardInterrupt" in out
        _assert_gone(ranks, within=10)
    finally:
        for pid in [proc.pid, *ranks]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(120)
def test_a_rank_stuck_in_a_collective_exits_on_sigterm(tiny_model):
    """Rank 1 runs a profiling forward alone, so it waits in its first all-reduce for a rank 0 that never
    comes (as when rank 0 died or left mid-step): a SIGTERM ends it there at once (ranks ignored SIGTERM,
    and lingered until the collective's timeout), and the engine reports the rank's exit."""
    import signal
    import time

    import torch
    from pagoda.engine.worker.rank_messages import Profile

    _, llm = _greedy(str(tiny_model("llama")), 2, [[1, 2, 3]], kv_cache_memory_bytes=4 << 20)
    workers = llm.engine.workers
    (rank1,) = workers.procs
    try:
        workers.send(Profile(64, 16, torch.float32, 0.9, forward_on_cpu=True))
        time.sleep(1.0)  # inside the forward's all-reduce by now
        assert rank1.is_alive()
        rank1.terminate()
        rank1.join(5)
        assert rank1.exitcode == -signal.SIGTERM
        deadline = time.monotonic() + 5
        while workers.dead_reason is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert workers.dead_reason == f"tensor-parallel rank 1 exited (code {-signal.SIGTERM})"
    finally:
        if rank1.is_alive():
            rank1.kill()
        llm.engine.close()
