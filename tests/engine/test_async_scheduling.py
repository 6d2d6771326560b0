"""Async scheduling (--async-scheduling): the same tokens as synchronous steps, and step N+1 really is
planned while step N runs."""

from __future__ import annotations

import threading

import pytest
from pagoda.engine import SamplingParams
from pagoda.engine.config import EngineConfig
from pagoda.engine.frontend.llm_engine import LLMEngine
from pagoda_testkit.prompts import MIXED_PROMPTS

PROMPTS = MIXED_PROMPTS
BYTES_PER_BLOCK16 = 46080 * 16  # SmolLM2-135M in fp32


def engine(async_scheduling: bool, **kwargs) -> LLMEngine:
    base = dict(device="cpu", dtype="float32", max_model_len=256, kv_cache_memory_bytes=48 << 20)
    return LLMEngine(EngineConfig(**{**base, **kwargs}, async_scheduling=async_scheduling))


def mixed_params(stop_token: int) -> list[SamplingParams]:
    """Different lengths, an EOS-free stop token, penalties (they read the tokens so far), a seeded n=2
    fork, prompt logprobs: what a step's tokens decide and what they do not."""
    greedy = dict(temperature=0.0, ignore_eos=True)
    return [
        SamplingParams(max_tokens=12, **greedy),
        SamplingParams(max_tokens=4, **greedy),
        SamplingParams(max_tokens=12, stop_token_ids=[stop_token], **greedy),
        SamplingParams(max_tokens=10, repetition_penalty=1.3, frequency_penalty=0.5, **greedy),
        SamplingParams(max_tokens=7, temperature=0.8, seed=7, n=2, ignore_eos=True),
        SamplingParams(max_tokens=8, prompt_logprobs=1, **greedy),
    ]


def run(eng: LLMEngine, params: list[SamplingParams], abort_at: int, every: int) -> dict:
    """A request arrives every ``every`` steps; request 0 is aborted after step ``abort_at``. Returns each
    request's tokens per sequence, and its finish reasons."""
    done: dict[str, dict[int, list[int]]] = {}
    reasons: dict[str, dict[int, str]] = {}
    pending = list(enumerate(zip(PROMPTS, params, strict=True)))
    step = 0
    while pending or eng.has_unfinished_requests():
        while pending and step % every == 0:
            i, (prompt, p) = pending.pop(0)
            eng.add_request(str(i), prompt, p)
            if every > 1:
                break
        for delta in eng.step():
            for c in delta.outputs:
                done.setdefault(delta.request_id, {}).setdefault(c.index, []).extend(c.token_ids)
                if c.finish_reason is not None:
                    reasons.setdefault(delta.request_id, {})[c.index] = c.finish_reason
        step += 1
        if step == abort_at:
            eng.abort_request("0")
    assert eng.kv.num_free_blocks == eng.core.num_blocks  # every block free or cached
    eng.scheduler.check_invariants()
    return {"tokens": done, "reasons": reasons}


@pytest.fixture(scope="module")
def shared() -> dict[bool, LLMEngine]:
    """A synchronous and an async engine of the default configuration, shared by the tests that leave
    them idle (engine start-up is most of a short test)."""
    engines = {mode: engine(mode) for mode in (False, True)}
    yield engines
    for eng in engines.values():
        eng.core.close()


