"""Async scheduling: the device side of a step runs on a thread of its own while the engine core plans the
next step and hands out the last one's outputs (vLLM's --async-scheduling, our own design).

The core's thread keeps everything that reads or writes request state: it plans a step, copies what the
device side needs out of request state (`ModelRunner.prepare`), and hands that to `StepThread`, which runs
the ops, the forward and the sampling (`ModelRunner.run_prepared`). On a CPU torch's operators release the
GIL, so the planning runs while the forward computes; on a GPU it runs while the kernels are queued and run.
One step is in flight at a time: the next one is submitted once the last one's tokens are in.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from pagoda.engine.step import RunnerOutput, SchedulerOutput
from pagoda.engine.worker.model_runner import ModelRunner, PreparedStep


@dataclass
class InFlight:
    """A step whose device side runs; ``advanced``: the scheduler has already moved its sequences on
    (`Scheduler.advance_in_flight`) to plan the next step."""

    sched: SchedulerOutput
    future: Future[RunnerOutput]
    advanced: bool = False


class StepThread:
    """One worker thread that runs steps' device sides, in submission order."""

    def __init__(self, runner: ModelRunner, device: torch.device) -> None:
        self.runner = runner
        # CUDA's current device is per thread: the worker's is the engine's ("cuda" alone: the caller's current)
        self._cuda_index = None
        if device.type == "cuda":
            self._cuda_index = device.index if device.index is not None else torch.cuda.current_device()
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="pagoda-step", initializer=self._init_thread
        )
        # Hooks for tests: called on the worker thread around each step's device side.
        self.on_start: Callable[[SchedulerOutput], None] | None = None
        self.on_end: Callable[[SchedulerOutput], None] | None = None

    def _init_thread(self) -> None:
        if self._cuda_index is not None:
            torch.cuda.set_device(self._cuda_index)

    def submit(self, sched: SchedulerOutput) -> InFlight:
        """Start ``sched``'s device side; its host side is prepared here, on the caller's thread."""
        prep = self.runner.prepare(sched)
        threads = torch.get_num_threads()  # OpenMP's team size is per thread: the caller's choice holds
        return InFlight(sched, self._pool.submit(self._run, sched, prep, threads))

    def _run(self, sched: SchedulerOutput, prep: PreparedStep, threads: int) -> RunnerOutput:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        if self.on_start is not None:
            self.on_start(sched)
        try:
            return self.runner.run_prepared(sched, prep)
        finally:
            if self.on_end is not None:
                self.on_end(sched)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
