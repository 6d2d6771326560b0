"""Input processing: a client's prompt and parameters -> an `EngineCoreRequest` the core can trust.

Everything a client sends is checked here, before the core sees it, so nothing a client sends can raise
inside the engine step: the prompt (not empty, ids in the vocabulary, room left in the context), the
sampling parameters (ranges, stop token ids in the vocabulary), the attention-sink plan, and `max_tokens`,
clamped to the room the context leaves. It also owns the text side of the way in: tokenization and chat
templates. It runs in the front end (the server's process, or LLMEngine's caller), never in the core.

Refusals are `InputError` (a ValueError) naming the request field and an error code, which a server turns
into a 400 and the offline API raises as it is.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from pagoda.engine.core.info import EngineInfo
from pagoda.engine.core.messages import EngineCoreRequest
from pagoda.engine.frontend.chat_messages import template_knows_tools, template_messages
from pagoda.engine.kv_cache.streaming import resolve_streaming
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.structured_output import check_spec

# chat_template_kwargs may not replace what input processing itself passes to the template.
RESERVED_TEMPLATE_ARGS = {"messages", "tools", "add_generation_prompt", "continue_final_message", "tokenize",
                          "chat_template", "conversation", "documents", "return_dict"}  # fmt: skip


class InputError(ValueError):
    """A request the engine refuses: the message, the request field at fault and an error code."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def max_chars_per_token(tokenizer: Any) -> int:
    """An upper bound on the characters one token of `tokenizer` stands for.

    The raw vocabulary strings are at least as long as the text they decode to (byte-level BPE spells
    each byte as one character; SentencePiece spells a byte-fallback token as "<0x0A>"), so the longest
    one bounds a token's text. A normalizer could compose characters (NFC / NFKC merge up to 3 into 1),
    so the bound is widened by 4 when there is one.
    """
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    widen = 4 if getattr(backend, "normalizer", None) is not None else 1
    return max(1, longest) * widen


