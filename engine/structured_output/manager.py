"""The scheduler's structured-output state: compiles off the engine loop, one matcher per sequence.

A request with a grammar is compiled on a worker thread (xgrammar releases the GIL while it compiles), and
waits outside the scheduler's queue until its grammar is ready: the batch keeps stepping meanwhile. Each
sequence gets its own matcher (n > 1: the children fork from their parent before its first token). The
matcher advances only with the tokens a sequence keeps, and a preempted sequence keeps its tokens (recompute
and swap rebuild only its KV), so its matcher state stays right without replay.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from pagoda.engine.structured_output.mask import TokenBitmask
from pagoda.engine.structured_output.spec import GrammarSpec

log = logging.getLogger("pagoda.engine.structured_output")

COMPILE_THREADS = 1


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        from pagoda.engine.structured_output.xgrammar_backend import XGrammarBackend

        self.backend = XGrammarBackend(tokenizer, vocab_size, stop_token_ids)
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="pagoda-grammar")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def submit(self, spec: GrammarSpec) -> Future:
        """Start compiling ``spec``; the future's result is the compiled grammar."""
        return self._pool.submit(self.backend.compile, spec)

    def matcher(self, compiled: Any) -> Any:
        return self.backend.matcher(compiled)

    @staticmethod
    def fork(matcher: Any) -> Any:
        """An independent copy of a matcher's state (a child sequence of an n > 1 request)."""
        return matcher.fork()

    def bitmask(self, matchers: list[tuple[int, Any]]) -> TokenBitmask | None:
        """The masks of the sampling rows that have a matcher: ``matchers`` is (row, matcher) pairs."""
        if not matchers:
            return None
        bits = torch.empty((len(matchers), self.backend.words), dtype=torch.int32)
        for i, (_, matcher) in enumerate(matchers):
            self.backend.fill(matcher, bits, i)
        return TokenBitmask([row for row, _ in matchers], bits)

    @staticmethod
    def accept(matcher: Any, token_id: int) -> bool:
        """Advance by the sampled token; False when the grammar refuses it (a bug: the mask allowed it)."""
        return bool(matcher.accept_token(token_id))

    @staticmethod
    def finished(matcher: Any) -> bool:
        """The grammar reached its end (and accepted the stop token it then allows)."""
        return bool(matcher.is_terminated())
