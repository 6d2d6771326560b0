"""transformers' greedy tokens on the real Gemma 3 270M GGUF file, the reference of the Gemma tests.

transformers dequantizes the file itself (its own GGUF reader, not Pagoda's converter) and runs eager
float32 attention with Gemma 3's sliding window. Loading the 262k-token vocabulary and dequantizing take about
a minute, so the answers are kept on disk under the Pagoda cache, keyed by the file's content, the
transformers and torch versions, the prompts and the token count: a change to any of them computes them anew.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pagoda.engine import envs
from pagoda.engine.loader.content_hash import file_sha256

# Each prompt: (text, whether the tokenizer adds <bos>); a chat prompt is rendered text that carries it.
Prompt = tuple[str, bool]

NEW_TOKENS = 24
WINDOW = 512  # Gemma 3 270M's sliding window
_PARAGRAPH = (
    "The history of the city begins with a small settlement on the river, where traders met to exchange "
    "grain, salt and cloth. Over the centuries the settlement grew into a market town, then a walled city "
    "with a cathedral, a university and a harbour. "
)
LONG = "".join(f"Chapter {i}. {_PARAGRAPH}" for i in range(1, 14)) + "In summary, the city is known for"
TEXTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of", LONG]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
# What Gemma's chat format makes of FRANCE (the file has no template; the converter gives Gemma's turns).
FRANCE_RENDERED = (
    "<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
)
PROMPTS: list[Prompt] = [(text, True) for text in TEXTS] + [(FRANCE_RENDERED, False)]


def gemma3_reference(gguf: Path) -> list[dict[str, Any]]:
    """The answers to PROMPTS (TEXTS, then FRANCE as the chat template renders it), NEW_TOKENS each."""
    return greedy_reference(gguf, PROMPTS, NEW_TOKENS)


def greedy_reference(gguf: Path, prompts: list[Prompt], new_tokens: int) -> list[dict[str, Any]]:
    """Per prompt: transformers' prompt ids, its greedy tokens (no stop: every step counts) and each chosen
    token's logprob."""
    import torch
    import transformers

    key = json.dumps([file_sha256(gguf), transformers.__version__, torch.__version__, prompts, new_tokens])
    cached = (
        envs.cache_root() / "reference" / f"{gguf.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    )
    if cached.is_file():
        return json.loads(cached.read_text())
    answers = _compute(gguf, prompts, new_tokens)
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(".partial")
    partial.write_text(json.dumps(answers))
    partial.replace(cached)
    return answers


def _compute(gguf: Path, prompts: list[Prompt], new_tokens: int) -> list[dict[str, Any]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = dict(gguf_file=gguf.name, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), **where)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), dtype=torch.float32, attn_implementation="eager", **where
    ).eval()
    answers = []
    with torch.no_grad():
        for text, special in prompts:
            ids = tok(text, add_special_tokens=special).input_ids
            out = model(input_ids=torch.tensor([ids]), use_cache=True)
            tokens: list[int] = []
            logprobs: list[float] = []
            for _ in range(new_tokens):
                logits = out.logits[0, -1].float()
                chosen = int(logits.argmax())
                tokens.append(chosen)
                logprobs.append(float(torch.log_softmax(logits, -1)[chosen]))
                out = model(input_ids=torch.tensor([[chosen]]), cache=out.cache, use_cache=True)
            answers.append({"prompt_ids": ids, "tokens": tokens, "logprobs": logprobs})
    return answers
