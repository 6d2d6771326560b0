"""Incremental detokenization and stop-string handling.

Each new token re-decodes only a short window of recent tokens. Text that ends in an incomplete UTF-8
character (the replacement character) is held until the next token completes it, and the last
`max stop length - 1` characters are held back while generation runs, so a stream never shows the start
of a stop string that later turns out to end the output.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.engine.sampling_params import SamplingParams

_INCOMPLETE = "\ufffd"


@dataclass
class SeqText:
    """One sequence's text as it is built: the detokenizer's window over its token ids, what was sent."""

    token_ids: list[int]  # prompt + output so far
    prefix_offset: int
    read_offset: int
    text: str = ""
    num_sent_chars: int = 0  # characters of the visible text already handed out
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @classmethod
    def for_prompt(cls, prompt_token_ids: list[int]) -> SeqText:
        n = len(prompt_token_ids)
        return cls(list(prompt_token_ids), prefix_offset=max(n - 5, 0), read_offset=n)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def append(self, seq: SeqText, params: SamplingParams) -> str:
        """Decode the sequence's newest token into seq.text; returns the new text (may be empty).

        The window starts a few tokens before the unread ones (prompt tokens at first), so a token's
        leading space and characters split across tokens decode as they do in the full text.
        """
        ids = seq.token_ids
        skip = params.skip_special_tokens
        prefix_text = self._decode(ids[seq.prefix_offset : seq.read_offset], skip)
        new_text = self._decode(ids[seq.prefix_offset :], skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_INCOMPLETE):
            return ""
        delta = new_text[len(prefix_text) :]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        seq.text += delta
        return delta


def check_stop_strings(seq: SeqText, params: SamplingParams, new_text_len: int) -> bool:
    """Finish the sequence if its text now contains a stop string; truncates the text. Returns True if stopped."""
    if not params.stop or not new_text_len:
        return False
    longest = max(len(s) for s in params.stop)
    start = max(len(seq.text) - new_text_len - longest + 1, 0)
    best = None
    for stop in params.stop:
        idx = seq.text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    if best is None:
        return False
    idx, stop = best
    seq.text = seq.text[: idx + len(stop)] if params.include_stop_str_in_output else seq.text[:idx]
    seq.finish_reason = "stop"
    seq.stop_reason = stop
    return True


def visible_text(seq: SeqText, params: SamplingParams) -> str:
    """The text a client may see now: all of it once finished, else minus a possible stop-string start."""
    if seq.finished or not params.stop:
        return seq.text
    hold = max(len(s) for s in params.stop) - 1
    return seq.text[: len(seq.text) - hold] if hold > 0 else seq.text
