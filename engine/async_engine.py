"""AsyncEngine: an asyncio front over the synchronous LLMEngine, driven by one engine-loop thread.

Why a thread: LLMEngine is not thread-safe and step() blocks for a model forward, so it lives on a thread
of its own. The event loop only hands requests and aborts over through an inbox and reads results; the
engine thread delivers the outputs of a whole step with one `call_soon_threadsafe`, so hundreds of streams
cost one wake-up per step. Outputs are cumulative, so each stream keeps only the newest one: a slow
reader never makes memory grow.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

from pagoda.engine.outputs import RequestOutput
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.stats import SchedulerStats

logger = logging.getLogger("pagoda.engine.async_engine")


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine failed while running this request."""


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    stream: RequestStream


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    fn: Any
    future: asyncio.Future


class RequestStream:
    """The async side of one request: the newest cumulative output, or the error that ended it."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._loop = loop
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self.admitted: asyncio.Future = loop.create_future()
        self.finished = False

    # Called on the event loop (via call_soon_threadsafe from the engine thread).
    def _put(self, output: RequestOutput) -> None:
        self._latest = output
        if output.finished:
            self.finished = True
        self._event.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self.finished = True
        if not self.admitted.done():
            self.admitted.set_exception(error)
        self._event.set()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            await self._event.wait()
            self._event.clear()
            if self._error is not None:
                raise self._error
            out = self._latest
            if out is not None:
                yield out
                if out.finished:
                    return


def _snapshot(out: RequestOutput) -> RequestOutput:
    """Copy what the event loop reads, so the engine may keep mutating its own objects."""
    outputs = []
    for c in out.outputs:
        c2 = copy.copy(c)
        c2.token_ids = list(c.token_ids)
        if c.logprobs is not None:
            c2.logprobs = list(c.logprobs)
        outputs.append(c2)
    snap = copy.copy(out)
    snap.outputs = outputs
    return snap


@dataclass
class _Counters:
    pending_adds: int = 0
    last_stats: SchedulerStats = field(default_factory=SchedulerStats)


class AsyncEngine:
    """Owns the engine thread. Create it, `start()` it from a running event loop, `shutdown()` at exit."""

    MAX_CONSECUTIVE_STEP_FAILURES = 3

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._dead_reason: str | None = None
        self._counters = _Counters()
        self._ids = itertools.count()
        self.steps = 0

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagoda-engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            # Only once the loop thread is gone: finish disk-tier writes and release its directory lock.
            self.engine.close()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    @property
    def num_waiting(self) -> int:
        """Requests waiting in the engine plus those handed over but not yet admitted."""
        return self._counters.last_stats.num_waiting + self._counters.pending_adds

    @property
    def num_running(self) -> int:
        return self._counters.last_stats.num_running

    # ------------------------------------------------------------ async API

    async def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, *, priority: int = 0
    ) -> RequestStream:
        """Hand a request to the engine; raises ValueError (bad input) once the engine has looked at it."""
        if not self.is_alive:
            raise EngineDeadError(self._dead_reason or "the engine loop is not running")
        assert self._loop is not None
        stream = RequestStream(request_id, self._loop)
        self._streams[request_id] = stream
        self._counters.pending_adds += 1
        self._inbox.put(_Add(request_id, prompt, params, priority, time.time(), stream))
        try:
            await stream.admitted
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return stream

    def abort(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        ids = [i for i in ids if i in self._streams]
        for i in ids:
            self._streams.pop(i, None)
        if ids:
            self._inbox.put(_Abort(ids))

    async def call(self, fn: Any) -> Any:
        """Run `fn(engine)` on the engine thread (the engine is not thread-safe) and return its result."""
        if not self.is_alive:
            raise EngineDeadError(self._dead_reason or "the engine loop is not running")
        assert self._loop is not None
        fut = self._loop.create_future()
        self._inbox.put(_Call(fn, fut))
        return await fut

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{time.monotonic_ns():x}"

    # ------------------------------------------------------------ engine thread

    def _post(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the server is going away
            pass

    def _handle(self, cmd: Any) -> None:
        if isinstance(cmd, _Add):
            self._post(self._admitted_pending_done)
            try:
                self.engine.add_request(
                    cmd.request_id,
                    cmd.prompt,
                    cmd.params,
                    arrival_time=cmd.arrival_time,
                    priority=cmd.priority,
                )
            except Exception as exc:  # noqa: BLE001 - handed to the request that caused it
                self._post(cmd.stream._fail, exc)
                return
            self._post(_set_result, cmd.stream.admitted)
        elif isinstance(cmd, _Abort):
            self.engine.abort_request(cmd.request_ids)
        elif isinstance(cmd, _Call):
            try:
                result = cmd.fn(self.engine)
            except Exception as exc:  # noqa: BLE001
                self._post(_set_exception, cmd.future, exc)
            else:
                self._post(_set_result, cmd.future, result)

    def _admitted_pending_done(self) -> None:
        self._counters.pending_adds -= 1

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream._put(out)
            if out.finished:
                self._streams.pop(out.request_id, None)

    def _fail_all(self, error: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream._fail(error)
        self._streams.clear()

    def _run(self) -> None:
        failures = 0
        try:
            while not self._stop.is_set():
                busy = self.engine.has_unfinished_requests()
                try:  # idle: sleep until a command arrives; busy: just drain what is there
                    cmd = self._inbox.get_nowait() if busy else self._inbox.get()
                except queue.Empty:
                    cmd = None
                handled = False
                while cmd is not None:
                    self._handle(cmd)
                    handled = True
                    try:
                        cmd = self._inbox.get_nowait()
                    except queue.Empty:
                        cmd = None
                if self._stop.is_set():
                    break
                if not self.engine.has_unfinished_requests() and not handled:
                    continue
                # Step even when idle after commands: an empty step flushes aborted requests' outputs
                # and stats, so gauges and counters are current once the last request leaves.
                try:
                    outputs = self.engine.step()
                    failures = 0
                except Exception as exc:  # noqa: BLE001 - fail the requests, keep serving
                    failures += 1
                    logger.exception("engine step failed (%d in a row)", failures)
                    ids = list(self._streams)
                    self._post(self._fail_all, RequestFailedError(f"engine step failed: {exc!r}"))
                    try:
                        self.engine.abort_request(ids)
                    except Exception:  # noqa: BLE001
                        logger.exception("abort after a failed step also failed")
                    if failures >= self.MAX_CONSECUTIVE_STEP_FAILURES:
                        self._dead_reason = f"engine step failed {failures} times in a row: {exc!r}"
                        return
                    continue
                self.steps += 1
                self._counters.last_stats = self.engine.get_scheduler_stats()
                if outputs:
                    self._post(self._deliver, [_snapshot(o) for o in outputs])
        except BaseException as exc:  # noqa: BLE001
            self._dead_reason = f"engine loop crashed: {exc!r}"
            logger.exception("engine loop crashed")
            self._post(self._fail_all, EngineDeadError(self._dead_reason))
        finally:
            if self._dead_reason is None and not self._stop.is_set():
                self._dead_reason = "engine loop exited"


def _set_result(fut: asyncio.Future, value: Any = None) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
