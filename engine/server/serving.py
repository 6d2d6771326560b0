"""The completion endpoints: request -> engine requests -> OpenAI response or SSE stream."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pagoda.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError, RequestStream
from pagoda.engine.outputs import CompletionOutput, RequestOutput
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.server import protocol as P
from pagoda.engine.server.errors import APIError, bad_request, error_body
from pagoda.engine.server.settings import ServerSettings

MAX_PROMPTS = 256
SAMPLING_FIELDS = {
    "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens",
    "logprobs",
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
    def __init__(self, engine: AsyncEngine, settings: ServerSettings, exporter: Any = None) -> None:
        self.aengine = engine
        core = engine.engine
        self.tokenizer = core.tokenizer
        self.max_model_len = int(core.max_model_len)
        self.model_names = list(settings.served_model_names) or [str(core.model_name)]
        self.settings = settings
        self.exporter = exporter
        self.vocab_size = len(self.tokenizer)
        self._token_text = lru_cache(maxsize=65536)(self._decode_one)

    # ------------------------------------------------------------ checks

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(
                404,
                f"The model {model!r} does not exist. This server serves: {', '.join(self.model_names)}.",
                param="model",
                code="model_not_found",
            )

    def check_admission(self, new_requests: int) -> None:
        if not self.aengine.is_alive:
            raise APIError(503, f"The engine is not running: {self.aengine.dead_reason}", code="engine_dead")
        limit = self.settings.max_num_queued_reqs
        if limit is not None and self.aengine.num_waiting + new_requests > limit:
            if self.exporter is not None:
                self.exporter.admission_rejected("queue_full")
            raise APIError(
                503,
                f"The server is overloaded: {self.aengine.num_waiting} requests are waiting and the limit "
                f"(--max-num-queued-reqs) is {limit}. Retry later.",
                code="queue_full",
                headers={"Retry-After": str(self.settings.retry_after_seconds)},
            )

    def check_prompt(self, token_ids: list[int], param: str) -> None:
        if not token_ids:
            raise bad_request(
                "The prompt is empty: it must contain at least one token.", param, "empty_prompt"
            )
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"Token id {bad} is outside the vocabulary (0..{self.vocab_size - 1}).",
                param,
                "invalid_token_id",
            )
        if len(token_ids) >= self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(token_ids)} tokens, which leaves no room to generate. Shorten the prompt.",
                param,
                "context_length_exceeded",
            )

    # ------------------------------------------------------------ tokenization

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except Exception as exc:  # noqa: BLE001 - e.g. lone surrogates
            raise bad_request(f"The {param} could not be tokenized: {exc}", param, "invalid_text") from exc

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def render_chat(
        self, messages: list[P.ChatMessage], add_generation_prompt: bool, continue_final: bool
    ) -> str:
        dicts = []
        for m in messages:
            d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.name:
                d["name"] = m.name
            dicts.append(d)
        if continue_final and dicts[-1]["role"] != "assistant":
            raise bad_request(
                "continue_final_message needs the last message to be the assistant's", "messages"
            )
        try:
            return self.tokenizer.apply_chat_template(
                dicts,
                add_generation_prompt=add_generation_prompt and not continue_final,
                continue_final_message=continue_final,
                tokenize=False,
            )
        except Exception as exc:  # noqa: BLE001 - templates raise on shapes they do not accept
            raise bad_request(
                f"The messages do not fit the model's chat template: {exc}", "messages"
            ) from exc

    def chat_prompt(
        self, messages: list[P.ChatMessage], add_generation_prompt: bool, continue_final: bool
    ) -> Prepared:
        text = self.render_chat(messages, add_generation_prompt, continue_final)
        ids = self.encode(text, "messages", add_special_tokens=False)
        self.check_prompt(ids, "messages")
        return Prepared(ids, text)

    def completion_prompts(self, prompt: Any) -> list[Prepared]:
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
        out = []
        for item in items:
            if isinstance(item, str):
                ids = self.encode(item, "prompt")
                self.check_prompt(ids, "prompt")
                out.append(Prepared(ids, item))
            else:
                self.check_prompt(item, "prompt")
                out.append(Prepared(list(item), self.decode(item)))
        return out

    # ------------------------------------------------------------ sampling

    def sampling_params(
        self,
        req: P.SamplingFields,
        prompt_len: int,
        max_tokens: int | None,
        logprobs: int | None,
        names: dict,
    ) -> SamplingParams:
        room = self.max_model_len - prompt_len
        if max_tokens is not None and req.min_tokens > max_tokens:
            raise bad_request(
                f"min_tokens ({req.min_tokens}) must not exceed {names.get('max_tokens', 'max_tokens')} ({max_tokens})",
                "min_tokens",
            )
        max_tokens = room if max_tokens is None else min(max_tokens, room)
        top_k = req.top_k if req.top_k is not None else 0
        if top_k >= self.vocab_size:
            top_k = 0  # keeps everything anyway
        kwargs = dict(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=top_k,
            min_p=req.min_p or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=min(req.min_tokens, max_tokens),
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
        )
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as exc:
            raise self.value_error(exc, names) from exc

    def value_error(self, exc: Exception, names: dict | None = None) -> APIError:
        message = str(exc)
        if "context length" in message:
            return bad_request(message, (names or {}).get("prompt", "prompt"), "context_length_exceeded")
        first = message.split(" ", 1)[0].strip(":,'\"")
        param = (names or {}).get(first, first) if first in SAMPLING_FIELDS else None
        return bad_request(message, param)

    # ------------------------------------------------------------ engine

    async def submit(
        self, base_id: str, prompts: list[Prepared], params: SamplingParams, priority: int, names: dict
    ) -> list[RequestStream]:
        self.check_admission(len(prompts))
        streams: list[RequestStream] = []
        try:
            for i, prepared in enumerate(prompts):
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                streams.append(
                    await self.aengine.add_request(rid, prepared.token_ids, params, priority=priority)
                )
        except ValueError as exc:
            self.aengine.abort([s.request_id for s in streams])
            raise self.value_error(exc, names) from exc
        except EngineDeadError as exc:
            self.aengine.abort([s.request_id for s in streams])
            raise APIError(503, str(exc), code="engine_dead") from exc
        except BaseException:
            self.aengine.abort([s.request_id for s in streams])
            raise
        return streams

    async def collect(self, request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
        """Wait for every stream's final output; abort them all if the client goes away."""

        async def last(stream: RequestStream) -> RequestOutput:
            final = None
            async for out in stream:
                final = out
            assert final is not None
            return final

        gather = asyncio.ensure_future(asyncio.gather(*(last(s) for s in streams)))
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({gather, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not gather.done():
                gather.cancel()
                self.aengine.abort([s.request_id for s in streams])
            watcher.cancel()
        if gather.cancelled():
            raise APIError(499, "client disconnected", code="client_closed_request")
        try:
            return gather.result()
        except (RequestFailedError, EngineDeadError) as exc:
            raise APIError(500, str(exc), code="engine_error") from exc

    # ------------------------------------------------------------ logprobs

    def completion_logprobs(
        self, c: CompletionOutput, start: int, k: int, text_offset0: int
    ) -> P.CompletionLogprobs:
        out = P.CompletionLogprobs()
        offset = text_offset0
        for pos in range(start, len(c.token_ids)):
            tid = c.token_ids[pos]
            entry = (c.logprobs or [])[pos] if c.logprobs and pos < len(c.logprobs) else {}
            token = self._token_for(tid, entry.get(tid))
            out.tokens.append(token)
            chosen = entry.get(tid)
            out.token_logprobs.append(_finite(chosen.logprob) if chosen else None)
            top = sorted(entry.items(), key=lambda kv: kv[1].rank)[:k] if k else []
            out.top_logprobs.append(
                {self._token_for(t, lp): _finite(lp.logprob) for t, lp in top} if k else None
            )
            out.text_offset.append(offset)
            offset += len(token)
        return out

    def chat_logprobs(self, c: CompletionOutput, start: int, k: int) -> P.ChatLogprobs:
        content = []
        for pos in range(start, len(c.token_ids)):
            tid = c.token_ids[pos]
            entry = c.logprobs[pos] if c.logprobs and pos < len(c.logprobs) else {}
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
        self.check_model(req.model)
        if req.echo and req.logprobs is not None:
            raise bad_request("echo together with logprobs is not supported (no prompt logprobs)", "echo")
        prompts = self.completion_prompts(req.prompt)
        names = {"logprobs": "logprobs", "max_tokens": "max_tokens", "prompt": "prompt"}
        longest = max(len(p.token_ids) for p in prompts)
        params = self.sampling_params(req, longest, req.max_tokens, req.logprobs, names)
        base_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self.submit(base_id, prompts, params, req.priority, names)
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(
                self._completion_stream(base_id, created, req, prompts, streams, include_usage),
                on_close=lambda: self.aengine.abort([s.request_id for s in streams if not s.finished]),
            )
        finals = await self.collect(request, streams)
        choices, usage = [], P.UsageInfo()
        for i, (prepared, out) in enumerate(zip(prompts, finals, strict=True)):
            usage.prompt_tokens += len(out.prompt_token_ids or prepared.token_ids)
            for c in sorted(out.outputs, key=lambda c: c.index):
                usage.completion_tokens += len(c.token_ids)
                echo = prepared.text if req.echo else ""
                logprobs = (
                    self.completion_logprobs(c, 0, req.logprobs, 0) if req.logprobs is not None else None
                )
                choices.append(
                    P.CompletionChoice(
                        index=i * req.n + c.index,
                        text=echo + c.text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
        _finish_usage(usage, finals)
        body = P.CompletionResponse(
            id=base_id, created=created, model=self.model_name, choices=choices, usage=usage
        )
        return JSONResponse(body.model_dump())

    async def _completion_stream(
        self, base_id: str, created: int, req: P.CompletionRequest, prompts: list[Prepared],
        streams: list[RequestStream], include_usage: bool,
    ) -> AsyncIterator[str]:  # fmt: skip
        sent_text: dict[tuple[int, int], int] = {}
        sent_tokens: dict[tuple[int, int], int] = {}
        done: set[tuple[int, int]] = set()
        finals: dict[int, RequestOutput] = {}
        base = {"id": base_id, "object": "text_completion", "created": created, "model": self.model_name}
        try:
            async for i, out in _merge(streams):
                finals[i] = out
                for c in out.outputs:
                    key = (i, c.index)
                    if key in done:
                        continue
                    first = key not in sent_text
                    prev_text, prev_tok = sent_text.get(key, 0), sent_tokens.get(key, 0)
                    delta = c.text[prev_text:]
                    if first and req.echo:
                        delta = prompts[i].text + delta
                    if not delta and not c.finish_reason:
                        continue
                    logprobs = None
                    if req.logprobs is not None:
                        logprobs = self.completion_logprobs(c, prev_tok, req.logprobs, prev_text).model_dump()
                    sent_text[key], sent_tokens[key] = len(c.text), len(c.token_ids)
                    if c.finish_reason:
                        done.add(key)
                    choice = {
                        "index": i * req.n + c.index,
                        "text": delta,
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason if c.finish_reason else None,
                    }
                    yield sse({**base, "choices": [choice], **({"usage": None} if include_usage else {})})
        except (RequestFailedError, EngineDeadError) as exc:
            yield sse(error_body(500, str(exc), code="engine_error"))
            yield "data: [DONE]\n\n"
            return
        if include_usage:
            usage = P.UsageInfo(
                prompt_tokens=sum(len(finals[i].prompt_token_ids or prompts[i].token_ids) for i in finals)
            )
            usage.completion_tokens = sum(len(c.token_ids) for o in finals.values() for c in o.outputs)
            _finish_usage(usage, list(finals.values()))
            yield sse({**base, "choices": [], "usage": usage.model_dump()})
        yield "data: [DONE]\n\n"

    async def create_chat_completion(self, req: P.ChatCompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        prepared = self.chat_prompt(req.messages, req.add_generation_prompt, req.continue_final_message)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        mt_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        k = (req.top_logprobs or 0) if req.logprobs else None
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
        names = {"logprobs": "top_logprobs", "max_tokens": mt_name, "prompt": "messages"}
        params = self.sampling_params(req, len(prepared.token_ids), max_tokens, k, names)
        base_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self.submit(base_id, [prepared], params, req.priority, names)
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(
                self._chat_stream(base_id, created, req, prepared, streams[0], k, include_usage),
                on_close=lambda: self.aengine.abort([s.request_id for s in streams if not s.finished]),
            )
        (final,) = await self.collect(request, streams)
        choices = []
        usage = P.UsageInfo(prompt_tokens=len(final.prompt_token_ids or prepared.token_ids))
        for c in sorted(final.outputs, key=lambda c: c.index):
            usage.completion_tokens += len(c.token_ids)
            choices.append(
                P.ChatChoice(
                    index=c.index,
                    message=P.ChatResponseMessage(content=c.text),
                    logprobs=self.chat_logprobs(c, 0, k) if k is not None else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        _finish_usage(usage, [final])
        body = P.ChatCompletionResponse(
            id=base_id, created=created, model=self.model_name, choices=choices, usage=usage
        )
        return JSONResponse(body.model_dump())

    async def _chat_stream(
        self, base_id: str, created: int, req: P.ChatCompletionRequest, prepared: Prepared,
        stream: RequestStream, k: int | None, include_usage: bool,
    ) -> AsyncIterator[str]:  # fmt: skip
        base = {
            "id": base_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": self.model_name,
        }
        extra = {"usage": None} if include_usage else {}
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        done: set[int] = set()
        final: RequestOutput | None = None
        try:
            for index in range(req.n):
                choice = {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield sse({**base, "choices": [choice], **extra})
            async for _, out in _merge([stream]):
                final = out
                for c in out.outputs:
                    if c.index in done:
                        continue
                    prev_text, prev_tok = sent_text.get(c.index, 0), sent_tokens.get(c.index, 0)
                    delta = c.text[prev_text:]
                    if not delta and not c.finish_reason:
                        continue
                    logprobs = self.chat_logprobs(c, prev_tok, k).model_dump() if k is not None else None
                    sent_text[c.index], sent_tokens[c.index] = len(c.text), len(c.token_ids)
                    if c.finish_reason:
                        done.add(c.index)
                    choice = {
                        "index": c.index,
                        "delta": {"content": delta} if delta else {},
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason if c.finish_reason else None,
                    }
                    yield sse({**base, "choices": [choice], **extra})
        except (RequestFailedError, EngineDeadError) as exc:
            yield sse(error_body(500, str(exc), code="engine_error"))
            yield "data: [DONE]\n\n"
            return
        if include_usage and final is not None:
            usage = P.UsageInfo(prompt_tokens=len(final.prompt_token_ids or prepared.token_ids))
            usage.completion_tokens = sum(len(c.token_ids) for c in final.outputs)
            _finish_usage(usage, [final])
            yield sse({**base, "choices": [], "usage": usage.model_dump()})
        yield "data: [DONE]\n\n"


def _finish_usage(usage: P.UsageInfo, finals: list[RequestOutput]) -> None:
    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
    cached = sum(getattr(o, "num_cached_tokens", 0) or 0 for o in finals)
    usage.prompt_tokens_details = {"cached_tokens": cached}


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
    """Interleave several request streams, tagging each output with its stream's position."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                await q.put((i, out, None))
        except Exception as exc:  # noqa: BLE001 - re-raised in the consumer
            await q.put((i, None, exc))
        finally:
            await q.put((i, None, end))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out, err = await q.get()
            if err is end:
                remaining -= 1
            elif err is not None:
                raise err
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
