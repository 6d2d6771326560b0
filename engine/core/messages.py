"""What crosses between the front end and the engine core: requests and commands in, per-step outputs out.

The same objects travel whether the core runs on a thread of the server's process (handed over as they
are) or in a process of its own (msgpack-encoded by msgspec over ZMQ, engine/frontend/core_process.py). They carry
only what the other side needs: the core never sees text (no prompt string, no detokenized output), the
front end never sees scheduler or KV state beyond the stats.

Flow of one request: the front end's input processing turns the client's prompt and parameters into an
`EngineCoreRequest` (validated, tokenized, lengths resolved); the core admits it on `AddRequests`, and
every step reports each sequence's new token as a `SeqDelta` inside a `CoreOutput`; the front end's output
processing detokenizes, applies stop strings and, when a stop string ends a sequence the core still runs,
sends `FinishSeqs` back. Stats of every step ride along with its outputs.
"""

from __future__ import annotations

from typing import Any

import msgspec
from pagoda.engine.core.stats import IterationStats, SchedulerStats
from pagoda.engine.outputs import Logprob, RequestMetrics
from pagoda.engine.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request as the core admits it: token ids, checked parameters, lengths already resolved."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # clamped to the room the context leaves (or the caller's, under attention sinks)
    arrival_time: float  # time.monotonic() of the front end (one clock for all processes of the host)
    priority: int = 0
    kv_streaming: tuple[int, int] | None = None  # attention sinks: (sink tokens, cache budget)
    lora: str | None = None  # the name of the LoRA adapter it runs through (the core resolves it)
    kv_export: bool = False  # a remote-decode prefill: hold its prompt blocks for a decode engine


class SeqDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one sequence got in one step: a token, several with speculative decoding (none for an abort)."""

    index: int
    token_ids: list[int]
    cumulative_logprob: float = 0.0
    top_logprobs: dict[int, Logprob] | None = None
    finish_reason: str | None = None  # the core's own: "stop" (EOS / stop token), "length", "abort"
    stop_reason: int | str | None = None


class CoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's progress in one step."""

    request_id: str
    seqs: list[SeqDelta]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None  # with the final output only
    # Per prompt token (None for the first), with the request's first output when params.prompt_logprobs.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class EngineCoreOutputs(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """Everything one step (or one failed step) hands the front end."""

    outputs: list[CoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    iteration_stats: IterationStats | None = None
    failed: list[str] = []  # requests that ended with an error (a failed step, an add the core refused)
    failure: str | None = None  # what went wrong, for their clients and the logs
    step_failed: bool = False  # the failure was a step that raised (counted as engine_step_failures)
    dead: str | None = None  # the core stopped for good: why


class AddRequests(msgspec.Struct, tag=True, array_like=True):
    """Admit all of them or none (a refused one fails the whole batch)."""

    requests: list[EngineCoreRequest]


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class FinishSeqs(msgspec.Struct, tag=True, array_like=True):
    """Sequences a stop string ended in the front end: (request id, sequence index, the stop string)."""

    seqs: list[tuple[str, int, str]]


class UtilityCall(msgspec.Struct, tag=True, array_like=True):
    """Run one of the core's `UTILITY_METHODS` between steps and answer with a `UtilityResult`."""

    call_id: int
    method: str
    args: list[Any] = []


class UtilityResult(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    call_id: int
    result: Any = None
    error: str | None = None
    error_type: str | None = None  # "ValueError" / "KeyError": the caller's mistake, raised as such again


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Finish the core's work (disk-tier writes) and exit; the front end has drained its clients."""


Command = AddRequests | Abort | FinishSeqs | UtilityCall | Shutdown
CoreMessage = EngineCoreOutputs | UtilityResult

# What the front end may ask of a core by name (a UtilityCall): queries and maintenance between steps. A
# result crosses a process boundary as msgpack: a struct (the scheduler stats) arrives as its field list.
UTILITY_METHODS = frozenset(
    {
        "reset_prefix_cache",
        "kv_events",
        "kv_snapshot",
        "check_invariants",
        "num_requests",
        "has_unfinished_requests",
        "get_scheduler_stats",
        "load_lora_adapter",
        "unload_lora_adapter",
        "kv_transfer_stage",
    }
)
