"""AsyncEngine over a fake engine core on a thread (no model): clock, ownership of the stream registry,
cancels, slow readers, failed steps. The fake keeps EngineCore's contract: one thread drives it, outputs are
token deltas that the front end's output processing turns into text."""

from __future__ import annotations

import asyncio
import gc
import random
import threading
import time

import pytest
from pagoda.engine.core.loop import CoreLoop
from pagoda.engine.frontend.async_engine import EngineDeadError, RequestFailedError
from pagoda.engine.outputs import RequestOutput
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.server.serving import _merge

pytestmark = pytest.mark.asyncio


class LoopOnlyDict(dict):
    """A dict that records every access made from a thread other than its owner's."""

    def __init__(self, owner: threading.Thread) -> None:
        super().__init__()
        self.owner = owner
        self.foreign: list[str] = []

    def _check(self) -> None:
        if threading.current_thread() is not self.owner:
            self.foreign.append(threading.current_thread().name)


for _name in ("__getitem__", "__setitem__", "__delitem__", "__contains__", "__iter__", "__len__", "get",
              "pop", "keys", "values", "items", "clear", "setdefault", "copy"):  # fmt: skip

    def _wrap(name: str = _name):
        base = getattr(dict, name)

        def method(self, *args, **kwargs):
            self._check()
            return base(self, *args, **kwargs)

        return method

    setattr(LoopOnlyDict, _name, _wrap())


async def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def consume(stream) -> dict[int, list[int]]:
    """Every token of every choice, folded from the deltas."""
    tokens: dict[int, list[int]] = {}
    async for out in stream:
        for c in out.outputs:
            tokens.setdefault(c.index, []).extend(c.token_ids)
    return tokens


@pytest.fixture
def engine_factory(fakes):
    started = []

    def make(**kwargs):
        aengine, core = fakes.start(**kwargs)
        started.append(aengine)
        return aengine, core

    yield make
    for aengine in started:
        aengine.shutdown()


async def test_arrival_time_is_stamped_with_the_engine_clock(engine_factory) -> None:
    """The engine subtracts arrival_time from time.monotonic(): a wall-clock stamp made latencies ~-1.8e9 s."""
    aengine, core = engine_factory()
    before = time.monotonic()
    stream = await aengine.add_request("r", [1, 2], SamplingParams(max_tokens=2))
    after = time.monotonic()
    assert await consume(stream) == {0: [1, 2]}
    assert before <= core.arrivals["r"] <= after


async def test_an_abort_right_after_the_add_reaches_the_core_after_it(engine_factory) -> None:
    """The add and the abort travel in order: the core admits, then drops the request; nothing leaks."""
    aengine, core = engine_factory(block_add=threading.Event(), step_s=0.001)
    await aengine.add_request("r", [1], SamplingParams(max_tokens=10**6))
    await asyncio.to_thread(core.entered_add.wait, 10)  # the core thread is admitting it now
    aengine.abort("r")
    core.block_add.set()
    await wait_for(lambda: ("abort", "r") in core.log)
    await wait_for(lambda: not core.requests)
    assert core.log.index(("add", "r")) < core.log.index(("abort", "r"))
    assert not aengine._streams and len(aengine.output_processor) == 0


async def test_input_processing_refuses_a_batch_before_the_core_sees_any_of_it(engine_factory) -> None:
    aengine, core = engine_factory()
    good, bad = SamplingParams(max_tokens=3), SamplingParams(max_tokens=3, stop_token_ids=[5000])
    from pagoda.engine.frontend.engine_client import NewRequest

    with pytest.raises(ValueError, match="stop_token_ids contains 5000"):
        await aengine.add_requests([NewRequest("a", [1], good), NewRequest("b", [1], bad)])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        await aengine.add_request("c", [1, 1000], good)
    assert not aengine._streams and not [e for e in core.log if e[0] == "add"]


async def test_engine_thread_never_touches_the_stream_registry(engine_factory) -> None:
    aengine, core = engine_factory(step_s=0.002)
    registry = LoopOnlyDict(threading.current_thread())
    aengine._streams = registry
    streams = [await aengine.add_request(f"r{i}", [1], SamplingParams(max_tokens=10**6)) for i in range(5)]
    core.fail_steps.add(core.steps + 3)
    for stream in streams:
        with pytest.raises(RequestFailedError):
            await consume(stream)
    await wait_for(lambda: not core.requests)
    assert registry.foreign == [], f"the engine thread read the registry {len(registry.foreign)} times"
    assert not registry


