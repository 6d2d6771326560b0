"""The engine core's busy loop: take the commands that arrived, step, hand the step's outputs out; repeat.

It never waits on the front end: while requests run it only drains commands already there between steps,
and the outputs of a step go out as one message the front end reads when it can. Idle, it waits for a
command (at most `IDLE_POLL_S`, so a dead tensor-parallel rank is noticed). After handling commands it
steps even when nothing runs: an empty step hands out aborted requests' final outputs and the stats, so
gauges and counters are current once the last request leaves.

A step that raises fails the requests it was running (their clients get an error) and the loop goes on;
`MAX_CONSECUTIVE_STEP_FAILURES` in a row stop it for good (`dead`). The same loop runs on a thread of the
server's process (engine/frontend/async_engine.py: CoreThread) and in the core's own process
(engine/frontend/core_process.py); only how commands arrive and outputs leave differs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pagoda.engine.core.messages import (
    UTILITY_METHODS,
    Abort,
    AddRequests,
    Command,
    CoreMessage,
    EngineCoreOutputs,
    FinishSeqs,
    Shutdown,
    UtilityCall,
    UtilityResult,
)
from pagoda.engine.core.stats import IterationStats

log = logging.getLogger("pagoda.engine.core.loop")

IDLE_POLL_S = 0.5

# receive(timeout): the commands that arrived, waiting up to `timeout` seconds for the first (0: no wait).
Receive = Callable[[float], list[Command]]


class CoreLoop:
    MAX_CONSECUTIVE_STEP_FAILURES = 3

    def __init__(self, core: Any, emit: Callable[[CoreMessage], None]) -> None:
        self.core = core
        self.emit = emit
        self.dead: str | None = None
        self._failures = 0

    def run(self, receive: Receive) -> None:
        """Until a Shutdown command, or the core dies (then the front end has been told why)."""
        try:
            while self.dead is None:
                busy = self.core.has_unfinished_requests()
                commands = receive(0.0 if busy else IDLE_POLL_S)
                for cmd in commands:
                    if isinstance(cmd, Shutdown):
                        return
                    self.handle(cmd)
                if self.core.dead_reason is not None:
                    self._die(self.core.dead_reason)
                elif busy or commands:
                    self.step()
        except BaseException as exc:  # noqa: BLE001 - whatever it was, the front end must hear of it
            log.exception("engine core loop crashed")
            self._die(f"engine core loop crashed: {exc!r}")
            if not isinstance(exc, Exception):
                raise

    def _die(self, reason: str) -> None:
        self.dead = reason
        self.emit(EngineCoreOutputs(dead=reason))

    def handle(self, cmd: Command) -> None:
        core = self.core
        if isinstance(cmd, AddRequests):
            added: list[str] = []
            try:
                for req in cmd.requests:
                    core.add_request(req)
                    added.append(req.request_id)
            except Exception as exc:  # noqa: BLE001 - input processing checked them: refuse the batch
                log.exception("the engine core refused a request")
                core.abort_requests(added)
                ids = [r.request_id for r in cmd.requests]
                self.emit(EngineCoreOutputs(failed=ids, failure=f"the engine refused the request: {exc!r}"))
        elif isinstance(cmd, Abort):
            core.abort_requests(cmd.request_ids)
        elif isinstance(cmd, FinishSeqs):
            core.finish_seqs(cmd.seqs)
        elif isinstance(cmd, UtilityCall):
            self.emit(self._utility(cmd))

    def _utility(self, call: UtilityCall) -> UtilityResult:
        if call.method not in UTILITY_METHODS:
            return UtilityResult(call.call_id, error=f"no such engine call: {call.method!r}")
        try:
            return UtilityResult(call.call_id, getattr(self.core, call.method)(*call.args))
        except (ValueError, KeyError) as exc:  # a refusal (e.g. an adapter that cannot be served): say why
            kind = "KeyError" if isinstance(exc, KeyError) else "ValueError"
            return UtilityResult(call.call_id, error=str(exc.args[0] if exc.args else exc), error_type=kind)
        except Exception as exc:  # noqa: BLE001 - the caller's error, not the loop's
            return UtilityResult(call.call_id, error=repr(exc))

    def step(self) -> None:
        try:
            out = self.core.step()
        except Exception as exc:  # noqa: BLE001 - fail the requests it ran, keep serving
            self._failures += 1
            log.exception("engine step failed (%d in a row)", self._failures)
            ids = self.core.request_ids()
            out = EngineCoreOutputs(failed=ids, failure=f"engine step failed: {exc!r}", step_failed=True)
            try:
                self.core.abort_requests(ids)
                # The gauges must not keep showing the failed requests as running.
                out.scheduler_stats = self.core.get_scheduler_stats()
                out.iteration_stats = IterationStats(finished_requests=self.core.take_finished_stats())
            except Exception:  # noqa: BLE001
                log.exception("abort after a failed step also failed")
            if self._failures >= self.MAX_CONSECUTIVE_STEP_FAILURES:
                self.dead = out.dead = f"engine step failed {self._failures} times in a row: {exc!r}"
            self.emit(out)
            return
        self._failures = 0
        self.emit(out)
