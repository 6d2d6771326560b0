"""The scheduling policies: one waiting-queue class each, chosen once by `waiting_queue(policy)`.

A policy decides three orders, so the scheduler asks its queue instead of testing the policy's name:
which waiting request is admitted next (`peek` / `pop`), in which order running requests are served
(`order_running`), and which running request gives its blocks up when the pool runs dry
(`pick_victim`). A preempted request goes back with ``front=True``: first in line under fcfs, in its
usual place under priority (its priority and arrival time already rank it).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from pagoda.engine.request import Request


class WaitingQueue(Protocol):
    def add(self, req: Request, front: bool = False) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, req: Request) -> bool: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...
    def order_running(self, running: list[Request]) -> None: ...
    def pick_victim(self, candidates: list[Request]) -> Request: ...


class FCFSQueue:
    """First come, first served; the last admitted running request is preempted first."""

    def __init__(self) -> None:
        self._fifo: deque[Request] = deque()

    def add(self, req: Request, front: bool = False) -> None:
        if front:
            self._fifo.appendleft(req)
        else:
            self._fifo.append(req)

    def peek(self) -> Request:
        return self._fifo[0]

    def pop(self) -> Request:
        return self._fifo.popleft()

    def remove(self, req: Request) -> bool:
        try:
            self._fifo.remove(req)
        except ValueError:
            return False
        return True

    def __len__(self) -> int:
        return len(self._fifo)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._fifo))

    def order_running(self, running: list[Request]) -> None:
        """Admission order already is the serving order."""

    def pick_victim(self, candidates: list[Request]) -> Request:
        return candidates[-1]


class PriorityQueue:
    """Lowest (priority, arrival time) first; the highest such running request is preempted first."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, req: Request, front: bool = False) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._counter), req))

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, req: Request) -> bool:
        for i, item in enumerate(self._heap):
            if item[3] is req:
                self._heap.pop(i)
                heapq.heapify(self._heap)
                return True
        return False

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter([item[3] for item in sorted(self._heap)])

    def order_running(self, running: list[Request]) -> None:
        running.sort(key=lambda r: r.sort_key)

    def pick_victim(self, candidates: list[Request]) -> Request:
        return max(candidates, key=lambda r: r.sort_key)


POLICIES: dict[str, type[FCFSQueue] | type[PriorityQueue]] = {"fcfs": FCFSQueue, "priority": PriorityQueue}


def waiting_queue(policy: str) -> WaitingQueue:
    """The queue of ``policy`` (a name `EngineConfig.scheduling_policy` accepts)."""
    try:
        return POLICIES[policy]()
    except KeyError:
        raise ValueError(
            f"unknown scheduling policy {policy!r}; choose one of {', '.join(POLICIES)}"
        ) from None
