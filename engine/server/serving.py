"""The completion endpoints: request -> engine requests -> OpenAI response or SSE stream.

The engine is an `EngineClient` and its `EngineInfo`, nothing more. Tokenization and chat-template rendering
(input processing, engine/frontend/input_processor.py) are CPU work that can take long for big inputs, so they run
on a small worker pool, never on the event loop that every stream shares; a prompt too long to fit the
context is refused by its character count before any tokenizing. Engine outputs arrive as deltas: streams
send them on as they come, non-streaming responses fold them together.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pagoda.engine.frontend.engine_client import EngineClient, EngineDeadError, NewRequest, RequestFailedError
from pagoda.engine.frontend.input_processor import InputError, InputProcessor
from pagoda.engine.frontend.request_stream import RequestStream
from pagoda.engine.kv_cache.streaming import resolve_streaming
from pagoda.engine.kv_transfer.remote import KVTransferServing
from pagoda.engine.outputs import Logprob, RequestOutput
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.server import protocol as P
from pagoda.engine.server.errors import APIError, bad_request, error_body
from pagoda.engine.server.settings import ServerSettings
from pagoda.engine.server.structured import requested_spec, tool_choice_spec
from pagoda.engine.structured_output import GrammarSpec, check_spec
from pagoda.engine.tool_parsers import (
    FORMATS,
    Harmony,
    NamedCall,
    RequiredCalls,
    ToolCallStream,
    ToolParser,
    extract,
    harmony,
    parser_for_template,
    writes_harmony,
)

log = logging.getLogger("pagoda.server")

MAX_PROMPTS = 256
TOKENIZER_THREADS = 2
T = TypeVar("T")
SAMPLING_FIELDS = {
    "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens",
    "logprobs", "kv_eviction", "kv_sink_tokens", "kv_window_tokens", "logit_bias", "prompt_logprobs",
}  # fmt: skip


@dataclass
class Prepared:
    """One engine request: its token ids and the text the client would see echoed."""

    token_ids: list[int]
    text: str


class SSEResponse(StreamingResponse):
    """A StreamingResponse that runs `on_close` however the stream ends (done, error, or disconnect)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class OpenAIServing:
    def __init__(self, engine: EngineClient, settings: ServerSettings, exporter: Any = None) -> None:
        self.engine = engine
        self.info = engine.info
        self.tokenizer = engine.tokenizer
        self.inputs = InputProcessor(engine.info, engine.tokenizer, settings.chat_template)
        self.max_model_len = self.info.max_model_len
        self.model_names = list(settings.served_model_names) or [self.info.model_name]
        self.settings = settings
        self.exporter = exporter
        self.vocab_size = self.inputs.vocab_size
        self.max_prompt_chars = self.inputs.max_prompt_chars
        self._token_text = lru_cache(maxsize=65536)(self._decode_one)
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="pagoda-tokenize")
        name = settings.tool_call_parser
        if name == "auto":  # a Harmony template (gpt-oss's) is Harmony with or without tools
            source = self.inputs.template_source
            name = parser_for_template(source if self.inputs.knows_tools or writes_harmony(source) else None)
        self.tool_parser: ToolParser = FORMATS[name]()
        # gpt-oss: prompts rendered and outputs read in Harmony (reasoning_content, content, tool_calls)
        self.harmony = isinstance(self.tool_parser, Harmony)
        self._hints_logged: set[str] = set()
        self.kv_transfer = KVTransferServing(engine, exporter)  # --kv-transfer-config: P/D disaggregation

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run CPU-bound tokenizer work on the worker pool, so streams keep flowing meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, partial(fn, *args))

    # ------------------------------------------------------------ checks

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter that a request's `model` names, None for the base model; 404 for a name that
        nothing here serves."""
        if model is None or model in self.model_names:
            return None
        adapters = self.engine.lora_adapters
        if model in adapters:
            return model
        raise APIError(
            404,
            f"The model {model!r} does not exist. This server serves: "
            f"{', '.join([*self.model_names, *adapters])}.",
            param="model",
            code="model_not_found",
        )

    def check_admission(self, new_requests: int) -> None:
        if not self.engine.is_alive:
            raise APIError(503, f"The engine is not running: {self.engine.dead_reason}", code="engine_dead")
        limit = self.settings.max_num_queued_reqs
        if limit is not None and self.engine.num_waiting + new_requests > limit:
            if self.exporter is not None:
                self.exporter.admission_rejected("queue_full")
            raise APIError(
                503,
                f"The server is overloaded: {self.engine.num_waiting} requests are waiting and the limit "
                f"(--max-num-queued-reqs) is {limit}. Retry later.",
                code="queue_full",
                headers={"Retry-After": str(self.settings.retry_after_seconds)},
            )

    def check_prompt(self, token_ids: list[int], param: str) -> None:
        self.inputs.check_prompt(token_ids, param)

    def check_chars(self, num_chars: int, param: str) -> None:
        self.inputs.check_chars(num_chars, param)

    # ------------------------------------------------------------ tokenization (worker pool)

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        return self.inputs.encode(text, param, add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.inputs.decode(token_ids, skip_special_tokens)

    def _decode_one(self, token_id: int) -> str:
        return self.inputs.decode([token_id])

    def render_chat(
        self,
        messages: list[P.ChatMessage],
        add_generation_prompt: bool,
        continue_final: bool,
        tools: list[P.Tool] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        return self.inputs.render_chat(
            [m.template_dict() for m in messages],
            add_generation_prompt,
            continue_final,
            [t.model_dump(exclude_none=True) for t in tools] if tools else None,
            template_kwargs,
        )

    def chat_prompt(self, req: P.ChatCompletionRequest, keep: int | None = None) -> Prepared:
        """Render and tokenize (on the worker pool): the prompt of a chat completion, its last ``keep``
        tokens when truncate_prompt_tokens asks."""
        args = (
            [m.template_dict() for m in req.messages],
            req.add_generation_prompt,
            req.continue_final_message,
            [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
            req.chat_template_kwargs,
        )
        if self.harmony:  # gpt-oss: Harmony's own rendering (tools as its functions namespace)
            text = harmony.render_prompt(args[0], args[3], args[1], req.reasoning_effort)
        elif keep is None:
            ids, text = self.inputs.chat_token_ids(*args)
            return Prepared(ids, text)
        else:
            text = self.inputs.render_chat(*args)
        ids = self.encode(text, "messages", add_special_tokens=False)
        if keep is None:
            self.check_prompt(ids, "messages")
            return Prepared(ids, text)
        kept = self.truncate(ids, keep)
        self.check_prompt(kept, "messages")
        return Prepared(kept, text if len(kept) == len(ids) else self.decode(kept))

    def check_fields(self, req: Any) -> None:
        """Fields vLLM honours and Pagoda cannot are a 400; fields nothing here knows are logged once each and
        ignored as vLLM does (--strict-api: a 400 naming the first)."""
        unknown = P.unknown_fields(req)
        for path in unknown:
            if path.rsplit(".", 1)[-1] in P.UNSUPPORTED_FIELDS:
                raise bad_request(
                    f"The request field {path!r} is not supported by Pagoda: it would change the answer, so "
                    "it is refused rather than ignored",
                    path,
                    "unsupported_field",
                )
        if unknown and self.settings.strict_api:
            raise bad_request(
                f"Unrecognized request field {unknown[0]!r}: Pagoda does not support it (--strict-api)",
                unknown[0],
                "unknown_field",
            )
        fresh = [path for path in unknown if path not in self._hints_logged]
        if fresh:
            self._hints_logged.update(fresh)
            log.warning("ignoring request field(s) this server does not know: %s", ", ".join(fresh))

    @staticmethod
    def check_text_only(messages: list[P.ChatMessage]) -> None:
        """A content part that is not text (an image, audio, a file) is a 400 in plain words."""
        for i, m in enumerate(messages):
            found = m.non_text_part()
            if found is not None:
                j, kind = found
                if kind == "text":
                    raise bad_request(
                        f"messages[{i}].content[{j}] is a text part without its 'text'.",
                        f"messages[{i}].content[{j}].text",
                        "missing_field",
                    )
                raise bad_request(
                    f"This model takes text only: messages[{i}].content[{j}] is a {kind!r} part. Send text "
                    "parts ({'type': 'text', 'text': ...}) or a string.",
                    f"messages[{i}].content[{j}]",
                    "unsupported_content",
                )

    def truncation(self, req: P.SamplingFields) -> int | None:
        """truncate_prompt_tokens as vLLM reads it: None keeps the prompt whole, -1 keeps the last
        max_model_len tokens, N the last N (more than max_model_len is a 400)."""
        n = req.truncate_prompt_tokens
        if n is None:
            return None
        if n < 0:
            return self.max_model_len
        if n > self.max_model_len:
            raise bad_request(
                f"truncate_prompt_tokens ({n}) is larger than this model's maximum context length "
                f"({self.max_model_len} tokens); use at most {self.max_model_len}, or -1 for that.",
                "truncate_prompt_tokens",
            )
        return n

    @staticmethod
    def truncate(ids: list[int], keep: int | None) -> list[int]:
        """The last ``keep`` token ids (None: all of them)."""
        return ids if keep is None or len(ids) <= keep else ids[len(ids) - keep :]

    def check_chat_chars(self, messages: list[P.ChatMessage], truncating: bool = False) -> None:
        self.check_text_only(messages)
        if truncating:  # the body limit bounds the text; the tokens are cut after tokenizing
            return
        self.check_chars(
            sum(
                len(m.text()) + len(m.name or "") + sum(len(c.function.arguments) for c in m.tool_calls or [])
                for m in messages
            ),
            "messages",
        )

    def note_hints(self, req: P.SamplingFields) -> None:
        """Hint fields are accepted and ignored; say so once per field, at debug level."""
        for name in req.hints_set():
            if name not in self._hints_logged:
                self._hints_logged.add(name)
                log.debug("the request field %r is a hint this server accepts and ignores", name)

    @staticmethod
    def check_grammar(spec: tuple[str, GrammarSpec] | None) -> None:
        """A spec that cannot compile is a 400 naming the field that sent it (on the worker pool)."""
        if spec is not None:
            try:
                check_spec(spec[1])
            except ValueError as exc:
                raise bad_request(f"Invalid {spec[0]}: {exc}", spec[0], "invalid_grammar") from exc

    def completion_items(self, prompt: Any, keep: int | None = None) -> list[str | list[int]]:
        """The prompts of a completion request, checked for shape and length before any tokenizing (token
        ids cut to their last ``keep``, truncate_prompt_tokens)."""
        if isinstance(prompt, str):
            items: list[str | list[int]] = [prompt]
        elif not prompt:
            raise bad_request("The prompt is empty.", "prompt", "empty_prompt")
        elif isinstance(prompt[0], int):
            items = [prompt]
        else:
            items = list(prompt)
        if len(items) > MAX_PROMPTS:
            raise bad_request(f"At most {MAX_PROMPTS} prompts per request, got {len(items)}.", "prompt")
        if keep is not None:
            items = [item if isinstance(item, str) else self.truncate(list(item), keep) for item in items]
        for item in items:
            if isinstance(item, str):
                if keep is None:  # truncating: the body limit bounds the text
                    self.check_chars(len(item), "prompt")
            else:
                self.check_prompt(item, "prompt")
        return items

    def completion_prompts(
        self, items: list[str | list[int]], echo: bool, keep: int | None = None
    ) -> list[Prepared]:
        """Tokenize (on the worker pool) the prompts of a completion request (their last ``keep`` tokens)."""
        out = []
        for item in items:
            if isinstance(item, str):
                ids = self.encode(item, "prompt")
                kept = self.truncate(ids, keep)
                self.check_prompt(kept, "prompt")
                out.append(Prepared(kept, item if len(kept) == len(ids) else self.decode(kept)))
            else:
                out.append(Prepared(list(item), self.decode(item) if echo else ""))
        return out

    # ------------------------------------------------------------ sampling

    def sampling_params(
        self,
        req: P.SamplingFields,
        prompt_len: int,
        max_tokens: int | None,
        logprobs: int | None,
        names: dict,
        spec: GrammarSpec | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        room = self.max_model_len - prompt_len
        if max_tokens is not None and req.min_tokens > max_tokens:
            raise bad_request(
                f"min_tokens ({req.min_tokens}) must not exceed {names.get('max_tokens', 'max_tokens')} ({max_tokens})",
                "min_tokens",
            )
        try:
            streaming = resolve_streaming(
                req, self.info.streaming, self.max_model_len, self.info.block_size, prompt_len, max_tokens
            )
        except ValueError as exc:
            raise self.value_error(exc, names) from exc
        if streaming is None and max_tokens is not None and max_tokens > room:
            name = names.get("max_tokens", "max_tokens")
            raise bad_request(
                f"{name} is {max_tokens}, more than the context leaves: this model's maximum context length "
                f"is {self.max_model_len} tokens and the prompt takes {prompt_len}, so at most {room} can be "
                f"generated. Lower {name} (or leave it out for all that fits), or shorten the prompt.",
                name,
                "context_length_exceeded",
            )
        if max_tokens is None:  # up to the context (with sinks + window, which never fills, too)
            max_tokens = room
        # What a request leaves out: the model's generation_config.json values (--generation-config), as vLLM
        default = self.inputs.sampling_default
        top_k = req.top_k if req.top_k is not None else int(default("top_k", 0))
        if top_k >= self.vocab_size:
            top_k = 0  # keeps everything anyway
        kwargs = dict(
            n=req.n,
            temperature=default("temperature", 1.0) if req.temperature is None else req.temperature,
            top_p=default("top_p", 1.0) if req.top_p is None else req.top_p,
            top_k=top_k,
            min_p=default("min_p", 0.0) if req.min_p is None else req.min_p,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=(
                default("repetition_penalty", 1.0)
                if req.repetition_penalty is None
                else req.repetition_penalty
            ),
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=min(req.min_tokens, max_tokens),
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            kv_eviction=req.kv_eviction,
            kv_sink_tokens=req.kv_sink_tokens,
            kv_window_tokens=req.kv_window_tokens,
            logit_bias=self.logit_bias(req.logit_bias),
            prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else req.prompt_logprobs,
            structured_outputs=spec,
        )
        try:
            params = SamplingParams(**kwargs)
            params.validate_token_ids(self.vocab_size)
        except (ValueError, TypeError) as exc:
            raise self.value_error(exc, names) from exc
        return params

    @staticmethod
    def logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
        """OpenAI sends token ids as strings; the vocabulary check comes with the other ids'."""
        if not bias:
            return None
        out = {}
        for key, value in bias.items():
            try:
                out[int(key)] = float(value)
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        return out

    def value_error(self, exc: Exception, names: dict | None = None) -> APIError:
        message = str(exc)
        if isinstance(exc, InputError):
            return bad_request(message, (names or {}).get(exc.param, exc.param), exc.code)
        if "context length" in message:
            return bad_request(message, (names or {}).get("prompt", "prompt"), "context_length_exceeded")
        first = message.split(" ", 1)[0].strip(":,'\"")
        param = (names or {}).get(first, first) if first in SAMPLING_FIELDS else None
        return bad_request(message, param)

    # ------------------------------------------------------------ engine

    async def submit(
        self,
        base_id: str,
        prompts: list[Prepared],
        params: SamplingParams,
        priority: int,
        names: dict,
        lora: str | None = None,
        transfer: tuple[dict | None, Request] | None = None,
    ) -> list[RequestStream]:
        """Admit every prompt of the request in one hand-off to the engine (one engine-loop pass); ``lora``:
        the adapter they run through (None: the base model). ``transfer``: the body's kv_transfer_params and
        the HTTP request, for a prefill/decode split (engine/kv_transfer/remote.py): a request naming a
        prefill engine has its prompt prefilled there first (any failure: here)."""
        self.check_admission(len(prompts))
        export = False
        if transfer is not None and (self.kv_transfer.consumes or self.kv_transfer.produces):
            body_params, http = transfer
            export = self.kv_transfer.exports(body_params) and len(prompts) == 1
            remote = self.kv_transfer.remote_of(http.headers, body_params)
            if remote is not None and len(prompts) == 1:
                await self.kv_transfer.prefill_remotely(
                    remote, prompts[0].token_ids, lora, http.headers.get("authorization")
                )
        batch = [
            NewRequest(
                base_id if len(prompts) == 1 else f"{base_id}-{i}",
                p.token_ids,
                params,
                priority,
                lora,
                export,
            )
            for i, p in enumerate(prompts)
        ]
        try:
            return await self.engine.add_requests(batch)
        except ValueError as exc:
            raise self.value_error(exc, names) from exc
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from exc

    async def collect(self, request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
        """Fold every stream's deltas into its whole output; abort them all if the client goes away."""
        finals: list[RequestOutput | None] = [None] * len(streams)

        async def fold() -> None:
            async for i, delta in _merge(streams):
                if finals[i] is None:
                    finals[i] = delta  # a stream hands out objects it owns: safe to fold into
                else:
                    finals[i].add(delta)

        task = asyncio.ensure_future(fold())
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
                self.engine.abort([s.request_id for s in streams])
            watcher.cancel()
        if not task.done() or task.cancelled():  # cancelled just now: the cancel lands on the next pass
            raise APIError(499, "client disconnected", code="client_closed_request")
        try:
            task.result()
        except (RequestFailedError, EngineDeadError) as exc:
            raise APIError(500, str(exc), code="engine_error") from exc
        assert all(f is not None for f in finals)
        return finals  # type: ignore[return-value]

    # ------------------------------------------------------------ logprobs

    def completion_logprobs(
        self, token_ids: list[int], entries: list[dict[int, Logprob]] | None, k: int, text_offset0: int
    ) -> P.CompletionLogprobs:
        out = P.CompletionLogprobs()
        offset = text_offset0
        for pos, tid in enumerate(token_ids):
            entry = entries[pos] if entries and pos < len(entries) else {}
            chosen = entry.get(tid)
            token = self._token_for(tid, chosen)
            out.tokens.append(token)
            out.token_logprobs.append(_finite(chosen.logprob) if chosen else None)
            top = sorted(entry.items(), key=lambda kv: kv[1].rank)[:k] if k else []
            out.top_logprobs.append(
                {self._token_for(t, lp): _finite(lp.logprob) for t, lp in top} if k else None
            )
            out.text_offset.append(offset)
            offset += len(token)
        return out

    def chat_logprobs(
        self, token_ids: list[int], entries: list[dict[int, Logprob]] | None, k: int
    ) -> P.ChatLogprobs:
        content = []
        for pos, tid in enumerate(token_ids):
            entry = entries[pos] if entries and pos < len(entries) else {}
            chosen = entry.get(tid)
            token = self._token_for(tid, chosen)
            top = sorted(entry.items(), key=lambda kv: kv[1].rank)[:k] if k else []
            content.append(
                P.TokenLogprob(
                    token=token,
                    logprob=_finite(chosen.logprob) if chosen else -9999.0,
                    bytes=list(token.encode("utf-8", "replace")),
                    top_logprobs=[
                        P.TopLogprob(
                            token=(s := self._token_for(t, lp)),
                            logprob=_finite(lp.logprob),
                            bytes=list(s.encode("utf-8", "replace")),
                        )
                        for t, lp in top
                    ],
                )
            )
        return P.ChatLogprobs(content=content)

    def _token_for(self, token_id: int, lp: Any) -> str:
        if lp is not None and getattr(lp, "decoded_token", None) is not None:
            return lp.decoded_token
        return self._token_text(token_id)

    # ------------------------------------------------------------ endpoints

    async def create_completion(self, req: P.CompletionRequest, request: Request) -> Response:
        lora = self.check_model(req.model)
        self.check_fields(req)
        self.note_hints(req)
        # max_tokens 0 with echo: prompt scoring (lm-evaluation-harness's loglikelihood): one token is
        # generated so the prompt's logprobs come back, and dropped from the answer.
        scoring = req.max_tokens == 0
        if scoring and not req.echo:
            raise bad_request(
                "max_tokens 0 generates nothing: it needs echo (prompt scoring, with logprobs for the prompt's "
                "token logprobs)",
                "max_tokens",
            )
        best_of = req.best_of or req.n
        if best_of < req.n:
            raise bad_request(f"best_of ({best_of}) must be at least n ({req.n})", "best_of")
        if best_of > req.n and req.stream:
            raise bad_request("best_of larger than n cannot be streamed", "best_of")
        keep = self.truncation(req)
        items = self.completion_items(req.prompt, keep)
        self.check_admission(len(items))  # refuse early under overload, before spending CPU
        spec = requested_spec(req)
        await self.off_loop(self.check_grammar, spec)
        prompts = await self.off_loop(self.completion_prompts, items, req.echo, keep)
        names = {"logprobs": "logprobs", "max_tokens": "max_tokens", "prompt": "prompt", "n": "best_of"}
        longest = max(len(p.token_ids) for p in prompts)
        # echo + logprobs: the prompt's tokens get their logprobs too (OpenAI's semantics)
        prompt_k = req.logprobs if req.echo and req.logprobs is not None else None
        if req.prompt_logprobs is not None:
            prompt_k = max(prompt_k or 0, req.prompt_logprobs)
        params = self.sampling_params(
            req, longest, 1 if scoring else req.max_tokens, req.logprobs, names, spec[1] if spec else None,
            prompt_k,
        )  # fmt: skip
        params.n = best_of
        base_id = f"cmpl-{uuid.uuid4().hex}"
        transfer = (req.kv_transfer_params, request)
        streams = await self.submit(base_id, prompts, params, req.priority, names, lora, transfer)
        created, model = int(time.time()), lora or self.model_name
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(
                self._completion_stream(
                    base_id, created, model, req, prompts, streams, include_usage, scoring
                ),
                on_close=lambda: self.engine.abort([s.request_id for s in streams if not s.finished]),
            )
        finals = await self.collect(request, streams)
        choices, usage = [], P.UsageInfo()
        for i, (prepared, out) in enumerate(zip(prompts, finals, strict=True)):
            usage.prompt_tokens += len(prepared.token_ids)
            if not scoring:
                usage.completion_tokens += sum(len(c.token_ids) for c in out.outputs)
            kept = sorted(out.outputs, key=lambda c: c.index)
            if best_of > req.n:  # the n most likely of best_of
                kept = sorted(kept, key=lambda c: -(c.cumulative_logprob or 0.0))[: req.n]
            for j, c in enumerate(kept):
                text, logprobs = ("" if scoring else c.text), None
                if req.logprobs is not None:
                    ids, entries = ([], []) if scoring else (c.token_ids, c.logprobs)
                    logprobs = self.completion_logprobs(ids, entries, req.logprobs, 0)
                if req.echo:
                    text = prepared.text + text
                    if logprobs is not None:
                        logprobs = self.echo_logprobs(prepared, out.prompt_logprobs, req.logprobs, logprobs)
                choices.append(
                    P.CompletionChoice(
                        index=i * req.n + j,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        prompt_logprobs=self.prompt_logprobs(out.prompt_logprobs)
                        if req.prompt_logprobs is not None
                        else None,
                    )
                )
        _finish_usage(usage, [o.num_cached_tokens for o in finals])
        body = P.CompletionResponse(id=base_id, created=created, model=model, choices=choices, usage=usage)
        data = body.model_dump(exclude_none=False)
        if self.kv_transfer.exports(req.kv_transfer_params) and len(prompts) == 1:
            data["kv_transfer_params"] = self.kv_transfer.answer_params(base_id, request.url.hostname)
        return JSONResponse(data)

    def echo_logprobs(
        self, prepared: Prepared, entries: list | None, k: int, generated: P.CompletionLogprobs
    ) -> P.CompletionLogprobs:
        """The logprobs of an echoed prompt followed by those of the generated tokens (offsets shifted)."""
        ids = prepared.token_ids
        lps = list(entries or [])
        head = self.completion_logprobs(ids, [e or {} for e in lps], k, 0)
        if lps and lps[0] is None:  # nothing predicts the first prompt token
            head.token_logprobs[0], head.top_logprobs[0] = None, None
        shift = len(prepared.text)
        head.tokens += generated.tokens
        head.token_logprobs += generated.token_logprobs
        head.top_logprobs += generated.top_logprobs
        head.text_offset += [o + shift for o in generated.text_offset]
        return head

    def prompt_logprobs(self, entries: list | None) -> list[dict[str, P.PromptLogprob] | None] | None:
        """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: logprob, rank, text}."""
        if entries is None:
            return None
        return [
            None
            if e is None
            else {
                str(t): P.PromptLogprob(
                    logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=self._token_for(t, lp)
                )
                for t, lp in e.items()
            }
            for e in entries
        ]

    async def _completion_stream(
        self, base_id: str, created: int, model: str, req: P.CompletionRequest, prompts: list[Prepared],
        streams: list[RequestStream], include_usage: bool, scoring: bool = False,
    ) -> AsyncIterator[str]:  # fmt: skip
        base = {"id": base_id, "object": "text_completion", "created": created, "model": model}
        extra = {"usage": None} if include_usage else {}
        continuous = include_usage and bool(req.stream_options and req.stream_options.continuous_usage_stats)
        num_prompt = sum(len(p.token_ids) for p in prompts)
        choices = _ChoiceDeltas(want_logprobs=req.logprobs is not None)
        cached: dict[int, int] = {}
        prompt_lps: dict[int, list | None] = {}
        try:
            async for i, out in _merge(streams):
                cached[i] = out.num_cached_tokens
                if out.prompt_logprobs is not None:
                    prompt_lps[i] = out.prompt_logprobs
                for c in out.outputs:
                    key = (i, c.index)
                    first = key not in choices.started
                    prefix = prompts[i].text if req.echo and first else ""
                    chunk = choices.take(key, c, prefix)
                    if chunk is None:
                        continue
                    text, token_ids, entries = chunk
                    if scoring:  # prompt scoring: the echoed prompt only, not the token generated for it
                        text, token_ids, entries = prefix, [], []
                    logprobs = None
                    if req.logprobs is not None:
                        lp = self.completion_logprobs(
                            token_ids, entries, req.logprobs, choices.text_offset(key, text) + len(prefix)
                        )
                        if prefix:
                            lp = self.echo_logprobs(prompts[i], prompt_lps.get(i), req.logprobs, lp)
                        logprobs = lp.model_dump()
                    choice = {
                        "index": i * req.n + c.index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason if c.finish_reason else None,
                    }
                    if req.prompt_logprobs is not None and first:
                        lps = self.prompt_logprobs(prompt_lps.get(i))
                        choice["prompt_logprobs"] = [
                            None if e is None else {t: v.model_dump() for t, v in e.items()}
                            for e in lps or []
                        ]
                    generated = 0 if scoring else choices.num_tokens
                    usage = self.usage_so_far(num_prompt, generated) if continuous else None
                    yield sse({**base, "choices": [choice], **extra, **({"usage": usage} if usage else {})})
        except (RequestFailedError, EngineDeadError) as exc:
            yield sse(error_body(500, str(exc), code="engine_error"))
            yield "data: [DONE]\n\n"
            return
        if include_usage:
            generated = 0 if scoring else choices.num_tokens
            usage = P.UsageInfo(prompt_tokens=num_prompt, completion_tokens=generated)
            _finish_usage(usage, list(cached.values()))
            yield sse({**base, "choices": [], "usage": usage.model_dump()})
        yield "data: [DONE]\n\n"

    @staticmethod
    def usage_so_far(prompt_tokens: int, completion_tokens: int) -> dict:
        """stream_options.continuous_usage_stats: the usage so far, in every chunk."""
        return P.UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        ).model_dump(exclude_none=True)

    def harmony_output(self, parser: ToolParser | None) -> bool:
        """Whether this chat's output is read as Harmony channels: a gpt-oss model's, unless a tool_choice
        constrains the output to a grammar (required, a named function)."""
        return self.harmony and not isinstance(parser, (NamedCall, RequiredCalls))

    def tool_setup(
        self, req: P.ChatCompletionRequest
    ) -> tuple[ToolParser | None, GrammarSpec | None, str | None]:
        """(the parser of this request's tool calls, the grammar its tool_choice needs, the field that asks
        for a grammar)."""
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
        if choice != "none" and not req.tools:
            raise bad_request("tool_choice needs tools", "tool_choice")
        spec = requested_spec(req)
        tool_spec = tool_choice_spec(req.tools or [], choice, req.parallel_tool_calls)
        if tool_spec is not None and spec is not None:
            raise bad_request(
                f"tool_choice {choice if isinstance(choice, str) else 'naming a function'} already structures "
                f"the output; drop {spec[0]}",
                spec[0],
            )
        if isinstance(choice, P.NamedToolChoice):
            return NamedCall(choice.function.name), tool_spec, "tool_choice"
        if choice == "required":
            return RequiredCalls(), tool_spec, "tool_choice"
        parser = self.tool_parser if choice == "auto" else None
        return parser, spec[1] if spec else None, spec[0] if spec else None

    async def create_chat_completion(self, req: P.ChatCompletionRequest, request: Request) -> Response:
        lora = self.check_model(req.model)
        self.check_text_only(req.messages)
        self.check_fields(req)
        self.note_hints(req)
        keep = self.truncation(req)
        self.check_chat_chars(req.messages, truncating=keep is not None)
        self.check_admission(1)  # refuse early under overload, before spending CPU
        parser, spec, spec_field = self.tool_setup(req)
        await self.off_loop(self.check_grammar, (spec_field, spec) if spec is not None else None)
        prepared = await self.off_loop(self.chat_prompt, req, keep)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        mt_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        k = (req.top_logprobs or 0) if req.logprobs else None
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
        names = {"logprobs": "top_logprobs", "max_tokens": mt_name, "prompt": "messages"}
        params = self.sampling_params(req, len(prepared.token_ids), max_tokens, k, names, spec)
        if self.harmony_output(parser):
            params.skip_special_tokens = False  # the channels' markers are special tokens
        base_id = f"chatcmpl-{uuid.uuid4().hex}"
        transfer = (req.kv_transfer_params, request)
        streams = await self.submit(base_id, [prepared], params, req.priority, names, lora, transfer)
        created, model = int(time.time()), lora or self.model_name
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(
                self._chat_stream(base_id, created, model, req, prepared, streams, k, include_usage, parser),
                on_close=lambda: self.engine.abort([s.request_id for s in streams if not s.finished]),
            )
        (final,) = await self.collect(request, streams)
        choices = []
        usage = P.UsageInfo(prompt_tokens=len(prepared.token_ids))
        for c in sorted(final.outputs, key=lambda c: c.index):
            usage.completion_tokens += len(c.token_ids)
            reasoning = None
            if self.harmony_output(parser):
                reasoning, content, calls = harmony.parse(c.text)
                calls = calls if parser is not None else []
            else:
                content, calls = (c.text, []) if parser is None else whole_tool_calls(parser, c.text)
            if calls and req.parallel_tool_calls is False:
                calls = calls[:1]
            finish = c.finish_reason
            if calls and finish == "stop" and not isinstance(parser, NamedCall):
                finish = "tool_calls"
            choices.append(
                P.ChatChoice(
                    index=c.index,
                    message=P.ChatResponseMessage(
                        content=content if content or not calls else None,
                        reasoning_content=reasoning,
                        tool_calls=calls,
                    ),
                    logprobs=self.chat_logprobs(c.token_ids, c.logprobs, k) if k is not None else None,
                    finish_reason=finish,
                    stop_reason=c.stop_reason,
                )
            )
        _finish_usage(usage, [final.num_cached_tokens])
        body = P.ChatCompletionResponse(
            id=base_id,
            created=created,
            model=model,
            choices=choices,
            usage=usage,
            prompt_logprobs=self.prompt_logprobs(final.prompt_logprobs),
        )
        data = body.model_dump()
        if self.kv_transfer.exports(req.kv_transfer_params):
            data["kv_transfer_params"] = self.kv_transfer.answer_params(base_id, request.url.hostname)
        return JSONResponse(data)

    async def _chat_stream(
        self, base_id: str, created: int, model: str, req: P.ChatCompletionRequest, prepared: Prepared,
        streams: list[RequestStream], k: int | None, include_usage: bool, parser: ToolParser | None,
    ) -> AsyncIterator[str]:  # fmt: skip
        base = {"id": base_id, "object": "chat.completion.chunk", "created": created, "model": model}
        extra = {"usage": None} if include_usage else {}
        continuous = include_usage and bool(req.stream_options and req.stream_options.continuous_usage_stats)
        num_prompt = len(prepared.token_ids)
        choices = _ChoiceDeltas(want_logprobs=k is not None)
        harmony_streams = (
            {i: harmony.HarmonyStream() for i in range(req.n)} if self.harmony_output(parser) else {}
        )
        tool_streams = (
            {i: ToolCallStream(parser) for i in range(req.n)}
            if parser is not None and not harmony_streams
            else {}
        )
        cached = 0
        try:
            for index in range(req.n):
                choice = {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield sse({**base, "choices": [choice], **extra})
            held: dict[int, tuple[list[int], list]] = {}  # tokens of deltas not sent (nothing to say yet)
            async for _, out in _merge(streams):
                cached = out.num_cached_tokens
                for c in out.outputs:
                    chunk = choices.take((0, c.index), c, "")
                    if chunk is None:
                        continue
                    text, token_ids, entries = chunk
                    if c.index in held:
                        ids0, entries0 = held.pop(c.index)
                        token_ids, entries = ids0 + list(token_ids), entries0 + list(entries)
                    delta: dict[str, Any] = {"content": text} if text else {}
                    finish = c.finish_reason
                    calls = tool_streams.get(c.index)
                    channels = harmony_streams.get(c.index)
                    if channels is not None:
                        d = channels.feed(text, final=bool(finish))
                        delta = {"reasoning_content": d.reasoning} if d.reasoning else {}
                        if d.content:
                            delta["content"] = d.content
                        if d.tool_calls and parser is not None:
                            delta["tool_calls"] = d.tool_calls
                        if parser is not None and channels.num_calls and finish == "stop":
                            finish = "tool_calls"
                    elif calls is not None:
                        content, tool_deltas = calls.feed(text, final=bool(finish))
                        delta = {"content": content} if content else {}
                        if tool_deltas:
                            delta["tool_calls"] = tool_deltas
                        if calls.num_calls and finish == "stop" and not isinstance(parser, NamedCall):
                            finish = "tool_calls"
                    if not delta and finish is None:  # vLLM sends no empty deltas: hold the tokens' logprobs
                        held[c.index] = (list(token_ids), list(entries))
                        continue
                    logprobs = (
                        self.chat_logprobs(token_ids, entries, k).model_dump() if k is not None else None
                    )
                    choice = {
                        "index": c.index,
                        "delta": delta,
                        "logprobs": logprobs,
                        "finish_reason": finish,
                        "stop_reason": c.stop_reason if c.finish_reason else None,
                    }
                    usage = self.usage_so_far(num_prompt, choices.num_tokens) if continuous else None
                    yield sse({**base, "choices": [choice], **extra, **({"usage": usage} if usage else {})})
        except (RequestFailedError, EngineDeadError) as exc:
            yield sse(error_body(500, str(exc), code="engine_error"))
            yield "data: [DONE]\n\n"
            return
        except Exception:  # noqa: BLE001 - a bug of ours (a tool parser's, say) still ends the stream properly
            log.exception("chat stream %s failed", base_id)
            yield sse(error_body(500, "the server failed while streaming this answer", code="internal_error"))
            yield "data: [DONE]\n\n"
            return
        if include_usage:
            usage = P.UsageInfo(prompt_tokens=num_prompt, completion_tokens=choices.num_tokens)
            _finish_usage(usage, [cached])
            yield sse({**base, "choices": [], "usage": usage.model_dump()})
        yield "data: [DONE]\n\n"


class _ChoiceDeltas:
    """Per-choice state of a stream: tokens whose text is still held back (an incomplete UTF-8 sequence,
    a possible stop string) ride along with the next chunk that has text, so logprobs lose none."""

    def __init__(self, want_logprobs: bool) -> None:
        self.want_logprobs = want_logprobs
        self.started: set[tuple[int, int]] = set()
        self.num_tokens = 0
        self._done: set[tuple[int, int]] = set()
        self._held: dict[tuple[int, int], tuple[list[int], list[dict[int, Logprob]]]] = {}
        self._offsets: dict[tuple[int, int], int] = {}

    def take(
        self, key: tuple[int, int], c: Any, prefix: str
    ) -> tuple[str, list[int], list[dict[int, Logprob]]] | None:
        """(text, token ids, logprob entries) to send for this delta of choice `key`, or None for now."""
        if key in self._done:
            return None
        self.num_tokens += len(c.token_ids)
        held_ids, held_entries = self._held.pop(key, ([], []))
        token_ids = held_ids + list(c.token_ids)
        entries = held_entries + list(c.logprobs or []) if self.want_logprobs else []
        text = prefix + c.text
        if not text and not c.finish_reason:
            if token_ids:
                self._held[key] = (token_ids, entries)
            return None
        self.started.add(key)
        if c.finish_reason:
            self._done.add(key)
        return text, token_ids, entries

    def text_offset(self, key: tuple[int, int], text: str) -> int:
        """The text offset of this chunk's first token; advances past the chunk."""
        start = self._offsets.get(key, 0)
        self._offsets[key] = start + len(text)
        return start


def whole_tool_calls(parser: ToolParser, text: str) -> tuple[str | None, list[dict]]:
    """(content, OpenAI tool calls) of a finished output. tool_choice "required" (a grammar wrote it) reads it
    exactly as a stream of it reads it: an output cut short by max_tokens keeps the calls a stream would have
    sent, not its raw text as content. Other parsers read free text: an output whose calls do not all parse
    is content (a stream may already have sent a call by then)."""
    if not isinstance(parser, RequiredCalls):
        content, named = extract(parser, text)
        return content, [call.to_openai() for call in named]
    stream = ToolCallStream(parser)
    head, first = stream.feed(text, final=False)
    tail, last = stream.feed("", final=True)
    calls: dict[int, dict] = {}
    for d in first + last:
        call = calls.setdefault(
            d["index"], {"id": None, "type": "function", "function": {"name": None, "arguments": ""}}
        )
        if "id" in d:
            call["id"] = d["id"]
            call["function"]["name"] = d["function"]["name"]
        call["function"]["arguments"] += d["function"].get("arguments", "")
    content = head + tail
    return (content or None), [calls[i] for i in sorted(calls)]


def _finish_usage(usage: P.UsageInfo, cached_tokens: list[int]) -> None:
    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
    usage.prompt_tokens_details = {"cached_tokens": sum(n or 0 for n in cached_tokens)}


def _finite(x: float) -> float:
    """JSON has no -inf; clients expect a very negative number instead."""
    if x != x:
        return -9999.0
    return max(float(x), -9999.0)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave the streams of one HTTP request, tagging each merged delta with its stream's position.

    One event watches them all and nothing is queued here: each stream merges what its reader has not
    taken into one pending delta, so a slow reader costs one object per stream, however long it sleeps.
    """
    wake = asyncio.Event()
    for stream in streams:
        stream.listen(wake)
    remaining = list(range(len(streams)))
    while remaining:
        wake.clear()
        for i in list(remaining):
            out = streams[i].take()  # raises the error that ended the stream
            if out is not None:
                if out.finished:
                    remaining.remove(i)
                yield i, out
            elif streams[i].finished:
                remaining.remove(i)
        if remaining:
            await wake.wait()
