"""The serving layer over a fake engine core (no model): one hand-off per multi-prompt request,
tokenization off the event loop, over-long prompts refused by characters, deltas turned into responses."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from pagoda.engine.frontend.input_processor import max_chars_per_token
from pagoda.engine.outputs import CompletionOutput, Logprob
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.server.app import build_app
from pagoda.engine.server.serving import OpenAIServing, Prepared, _ChoiceDeltas
from pagoda.engine.server.settings import DEFAULT_MAX_NUM_QUEUED_REQS, ServerSettings

pytestmark = pytest.mark.asyncio


@pytest.fixture
def started(fakes):
    """(AsyncEngine, FakeCore) pairs, started on the test's loop and shut down after it."""
    engines = []

    def make(**kwargs):
        aengine, core = fakes.start(**kwargs)
        engines.append(aengine)
        return aengine, core

    yield make
    for aengine in engines:
        aengine.shutdown()


def client_for(aengine, **settings) -> httpx.AsyncClient:
    """An in-process client (the engine is started by the test, not by the app's lifespan)."""
    app = build_app(aengine, ServerSettings(**settings))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pagoda", timeout=30)


def sse_events(text: str) -> list[dict]:
    lines = [line for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


async def test_multi_prompt_completion_is_admitted_in_one_hand_off(started) -> None:
    aengine, core = started(step_s=0.005)
    await aengine.add_request("busy", [1], SamplingParams(max_tokens=10**6))  # the loop keeps stepping
    serving = OpenAIServing(aengine, ServerSettings())
    prompts = [Prepared([1, 2], "") for _ in range(8)]
    streams = await serving.submit("cmpl-x", prompts, SamplingParams(max_tokens=2), 0, {})
    assert [s.request_id for s in streams] == [f"cmpl-x-{i}" for i in range(8)]
    for _ in range(1000):  # the hand-off is a message: wait until the core thread has handled it
        if ("add", "cmpl-x-7") in core.log:
            break
        await asyncio.sleep(0.01)
    events = [kind for kind, rid in core.log if kind == "step" or (rid or "").startswith("cmpl-x")]
    first, last = events.index("add"), len(events) - 1 - events[::-1].index("add")
    assert events[first : last + 1] == ["add"] * 8, "engine steps ran between the prompts' admissions"
    aengine.abort(["busy"] + [s.request_id for s in streams])


async def test_tokenization_and_chat_rendering_run_off_the_event_loop(started) -> None:
    aengine, core = started()
    loop_thread = threading.current_thread().name
    async with client_for(aengine) as client:
        r = await client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 2})
        assert r.status_code == 200, r.text
        r = await client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        )
        assert r.status_code == 200, r.text
        r = await client.post("/tokenize", json={"prompt": "a b"})
        assert r.status_code == 200 and r.json()["count"] == 2
    threads = aengine.tokenizer.threads
    assert len(threads) == 4  # encode, render + encode, encode
    assert loop_thread not in threads and all(t.startswith("pagoda-tokenize") for t in threads), threads


async def test_over_long_prompts_are_refused_by_characters_before_tokenizing(started) -> None:
    aengine, core = started()  # max_model_len 1024, tokens of at most 4 characters: 4096 characters fit
    assert OpenAIServing(aengine, ServerSettings()).max_prompt_chars == 4096
    async with client_for(aengine) as client:
        for path, body in [
            ("/v1/completions", {"prompt": "x" * 5000}),
            ("/v1/completions", {"prompt": ["short", "x" * 5000]}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 5000}]}),
            ("/tokenize", {"prompt": "x" * 5000}),
        ]:
            r = await client.post(path, json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "context_length_exceeded" and "5000 characters" in err["message"]
            assert err["param"] == ("messages" if "chat" in path else "prompt")
        assert aengine.tokenizer.encode_calls == 0
        # Under the bound the tokenizer decides: 2000 one-character words are 2000 tokens > 1024.
        r = await client.post("/v1/completions", json={"prompt": "x " * 2000})
        assert r.status_code == 400 and "the prompt has 2000 tokens" in r.json()["error"]["message"]
        assert aengine.tokenizer.encode_calls == 1


def test_the_character_bound_holds_for_every_token_of_the_default_model() -> None:
    from pagoda.engine.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(None))
    bound = max_chars_per_token(tokenizer)
    longest = max(len(tokenizer.decode([i])) for i in range(len(tokenizer)))
    assert longest <= bound <= 4 * longest, (longest, bound)


