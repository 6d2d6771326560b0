"""RequestStream: the event-loop side of one request, as an engine client hands it to a server.

Outputs are deltas (what each step added). A stream merges the deltas its reader has not taken yet into one
pending output (`RequestOutput.add`), so a slow reader holds at most one pending object per request,
however many steps it sleeps through. Only the event loop touches a stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from pagoda.engine.outputs import RequestOutput


def _fresh(delta: RequestOutput) -> RequestOutput:
    """A copy of `delta` the stream owns (lists copied), so merging into it never touches shared objects."""
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
    """The deltas of one request not read yet (merged into one), or the error that ended it."""

    def __init__(self, request_id: str, on_abandon: Callable[[str], None]) -> None:
        self.request_id = request_id
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

    def put(self, delta: RequestOutput) -> None:
        if self._pending is None:
            self._pending = _fresh(delta)
        else:
            self._pending.add(delta)
        if delta.finished:
            self.finished = True
        self._wake()

    def fail(self, error: BaseException) -> None:
        if self.finished and self._error is None and self._pending is None:
            return  # already delivered in full
        self._error = error
        self._pending = None
        self.finished = True
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
