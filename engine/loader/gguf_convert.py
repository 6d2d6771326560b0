"""GGUF -> Hugging Face directory (config.json, model.safetensors, tokenizer files), done once and cached.

Weights are dequantized with the `gguf` package and stored as float32 (lossless for every GGML type);
llama.cpp's rotary permutation of the q/k rows is undone. Config and tokenizer come from transformers'
GGUF readers (no model forward involved).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from pagoda.engine.loader.content_hash import file_sha256
from pagoda.engine.sizing.architectures import from_gguf

log = logging.getLogger(__name__)

CONVERTER_VERSION = 2

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_cache_key(path: Path) -> str:
    """Short digest of the file's whole content and the converter version: stable across copies and
    reinstalls, and new for a retrained file of the same size (the content hash is computed once, see
    content_hash)."""
    content = file_sha256(path)
    return hashlib.sha256(f"pagoda-gguf-v{CONVERTER_VERSION}:{content}".encode()).hexdigest()[:12]


def converted_dir(gguf_path: Path, cache_dir: Path) -> Path:
    return cache_dir / f"{gguf_path.stem}-{gguf_cache_key(gguf_path)}"


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Invert llama.cpp's per-head interleaving of rotary halves (rows of q_proj / k_proj)."""
    shape = w.shape
    return w.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def convert_gguf(gguf_path: Path, cache_dir: Path) -> Path:
    """Return the converted directory, converting first if no complete conversion is cached."""
    target = converted_dir(gguf_path, cache_dir)
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(cache_dir, target.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=cache_dir))
    try:
        _convert_into(gguf_path, tmp)
        try:
            os.rename(tmp, target)  # atomic: the directory appears complete or not at all
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
            # Another process finished the same conversion first; its result is as good as ours.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _remove_stale_temp_dirs(cache_dir: Path, name: str, max_age_s: float = 3600.0) -> None:
    """Temp dirs of conversions killed midway; a live conversion is younger than an hour."""
    now = time.time()
    for stale in cache_dir.glob(f".tmp-{name}-*"):
        try:
            if now - stale.stat().st_mtime > max_age_s:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass


def _convert_into(gguf_path: Path, out: Path) -> None:
    import gguf
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    reader = gguf.GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    family = from_gguf(arch, str(gguf_path))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv") or heads)

    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=f"Converting {gguf_path.name}", unit="tensor"):
        if t.name == "rope_freqs.weight":
            raise ValueError(
                f"GGUF file {str(gguf_path)!r} carries rope_freqs (Llama 3.1-style scaling baked into the file), "
                "which Pagoda does not convert; use the Hugging Face directory of this model instead"
            )
        name = _hf_name(t.name)
        if name is None:
            raise ValueError(f"GGUF file {str(gguf_path)!r} has an unexpected tensor {t.name!r}")
        w = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32, copy=True)
        if family.gguf_permuted_qk and (".q_proj." in name or ".k_proj." in name):
            w = _unpermute(w, heads if ".q_proj." in name else kv_heads)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    tied = "lm_head.weight" not in tensors
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors

    config = _hf_config(gguf_path, tied, family.hf_architectures[0])
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _write_tokenizer(gguf_path, out)
    (out / "pagoda_source.json").write_text(
        json.dumps(
            {
                "gguf": str(gguf_path),
                "gguf_sha256": file_sha256(gguf_path),
                "converter_version": CONVERTER_VERSION,
            },
            indent=2,
        )
        + "\n"
    )


def _hf_config(gguf_path: Path, tied: bool, hf_architecture: str) -> dict:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    d = cfg.to_dict()
    d.pop("_name_or_path", None)
    d.pop("_model_name_or_path", None)
    d["tie_word_embeddings"] = tied
    d["architectures"] = [hf_architecture]
    # Weights are stored as float32 (lossless dequantization); bfloat16 is what these models run in on GPU.
    d["torch_dtype"] = "bfloat16"
    d.pop("dtype", None)
    return d


def _write_tokenizer(gguf_path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )
    tok.save_pretrained(str(out))
    # Keep the chat template inside tokenizer_config.json too, where older readers look for it, and name
    # a tokenizer class every transformers version knows.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    template = tok.chat_template
    if template is None:
        raise ValueError(f"GGUF file {str(gguf_path)!r} has no chat template (tokenizer.chat_template)")
    cfg["chat_template"] = template
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("local_files_only", None)
    cfg.pop("is_local", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
