"""The engine core in a process of its own: `pagoda serve`'s default.

The server's process keeps the front end (HTTP, input and output processing, streams, metrics); the core
process runs only the busy loop (engine/core/loop.py) over the scheduler and the model. They share no GIL
and no thread pool: the event loop's wake-ups no longer land between the core's compute threads.

    front end                                   core process
    CoreProcess.send(cmd)  --PUSH ipc://.../in-->   PULL: commands, drained between steps
    AsyncEngine._on_message <--PULL ipc://.../out-- PUSH: one EngineCoreOutputs per step, UtilityResults

Messages are msgpack (msgspec) encodings of engine/core/messages.py. Start-up goes over a pipe: the core
reports its `EngineInfo`, or how it failed (exit code, message, the termination message of an out-of-memory
start), and the front end exits the way a failed in-process start-up would.

Commands are never dropped. A core in a long step (a first kernel compile, a long prefill, an adapter
load) does not read them; once the socket's queues are full, `send` keeps the rest in order in an outbox
of the front end that a task hands over as soon as the core reads again. How many requests may wait for
the core is the server's admission limit (--max-num-queued-reqs: a 503 with Retry-After before a request
is admitted, never after). The core connects to both sockets before it reports ready.

Lifetime: the core ignores SIGINT and SIGTERM (a Ctrl-C or a pod's SIGTERM reaches the whole process
group, and draining is the front end's job: it finishes the in-flight requests, then sends `Shutdown`); it
exits when told to, when its step loop dies, or when the front end's process is gone, however that ended:
the kernel kills it with its parent (engine/worker/lifetime.py), even inside a step that holds the GIL.
The front end watches the core's process: if it dies, every in-flight request ends with an error, /health
answers 503 and the server exits non-zero (engine/cli/serve.py).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from pagoda.engine.core.info import EngineInfo
from pagoda.engine.core.messages import Command, CoreMessage, EngineCoreOutputs, Shutdown
from pagoda.engine.worker.lifetime import die_with_parent, started_on_main_thread

log = logging.getLogger("pagoda.engine.frontend.core_process")

START_POLL_S = 0.5
LINGER_MS = 2000  # how long a closing socket may still deliver what it queued (a dead message, a result)
OUTBOX_RETRY_S = (0.001, 0.05)  # how often a backed-up outbox tries the socket again: first, at most


class CoreStartError(RuntimeError):
    """The core process could not start: ``exit_code`` and ``termination`` (a message for the pod, or
    None) say how the server should exit."""

    def __init__(self, message: str, exit_code: int, termination: str | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.termination = termination


class CoreProcess:
    """Starts the core process for ``config`` and waits until it serves (or raises CoreStartError).

    ``core_factory(config)`` builds the core in the child (default: EngineCore; tests pass a fake one,
    importable by the child)."""

    def __init__(
        self,
        config: Any,
        *,
        threads: int | None = None,
        share_cores: bool = False,
        core_factory: Callable[[Any], Any] | None = None,
    ) -> None:
        self._dir = tempfile.mkdtemp(prefix="pagoda-core-")
        self.in_addr = f"ipc://{self._dir}/in"
        self.out_addr = f"ipc://{self._dir}/out"
        ctx = mp.get_context("spawn")
        parent_end, child_end = ctx.Pipe(duplex=False)
        # Not a daemon: it starts the tensor-parallel ranks, and daemons may not have children.
        self.proc = ctx.Process(
            target=run_core_process,
            args=(config, self.in_addr, self.out_addr, child_end, os.getpid(), threads, share_cores),
            kwargs={"core_factory": core_factory, "pdeathsig": started_on_main_thread()},
            name="pagoda-engine-core",
        )
        self._zmq = zmq.Context()
        self._in = self._zmq.socket(zmq.PUSH)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.bind(self.in_addr)
        self._encoder = msgspec.msgpack.Encoder()
        self._outbox: collections.deque[bytes] = collections.deque()  # what the socket could not take yet
        self._flusher: asyncio.Task | None = None
        self._out: Any = None
        self._reader: asyncio.Task | None = None
        self._closing = False
        self._gone = False  # the core's process ended on its own
        self.proc.start()
        child_end.close()
        try:
            self.info = self._wait_ready(parent_end)
        except BaseException:
            self._close_sockets()
            raise
        finally:
            parent_end.close()

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def _wait_ready(self, conn: Any) -> EngineInfo:
        while not conn.poll(START_POLL_S):
            if not self.proc.is_alive():
                self.proc.join()
                raise CoreStartError(
                    f"the engine core process exited with {self.proc.exitcode} while starting", 1
                )
        try:
            kind, payload = conn.recv()
        except EOFError:
            self.proc.join()
            raise CoreStartError(
                f"the engine core process exited with {self.proc.exitcode} while starting", 1
            ) from None
        if kind == "failed":
            self.proc.join()
            message, exit_code, termination = payload
            raise CoreStartError(message, exit_code, termination)
        return msgspec.msgpack.decode(payload, type=EngineInfo)

    # ------------------------------------------------------------ running (on the event loop)

    def start(self, deliver: Callable[[CoreMessage], None]) -> None:
        loop = asyncio.get_running_loop()
        self._out = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.bind(self.out_addr)
        decoder = msgspec.msgpack.Decoder(CoreMessage)

        async def read() -> None:
            while True:
                frame = await self._out.recv(copy=False)
                deliver(decoder.decode(frame.buffer))

        self._reader = loop.create_task(read())
        loop.add_reader(self.proc.sentinel, self._exited, deliver)

    def _exited(self, deliver: Callable[[CoreMessage], None]) -> None:
        """The core's process ended: unless we asked it to, the engine is dead."""
        loop = asyncio.get_running_loop()
        loop.remove_reader(self.proc.sentinel)
        self.proc.join(5)  # the sentinel closes as the process exits, a moment before it can be reaped
        if self._closing:
            return
        self._gone = True
        self._outbox.clear()  # nobody will read it: every waiting client gets the core's death instead
        code = self.proc.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        log.error("the engine core process (pid %s) %s", self.proc.pid, how)
        if self._reader is not None:
            self._reader.cancel()
        decoder = msgspec.msgpack.Decoder(CoreMessage)

        async def drain_then_die() -> None:
            """What it sent before it ended (its own reason, a last step) is delivered first."""
            while True:
                try:
                    frame = await self._out.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                deliver(decoder.decode(frame.buffer))
            deliver(EngineCoreOutputs(dead=f"the engine core process {how}"))

        loop.create_task(drain_then_die())

    @property
    def backlog(self) -> int:
        """Commands waiting in the outbox for the core to read again."""
        return len(self._outbox)

    def send(self, cmd: Command) -> None:
        """Hand ``cmd`` to the core, in order after every earlier one; never drops it. While the core
        reads no commands (a long step), what its socket cannot take waits in the outbox."""
        if self._closing or self._gone:
            return  # the core is gone: its death is reported by the process watch
        data = self._encoder.encode(cmd)
        if not self._outbox:
            try:
                self._in.send(data, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                log.info("the engine core is busy; commands wait for it in order")
        self._outbox.append(data)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        wait = OUTBOX_RETRY_S[0]
        while self._outbox and not self._closing:
            try:
                self._in.send(self._outbox[0], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                await asyncio.sleep(wait)
                wait = min(2 * wait, OUTBOX_RETRY_S[1])
                continue
            except zmq.ZMQError:  # the socket closed under us: shutting down
                return
            self._outbox.popleft()
            wait = OUTBOX_RETRY_S[0]

    def _flush_now(self, timeout: float) -> None:
        """Hand over the outbox, blocking up to ``timeout`` seconds (at shutdown: its requests were
        drained, so this is at most a last abort or two)."""
        deadline = time.monotonic() + timeout
        while self._outbox and time.monotonic() < deadline and self.proc.is_alive():
            try:
                self._in.send(self._outbox[0], flags=zmq.NOBLOCK, copy=False)
                self._outbox.popleft()
            except zmq.Again:
                time.sleep(0.01)
            except zmq.ZMQError:
                break

    def shutdown(self, timeout: float = 30.0) -> None:
        """Ask the core to finish (disk-tier writes, ranks) and exit; kill it if it does not in time."""
        if self.proc.is_alive():
            if self._flusher is not None:
                self._flusher.cancel()
            self._flush_now(min(timeout, 5.0))
            try:
                self._in.send(self._encoder.encode(Shutdown()), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self._closing = True
            self.proc.join(timeout)
            if self.proc.is_alive():
                log.error("the engine core did not stop within %.0f s; killing it", timeout)
                self.proc.kill()
                self.proc.join(5)
        self._closing = True
        self._outbox.clear()
        if self._reader is not None:
            self._reader.cancel()
        self._close_sockets()

    def _close_sockets(self) -> None:
        if self._zmq.closed:
            return
        self._in.close(linger=0)
        if self._out is not None:
            self._out.close(linger=0)
        self._zmq.term()
        shutil.rmtree(self._dir, ignore_errors=True)


# ---------------------------------------------------------------- the core's side


def run_core_process(
    config: Any,
    in_addr: str,
    out_addr: str,
    ready: Any,
    parent_pid: int,
    threads: int | None,
    share_cores: bool,
    *,
    core_factory: Callable[[Any], Any] | None = None,
    pdeathsig: bool = True,
) -> None:
    """The core process's main: build the core, connect, report ready, run the busy loop until shut down."""
    # However the front end ends, the core ends with it (its loop notices between steps and shuts down in
    # order; the kernel's signal ends it inside a step).
    die_with_parent(parent_pid, pdeathsig=pdeathsig)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    import torch
    from pagoda.engine.core.engine_core import EngineCore
    from pagoda.engine.core.loop import CoreLoop
    from pagoda.engine.core.startup import startup_failure
    from pagoda.engine.sizing.engine_plan import forget_last_profile

    if threads:
        torch.set_num_threads(threads)
    forget_last_profile()
    try:
        core = EngineCore(config, publish_kv_events=True) if core_factory is None else core_factory(config)
    except BaseException as exc:  # noqa: BLE001 - reported to the front end, which exits accordingly
        failure = startup_failure(exc)
        if failure is None:
            log.exception("the engine core failed to start")
            failure = (f"the engine core failed to start: {exc!r}", 1, None)
        ready.send(("failed", failure))
        ready.close()
        raise SystemExit(failure[1]) from None
    core.serving_front_end = share_cores
    # Connected before "ready": the front end may send the moment it hears it.
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.connect(in_addr)
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, LINGER_MS)
    outputs.setsockopt(zmq.SNDTIMEO, 1000)
    outputs.connect(out_addr)
    ready.send(("ready", msgspec.msgpack.encode(core.info)))
    ready.close()
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(Command)

    def emit(msg: CoreMessage) -> None:
        data = encoder.encode(msg)
        while True:  # blocks only while the front end does not read (backpressure), or is gone
            try:
                outputs.send(data, copy=False)
                return
            except zmq.Again:
                if os.getppid() != parent_pid:
                    raise SystemExit(1) from None

    def receive(timeout: float) -> list[Command]:
        if os.getppid() != parent_pid:
            log.error("the server's process is gone; the engine core stops")
            return [Shutdown()]
        if timeout > 0 and not commands.poll(int(timeout * 1000)):
            return []
        cmds = []
        while True:
            try:
                cmds.append(decoder.decode(commands.recv(zmq.NOBLOCK, copy=False).buffer))
            except zmq.Again:
                return cmds

    loop = CoreLoop(core, emit)
    try:
        loop.run(receive)
    finally:
        core.close()
        commands.close(linger=0)
        outputs.close()
        ctx.term()
    if loop.dead is not None:
        raise SystemExit(1)
