"""A random-weight 2-layer Llama in float32 for tests that start engines (in process or as `pagoda serve`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def tiny_llama(out: Path, tokenizer_src: Path, vocab_size: int = 512) -> Path:
    """A random-weight 2-layer Llama (float32) with the default model's tokenizer files (``vocab_size``
    49152 covers that tokenizer, for text and chat prompts; 512 takes token-id prompts only)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.08)  # logits that are not flat: greedy ties are rare
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_src / name).exists():
            shutil.copy(tokenizer_src / name, out / name)
    return out
