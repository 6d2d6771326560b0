"""A child process of the engine (the engine core of `pagoda serve`, a tensor-parallel rank) never outlives
the process that started it, however that one ended: a SIGKILL, an OOM kill, a crash.

Two guards, set up first thing in the child by `die_with_parent`:

- on Linux the kernel itself sends the child SIGKILL when its parent goes (`prctl(PR_SET_PDEATHSIG)`): it
  needs nothing from the child, so a child stuck in a C call holding the GIL (a runaway regex, a
  collective that never completes) dies too. The kernel watches the parent *thread* that started the
  child, so the parent passes ``pdeathsig=False`` when it starts the child from a thread that may end
  before the process does (`started_on_main_thread`);
- everywhere, a watch thread polls the parent's pid and ends the child once the parent is gone, after
  ``grace_s`` for the child's own orderly exit (the core's loop notices the parent too, between steps).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger("pagoda.engine.worker.lifetime")

PR_SET_PDEATHSIG = 1
PARENT_POLL_S = 0.5
EXIT_PARENT_GONE = 1


def started_on_main_thread() -> bool:
    """Whether a child started now may tie its life to this thread (see the module's docstring)."""
    return threading.current_thread() is threading.main_thread()


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent thread ends (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(parent_pid: int, *, pdeathsig: bool = True, grace_s: float = 10.0) -> None:
    """Tie this process's life to ``parent_pid`` (the pid its parent had when it started it)."""
    if pdeathsig and not set_parent_death_signal():
        log.warning("could not set a parent-death signal; a watch thread alone ends this process")
    if os.getppid() != parent_pid:  # the parent died before the signal was set: nobody would send it
        os._exit(EXIT_PARENT_GONE)
    threading.Thread(
        target=_watch_parent, args=(parent_pid, grace_s), name="pagoda-parent-watch", daemon=True
    ).start()


def _watch_parent(parent_pid: int, grace_s: float) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    log.error("the parent process (pid %d) is gone; exiting in at most %.0f s", parent_pid, grace_s)
    time.sleep(grace_s)
    os._exit(EXIT_PARENT_GONE)