class InputProcessor:
    """Checks and resolves requests against one engine's `EngineInfo`; ``tokenizer`` None: token ids only.
    ``chat_template`` (a server's --chat-template) replaces the model's."""

    def __init__(self, info: EngineInfo, tokenizer: Any = None, chat_template: str | None = None) -> None:
        self.info = info
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        source = chat_template or getattr(tokenizer, "chat_template", None)
        self.template_source = source if isinstance(source, str) else json.dumps(source)
        # Tools go to a template that knows them in its own way; Pagoda renders them for one that does not.
        self.knows_tools = template_knows_tools(self.template_source)
        self.max_model_len = info.max_model_len
        # generation_config.json's sampling values (--generation-config) and --max-logprobs
        self.generation_defaults = dict(getattr(info, "generation_defaults", None) or {})
        self.max_logprobs = getattr(info, "max_logprobs", 20)
        # An id must be both decodable and a row of the logits.
        self.vocab_size = min(len(tokenizer), info.vocab_size) if tokenizer is not None else info.vocab_size
        self.max_prompt_chars = (
            self.max_model_len * max_chars_per_token(tokenizer) if tokenizer is not None else 0
        )

    # ------------------------------------------------------------ text (CPU-bound: servers run it off the loop)

    def _need_tokenizer(self, what: str, param: str | None) -> Any:
        if self.tokenizer is None:
            raise InputError(
                f"{what} need the tokenizer; the engine was started with skip_tokenizer_init: pass "
                "prompt_token_ids",
                param,
            )
        return self.tokenizer

    def encode(self, text: str, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        tokenizer = self._need_tokenizer("text prompts", param)
        try:
            return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except Exception as exc:  # noqa: BLE001 - e.g. lone surrogates
            raise InputError(f"The {param} could not be tokenized: {exc}", param, "invalid_text") from exc

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._need_tokenizer("texts", None).decode(
            list(token_ids), skip_special_tokens=skip_special_tokens
        )

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final: bool = False,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The chat template applied to ``messages`` (dicts with role and content; assistant tool calls and
        tool results kept), with the client's ``tools`` and ``template_kwargs``."""
        tokenizer = self._need_tokenizer("chat messages", "messages")
        if continue_final and (not messages or messages[-1].get("role") != "assistant"):
            raise InputError(
                "continue_final_message needs the last message to be the assistant's", "messages"
            )
        kwargs = dict(template_kwargs or {})
        reserved = sorted(RESERVED_TEMPLATE_ARGS & set(kwargs))
        if reserved:
            raise InputError(
                f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs"
            )
        messages, extra = template_messages(messages, tools, self.knows_tools)
        try:
            return tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt and not continue_final,
                continue_final_message=continue_final,
                tokenize=False,
                chat_template=self.chat_template,
                **extra,
                **kwargs,
            )
        except Exception as exc:  # noqa: BLE001 - templates raise on shapes they do not accept
            raise InputError(f"The messages do not fit the model's chat template: {exc}", "messages") from exc

    def chat_token_ids(
        self, messages: list[dict[str, Any]], *args: Any, **kwargs: Any
    ) -> tuple[list[int], str]:
        """Render (render_chat's arguments) and tokenize a conversation: (token ids, the rendered prompt)."""
        text = self.render_chat(messages, *args, **kwargs)
        ids = self.encode(text, "messages", add_special_tokens=False)
        self.check_prompt(ids, "messages")
        return ids, text

    # ------------------------------------------------------------ checks

    def check_prompt(self, token_ids: Sequence[int], param: str = "prompt") -> None:
        if not token_ids:
            raise InputError(
                "The prompt is empty: it must contain at least one token.", param, "empty_prompt"
            )
        bad = next(
            (
                t
                for t in token_ids
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size
            ),
            None,
        )
        if bad is not None:
            raise InputError(
                f"Token id {bad!r} is outside the vocabulary (0..{self.vocab_size - 1}).",
                param,
                "invalid_token_id",
            )
        if len(token_ids) >= self.max_model_len:
            raise InputError(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(token_ids)} tokens, which leaves no room to generate. Shorten the prompt.",
                param,
                "context_length_exceeded",
            )

    def check_chars(self, num_chars: int, param: str = "prompt") -> None:
        """Refuse, without tokenizing, text that cannot fit: no token of this tokenizer is longer than
        max_prompt_chars / max_model_len characters."""
        if self.tokenizer is not None and num_chars > self.max_prompt_chars:
            raise InputError(
                f"This model's maximum context length is {self.max_model_len} tokens; the {param} has "
                f"{num_chars} characters, more than {self.max_model_len} tokens can hold "
                f"({self.max_prompt_chars}). Shorten the prompt.",
                param,
                "context_length_exceeded",
            )

    def sampling_default(self, name: str, fallback: float) -> float:
        """A sampling value for a request that leaves `name` out: the model's generation_config.json
        value (as vLLM applies it), else `fallback` (SamplingParams' own default)."""
        value = self.generation_defaults.get(name)
        if value is None:
            return fallback
        return int(value) if name == "top_k" else value

    def default_params(self) -> SamplingParams:
        """SamplingParams for a request that gives none: the model's generation defaults applied."""
        fields = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        base = SamplingParams()
        return SamplingParams(**{name: self.sampling_default(name, getattr(base, name)) for name in fields})

    def check_params(self, params: SamplingParams) -> None:
        params.validate()
        params.validate_token_ids(self.vocab_size)
        for field, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            asked = getattr(params, field)
            if asked is not None and asked > self.max_logprobs:  # vLLM's words, which clients may match on
                raise InputError(
                    f"Requested {kind} logprobs of {asked}, which is greater than max allowed: {self.max_logprobs}",
                    field,
                )
        if params.stop and self.tokenizer is None:
            raise InputError(
                "stop strings need the tokenizer; the engine was started with skip_tokenizer_init", "stop"
            )
        spec = params.structured_outputs
        if spec is not None:
            if self.tokenizer is None:
                raise InputError(
                    "structured outputs need the tokenizer; the engine was started with skip_tokenizer_init",
                    "structured_outputs",
                )
            try:
                check_spec(spec)
            except ValueError as exc:
                raise InputError(str(exc), "structured_outputs", "invalid_grammar") from exc

    # ------------------------------------------------------------ the request

    def process(
        self,
        request_id: str,
        prompt: str | Sequence[int] | None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora: str | None = None,
    ) -> EngineCoreRequest:
        """Check and resolve one request (tokenizing a text prompt); raises InputError naming the problem."""
        params = params or self.default_params()
        self.check_params(params)
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                self.check_chars(len(prompt))
                prompt_token_ids = self.encode(prompt)
            elif prompt is not None:
                prompt_token_ids = prompt
        ids = list(prompt_token_ids or [])
        self.check_prompt(ids)
        n = len(ids)
        try:
            streaming = resolve_streaming(
                params, self.info.streaming, self.max_model_len, self.info.block_size, n, params.max_tokens
            )
        except ValueError as exc:
            message = str(exc)
            if "context length" in message:
                raise InputError(message, "prompt", "context_length_exceeded") from exc
            raise InputError(message, message.split(" ", 1)[0]) from exc
        room = self.max_model_len - n
        if streaming is not None and params.max_tokens is not None:
            max_tokens = params.max_tokens  # sinks + window: the context never fills up
        else:
            max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            max_tokens=max_tokens,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            priority=priority,
            kv_streaming=streaming.as_tuple if streaming is not None else None,
            lora=lora,
        )
