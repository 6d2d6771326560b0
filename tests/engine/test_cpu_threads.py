"""A serving CPU engine leaves a core to its event loop for small steps and computes on all of them otherwise."""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch
from pagoda.engine import LLM, SamplingParams
from pagoda.engine.frontend.async_engine import AsyncEngine, CoreThread


@pytest.fixture
def threads_per_step():
    """The engine and, per step, (new tokens scheduled, torch threads the forward ran with)."""
    if torch.get_num_threads() < 2:
        pytest.skip("leaving a core to the front end needs at least 2 CPU cores")
    llm = LLM(device="cpu", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    seen: list[tuple[int, int]] = []
    runner = llm.engine.runner
    execute = runner.execute

    def spy(out):
        seen.append((sum(s.num_new_tokens for s in out.scheduled), torch.get_num_threads()))
        return execute(out)

    runner.execute = spy
    yield llm, seen
    del runner.execute  # no cycle through the spy: the engine is freed here, not by a GC pass in a later test
    llm.engine.close()
    gc.collect()


def test_offline_engines_use_every_core(threads_per_step):
    llm, seen = threads_per_step
    llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert seen and all(threads == torch.get_num_threads() for _, threads in seen)


def test_serving_leaves_a_core_to_the_event_loop_for_small_steps(threads_per_step):
    llm, seen = threads_per_step
    engine = AsyncEngine(CoreThread(llm.engine.core), llm.engine.tokenizer)

    async def serve() -> None:
        engine.start()
        try:
            # Lengths 2, 4 and 6: however the engine thread happens to batch the three (all together, or
            # each alone), the longest stream's last decodes run without the others.
            streams = [
                await engine.add_request(
                    f"r{i}",
                    [101 + i] * 40,
                    SamplingParams(temperature=0, max_tokens=2 * (i + 1), ignore_eos=True),
                )
                for i in range(3)
            ]
            for stream in streams:
                async for _ in stream:
                    pass
        finally:
            engine.shutdown()

    asyncio.run(serve())
    every = torch.get_num_threads()  # this thread's count, untouched by the engine thread's
    prefill = [threads for tokens, threads in seen if tokens > 2]
    small = [threads for tokens, threads in seen if 0 < tokens <= 2]
    assert prefill and all(t == every for t in prefill)  # prefills and batches of 3 decodes: every core
    assert small and all(t == every - 1 for t in small)  # the last stream's decodes: a core for the front end
