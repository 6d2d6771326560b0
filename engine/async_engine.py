"""AsyncEngine: an asyncio front over the synchronous LLMEngine, driven by one engine-loop thread.

Why a thread: LLMEngine is not thread-safe and step() blocks for a model forward, so it lives on a thread
of its own. Ownership is single-threaded on both sides, and they talk only through hand-offs:

- the event loop owns the stream registry (`_streams`) and every RequestStream; it sends commands (add a
  batch of requests, abort, call a function) through the inbox queue;
- the engine thread owns the engine and the set of request ids it has admitted (`_live`); it posts the
  outputs of a whole step back with one `call_soon_threadsafe`, so hundreds of streams cost one wake-up
  per step.

Outputs are deltas (what each step added). A stream merges the deltas its reader has not taken yet into
one pending output (`RequestOutput.add`), so a slow reader holds at most one pending object per request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagoda.engine.outputs import RequestOutput
from pagoda.engine.request import now
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.stats import SchedulerStats

logger = logging.getLogger("pagoda.engine.async_engine")


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine failed while running this request."""


@dataclass
class NewRequest:
    """One request of a batch handed to the engine in a single hand-off."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int = 0


@dataclass
class _Add:
    requests: list[NewRequest]
    arrival_time: float
    admitted: asyncio.Future


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    future: asyncio.Future


def _fresh(delta: RequestOutput) -> RequestOutput:
    """A copy of `delta` the stream owns (lists copied), so merging into it never touches engine objects."""
    out = RequestOutput(
        request_id=delta.request_id,
        prompt=delta.prompt,
        prompt_token_ids=delta.prompt_token_ids,
        outputs=[],
        finished=False,
    )
    out.add(delta)
    return out


class RequestStream:
    """The event-loop side of one request: the deltas not read yet (merged into one), or the error that
    ended it. Only the event loop touches it."""

    def __init__(self, request_id: str, admitted: asyncio.Future, on_abandon: Callable[[str], None]) -> None:
        self.request_id = request_id
        self.admitted = admitted  # shared by the requests of one hand-off
        self.finished = False  # the final delta (or an error) has arrived
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self._listeners: list[asyncio.Event] = []
        self._on_abandon = on_abandon

    def _wake(self) -> None:
        self._event.set()
        for ev in self._listeners:
            ev.set()

    def _put(self, delta: RequestOutput) -> None:
        if self._pending is None:
            self._pending = _fresh(delta)
        else:
            self._pending.add(delta)
        if delta.finished:
            self.finished = True
        self._wake()

    def _fail(self, error: BaseException) -> None:
        if self.finished and self._error is None and self._pending is None:
            return  # already delivered in full
        self._error = error
        self._pending = None
        self.finished = True
        if not self.admitted.done():
            self.admitted.set_exception(error)
        self._wake()

    def take(self) -> RequestOutput | None:
        """The deltas that arrived since the last call, merged (None if none); raises the request's error."""
        if self._error is not None:
            raise self._error
        out, self._pending = self._pending, None
        return out

    @property
    def done(self) -> bool:
        """Finished and nothing left to take."""
        return self.finished and self._pending is None and self._error is None

    def listen(self, event: asyncio.Event) -> None:
        """Also set `event` whenever something arrives (one event can watch several streams)."""
        self._listeners.append(event)
        if self._pending is not None or self._error is not None:
            event.set()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """Merged deltas until the final one; leaving early (break, cancel) aborts the request."""
        try:
            while True:
                self._event.clear()
                out = self.take()
                if out is not None:
                    yield out
                    if out.finished:
                        return
                elif self.finished:
                    return
                else:
                    await self._event.wait()
        finally:
            if not self.finished:
                self._on_abandon(self.request_id)


@dataclass
class _Counters:
    pending_adds: int = 0  # handed over, not yet looked at by the engine thread (event loop only)
    last_stats: SchedulerStats = field(default_factory=SchedulerStats)  # written by the engine thread


