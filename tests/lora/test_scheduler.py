"""The scheduler keeps the running requests within --max-loras distinct adapters: a request of another
adapter waits (those behind it of a running adapter, or of the base model, go ahead) until a slot's
adapter has no running request left."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.engine.core.scheduler import CacheConfig, Scheduler, SchedulerConfig
from pagoda.engine.kv_cache.hashing import adapter_chain_root
from pagoda.engine.request import Request
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.step import RunnerOutput


@dataclass(eq=False)
class FakeAdapter:
    id: int

    @property
    def cache_root(self):
        return adapter_chain_root(f"adapter-{self.id}")


def request(rid: str, adapter: FakeAdapter | None, max_tokens: int) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return Request(rid, [1, 2, 3, 4, 5], params, max_tokens, arrival_time=float(len(rid)), lora=adapter)


def step(s: Scheduler) -> list[str]:
    out = s.schedule()
    samples = sum(len(x.sample_seqs) for x in out.scheduled)
    s.update_from_output(out, RunnerOutput(token_ids=[7] * samples, logprobs=[0.0] * samples))
    s.check_invariants()
    return [x.request.request_id for x in out.scheduled]


def test_a_third_adapter_waits_for_a_free_slot_while_others_go_ahead():
    s = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, max_loras=2),
        CacheConfig(num_blocks=32, block_size=4),
    )
    a, b, c = FakeAdapter(1), FakeAdapter(2), FakeAdapter(3)
    for req in (
        request("a", a, 2),
        request("b", b, 4),
        request("c", c, 1),
        request("base", None, 1),
        request("a2", a, 1),
    ):
        s.add_request(req)
    assert step(s) == ["a", "b", "base", "a2"]  # c waits: a and b hold both slots
    assert [r.request_id for r in s.waiting] == ["c"]
    assert step(s) == ["a", "b"]  # a finishes now; b still runs
    assert step(s) == ["b", "c"]  # a's slot is free: c is admitted, first in line again
    assert {r.lora.id for r in s.running if r.lora} <= {2, 3}


def test_without_a_limit_every_adapter_is_admitted():
    s = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
        CacheConfig(num_blocks=32, block_size=4),
    )
    for i in range(4):
        s.add_request(request(f"r{i}", FakeAdapter(i), 1))
    assert step(s) == ["r0", "r1", "r2", "r3"]
