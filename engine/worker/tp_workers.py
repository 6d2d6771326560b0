"""Tensor-parallel ranks 1..N-1: child processes that each hold a shard of the model and its KV cache.

Rank 0 is the engine's own process: it runs the scheduler and the sampler and sends every step's batch to
the other ranks through one queue each, then all ranks run the same forward, meeting in the model's
all-reduces. Ranks never schedule or sample. A rank that dies is noticed by a watchdog thread in the
engine process (the engine reports itself dead, so /health fails and the pod restarts).

Lifetime: a rank never outlives the engine's process (engine/worker/lifetime.py: the kernel kills it when
its parent goes, however that ended). It ignores SIGINT (a Ctrl-C reaches the whole process group; the
engine stops its ranks itself) but a SIGTERM ends it at once, even inside a collective that will never
complete. The engine stops its ranks when it closes and, failing that, when its interpreter exits (an
offline script that ends, or is interrupted, never waits on a rank).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import queue
import signal
import socket
import threading
from typing import Any

from pagoda.engine.worker.lifetime import die_with_parent, started_on_main_thread
from pagoda.engine.worker.rank_messages import Allocate, CaptureGraphs, Profile, Step, Stop, run_message

log = logging.getLogger("pagoda.engine.distributed")


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


EXIT_TIMEOUT_S = 5.0  # at interpreter exit: how long ranks get to stop before they are terminated


class TPWorkers:
    """Starts ranks 1..size-1 for ``config``; ``send`` hands each the same message, in order."""

    def __init__(self, config: Any, size: int, init_method: str) -> None:
        ctx = mp.get_context("spawn")
        self.size = size
        pdeathsig = started_on_main_thread()
        self.queues = [ctx.Queue() for _ in range(1, size)]
        self.procs = [
            ctx.Process(
                target=worker_main,
                args=(rank, size, init_method, config, self.queues[rank - 1], os.getpid(), pdeathsig),
                name=f"pagoda-tp-rank{rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        for p in self.procs:
            p.start()
        self.dead_reason: str | None = None
        self._closing = False
        self._watchdog = threading.Thread(target=self._watch, name="pagoda-tp-watchdog", daemon=True)
        self._watchdog.start()
        # Before multiprocessing's own exit handler (registered earlier, so run later), which would
        # otherwise wait forever for ranks waiting for a message.
        atexit.register(self.shutdown, EXIT_TIMEOUT_S)

    def _watch(self) -> None:
        while not self._closing:
            for rank, p in enumerate(self.procs, start=1):
                if not p.is_alive() and not self._closing:
                    self.dead_reason = f"tensor-parallel rank {rank} exited (code {p.exitcode})"
                    log.error("%s", self.dead_reason)
                    return
            threading.Event().wait(0.5)

    def send(self, msg: Profile | Allocate | CaptureGraphs | Step | Stop) -> None:
        if self.dead_reason is not None:
            raise RuntimeError(self.dead_reason)
        for q in self.queues:
            q.put(msg)

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.shutdown)
        for q in self.queues:
            try:
                q.put(Stop())
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():  # stuck (in a collective rank 0 left): SIGTERM ends it, SIGKILL if not
                p.terminate()
                p.join(2)
            if p.is_alive():
                p.kill()
                p.join(2)


def worker_main(
    rank: int, size: int, init_method: str, config: Any, inbox: Any, parent_pid: int, pdeathsig: bool = True
) -> None:
    """One tensor-parallel rank: build its shard, then run every step rank 0 sends until told to stop."""
    die_with_parent(parent_pid, pdeathsig=pdeathsig, grace_s=0)
    # Ctrl-C reaches the whole process group: the engine handles it and then stops the ranks. A SIGTERM
    # (the engine's own when a rank does not stop, a supervisor's) ends the rank wherever it is.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    from pagoda.engine.distributed.parallel_state import destroy_tensor_parallel
    from pagoda.engine.worker.rank import join_rank

    runner = join_rank(config, rank, size, init_method)
    try:
        while True:
            try:
                msg = inbox.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent_pid:
                    return  # the engine is gone
                continue
            if isinstance(msg, Stop):
                return
            run_message(runner, msg)
    finally:
        destroy_tensor_parallel()
