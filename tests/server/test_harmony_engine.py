"""A gpt-oss-shaped tiny model served for real (the engine core on a thread, its scheduler, paged cache, sampler
and detokenizer; the server; the official openai client) answering a chat with a tool call in Harmony.

What is forced, and how: a random tiny model never writes Harmony, so the model's logits are replaced, step by
step, by ones whose argmax is the next token of a scripted Harmony answer (the token the request's position
asks for); everything else is the engine's own path: the chat template that writes `<|channel|>` makes the
server pick Harmony, the prompt is rendered in Harmony and tokenized by the checkpoint's tokenizer (byte-level,
with Harmony's special tokens), generation stops at `<|call|>` (an eos id of the model), the output is
detokenized with its special tokens, and its channels become `reasoning_content` and `tool_calls`.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

pytestmark = pytest.mark.asyncio

SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
ANSWER = (
    "<|channel|>analysis<|message|>Need the weather: call get_weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"location": "Paris"}<|call|>'
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather.",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string"}},
            "required": ["location"],
        },
    },
}


def _checkpoint(path) -> None:
    """A tiny random gpt-oss (transformers' class) and a byte-level tokenizer with Harmony's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GptOssConfig, GptOssForCausalLM, PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|return|>")
    fast.chat_template = "{% for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>{{ m.content }}<|end|>{% endfor %}"
    fast.save_pretrained(path)
    ids = {s: fast.convert_tokens_to_ids(s) for s in SPECIALS}
    torch.manual_seed(0)
    cfg = GptOssConfig(
        vocab_size=len(vocab) + len(SPECIALS), hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8, max_position_embeddings=2048, eos_token_id=[ids["<|return|>"], ids["<|call|>"]],
    )  # fmt: skip
    model = GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    model.save_pretrained(path, safe_serialization=True)


def _force(model, script: list[int]) -> None:
    """The model's logits replaced by ones whose argmax is the script's token for the sequence's next position
    (one request at a time, prefix caching off: a step whose positions start at 0 is a new prompt)."""
    forward, state = model.forward, {"prompt": 0, "last": 0}

    def traced(input_ids, positions, kv_caches, meta):
        if int(positions.min()) == 0:
            state["prompt"] = int(positions.max()) + 1
        state["last"] = int(positions.max())
        return forward(input_ids, positions, kv_caches, meta)

    def forced(hidden):
        k = state["last"] + 1 - state["prompt"]
        logits = torch.zeros(hidden.shape[0], model.config.vocab_size)
        logits[:, script[min(k, len(script) - 1)]] = 100.0
        return logits

    model.forward, model.compute_logits = traced, forced


@pytest.fixture
def client(tmp_path):
    from pagoda.engine.config import EngineConfig
    from pagoda.engine.core.engine_core import EngineCore
    from pagoda.engine.frontend.async_engine import AsyncEngine, CoreThread
    from pagoda.engine.loader import load_tokenizer
    from pagoda.engine.server.app import build_app
    from pagoda.engine.server.settings import ServerSettings

    _checkpoint(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    config = EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", max_model_len=1536,
                          kv_cache_memory_bytes=16 << 20, enable_prefix_caching=False,
                          max_num_batched_tokens=2048)  # fmt: skip
    core = EngineCore(config, tokenizer=tokenizer)
    _force(core.runner.model, tokenizer.encode(ANSWER, add_special_tokens=False))
    engines = []

    def make() -> openai.AsyncOpenAI:  # inside the test's event loop
        engine = AsyncEngine(CoreThread(core), tokenizer)
        engine.start()
        engines.append(engine)
        app = build_app(engine, ServerSettings())
        raw = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pagoda", timeout=300)
        return openai.AsyncOpenAI(base_url="http://pagoda/v1", api_key="x", http_client=raw, max_retries=0)

    yield make
    for engine in engines:
        engine.shutdown()


async def test_a_served_gpt_oss_answers_a_chat_with_a_tool_call(client):
    client = client()
    body = dict(
        model=(await client.models.list()).data[0].id,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        temperature=0,
    )
    (choice,) = (await client.chat.completions.create(**body)).choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"location": "Paris"})
    assert choice.message.reasoning_content == "Need the weather: call get_weather."
    assert not choice.message.content

    chunks = [c async for c in await client.chat.completions.create(**body, stream=True)]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert (
        "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        == choice.message.reasoning_content
    )
    assert (
        "".join(t.function.arguments or "" for d in deltas for t in d.tool_calls or [])
        == call.function.arguments
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "tool_calls"
    ]
