"""Tokenizer from local files only (no hub access, no remote code)."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(path: str | Path):
    """A fast tokenizer with the directory's chat template."""
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise ValueError(
            f"model directory {str(path)!r} has no tokenizer.json (Pagoda needs a fast tokenizer)"
        )
    return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
