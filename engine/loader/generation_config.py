"""A model folder's generation_config.json, read as vLLM reads it (`--generation-config auto|vllm|DIR`).

Two things come from it: extra end-of-sequence ids (its `eos_token_id`, an id or a list, joins the stop ids
of config.json and the tokenizer), and sampling defaults (temperature, top_p, top_k, min_p,
repetition_penalty) that apply to requests that do not set them. Torch-free, and it never fails a start over
a missing file; an unreadable one is an error that names it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FILE = "generation_config.json"
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
AUTO, NONE = "auto", "vllm"


def generation_config_dir(setting: str | None, model_path: str | Path) -> Path | None:
    """The folder to read generation_config.json from: the model's (auto), none (vllm), or DIR; a GGUF
    file's folder has none of its own."""
    if setting in (None, "", NONE):
        return None
    if setting == AUTO:
        path = Path(model_path)
        return path if path.is_dir() else None
    path = Path(setting).expanduser()
    if not path.is_dir():
        raise ValueError(f"--generation-config {setting!r} is not 'auto', 'vllm' or a directory")
    return path


def read_generation_config(setting: str | None, model_path: str | Path) -> dict[str, Any]:
    """The file's contents ({} where there is none to read)."""
    folder = generation_config_dir(setting, model_path)
    if folder is None or not (folder / FILE).is_file():
        return {}
    try:
        body = json.loads((folder / FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{folder / FILE} cannot be read: {exc}") from exc
    return body if isinstance(body, dict) else {}


def eos_token_ids(body: dict[str, Any]) -> list[int]:
    """Its eos_token_id as a list."""
    eos = body.get("eos_token_id")
    if isinstance(eos, int) and not isinstance(eos, bool):
        return [eos]
    if isinstance(eos, list):
        return [e for e in eos if isinstance(e, int) and not isinstance(e, bool)]
    return []


def sampling_defaults(body: dict[str, Any]) -> dict[str, float | int]:
    """The sampling values it recommends, by SamplingParams' names (those it gives, with a number)."""
    out: dict[str, float | int] = {}
    for key in SAMPLING_KEYS:
        value = body.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = value
    return out
