"""The typed boundary between a server and an engine: the `EngineClient` protocol and the frozen `EngineInfo` (built by the core, engine/core/info.py).

The server (engine/server/*) sees an engine only through these two. `EngineInfo` holds every fact about the
engine that a front end needs and that does not change once it has started (lengths, vocabulary, KV layout,
tiers, defaults, the start-up memory profile); it is built once by the core and crosses the process
boundary as a message. `EngineClient` is the moving part: add requests and stream their outputs, abort,
health, stats, and the few maintenance calls the routes expose. `AsyncEngine` implements it (the core on a
thread of this process, or in its own process); test fakes implement it too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pagoda.engine.core.info import EngineInfo, LoRAAdapterInfo
from pagoda.engine.core.stats import StatLogger
from pagoda.engine.frontend.request_stream import RequestStream
from pagoda.engine.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine core stopped; no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine failed while running this request."""


@dataclass
class NewRequest:
    """One request as a server hands it over: a prompt (token ids, or text when the engine tokenizes) and
    its sampling parameters. Input processing checks and resolves it before the core sees it."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int = 0
    lora: str | None = None  # the name of a served LoRA adapter to run it through; None: the base model
    kv_export: bool = False  # a remote-decode prefill: the core holds its prompt blocks for a decode engine


class EngineClient(Protocol):
    """An engine as a server uses it. Call everything from the event loop the client was started on."""

    info: EngineInfo
    tokenizer: Any  # the front end's tokenizer (None when the engine serves token ids only)

    def start(self) -> None:
        """Start serving (from the running event loop)."""

    def shutdown(self) -> None:
        """Stop the core after its work is done (disk-tier writes, tensor-parallel ranks)."""

    async def add_requests(self, requests: Sequence[NewRequest]) -> list[RequestStream]:
        """Admit all of them or none: ValueError names the problem (a 400), EngineDeadError when stopped."""

    def abort(self, request_ids: str | Iterable[str]) -> None: ...

    @property
    def is_alive(self) -> bool: ...

    @property
    def dead_reason(self) -> str | None: ...

    @property
    def num_waiting(self) -> int:
        """Requests admitted but not yet running (for admission control)."""

    @property
    def num_running(self) -> int: ...

    def add_stat_logger(self, logger: StatLogger) -> None:
        """Call `logger.record(scheduler_stats, iteration_stats)` for every step, on the event loop."""

    def add_step_failure_listener(self, fn: Callable[[BaseException], None]) -> None: ...

    def add_dead_listener(self, fn: Callable[[str], None]) -> None:
        """Call `fn(reason)` once, on the event loop, when the core stops for good."""

    async def reset_prefix_cache(self) -> bool: ...

    @property
    def lora_adapters(self) -> dict[str, LoRAAdapterInfo]:
        """The LoRA adapters served now, by name."""

    async def load_lora_adapter(self, name: str, path: str) -> LoRAAdapterInfo:
        """Read a PEFT directory in the core and serve it as ``name`` from the next request on; ValueError
        names why it cannot be served."""

    async def unload_lora_adapter(self, name: str) -> None:
        """Stop serving ``name`` (KeyError when nothing has it); admitted requests finish with it."""

    async def kv_events(self, since: int, epoch: str | None) -> dict[str, Any]:
        """Block-event batches after `since` (engine/kv_cache/events.py)."""

    async def kv_snapshot(self) -> dict[str, Any]: ...

    async def kv_transfer_stage(self, records: list[bytes], checksummed: bool = False) -> dict[str, Any]:
        """Verify and stage KV blocks received from a prefill engine (engine/kv_transfer)."""