@pytest.fixture(scope="module")
def stop_token(shared) -> int:
    """A token the third prompt's greedy continuation produces at its 6th step, to stop it there."""
    eng = shared[False]
    eng.add_request("x", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    tokens: list[int] = []
    while eng.has_unfinished_requests():
        for delta in eng.step():
            tokens.extend(delta.outputs[0].token_ids)
    assert tokens[5] not in tokens[:5]
    return tokens[5]


@pytest.mark.parametrize(
    ("kwargs", "every"),
    [
        ({}, 2),  # arriving over the first steps
        # all at once into a pool of six blocks: preemptions, recomputed
        ({"kv_cache_memory_bytes": 6 * BYTES_PER_BLOCK16, "max_model_len": 96}, 1),
        # the same, preempted sequences swapped out to a host tier that also serves prefix hits
        (
            {
                "kv_cache_memory_bytes": 6 * BYTES_PER_BLOCK16,
                "max_model_len": 96,
                "preemption_mode": "swap",
                "kv_offload_host_bytes": 64 << 20,
            },
            1,
        ),
    ],
    ids=["arriving", "preempting", "swapping"],
)
def test_same_tokens_as_synchronous_steps(shared, stop_token, kwargs, every):
    params = mixed_params(stop_token)
    outs, preemptions = {}, {}
    for mode in (False, True):
        eng = engine(mode, **kwargs) if kwargs else shared[mode]
        before = eng.scheduler.total_preemptions
        outs[mode] = run(eng, params, abort_at=5, every=every)
        preemptions[mode] = eng.scheduler.total_preemptions - before
        if kwargs:
            eng.core.close()
    assert outs[True] == outs[False]
    got = outs[True]
    assert got["reasons"]["0"] == {0: "abort"} and 0 < len(got["tokens"]["0"][0]) < 12
    assert got["reasons"]["2"] == {0: "stop"} and got["tokens"]["2"][0][-1] == stop_token
    assert [len(got["tokens"]["1"][0]), len(got["tokens"]["3"][0])] == [4, 10]
    assert got["reasons"]["4"] == {0: "length", 1: "length"}
    assert all(len(t) == 7 for t in got["tokens"]["4"].values())
    if kwargs:
        assert preemptions[False] > 0 and preemptions[True] > 0


class StepEvents:
    """Records, in order, when the core starts planning a step, submits one and when a step's device side
    ends. A step's device side waits (up to ``wait_s``) for the core to start planning again after its
    submission, so a core that plans ahead always shows a plan between the two, whatever the timing; one
    that does not shows its plan after the end."""

    def __init__(self, eng: LLMEngine, wait_s: float) -> None:
        self.events: list[str] = []
        self.plans = 0
        self.plans_at_submit: dict[int, int] = {}
        self.cond = threading.Condition()
        self.wait_s = wait_s
        scheduler, schedule = eng.scheduler, eng.scheduler.schedule
        steps = eng.core._steps
        submit = steps.submit

        def planned():
            with self.cond:
                self.plans += 1
                self.events.append("plan")
                self.cond.notify_all()
            return schedule()

        def submitted(sched):
            with self.cond:
                self.events.append("submit")
                self.plans_at_submit[id(sched)] = self.plans
            return submit(sched)

        scheduler.schedule, steps.submit = planned, submitted
        steps.on_start, steps.on_end = self.start, self.end
        self.undo = lambda: (
            delattr(scheduler, "schedule"),
            delattr(steps, "submit"),
            setattr(steps, "on_start", None),
            setattr(steps, "on_end", None),
        )

    def start(self, sched) -> None:
        with self.cond:
            plans = self.plans_at_submit[id(sched)]
            self.cond.wait_for(lambda: self.plans > plans, timeout=self.wait_s)

    def end(self, sched) -> None:
        with self.cond:
            self.events.append("end")

    def planned_during(self) -> list[bool]:
        """Per step, in order: whether a plan started between its submission and the end of its run."""
        out, inside = [], None
        for kind in self.events:
            if kind == "submit":
                inside = False
            elif kind == "plan" and inside is not None:
                inside = True
            elif kind == "end":
                out.append(bool(inside))
                inside = None
        return out


def test_the_next_step_is_planned_while_the_step_runs(shared):
    eng = shared[True]
    events = StepEvents(eng, wait_s=10.0)
    for i, n in enumerate((6, 3, 8)):
        eng.add_request(str(i), PROMPTS[i], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    events.undo()
    during = events.planned_during()
    assert len(during) == 8  # a prefill step, then one per token until the longest request ends
    assert all(during), events.events


def test_steps_whose_tokens_decide_the_next_plan_after_them(shared):
    """The step whose prompt forks into n=2 sequences is not planned past (the fork's first tokens are
    drawn in it); the decodes after it are."""
    eng = shared[True]
    events = StepEvents(eng, wait_s=0.3)
    eng.add_request("f", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=3, n=2, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    events.undo()
    assert events.planned_during() == [False, True, True]


def test_a_grammar_in_the_batch_gives_the_same_tokens(shared):
    """A sequence with a grammar needs its token before its next mask: steps that sample it are planned
    after their tokens, the others ahead; every output is the synchronous one."""
    import re

    from pagoda.engine.structured_output import GrammarSpec

    spec = GrammarSpec("regex", r"[0-9]{3}-[a-z]{2}")
    params = [
        SamplingParams(max_tokens=12, temperature=0.8, seed=1, structured_outputs=spec),
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.8, seed=2, ignore_eos=True),
    ]
    outs = {}
    for mode in (False, True):
        eng = shared[mode]
        for i, p in enumerate(params):
            eng.add_request(str(i), PROMPTS[i], p)
        tokens: dict[str, list[int]] = {}
        while eng.has_unfinished_requests():
            for delta in eng.step():
                tokens.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
        outs[mode] = tokens
        text = eng.tokenizer.decode(tokens["0"], skip_special_tokens=True)
    assert outs[True] == outs[False]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text) and len(outs[True]["2"]) == 10


def serve_script(eng: LLMEngine) -> dict[str, list[int]]:
    """Runs the server's loop (engine/core/loop.py) over a core: requests a and b, b aborted while a step
    runs, then c added once the core is idle (an async core may still have b's last step in flight)."""
    import time

    from pagoda.engine.core.loop import CoreLoop
    from pagoda.engine.core.messages import Abort, AddRequests, EngineCoreRequest, Shutdown

    ids = {"a": [1, 504, 3116, 282, 4649, 314], "b": [1, 7042, 30, 2306], "c": [1, 216, 33, 32]}

    def request(rid: str, max_tokens: int) -> EngineCoreRequest:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return EngineCoreRequest(rid, ids[rid], params, max_tokens, time.monotonic())

    core = eng.core
    tokens: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    script = [[AddRequests([request("a", 6), request("b", 40)])], [], [], [Abort(["b"])]]
    calls = 0

    def emit(out) -> None:
        assert not out.failed and out.dead is None
        for o in out.outputs:
            tokens.setdefault(o.request_id, []).extend(o.seqs[0].token_ids)
            if o.finished:
                finished[o.request_id] = o.seqs[0].finish_reason

    def receive(timeout: float) -> list:
        nonlocal calls
        calls += 1
        if script:
            return script.pop(0)
        if set(finished) == {"a", "b"} and "c" not in tokens:
            tokens["c"] = []
            return [AddRequests([request("c", 5)])]
        return [Shutdown()] if len(finished) == 3 or calls > 200 else []

    CoreLoop(core, emit).run(receive)
    assert finished == {"a": "length", "b": "abort", "c": "length"}
    core.scheduler.check_invariants()
    return tokens


def test_the_core_loop_serves_aborts_and_idles_with_a_step_in_flight(shared):
    sync, asynchronous = serve_script(shared[False]), serve_script(shared[True])
    assert asynchronous == sync
    assert [len(sync[r]) for r in "ac"] == [6, 5] and 0 < len(sync["b"]) < 40


def test_a_grammar_row_planned_ahead_keeps_its_mask_when_rows_before_it_leave(shared):
    """The step planned ahead holds [p's decode, g's prefill]; p ends in the step running, so g's row moves
    up before the planned step runs: its mask must move with it, or g samples unmasked."""
    import re

    from pagoda.engine.structured_output import GrammarSpec

    eng = shared[True]
    eng.add_request("p", PROMPTS[0], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    first = eng.step()  # p's prefill ran; p's decode is in flight
    spec = GrammarSpec("regex", r"[0-9]{3}-[a-z]{2}")
    eng.add_request(
        "g", PROMPTS[1], SamplingParams(max_tokens=12, temperature=1.0, seed=5, structured_outputs=spec)
    )
    eng.scheduler.compiling[0].grammar.result(timeout=120)  # compiled before the next plan
    outs = {o.request_id: o for o in first}
    while eng.has_unfinished_requests():
        for delta in eng.step():
            if delta.request_id in outs:
                outs[delta.request_id].add(delta)
            else:
                outs[delta.request_id] = delta
    text = eng.tokenizer.decode(outs["g"].outputs[0].token_ids, skip_special_tokens=True)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text) and outs["g"].outputs[0].finish_reason == "stop"
    assert len(outs["p"].outputs[0].token_ids) == 2


def test_a_failed_step_raises_and_the_engine_serves_on(shared):
    """A step whose device side raises: the error reaches the caller (the core loop then fails its
    requests), nothing stays in flight, and the next request gets the tokens the first one was getting."""
    eng = shared[True]
    runner, real = eng.core.runner, eng.core.runner.run_prepared
    calls = 0

    def flaky(out, prep):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("device fault")
        return real(out, prep)

    runner.run_prepared = flaky
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    eng.add_request("a", PROMPTS[1], params)
    got = []
    try:
        with pytest.raises(RuntimeError, match="device fault"):
            for _ in range(4):
                for delta in eng.step():
                    got.extend(delta.outputs[0].token_ids)
    finally:
        del runner.run_prepared
    assert eng.core._in_flight is None and len(got) == 2
    eng.abort_request("a")
    eng.step()
    assert not eng.has_unfinished_requests()
    eng.scheduler.check_invariants()
    eng.add_request("b", PROMPTS[1], params)
    again = []
    while eng.has_unfinished_requests():
        for delta in eng.step():
            again.extend(delta.outputs[0].token_ids)
    assert again[:2] == got and len(again) == 8


def test_a_window_group_preempting_gives_the_tokens_of_transformers(tmp_path):
    """Gemma 3's sliding layers keep only their window's blocks (freed as a sequence moves on, which async
    planning does while the step runs): a tight cache that preempts still gives transformers' tokens."""
    from pagoda.engine import LLM
    from pagoda_testkit import tiny_gemma

    hf, ids, _ = tiny_gemma.build("gemma3", tmp_path)
    prompts = [ids[i % 2, : 9 + 3 * i].tolist() for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expect = [[tiny_gemma.hf_greedy(hf, p, 24)] for p in prompts]
    llm = LLM(
        str(tmp_path), device="cpu", dtype="float32", max_model_len=48, kv_cache_memory_bytes=1 << 18,
        skip_tokenizer_init=True, block_size=8, max_num_seqs=8, sliding_window_cache="auto",
        async_scheduling=True,
    )  # fmt: skip
    try:
        core = llm.engine.core
        assert core.plan.num_window_blocks > 0 and core._steps is not None
        got = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert got == expect
        assert core.scheduler.total_preemptions > 0
        core.scheduler.kv.check_invariants()
    finally:
        llm.engine.close()


def test_the_step_thread_uses_the_engines_cuda_device(monkeypatch):
    """CUDA's current device is per thread: the worker selects the engine's (the caller's current one when
    the engine's device names no index), before it runs any step."""
    import torch
    from pagoda.engine.core.async_steps import StepThread
    from pagoda.engine.step import RunnerOutput, SchedulerOutput

    chosen: list[tuple[int, str]] = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda i: chosen.append((i, threading.current_thread().name))
    )

    class Runner:
        def prepare(self, out):
            return None

        def run_prepared(self, out, prep):
            return RunnerOutput(token_ids=[len(chosen)])

    for device, index in ((torch.device("cuda"), 1), (torch.device("cuda", 3), 3)):
        chosen.clear()
        steps = StepThread(Runner(), device)
        assert steps.submit(SchedulerOutput()).future.result().token_ids == [1]
        steps.close()
        assert chosen[0][0] == index and chosen[0][1].startswith("pagoda-step")


def test_a_lora_engine_steps_synchronously(caplog):
    """Adapter slots are loaded by the step's host side and released by the core: not from two threads."""
    with caplog.at_level("WARNING", logger="pagoda.engine"):
        eng = engine(True, enable_lora=True, max_loras=1, max_lora_rank=8)
    try:
        assert eng.core._steps is None
        assert "--async-scheduling is not supported with LoRA" in caplog.text
    finally:
        eng.core.close()
