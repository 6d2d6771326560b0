"""What the engine hands back for a request.

`LLMEngine.step()` returns deltas: each CompletionOutput carries only the tokens, text and logprobs that
sequence produced in that step (a sequence that did not progress is left out), plus its running
`cumulative_logprob` and `finish_reason`. `RequestOutput.add` folds a later delta into an earlier output,
so a consumer that wants whole outputs (``LLM.generate``, a non-streaming response, a slow stream reader
coalescing what it has not read yet) keeps one object per request and the engine never copies a
request's whole output per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


# One entry per generated token: token id -> Logprob (the chosen token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    extra: dict = field(default_factory=dict)
    # Prompt logprobs (params.prompt_logprobs): one entry per prompt token, None for the first; in the
    # request's first delta only.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def add(self, later: RequestOutput) -> None:
        """Fold the delta ``later`` (same request, a later step) into this output, in place."""
        by_index = {c.index: c for c in self.outputs}
        for new in later.outputs:
            mine = by_index.get(new.index)
            if mine is None:
                mine = CompletionOutput(
                    index=new.index,
                    text="",
                    token_ids=[],
                    logprobs=[] if new.logprobs is not None else None,
                )
                self.outputs.append(mine)
                by_index[new.index] = mine
            mine.text += new.text
            mine.token_ids.extend(new.token_ids)
            if new.logprobs is not None:
                if mine.logprobs is None:
                    mine.logprobs = []
                mine.logprobs.extend(new.logprobs)
            mine.cumulative_logprob = new.cumulative_logprob
            mine.finish_reason = new.finish_reason
            mine.stop_reason = new.stop_reason
        self.outputs.sort(key=lambda c: c.index)
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        if later.metrics is not None:
            self.metrics = later.metrics
        self.extra.update(later.extra)
