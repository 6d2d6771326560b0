"""An engine core without a model, for tests of the core's own process and its transport
(`CoreProcess(config, core_factory=FakeCoreFactory(...))`): the factory is pickled into the spawned
child, which imports this module to build the core there.

Every sequence gets token k in its k-th step. The first step that has requests can be held: until a file
exists (``hold_until``, the test decides when the core reads again) or, holding the GIL, in a regex that
backtracks for minutes (``gil_bound``: a core deaf to everything but the kernel's signals).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

HOLD_LIMIT_S = 120.0


@dataclass
class FakeCoreFactory:
    hold_until: str | None = None  # the first step with requests waits until this path exists
    gil_bound: bool = False  # the first step with requests runs a runaway regex instead
    step_s: float = 0.0
    vocab_size: int = 1000
    max_model_len: int = 1024
    started_file: str | None = None  # written (with the core's pid) when the first held step starts

    def __call__(self, config: Any) -> FakeProcessCore:
        return FakeProcessCore(self)


@dataclass
class _Req:
    n: int
    max_tokens: int
    produced: int = 0


@dataclass
class FakeProcessCore:
    spec: FakeCoreFactory
    requests: dict[str, _Req] = field(default_factory=dict)
    steps: int = 0
    held: bool = False
    serving_front_end: bool = False
    dead_reason: str | None = None
    _aborted: list = field(default_factory=list)

    def __post_init__(self) -> None:
        from pagoda.engine.core.info import EngineInfo

        self.info = EngineInfo(
            model_name="fake",
            max_model_len=self.spec.max_model_len,
            vocab_size=self.spec.vocab_size,
            block_size=16,
            num_blocks=64,
        )

    def add_request(self, req: Any) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.requests[req.request_id] = _Req(req.params.n, req.max_tokens)

    def abort_requests(self, request_ids: Any) -> None:
        from pagoda.engine.core.messages import CoreOutput, SeqDelta

        for rid in list(request_ids):
            req = self.requests.pop(rid, None)
            if req is not None:
                seqs = [SeqDelta(i, [], finish_reason="abort") for i in range(req.n)]
                self._aborted.append(CoreOutput(rid, seqs, finished=True))

    def finish_seqs(self, seqs: Any) -> None:
        for rid, _index, _stop in seqs:
            self.requests.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def request_ids(self) -> list[str]:
        return list(self.requests)

    def num_requests(self) -> int:
        return len(self.requests)

    def get_scheduler_stats(self) -> Any:
        from pagoda.engine.core.stats import SchedulerStats

        return SchedulerStats(num_running=len(self.requests))

    def take_finished_stats(self) -> list:
        return []

    def _hold(self) -> None:
        self.held = True
        if self.spec.started_file:
            with open(self.spec.started_file, "w") as f:
                f.write(str(os.getpid()))
        if self.spec.gil_bound:
            re.match(r"(a|aa)*c", "a" * 60)  # exponential: minutes, in C, holding the GIL
        deadline = time.monotonic() + HOLD_LIMIT_S
        while self.spec.hold_until and not os.path.exists(self.spec.hold_until):
            if time.monotonic() > deadline:
                raise RuntimeError("the test never released the held step")
            time.sleep(0.01)

    def step(self, stats: bool = True) -> Any:
        from pagoda.engine.core.messages import CoreOutput, EngineCoreOutputs, SeqDelta
        from pagoda.engine.core.stats import IterationStats

        self.steps += 1
        if self.requests and not self.held and (self.spec.hold_until or self.spec.gil_bound):
            self._hold()
        if self.spec.step_s:
            time.sleep(self.spec.step_s)
        outputs, self._aborted = self._aborted, []
        for rid, req in list(self.requests.items()):
            req.produced += 1
            done = req.produced >= req.max_tokens
            reason = "length" if done else None
            seqs = [SeqDelta(i, [req.produced], finish_reason=reason) for i in range(req.n)]
            outputs.append(CoreOutput(rid, seqs, finished=done))
            if done:
                del self.requests[rid]
        return EngineCoreOutputs(outputs, self.get_scheduler_stats(), IterationStats())

    def close(self) -> None:
        pass
