"""A GGUF model kept in its quantized blocks (`--quantization gguf`, vLLM's flag): the tensor source and the
model load.

The converter (gguf_convert.py) still makes the model's directory (config, tokenizer, float32 safetensors);
here the linear layers' weights come from the GGUF file itself instead, as blocks under their Hugging Face
names (each carrying its ggml type as ``tensor.ggml_type``), with llama.cpp's per-head interleaving of q/k
rows undone as the same permutation of block rows. Norms and embeddings come from the converted directory
(float). The LM head runs from the file's blocks too (Q8_0 in the default model: a third of the bytes read
per token there), embedding lookups from the float copy.

A linear in a ggml type the kernels do not run is refused, naming the tensor and its type: without the flag
the whole model is dequantized (the default), which runs every type.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from pagoda.engine.attention.base import AttentionBackend
from pagoda.engine.loader.gguf_convert import _hf_name, _layer_names, _unpermute
from pagoda.engine.loader.gguf_metadata import field
from pagoda.engine.loader.weights import iter_weights
from pagoda.engine.models import ModelConfig, get_model_class
from pagoda.engine.quantization.gguf_linear import KERNEL_TYPES, GGUFLinear
from pagoda.engine.quantization.scheme import QuantScheme
from pagoda.engine.sizing.architectures import from_gguf
from pagoda.kernels.gguf_reference import NAMES

log = logging.getLogger(__name__)

GGUF_SCHEME = QuantScheme(format="gguf", source="gguf")
SOURCE_FILE = "pagoda_source.json"  # written by the converter: the GGUF file a directory came from
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted model directory came from (None for a Hugging Face directory)."""
    try:
        return Path(json.loads((Path(model_dir) / SOURCE_FILE).read_text())["gguf"])
    except (OSError, ValueError, KeyError):
        return None


def _is_linear(name: str) -> bool:
    stem, _, kind = name.rpartition(".")
    module = stem.rpartition(".")[2]
    return kind == "weight" and ".layers." in f".{stem}" and (module in _LINEARS or module in _FUSED)


def _blocks(data: np.ndarray, ggml_type: int) -> torch.Tensor:
    tensor = torch.from_numpy(np.array(data, dtype=np.uint8, copy=True))
    tensor.ggml_type = ggml_type
    return tensor


def iter_gguf_blocks(gguf_path: Path, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, uint8 blocks [rows, row bytes] with ``.ggml_type``) for every linear weight of the
    file, and "lm_head.weight" for its output (or tied token embedding) matrix; fused q/k/v and gate/up
    tensors (Phi-3) come split in their parts. ValueError for a linear of a type the kernels do not run."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    arch = field(reader, "general.architecture")
    family = from_gguf(arch, str(gguf_path))
    heads = int(field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(field(reader, f"{arch}.attention.head_count_kv") or heads)
    layer_names = _layer_names(family)
    tensors = {t.name: t for t in reader.tensors}
    head = tensors.get("output.weight", tensors.get("token_embd.weight"))
    for t in reader.tensors:
        name = _hf_name(t.name, layer_names)
        if name is None or not _is_linear(name):
            continue
        ggml_type = int(t.tensor_type)
        if ggml_type not in KERNEL_TYPES:
            raise ValueError(
                f"GGUF file {str(gguf_path)!r}: tensor {t.name!r} is {t.tensor_type.name}, which "
                f"--quantization gguf does not run (it runs {', '.join(sorted(NAMES.values()))}); leave the flag "
                "out to run the model dequantized"
            )
        blocks = np.asarray(t.data)
        if family.gguf_permuted_qk and (".q_proj." in name or ".k_proj." in name):
            blocks = _unpermute(blocks, heads if ".q_proj." in name else kv_heads)
        module = name.rsplit(".", 2)[-2]
        if module in _FUSED:
            c = config
            q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            sizes = [q, kv, kv] if module == "qkv_proj" else [c.intermediate_size] * 2
            start = 0
            for part, rows in zip(_FUSED[module], sizes, strict=True):
                yield (
                    name.replace(f".{module}.", f".{part}."),
                    _blocks(blocks[start : start + rows], ggml_type),
                )
                start += rows
            continue
        yield name, _blocks(blocks, ggml_type)
    if head is not None and int(head.tensor_type) in KERNEL_TYPES:
        yield "lm_head.weight", _blocks(np.asarray(head.data), int(head.tensor_type))


def load_gguf_model(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    backend: AttentionBackend,
    progress: bool = True,
) -> tuple[torch.nn.Module, ModelConfig]:
    """Our model for a converted GGUF directory with its linears (and LM head) over the file's blocks."""
    path = Path(path)
    gguf_path = gguf_source(path)
    if gguf_path is None or not gguf_path.is_file():
        raise ValueError(
            f"--quantization gguf needs a GGUF model file; {str(path)!r} is not one's conversion"
        )
    if torch.device(device).type != "cpu":
        raise ValueError("--quantization gguf runs on the CPU only: use --device cpu, or leave the flag out")
    config = dataclasses.replace(ModelConfig.from_dir(path), quantization=GGUF_SCHEME)
    model = get_model_class(config.architecture)(config, backend, dtype=dtype, device=torch.device(device))
    blocks = dict(iter_gguf_blocks(gguf_path, config))
    head = blocks.pop("lm_head.weight", None)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in iter_weights(path, progress):
            if not _is_linear(name):
                yield name, tensor
        yield from blocks.items()

    model.load_weights(weights())
    if head is not None and hasattr(model, "lm_head_quantized"):
        lm_head = GGUFLinear(config.hidden_size, head.shape[0], False, dtype, "cpu")
        lm_head.load_part("weight", head, 0, head.shape[0])
        model.lm_head_quantized = lm_head
        if not config.tie_word_embeddings:  # the float copy is no longer read
            model.lm_head_weight.data = torch.empty(0, config.hidden_size, dtype=dtype)
    types = sorted({NAMES[t.ggml_type] for t in blocks.values()})
    log.info(
        "GGUF blocks kept quantized: %d linear weights (%s)%s",
        len(blocks),
        ", ".join(types),
        f", LM head {NAMES[head.ggml_type]}" if head is not None else "",
    )
    return model.eval(), config


def check_quantization(
    method: str | None, model_dir: Path, config: ModelConfig, device: torch.device
) -> None:
    """`--quantization` against the model: "gguf" needs a GGUF model on the CPU; another method must be the
    checkpoint's own (read from its config.json either way). ValueError saying what to pass instead."""
    if method is None:
        return
    gguf_path = gguf_source(Path(model_dir))
    if method == "gguf":
        if gguf_path is None:
            raise ValueError(
                f"--quantization gguf keeps a GGUF file's blocks; {str(model_dir)!r} is a safetensors checkpoint "
                + (
                    f"({config.quantization.label}, read from its config.json): leave the flag out"
                    if config.quantization
                    else "(not quantized): leave the flag out"
                )
            )
        if device.type != "cpu":
            raise ValueError(
                "--quantization gguf runs on the CPU only: use --device cpu, or leave the flag out"
            )
        return
    if gguf_path is not None:
        raise ValueError(
            f"--quantization {method}: the model is the GGUF file {str(gguf_path)!r}; pass --quantization gguf to "
            "keep its blocks, or leave the flag out to run it dequantized"
        )
    own = config.quantization.source if config.quantization is not None else None
    if own != method:
        what = f"{config.quantization.label}" if config.quantization is not None else "not quantized"
        raise ValueError(
            f"--quantization {method} does not match the checkpoint {str(model_dir)!r}, which is {what} (read from "
            "its config.json): leave the flag out"
        )