async def test_streamed_deltas_become_chunks_and_usage(started) -> None:
    aengine, core = started()
    async with client_for(aengine) as client:
        body = {
            "prompt": ["a b", "c d e"],
            "max_tokens": 3,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        events = sse_events(r.text)
        texts: dict[int, str] = {}
        finishes: dict[int, str] = {}
        for e in events[:-1]:
            (choice,) = e["choices"]
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
        assert texts == {i: " w1 w2 w3" for i in range(4)}  # the fake tokenizer's text of tokens 1, 2, 3
        assert finishes == {i: "length" for i in range(4)}
        assert events[-1]["usage"] == {
            "prompt_tokens": 5,
            "completion_tokens": 12,
            "total_tokens": 17,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        r = await client.post("/v1/completions", json={**body, "stream": False, "stream_options": None})
        assert [c["text"] for c in r.json()["choices"]] == [" w1 w2 w3"] * 4
        assert r.json()["usage"]["completion_tokens"] == 12


def test_held_back_tokens_ride_with_the_next_chunk() -> None:
    """A token whose text is withheld (incomplete UTF-8, a possible stop string) keeps its logprob."""
    choices = _ChoiceDeltas(want_logprobs=True)

    def lp(t: int) -> dict[int, Logprob]:
        return {t: Logprob(-0.5, 1)}

    assert choices.take((0, 0), CompletionOutput(0, "", [7], logprobs=[lp(7)]), "") is None
    text, ids, entries = choices.take((0, 0), CompletionOutput(0, "é", [8], logprobs=[lp(8)]), "")
    assert (text, ids, [list(e) for e in entries]) == ("é", [7, 8], [[7], [8]])
    final = choices.take((0, 0), CompletionOutput(0, "", [9], logprobs=[lp(9)], finish_reason="stop"), "")
    assert final[0] == "" and final[1] == [9]
    assert choices.take((0, 0), CompletionOutput(0, "late", [10]), "") is None  # nothing after the end
    assert choices.num_tokens == 3


def test_the_queue_is_bounded_by_default() -> None:
    from pagoda.engine.cli import serve_args

    assert ServerSettings().max_num_queued_reqs == DEFAULT_MAX_NUM_QUEUED_REQS == 512
    assert serve_args.server_settings(serve_args.parse_args([])).max_num_queued_reqs == 512
    assert (
        serve_args.server_settings(serve_args.parse_args(["--max-num-queued-reqs", "7"])).max_num_queued_reqs
        == 7
    )


async def test_the_default_queue_limit_answers_503_with_retry_after(started) -> None:
    aengine, core = started(block_add=threading.Event())  # the core admits nothing: all of them wait
    serving = OpenAIServing(aengine, ServerSettings())
    from pagoda.engine.server.errors import APIError

    params = SamplingParams(max_tokens=2)
    await serving.submit("cmpl-q", [Prepared([1], "")] * DEFAULT_MAX_NUM_QUEUED_REQS, params, 0, {})
    assert aengine.num_waiting == DEFAULT_MAX_NUM_QUEUED_REQS
    with pytest.raises(APIError) as info:
        serving.check_admission(1)
    assert info.value.status == 503 and info.value.headers["Retry-After"] == "1"
    core.block_add.set()


async def test_a_client_gone_before_the_answer_gets_499_and_its_requests_aborted(started) -> None:
    aengine, core = started(step_s=0.002)
    serving = OpenAIServing(aengine, ServerSettings())
    streams = await serving.submit(
        "cmpl-gone", [Prepared([1], "")] * 2, SamplingParams(max_tokens=10**6), 0, {}
    )

    class Gone:
        async def receive(self) -> dict:
            return {"type": "http.disconnect"}

    from pagoda.engine.server.errors import APIError

    with pytest.raises(APIError) as info:
        await serving.collect(Gone(), streams)
    assert info.value.status == 499
    aborts = {("abort", "cmpl-gone-0"), ("abort", "cmpl-gone-1")}
    for _ in range(500):
        if aborts <= set(core.log):
            break
        await asyncio.sleep(0.01)
    assert aborts <= set(core.log) and not core.requests
