"""`pagoda serve ARGS --dry-run`: what the real start would decide, without loading a single weight.

The configuration goes through the real start's parser and EngineConfig; the model's shape comes from its
config.json and safetensors headers, its GGUF metadata, or `--model-shape`; the start-up arithmetic is the
engine's own (pagoda.engine.sizing.engine_plan), fed with the device memory: measured where a CUDA GPU is
present, the GPU catalogue's for `--gpu`, this machine's RAM on CPU. The weights and the activation peak are
estimated (the real start measures them), so a pass here is a strong hint, not a guarantee.

What needs no machine (parsing, validation, the arithmetic for a given shape and GPU) is serve_check, which the
operator runs on every pod it renders; this module adds reading the model's files and measuring a CUDA GPU
(torch is imported only for that, and only where it is installed).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from typing import Any

from pagoda.engine.cli.serve_check import (
    DryRunError,
    DryRunReport,
    ModelFacts,
    check_args,
    check_published,
    configure,
    facts,
    given_shape,
    parse,
    shape_config,
)
from pagoda.engine.config import EngineConfig
from pagoda.engine.sizing import shape_from_path, well_known_shape
from pagoda.engine.sizing.architectures import from_gguf
from pagoda.engine.sizing.model_config import ModelConfig

__all__ = [
    "DryRunError",
    "DryRunReport",
    "ModelFacts",
    "check",
    "check_parsed",
    "model_facts",
    "shape_config",
]


def _gguf_facts(path: Path) -> ModelFacts:
    from pagoda.engine.sizing.gguf_meta import read_gguf_meta

    from_gguf(read_gguf_meta(path).get("general.architecture"), str(path))
    return facts(shape_from_path(path), "gguf metadata", str(path), "float16")


def _dir_facts(path: Path) -> ModelFacts:
    shape = shape_from_path(path)
    found = facts(shape, "config.json + safetensors headers", str(path), None)
    mc = ModelConfig.from_hf_config(
        json.loads((path / "config.json").read_text())
    )  # the engine's own reading
    found.num_heads, found.num_kv_heads, found.head_dim = (
        mc.num_attention_heads,
        mc.num_key_value_heads,
        mc.head_dim,
    )
    found.num_layers, found.max_position_embeddings = mc.num_hidden_layers, mc.max_position_embeddings
    found.checkpoint_dtype = mc.torch_dtype
    return found


def model_facts(config: EngineConfig, model_shape: str | None, warnings: list[str]) -> ModelFacts:
    """The model's shape as the real start would read it; a DryRunError where it would fail."""
    if model_shape is not None:
        return given_shape(model_shape)
    from pagoda.engine.loader.resolve import ModelNotFoundError, is_hub_id, locate_model

    try:
        path = locate_model(config.model, config.revision)
    except ModelNotFoundError as exc:
        # Checking a pod's command before deploying, where the weights are not: a model Pagoda knows by its
        # hub id is sized from its published shape, as the operator sizes it; one the engine does not run
        # (a quantized checkpoint named after a catalogue model) is refused as the operator refuses it.
        check_published(config.model)
        known = well_known_shape(config.model) if config.model and is_hub_id(config.model) else None
        if known is None:
            raise DryRunError(
                f"cannot start the engine: {exc} (for a dry run without the weights, pass --model-shape)"
            ) from None
        warnings.append(
            f"{config.model} is not in the local Hugging Face cache: its shape comes from Pagoda's catalogue of "
            "known models; the real start needs the weights there"
        )
        return facts(known, "catalogue of known models", None, known.dtype)
    except (ValueError, OSError) as exc:
        raise DryRunError(f"cannot start the engine: {exc}") from None
    try:
        if config.revision is not None and (config.model is None or Path(config.model).expanduser().exists()):
            warnings.append(f"--revision {config.revision} does not apply to a local model, served as it is")
        if path.is_file():
            return _gguf_facts(path)
        return _dir_facts(path)
    except (ValueError, OSError) as exc:
        raise DryRunError(f"cannot start the engine: {exc}") from None


def _cuda() -> Any:
    """torch.cuda when torch is installed and sees a GPU; None otherwise (torch is never required)."""
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    return torch.cuda if torch.cuda.is_available() else None


def check(argv: list[str]) -> DryRunReport:
    """The dry run of a `pagoda serve` command line (without the program name), in this process: the same
    parser, EngineConfig and start-up arithmetic as the real start. Raises DryRunError where it would fail."""
    return check_parsed(parse(argv))


def check_parsed(args: argparse.Namespace) -> DryRunReport:
    config, server = configure(args)
    warnings: list[str] = []
    model = model_facts(config, args.model_shape, warnings)
    cuda = None if args.gpu or config.device == "cpu" else _cuda()
    report = check_args(args, config, server, model, cuda)
    report.warnings[:0] = warnings
    return report