class AsyncEngine:
    """Owns the engine thread. Create it, `start()` it from a running event loop, `shutdown()` at exit."""

    MAX_CONSECUTIVE_STEP_FAILURES = 3

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._dead_reason: str | None = None
        self._counters = _Counters()
        self._ids = itertools.count()
        self._failure_listeners: list[Callable[[BaseException], None]] = []
        # Event loop only.
        self._streams: dict[str, RequestStream] = {}
        self._calls: set[asyncio.Future] = set()
        # Engine thread only.
        self._live: set[str] = set()
        self.steps = 0
        self.failed_steps = 0

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # Serving: this process also runs the event loop, which must not preempt the engine's compute threads
        # on every token (engines that can leave it a core while a step is small: `serving_front_end`).
        if hasattr(self.engine, "serving_front_end"):
            self.engine.serving_front_end = True
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

    def add_step_failure_listener(self, fn: Callable[[BaseException], None]) -> None:
        """Call `fn(error)` on the engine thread after every failed step (e.g. a metrics counter)."""
        self._failure_listeners.append(fn)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        """Why no request can be served: the loop's own failure, or the engine's (a tensor-parallel rank
        that died, noticed by its watchdog even while the loop idles)."""
        return self._dead_reason or getattr(self.engine, "dead_reason", None)

    @property
    def num_waiting(self) -> int:
        """Requests waiting in the engine plus those handed over but not yet admitted."""
        return self._counters.last_stats.num_waiting + self._counters.pending_adds

    @property
    def num_running(self) -> int:
        return self._counters.last_stats.num_running

    # ------------------------------------------------------------ async API

    async def add_requests(self, requests: Sequence[NewRequest]) -> list[RequestStream]:
        """Hand a batch of requests to the engine in one hand-off (one engine-loop pass admits them all).

        All or nothing: if the engine refuses one (ValueError naming the problem), none stays admitted.
        If the caller is cancelled while waiting, the requests are aborted.
        """
        if not self.is_alive:
            raise EngineDeadError(self._dead_reason or "the engine loop is not running")
        assert self._loop is not None
        admitted = self._loop.create_future()
        streams = [RequestStream(r.request_id, admitted, self._abandon) for r in requests]
        for stream in streams:
            self._streams[stream.request_id] = stream
        self._counters.pending_adds += len(streams)
        self._inbox.put(_Add(list(requests), now(), admitted))
        try:
            await admitted
        except BaseException:
            for stream in streams:
                self._streams.pop(stream.request_id, None)
            # Queued after the add, so it lands after it: whatever the engine admitted leaves again.
            self._inbox.put(_Abort([s.request_id for s in streams]))
            raise
        return streams

    async def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, *, priority: int = 0
    ) -> RequestStream:
        """Hand one request to the engine; raises ValueError (bad input) once the engine has looked at it."""
        (stream,) = await self.add_requests([NewRequest(request_id, prompt, params, priority)])
        return stream

    def abort(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        ids = [i for i in ids if self._streams.pop(i, None) is not None]
        if ids:
            self._inbox.put(_Abort(ids))

    def _abandon(self, request_id: str) -> None:
        self.abort(request_id)

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run `fn(engine)` on the engine thread (the engine is not thread-safe) and return its result."""
        if not self.is_alive:
            raise EngineDeadError(self._dead_reason or "the engine loop is not running")
        assert self._loop is not None
        fut = self._loop.create_future()
        self._calls.add(fut)
        fut.add_done_callback(self._calls.discard)
        self._inbox.put(_Call(fn, fut))
        return await fut

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{time.monotonic_ns():x}"

    # ------------------------------------------------------------ event loop side of the hand-offs

    def _handed_over(self, count: int) -> None:
        self._counters.pending_adds -= count

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream._put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream._fail(error)

    def _fail_all(self, error: BaseException) -> None:
        streams = list(self._streams.values())
        self._streams.clear()
        for stream in streams:
            stream._fail(error)
        for fut in list(self._calls):
            _set_exception(fut, error)

    # ------------------------------------------------------------ engine thread

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the server is going away
            pass

    def _handle(self, cmd: Any) -> None:
        if isinstance(cmd, _Add):
            self._post(self._handed_over, len(cmd.requests))
            added: list[str] = []
            try:
                for r in cmd.requests:
                    self.engine.add_request(
                        r.request_id, r.prompt, r.params, arrival_time=cmd.arrival_time, priority=r.priority
                    )
                    added.append(r.request_id)
            except Exception as exc:  # noqa: BLE001 - handed to the requests that caused it
                if added:
                    self.engine.abort_request(added)
                self._post(_set_exception, cmd.admitted, exc)
                return
            self._live.update(added)
            self._post(_set_result, cmd.admitted)
        elif isinstance(cmd, _Abort):
            ids = [i for i in cmd.request_ids if i in self._live]
            if ids:
                self._live.difference_update(ids)
                self.engine.abort_request(ids)
        elif isinstance(cmd, _Call):
            try:
                result = cmd.fn(self.engine)
            except Exception as exc:  # noqa: BLE001
                self._post(_set_exception, cmd.future, exc)
            else:
                self._post(_set_result, cmd.future, result)

    def _step_failed(self, exc: BaseException, consecutive: int) -> None:
        self.failed_steps += 1
        logger.exception("engine step failed (%d in a row)", consecutive)
        for fn in self._failure_listeners:
            try:
                fn(exc)
            except Exception:  # noqa: BLE001 - a listener must not take the loop down
                logger.exception("step-failure listener failed")
        ids, self._live = list(self._live), set()
        self._post(self._fail, ids, RequestFailedError(f"engine step failed: {exc!r}"))
        try:
            self.engine.abort_request(ids)
        except Exception:  # noqa: BLE001
            logger.exception("abort after a failed step also failed")

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
                    self._step_failed(exc, failures)
                    if failures >= self.MAX_CONSECUTIVE_STEP_FAILURES:
                        self._dead_reason = f"engine step failed {failures} times in a row: {exc!r}"
                        self._post(self._fail_all, EngineDeadError(self._dead_reason))
                        return
                    continue
                self.steps += 1
                self._counters.last_stats = self.engine.get_scheduler_stats()
                for out in outputs:
                    if out.finished:
                        self._live.discard(out.request_id)
                if outputs:
                    self._post(self._deliver, outputs)
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
