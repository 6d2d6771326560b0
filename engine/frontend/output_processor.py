"""Output processing: the core's token deltas -> `RequestOutput` deltas with text, in the front end.

Per sequence it keeps the detokenizer's window and the text so far, applies stop strings, and hands out
only the text a client may see (engine/frontend/detokenizer.py). A stop string is found here, after the core has
already run the token that completed it; `process` returns such sequences so the caller tells the core to
finish them (`EngineCore.finish_seqs`). Until the core hears of it, tokens it still produces for them are
dropped here. Top logprobs get their decoded tokens here too. Runs where the core's outputs arrive: on the
caller of LLMEngine.step, or on a server's event loop.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pagoda.engine.core.messages import CoreOutput, EngineCoreRequest
from pagoda.engine.frontend.detokenizer import Detokenizer, SeqText, check_stop_strings, visible_text
from pagoda.engine.outputs import CompletionOutput, RequestOutput
from pagoda.engine.sampling_params import SamplingParams


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: dict[int, SeqText] = field(default_factory=dict)

    def seq(self, index: int) -> SeqText:
        state = self.seqs.get(index)
        if state is None:  # n > 1: a sequence forked from the prompt shows up with its first token
            state = self.seqs[index] = SeqText.for_prompt(self.prompt_token_ids)
        return state

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.finished for s in self.seqs.values())


class OutputProcessor:
    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self._requests: dict[str, _RequestState] = {}

    def add_request(self, req: EngineCoreRequest, prompt: str | None = None) -> None:
        self._requests[req.request_id] = _RequestState(
            req.request_id, prompt, req.prompt_token_ids, req.params
        )

    def abort(self, request_ids: Iterable[str]) -> None:
        """Forget requests whose client left: nothing more is produced for them."""
        for rid in request_ids:
            self._requests.pop(rid, None)

    def __len__(self) -> int:
        return len(self._requests)

    def process(
        self, outputs: Iterable[CoreOutput]
    ) -> tuple[list[RequestOutput], list[tuple[str, int, str]]]:
        """One `RequestOutput` delta per request that progressed, and the (request id, sequence index, stop
        string) of every sequence a stop string ended while the core still runs it."""
        deltas: list[RequestOutput] = []
        stops: list[tuple[str, int, str]] = []
        for out in outputs:
            state = self._requests.get(out.request_id)
            if state is None:
                continue  # finished or aborted here already
            comps = []
            for d in out.seqs:
                seq = state.seq(d.index)
                if seq.finished:
                    continue  # a stop string ended it; the core had not heard yet
                comp = self._advance(state, seq, d)
                if seq.finish_reason == "stop" and d.finish_reason is None:
                    stops.append((state.request_id, d.index, str(seq.stop_reason)))
                comps.append(comp)
            if out.finished:  # the core ended it (all sequences, or an abort before the fork)
                for s in state.seqs.values():
                    if s.finish_reason is None:
                        s.finish_reason = "abort"
            finished = out.finished or state.finished
            if finished:
                del self._requests[state.request_id]
            elif not comps:
                continue
            deltas.append(
                RequestOutput(
                    request_id=state.request_id,
                    prompt=state.prompt,
                    prompt_token_ids=state.prompt_token_ids,
                    outputs=comps,
                    finished=finished,
                    num_cached_tokens=out.num_cached_tokens,
                    metrics=out.metrics,
                    prompt_logprobs=out.prompt_logprobs,
                )
            )
        return deltas, stops

    def _advance(self, state: _RequestState, seq: SeqText, d: Any) -> CompletionOutput:
        """Append the delta's token: detokenize it and look for a stop string, unless the core stopped the
        sequence on an EOS or stop token (that token's text is not part of the output)."""
        params = state.params
        seq.token_ids.extend(d.token_ids)
        seq.finish_reason, seq.stop_reason = d.finish_reason, d.stop_reason
        if d.token_ids and self.detokenizer is not None and d.finish_reason != "stop":
            new_text = self.detokenizer.append(seq, params)
            if check_stop_strings(seq, params, len(new_text)):
                seq.finish_reason = "stop"  # a stop string beats the length limit of the same token
        top = d.top_logprobs
        if top is not None and self.tokenizer is not None:
            for tid, entry in top.items():
                if entry.decoded_token is None:
                    entry.decoded_token = self.tokenizer.decode([tid])
        visible = visible_text(seq, params)
        text = visible[seq.num_sent_chars :] if len(visible) > seq.num_sent_chars else ""
        seq.num_sent_chars = max(seq.num_sent_chars, len(visible))
        return CompletionOutput(
            index=d.index,
            text=text,
            token_ids=list(d.token_ids),
            cumulative_logprob=d.cumulative_logprob,
            logprobs=([top] if top is not None else []) if params.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
