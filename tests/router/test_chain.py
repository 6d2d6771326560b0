"""The router's prompt tokenizing (router/chain.py) gives the engine's token ids, piece cache or not."""

from __future__ import annotations

import random

import pytest
from pagoda.engine.loader import load_tokenizer, resolve_model
from pagoda.router.chain import ChainHasher, find_tokenizer_dir, load_local_tokenizer, render_messages

WORDS = "cargo harbour  invoice\n pallet über 日本 🙂 <tag> {json: 1} <|im_start|> <|im_end|> tab\tend".split(
    " "
)


@pytest.fixture(scope="module")
def engine_tokenizer():
    path = resolve_model(None)  # converts the embedded GGUF once, as `pagoda serve` does
    assert find_tokenizer_dir(None) == path
    return load_tokenizer(path)


def conversation(rng: random.Random) -> list[dict]:
    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, n)))

    msgs = [{"role": rng.choice(["system", "developer"]), "content": text(300)}]
    for _ in range(rng.randint(0, 5)):
        msgs += [{"role": "user", "content": text(40)}, {"role": "assistant", "content": text(40)}]
    msgs.append(
        {"role": "user", "content": [{"type": "text", "text": text(20)}, {"type": "text", "text": "?"}]}
    )
    return msgs


def test_chat_ids_equal_the_engines_for_random_conversations(engine_tokenizer):
    hasher = ChainHasher(load_local_tokenizer(None))
    assert hasher._split is not None  # the piece cache is on (its self-check passed)
    rng = random.Random(7)
    for _ in range(100):
        msgs = conversation(rng)
        # what engine/server/serving.py does for a chat request: render, then encode without special tokens
        dicts = [
            {
                "role": "system" if m["role"] == "developer" else m["role"],
                "content": m["content"]
                if isinstance(m["content"], str)
                else "".join(p["text"] for p in m["content"]),
            }
            for m in msgs
        ]
        assert dicts == render_messages(msgs)
        text = engine_tokenizer.apply_chat_template(dicts, add_generation_prompt=True, tokenize=False)
        want = list(engine_tokenizer.encode(text, add_special_tokens=False))
        assert hasher.token_ids("/v1/chat/completions", {"messages": msgs}) == want
        assert hasher.token_ids("/v1/chat/completions", {"messages": msgs}) == want  # from the cache


def test_completion_prompts_keep_special_tokens_and_ids_pass_through(engine_tokenizer):
    hasher = ChainHasher(load_local_tokenizer(None))
    prompt = "Once upon a time <|im_start|> there"
    assert hasher.token_ids("/v1/completions", {"prompt": prompt}) == list(engine_tokenizer.encode(prompt))
    assert hasher.token_ids("/v1/completions", {"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert hasher.token_ids("/v1/completions", {"prompt": ["a", "b"]}) is None  # a batch: route by load
    assert ChainHasher(None).token_ids("/v1/chat/completions", {"messages": [{"role": "user"}]}) is None


def test_a_conversion_made_from_another_copy_of_the_gguf_is_found_by_content(tmp_path, monkeypatch):
    """The engine finds a GGUF's conversion by content; so must the router (the same file installed in
    another venv or image layer has another path)."""
    import hashlib
    import json

    gguf = tmp_path / "here" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF fake model bytes")
    cache = tmp_path / "cache"
    conv = cache / "model-abc"
    conv.mkdir(parents=True)
    (conv / "tokenizer.json").write_text("{}")
    source = {"gguf": str(tmp_path / "elsewhere" / "model.gguf"), "converter_version": 2}
    (conv / "pagoda_source.json").write_text(json.dumps({**source, "gguf_sha256": "0" * 64}))
    monkeypatch.setenv("PAGODA_CACHE", str(cache))
    assert find_tokenizer_dir(str(gguf)) is None  # another file's conversion is not this one's
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    (conv / "pagoda_source.json").write_text(json.dumps({**source, "gguf_sha256": digest}))
    assert find_tokenizer_dir(str(gguf)) == conv