async def test_stress_with_cancels_leaves_nothing_behind(engine_factory) -> None:
    """300 clients with random lengths and n, a third cancelled at random points, two failed steps."""
    aengine, core = engine_factory(step_s=0.0005)
    registry = LoopOnlyDict(threading.current_thread())
    aengine._streams = registry
    rng = random.Random(0)
    # early enough that both come while clients still arrive (0.2 s of them), however slow the machine: at
    # steps 15 and 60 a loaded CI machine had run out of work before the second
    core.fail_steps.update({10, 14})

    async def client(i: int, params: SamplingParams) -> tuple[str, dict]:
        await asyncio.sleep(rng.random() * 0.2)
        rid = f"r{i}"
        try:
            stream = await aengine.add_request(rid, [1, 2, 3], params)
            return "done", await consume(stream)
        except RequestFailedError:
            return "failed", {}

    params = [SamplingParams(max_tokens=rng.randint(1, 30), n=rng.choice([1, 1, 2])) for _ in range(300)]
    tasks = [asyncio.ensure_future(client(i, p)) for i, p in enumerate(params)]
    for i in rng.sample(range(300), 100):
        await asyncio.sleep(rng.random() * 0.003)
        tasks[i].cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)

    await wait_for(lambda: not core.requests)
    await wait_for(lambda: not registry)
    assert registry.foreign == []
    outcomes = {"done": 0, "failed": 0, "cancelled": 0}
    for p, result in zip(params, results, strict=True):
        if isinstance(result, asyncio.CancelledError):
            outcomes["cancelled"] += 1
            continue
        kind, tokens = result
        outcomes[kind] += 1
        if kind == "done":  # every delta arrived exactly once, in order, for every choice
            assert tokens == {i: list(range(1, p.max_tokens + 1)) for i in range(p.n)}
    assert outcomes["done"] > 50 and outcomes["cancelled"] > 0, outcomes
    assert aengine.failed_steps == 2
    # Every cancelled client's request was aborted or had already finished: nothing runs unread (the
    # core's last stats reach the loop with its last step's message).
    await wait_for(lambda: aengine.num_running == 0)
    assert aengine.is_alive and aengine.num_waiting == 0


async def test_slow_reader_holds_at_most_one_pending_output_per_stream(engine_factory) -> None:
    aengine, core = engine_factory(step_s=0.0005)
    streams = [await aengine.add_request(f"r{i}", [1], SamplingParams(max_tokens=10**6)) for i in range(3)]
    merged = _merge(streams)
    i, first = await merged.__anext__()
    read = {0: 0, 1: 0, 2: 0}
    read[i] = first.outputs[0].token_ids[-1]
    target = core.steps + 300
    await wait_for(lambda: core.steps >= target)  # 300 steps x 3 streams while nobody reads
    gc.collect()
    alive = sum(1 for o in gc.get_objects() if type(o) is RequestOutput)
    # 3 pending (one per stream) plus the few steps' deliveries still queued on the loop; unbounded ~900
    assert alive <= 30, f"{alive} outputs buffered for a reader that reads nothing"
    for _ in range(3):  # what was buffered comes out as one merged delta per stream, nothing lost
        i, delta = await merged.__anext__()
        tokens = delta.outputs[0].token_ids
        assert tokens == list(range(read[i] + 1, read[i] + 1 + len(tokens))) and len(tokens) >= 250
        read[i] = tokens[-1]
    await merged.aclose()
    aengine.abort([s.request_id for s in streams])
    await wait_for(lambda: not core.requests)


async def test_failed_steps_are_counted_reported_and_survived(engine_factory) -> None:
    aengine, core = engine_factory()
    seen: list[BaseException] = []
    aengine.add_step_failure_listener(seen.append)
    core.fail_steps.add(core.steps + 2)
    stream = await aengine.add_request("a", [1], SamplingParams(max_tokens=10**6))
    with pytest.raises(RequestFailedError):
        await consume(stream)
    assert aengine.failed_steps == 1 and len(seen) == 1 and "injected failure" in str(seen[0])
    stream = await aengine.add_request("b", [1], SamplingParams(max_tokens=3))
    assert await consume(stream) == {0: [1, 2, 3]}
    assert aengine.is_alive


async def test_consecutive_failures_kill_the_engine_and_fail_what_waits(engine_factory) -> None:
    aengine, core = engine_factory()
    core.fail_steps.update(range(1, 1000))
    for i in range(CoreLoop.MAX_CONSECUTIVE_STEP_FAILURES):  # each request's first step fails
        stream = await aengine.add_request(f"a{i}", [1], SamplingParams(max_tokens=10**6))
        with pytest.raises(RequestFailedError):
            await consume(stream)
    await wait_for(lambda: not aengine.is_alive)
    assert aengine.failed_steps == CoreLoop.MAX_CONSECUTIVE_STEP_FAILURES
    assert "3 times in a row" in aengine.dead_reason
    with pytest.raises(EngineDeadError):
        await aengine.add_request("b", [1], SamplingParams(max_tokens=3))
    with pytest.raises(EngineDeadError):
        await aengine.reset_prefix_cache()
