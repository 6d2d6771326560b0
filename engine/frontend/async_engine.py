"""AsyncEngine: the server's engine client (`EngineClient`), the front end of an engine core.

On the event loop it runs input processing (checks, lengths; the server tokenizes on its worker pool),
keeps one RequestStream per request, turns the core's per-step outputs into text deltas (output
processing: detokenization, stop strings) and feeds every step's stats to the stat loggers (Prometheus,
the log line, the router's rates). The core itself runs elsewhere and is reached only by messages
(engine/core/messages.py):

- `CoreThread` (here): the core's busy loop on a thread of this process: tests, benchmarks, and
  `pagoda serve --no-engine-process`;
- `CoreProcess` (engine/frontend/core_process.py): the core in a process of its own, over ZMQ: `pagoda serve`.

Ownership is single-threaded on each side: the event loop owns the streams and the processors, the core
owns request and KV state. Each step's outputs reach the loop as one message, so hundreds of streams cost
one wake-up per step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from pagoda.engine.core.loop import CoreLoop
from pagoda.engine.core.messages import (
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
from pagoda.engine.core.stats import SchedulerStats, StatLogger
from pagoda.engine.frontend.engine_client import (
    EngineDeadError,
    EngineInfo,
    LoRAAdapterInfo,
    NewRequest,
    RequestFailedError,
)
from pagoda.engine.frontend.input_processor import InputError, InputProcessor
from pagoda.engine.frontend.output_processor import OutputProcessor
from pagoda.engine.frontend.request_stream import RequestStream
from pagoda.engine.request import now

__all__ = ["AsyncEngine", "CoreThread", "EngineDeadError", "RequestFailedError", "NewRequest"]

logger = logging.getLogger("pagoda.engine.frontend.async_engine")

# What a refused call into the core raises here (UtilityResult.error_type); anything else: RuntimeError.
_REFUSALS: dict[str, type[Exception]] = {"ValueError": ValueError, "KeyError": KeyError}


class CoreHandle(Protocol):
    """Where the core runs, as the front end drives it."""

    info: EngineInfo

    def start(self, deliver: Callable[[CoreMessage], None]) -> None:
        """Start the core; `deliver(message)` is then called on the current event loop for every message."""

    def send(self, cmd: Command) -> None: ...

    def shutdown(self, timeout: float = 10.0) -> None: ...


class CoreThread:
    """The core's busy loop on a thread of this process (the core is not thread-safe: only that thread
    touches it). ``share_cores``: the core computes on one core fewer for small steps, leaving it to the
    event loop that shares this process (EngineCore.FRONT_END_CORE_MAX_TOKENS)."""

    def __init__(self, core: Any, *, share_cores: bool = True) -> None:
        self.core = core
        self.info: EngineInfo = core.info
        self.core.serving_front_end = share_cores
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, deliver: Callable[[CoreMessage], None]) -> None:
        loop = asyncio.get_running_loop()

        def emit(msg: CoreMessage) -> None:
            try:
                loop.call_soon_threadsafe(deliver, msg)
            except RuntimeError:  # the loop is closed: the server is going away
                pass

        core_loop = CoreLoop(self.core, emit)
        self._thread = threading.Thread(
            target=core_loop.run, args=(self._receive,), name="pagoda-engine-loop", daemon=True
        )
        self._thread.start()

    def _receive(self, timeout: float) -> list[Command]:
        try:
            first = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return []
        cmds = [first]
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                return cmds

    def send(self, cmd: Command) -> None:
        self._inbox.put(cmd)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._inbox.put(Shutdown())
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            # Only once the loop thread is gone: finish disk-tier writes and release its directory lock.
            self.core.close()


class AsyncEngine:
    """The front end of one engine core; create it, `start()` it from a running event loop, `shutdown()`."""

    def __init__(self, core: CoreHandle, tokenizer: Any = None) -> None:
        self.core = core
        self.info = core.info
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(self.info, tokenizer)
        self.output_processor = OutputProcessor(tokenizer)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._ids = itertools.count()
        self._stat_loggers: list[StatLogger] = []
        self._failure_listeners: list[Callable[[BaseException], None]] = []
        self._dead_listeners: list[Callable[[str], None]] = []
        self._dead_reason: str | None = None
        self._last_stats = SchedulerStats()
        self._lora = {a.name: a for a in self.info.lora_adapters}  # served now; the core's list follows it
        self._lora_locks: dict[str, tuple[asyncio.Lock, int]] = {}  # name -> (its lock, changes waiting)
        self.steps = 0
        self.failed_steps = 0

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.core.start(self._on_message)

    def shutdown(self) -> None:
        self.core.shutdown()

    def add_stat_logger(self, logger: StatLogger) -> None:
        self._stat_loggers.append(logger)

    def add_step_failure_listener(self, fn: Callable[[BaseException], None]) -> None:
        """Call `fn(error)` after every failed step (e.g. a metrics counter)."""
        self._failure_listeners.append(fn)

    def add_dead_listener(self, fn: Callable[[str], None]) -> None:
        self._dead_listeners.append(fn)

    @property
    def is_alive(self) -> bool:
        return self._loop is not None and self._dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason if self._loop is not None else "the engine has not started"

    @property
    def num_running(self) -> int:
        return self._last_stats.num_running

    @property
    def num_waiting(self) -> int:
        """Requests handed over and not finished, less those the core last reported running."""
        return max(0, len(self._streams) - self._last_stats.num_running)

    # ------------------------------------------------------------ requests

    async def add_requests(self, requests: Sequence[NewRequest]) -> list[RequestStream]:
        """Hand a batch of requests to the core in one message (one loop pass admits them all).

        All or nothing: if input processing refuses one (ValueError naming the problem), none is handed
        over; if the core then refuses one, every stream of the batch ends with RequestFailedError.
        """
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        arrival = now()
        core_requests = []
        for r in requests:
            if r.request_id in self._streams:
                raise ValueError(f"request_id {r.request_id!r} is already in use")
            if r.lora is not None and r.lora not in self._lora:
                raise InputError(f"LoRA adapter {r.lora!r} is not loaded", "model", "model_not_found")
            core_requests.append(
                self.input_processor.process(
                    r.request_id, r.prompt, r.params, arrival_time=arrival, priority=r.priority, lora=r.lora
                )
            )
            core_requests[-1].kv_export = r.kv_export
        streams = []
        for r, req in zip(requests, core_requests, strict=True):
            stream = RequestStream(r.request_id, self._abandon)
            self._streams[r.request_id] = stream
            self.output_processor.add_request(req, r.prompt if isinstance(r.prompt, str) else None)
            streams.append(stream)
        self.core.send(AddRequests(core_requests))
        return streams

    async def add_request(
        self, request_id: str, prompt: Any, params: Any, *, priority: int = 0
    ) -> RequestStream:
        (stream,) = await self.add_requests([NewRequest(request_id, prompt, params, priority)])
        return stream

    def abort(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        ids = [i for i in ids if self._streams.pop(i, None) is not None]
        if ids:
            self.output_processor.abort(ids)
            self.core.send(Abort(ids))

    def _abandon(self, request_id: str) -> None:
        self.abort(request_id)

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{time.monotonic_ns():x}"

    # ------------------------------------------------------------ calls into the core, between its steps

    async def call(self, method: str, *args: Any) -> Any:
        """Run the core's `method` (one of engine/core/messages.py UTILITY_METHODS) between two steps."""
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        assert self._loop is not None
        call_id = next(self._call_ids)
        fut = self._loop.create_future()
        self._calls[call_id] = fut
        self.core.send(UtilityCall(call_id, method, list(args)))
        try:
            return await fut
        finally:
            self._calls.pop(call_id, None)

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.call("reset_prefix_cache"))

    async def kv_events(self, since: int, epoch: str | None) -> dict[str, Any]:
        return await self.call("kv_events", since, epoch)

    async def kv_snapshot(self) -> dict[str, Any]:
        return await self.call("kv_snapshot")

    async def kv_transfer_stage(self, records: list[bytes], checksummed: bool = False) -> dict[str, Any]:
        return await self.call("kv_transfer_stage", records, checksummed)

    @property
    def lora_adapters(self) -> dict[str, LoRAAdapterInfo]:
        return dict(self._lora)

    # The served list follows the core's answers. Loads and unloads of one name run one at a time, in the
    # order they were asked for (an unload that raced a load of the same name used to leave the name served
    # here after the core had dropped it), and each finishes its bookkeeping even when its caller goes away.
    async def load_lora_adapter(self, name: str, path: str) -> LoRAAdapterInfo:
        async def load() -> LoRAAdapterInfo:
            # Served from the core's answer on: every request sent after it reaches the core after the load.
            adapter = LoRAAdapterInfo(**await self.call("load_lora_adapter", name, path))
            self._lora[name] = adapter
            return adapter

        return await self._lora_change(name, load)

    async def unload_lora_adapter(self, name: str) -> None:
        async def unload() -> None:
            # Refused here at once: a request admitted before the core unloads it finishes with it.
            self._lora.pop(name, None)
            await self.call("unload_lora_adapter", name)

        await self._lora_change(name, unload)

    async def _lora_change(self, name: str, change: Callable[[], Any]) -> Any:
        lock, users = self._lora_locks.get(name, (None, 0))
        lock = lock or asyncio.Lock()
        self._lora_locks[name] = (lock, users + 1)

        async def run() -> Any:
            try:
                async with lock:
                    return await change()
            finally:
                lock_, left = self._lora_locks[name]
                if left <= 1:
                    del self._lora_locks[name]
                else:
                    self._lora_locks[name] = (lock_, left - 1)

        # Shielded: a caller that goes away (a closed connection) must not cut the change in half.
        task = asyncio.ensure_future(run())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved, whoever awaits it
        return await asyncio.shield(task)

    # ------------------------------------------------------------ what the core sends (on the event loop)

    def _on_message(self, msg: CoreMessage) -> None:
        if isinstance(msg, UtilityResult):
            fut = self._calls.get(msg.call_id)
            if fut is not None and not fut.done():
                if msg.error is not None:
                    fut.set_exception(_REFUSALS.get(msg.error_type or "", RuntimeError)(msg.error))
                else:
                    fut.set_result(msg.result)
            return
        self._on_outputs(msg)

    def _on_outputs(self, msg: EngineCoreOutputs) -> None:
        if msg.failed:
            self._fail(msg.failed, RequestFailedError(msg.failure or "the engine failed this request"))
        if msg.step_failed:
            self.failed_steps += 1
            error = RuntimeError(msg.failure)
            for fn in self._failure_listeners:
                try:
                    fn(error)
                except Exception:  # noqa: BLE001 - a listener must not take the front end down
                    logger.exception("step-failure listener failed")
        if msg.outputs:
            deltas, stops = self.output_processor.process(msg.outputs)
            if stops:
                self.core.send(FinishSeqs(stops))
            for delta in deltas:
                stream = self._streams.get(delta.request_id)
                if stream is None:
                    continue
                stream.put(delta)
                if delta.finished:
                    del self._streams[delta.request_id]
        if msg.scheduler_stats is not None and msg.iteration_stats is not None:
            self.steps += 1
            self._last_stats = msg.scheduler_stats
            for stat_logger in self._stat_loggers:
                stat_logger.record(msg.scheduler_stats, msg.iteration_stats)
        if msg.dead is not None:
            self._die(msg.dead)

    def _fail(self, request_ids: Iterable[str], error: BaseException) -> None:
        ids = [rid for rid in request_ids if rid in self._streams]
        self.output_processor.abort(ids)
        for rid in ids:
            self._streams.pop(rid).fail(error)

    def _die(self, reason: str) -> None:
        if self._dead_reason is not None:
            return
        self._dead_reason = reason
        logger.error("the engine core stopped: %s", reason)
        error = EngineDeadError(reason)
        self._fail(list(self._streams), error)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(error)
        for fn in self._dead_listeners:
            fn(reason)
