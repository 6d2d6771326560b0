"""The HF parity prompts (raw text and chat questions), shared by the parity test, the bfloat16 test and
`make bench-kv-accuracy`, tokenised one way everywhere."""

from __future__ import annotations

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "import numpy as np\n\nx = np.",
    "Water boils at a temperature of",
    "The quick brown fox",
    "List of planets in the solar system: Mercury,",
    "In 1492, Christopher Columbus",
    "Photosynthesis is the process by which",
    "SELECT name FROM users WHERE",
    "Les fleurs du jardin sont",
]
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion in one sentence.",
    "How many legs does a spider have?",
    "Give me three tips for better sleep.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Name a famous painting by Leonardo da Vinci.",
]


def parity_prompts(tokenizer) -> list[list[int]]:
    """Token ids of every prompt: raw prompts as the tokenizer encodes them, chat questions through the
    model's chat template with the generation prompt."""
    prompts = [tokenizer(p).input_ids for p in RAW_PROMPTS]
    for q in CHAT_PROMPTS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        prompts.append(tokenizer(text, add_special_tokens=False).input_ids)
    return prompts
