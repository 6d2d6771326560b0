"""Which requests speculate. Verification compares proposals with the target's raw next-token
distribution (greedy: its argmax; sampling: temperature, top-k, top-p and min-p applied per position),
so a request whose next token depends on more than that opts out and decodes one token a step:

- penalties (repetition, presence, frequency) and logit_bias: they change the logits by the tokens so far;
- logprobs: each emitted token would need its top-logprob entries (not worth it for the few that ask);
- structured outputs: the grammar's mask depends on every accepted token;
- n > 1: the forks share their prompt blocks and draw from one row;
- stop strings: they end the text inside a step's tokens, so the token ids sent would run past the stop
  (EOS, stop_token_ids, max_tokens and min_tokens are applied token by token on the accepted tokens and
  need no opt-out; a request speculates only once min_tokens are out);
- attention sinks (kv_eviction streaming): eviction moves cache positions under the proposal.
"""

from __future__ import annotations

from pagoda.engine.request import Request


def opt_out_reason(req: Request) -> str | None:
    """Why ``req`` cannot speculate, or None when it can."""
    p = req.params
    if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or p.logit_bias:
        return "penalties or logit_bias"
    if p.logprobs is not None:
        return "logprobs"
    if p.structured_outputs is not None:
        return "structured outputs"
    if p.n > 1:
        return "n > 1"
    if p.stop:
        return "stop strings"
    if req.kv_streaming is not None:
        return "attention sinks"
    return None
