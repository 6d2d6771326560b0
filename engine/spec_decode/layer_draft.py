"""A draft model cut from the target's own checkpoint: its embedding, its first N decoder layers, its final
norm and head. It shares the tokenizer by construction and needs no other download, which makes it the
draft the tests and `make bench-spec` use for the default model. Its proposals are only as good as N
layers make them; a separately trained small checkpoint of the same tokenizer usually accepts more."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_COPIED = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


def write_layer_draft(src: str | Path, dst: str | Path, num_layers: int) -> Path:
    """Write the first ``num_layers`` decoder layers of the safetensors checkpoint ``src`` (with everything
    that is not a layer) into ``dst`` as a checkpoint of its own; returns ``dst``."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    total = int(config["num_hidden_layers"])
    if not 1 <= num_layers <= total:
        raise ValueError(f"a layer draft of {src} takes 1 to {total} layers, got {num_layers}")
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                m = _LAYER.search(key)
                if m is None or int(m.group(1)) < num_layers:
                    tensors[key] = f.get_tensor(key)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config["num_hidden_layers"] = num_layers
    for key in ("layer_types", "sliding_window_pattern_layers"):
        if isinstance(config.get(key), list):
            config[key] = config[key][:num_layers]
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for name in _COPIED:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return dst
