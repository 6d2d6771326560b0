"""Tokenizer from local files only (no hub access, no remote code)."""

from __future__ import annotations

from pathlib import Path


def tokenizer_path(tokenizer: str | None, model_path: str | Path) -> str | Path:
    """Where the tokenizer is read from: --tokenizer (a directory, or a hub id with a local copy) where it
    is given, else the model's own folder."""
    if not tokenizer:
        return model_path
    if Path(tokenizer).expanduser().is_dir():  # a tokenizer folder needs no config.json or weights
        return Path(tokenizer).expanduser()
    from pagoda.engine.loader.resolve import resolve_model

    return resolve_model(tokenizer)


def load_tokenizer(path: str | Path):
    """A fast tokenizer with the directory's chat template."""
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise ValueError(
            f"model directory {str(path)!r} has no tokenizer.json (Pagoda needs a fast tokenizer)"
        )
    return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
