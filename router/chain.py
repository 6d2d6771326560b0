"""A request's block-hash chain, computed exactly as the engine computes it.

The engine renders chat messages with the model's chat template, tokenizes without special tokens
(completions: a text prompt with them), and hashes every full block with
pagoda.engine.kv_cache.hashing and the extra keys it publishes in /v1/router_info. The router does the same
with the same tokenizer files (the engines' model source, read locally; transformers runs without torch).
Where no local tokenizer can be had it asks a replica's /tokenize.
"""

from __future__ import annotations

import logging
import os
import re
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path
from typing import Any

from pagoda.engine.kv_cache.hashing import encode_extra_keys, hash_full_blocks

log = logging.getLogger("pagoda.router")


def find_tokenizer_dir(source: str | None) -> Path | None:
    """The directory with tokenizer.json for a model source as the engine takes it (None = the embedded
    default), without converting anything: a GGUF must have been converted by an engine on this machine
    (its directory in the Pagoda cache names the GGUF in pagoda_source.json)."""
    import json

    from pagoda.engine import envs
    from pagoda.engine.loader.resolve import locate_model

    try:
        path = locate_model(source)
    except Exception as exc:  # noqa: BLE001 - any lookup failure means "ask a replica"
        log.info("no local model for %r: %s", source, exc)
        return None
    if path.is_dir():
        return path if (path / "tokenizer.json").is_file() else None
    cache = envs.cache_root()
    if not cache.is_dir():
        return None
    # The engine's own conversion of this file by this converter version first; then any conversion of the
    # same content (the same file installed in another environment has another path).
    from pagoda.engine.loader.gguf_cache import converted_dir

    current = converted_dir(path, cache)
    if (current / "tokenizer.json").is_file():
        return current
    content: str | None = None
    for meta in cache.glob("*/pagoda_source.json"):
        try:
            source = json.loads(meta.read_text())
            if not (meta.parent / "tokenizer.json").is_file():
                continue
            if os.path.exists(source["gguf"]) and os.path.samefile(source["gguf"], path):
                return meta.parent
            if content is None:
                from pagoda.engine.loader.content_hash import file_sha256

                content = file_sha256(path)
            if source.get("gguf_sha256") == content:
                return meta.parent
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def load_local_tokenizer(source: str | None) -> Any | None:
    if source == "backend":
        return None
    where = find_tokenizer_dir(source)
    if where is None:
        return None
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        return PreTrainedTokenizerFast.from_pretrained(str(where), local_files_only=True)
    except Exception as exc:  # noqa: BLE001
        log.warning("cannot load the tokenizer from %s (%s); asking the replicas instead", where, exc)
        return None


def render_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The dicts the engine hands to the chat template (engine/server/serving.py: render_chat)."""
    out = []
    for m in messages:
        content = m.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            text = "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
        role = m.get("role")
        d: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": text}
        if m.get("name"):
            d["name"] = m["name"]
        out.append(d)
    return out


class ChainHasher:
    """Token ids of a request body as the engine computes them.

    A chat prompt is cut at the tokenizer's added tokens (``<|im_start|>`` ...), which the tokenizer also
    splits on before anything else, and each piece between them is encoded once and remembered: a
    conversation re-sends the same system prompt and history every turn, so only the new turn costs
    anything. A self-check at start falls back to whole-text encoding if the pieces ever disagree.
    """

    def __init__(self, tokenizer: Any | None, cache_size: int = 4096) -> None:
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._split: re.Pattern[str] | None = None
        self._special: dict[str, int] = {}
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        self._cache_size = cache_size
        if self._backend is not None:
            added = {t.content: i for i, t in self._backend.get_added_tokens_decoder().items()}
            if added:
                self._special = added
                self._split = re.compile(
                    "(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")"
                )
                if not self._self_check():
                    log.warning("piecewise tokenizing disagrees with the tokenizer; encoding whole prompts")
                    self._split = None

    def _self_check(self) -> bool:
        sample = "".join(
            f"{tok}user\nHello, {tok[::-1]} world!  \n\tx{tok}" for tok in list(self._special)[:8]
        )
        sample += " trailing text ok"
        return self._encode_pieces(sample) == self._backend.encode(sample, add_special_tokens=False).ids

    def _encode_pieces(self, text: str) -> list[int]:
        assert self._split is not None
        out: list[int] = []
        for piece in self._split.split(text):
            if not piece:
                continue
            special = self._special.get(piece)
            if special is not None:
                out.append(special)
                continue
            ids = self._pieces.get(piece)
            if ids is None:
                ids = self._encode_new_piece(piece)
                self._pieces[piece] = ids
                if len(self._pieces) > self._cache_size:
                    self._pieces.popitem(last=False)
            else:
                self._pieces.move_to_end(piece)
            out.extend(ids)
        return out

    def _encode_new_piece(self, piece: str) -> list[int]:
        """The ids of a piece not seen before. ``encode_batch_fast`` (tokenizers >= 0.21) skips the character
        offsets, which the router never reads: a quarter less time for a new 500-token system prompt, the
        routing path's most expensive step. Checked against ``encode`` at start (``_self_check``)."""
        fast = getattr(self._backend, "encode_batch_fast", None)
        if fast is not None:
            return fast([piece], add_special_tokens=False)[0].ids
        return self._backend.encode(piece, add_special_tokens=False).ids

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """The fast tokenizer's Rust encoder directly: the same ids, without the Python wrapper's cost."""
        if not add_special_tokens and self._split is not None:
            return self._encode_pieces(text)
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """None when the prompt cannot be tokenized here (then the caller may ask a replica)."""
        if path.endswith("/chat/completions"):
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or self.tokenizer is None:
                return None
            cont = bool(body.get("continue_final_message", False))
            try:
                text = self.tokenizer.apply_chat_template(
                    render_messages(messages),
                    add_generation_prompt=bool(body.get("add_generation_prompt", True)) and not cont,
                    continue_final_message=cont,
                    tokenize=False,
                )
                return self._encode(text, add_special_tokens=False)
            except Exception:  # noqa: BLE001 - the replica will answer the error
                return None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str) and self.tokenizer is not None:
            try:
                return self._encode(prompt, add_special_tokens=True)
            except Exception:  # noqa: BLE001
                return None
        return None


@lru_cache(maxsize=16)
def _extra(keys: tuple[str, ...]) -> bytes:
    return encode_extra_keys(keys)


def chain_of(
    token_ids: list[int], block_size: int, extra_keys: tuple[str, ...], root: bytes | None = None
) -> list[str]:
    """Hex block hashes of the full blocks of ``token_ids``, identical to the engine's; ``root``: the chain
    root of the request's LoRA adapter (what the replica publishes for it), None for the base model."""
    return [h.hex() for h in hash_full_blocks(token_ids, block_size, _extra(extra_keys), parent=root)]
