"""`pagoda serve ARGS --dry-run`: what the real start would decide, without loading a single weight.

The configuration goes through the real start's parser and EngineConfig; the model's shape comes from its
config.json and safetensors headers, its GGUF metadata, or `--model-shape`; the start-up arithmetic is the
engine's own (pagoda.engine.sizing.engine_plan), fed with the device memory: measured where a CUDA GPU is
present, the GPU catalogue's for `--gpu`, this machine's RAM on CPU. The weights and the activation peak are
estimated (the real start measures them), so a pass here is a strong hint, not a guarantee.

Torch is imported only to measure a CUDA GPU: the operator runs this same check on every pod it renders
(with `--model-shape` and `--gpu` or `--device cpu`), so no invalid spec becomes a pod.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagoda.engine.config import EngineConfig
from pagoda.engine.sizing import (
    GPUInfo,
    ModelShape,
    SizingError,
    gpu_info,
    shape_from_config,
    shape_from_path,
    well_known_shape,
)
from pagoda.engine.sizing.engine_plan import (
    EnginePlan,
    check_tensor_parallel,
    engine_plan,
    gpu_kv_budget,
    kv_bytes_per_token,
    kv_dtype_name,
    kv_element_bytes,
    kv_element_scale_bytes,
    profile_tokens,
    resolve_dtype_name,
)
from pagoda.engine.sizing.errors import UnsupportedOnGPU
from pagoda.engine.sizing.gpus import check_dtypes
from pagoda.engine.sizing.planner import activation_bytes, cuda_context_bytes
from pagoda.engine.sizing.shapes import dtype_bytes

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2")  # what the GGUF converter accepts


class DryRunError(Exception):
    """The real start would refuse; the message is the line it would print (without the program name)."""


@dataclass
class ModelFacts:
    """What the engine reads from the model before loading weights."""

    shape: ModelShape
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    max_position_embeddings: int
    checkpoint_dtype: str | None
    shape_from: str
    path: str | None = None


@dataclass
class DryRunReport:
    config: EngineConfig
    server: dict[str, Any]
    model: ModelFacts
    device: dict[str, Any]
    plan: EnginePlan | None
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "dry_run": True,
            "weights_loaded": False,
            "config": self.config.to_dict(),
            "server": self.server,
            "model": {
                "argument": self.config.model,
                "revision": self.config.revision,
                "path": self.model.path,
                "shape_from": self.model.shape_from,
                "shape": self.model.shape.to_dict(),
            },
            "device": self.device,
            "fit_checked": self.plan is not None,
            "memory": self.plan.profile.to_dict() if self.plan else None,
            "plan": {k: v for k, v in self.plan.to_dict().items() if k != "profile"} if self.plan else None,
            "warnings": self.warnings,
        }


def _shape_json(text: str) -> dict[str, Any]:
    source = text
    if not text.lstrip().startswith("{"):
        try:
            source = Path(text).expanduser().read_text()
        except OSError as exc:
            raise DryRunError(
                f"error: --model-shape {text!r} is neither JSON nor a readable file ({exc})"
            ) from None
    try:
        data = json.loads(source)
    except ValueError as exc:
        raise DryRunError(f"error: --model-shape is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise DryRunError("error: --model-shape must be a JSON object")
    return data


def shape_config(shape: ModelShape) -> dict[str, Any]:
    """A ModelShape as the config.json keys `--model-shape` takes (what the operator passes)."""
    return {
        "_name_or_path": shape.name,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "torch_dtype": shape.dtype,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "num_parameters": shape.num_params,
    }


def _facts(shape: ModelShape, shape_from: str, path: str | None, checkpoint_dtype: str | None) -> ModelFacts:
    return ModelFacts(
        shape,
        shape.num_attention_heads,
        shape.num_kv_heads,
        shape.head_dim,
        shape.num_layers,
        shape.max_position_embeddings,
        checkpoint_dtype,
        shape_from,
        path,
    )


def _given_shape(text: str) -> ModelFacts:
    data = _shape_json(text)
    try:
        shape = shape_from_config(data, name=str(data.get("_name_or_path") or "model"), where="--model-shape")
    except SizingError as exc:
        raise DryRunError(f"error: {exc}") from None
    if isinstance(data.get("num_parameters"), int) and data["num_parameters"] > 0:
        n = data["num_parameters"]
        shape = ModelShape(
            **{**shape.to_dict(), "num_params": n, "weight_bytes": n * dtype_bytes(shape.dtype)}
        )
    dtype = data.get("torch_dtype") or data.get("dtype")
    return _facts(shape, "--model-shape", None, str(dtype) if dtype else None)


def _gguf_facts(path: Path) -> ModelFacts:
    from pagoda.engine.sizing.gguf_meta import read_gguf_meta

    arch = read_gguf_meta(path).get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF file {str(path)!r} has architecture {arch!r}; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    shape = shape_from_path(path)
    return _facts(shape, "gguf metadata", str(path), "float16")


def _dir_facts(path: Path, warnings: list[str]) -> ModelFacts:
    shape = shape_from_path(path)
    facts = _facts(shape, "config.json + safetensors headers", str(path), None)
    raw = json.loads((path / "config.json").read_text())
    facts.checkpoint_dtype = raw.get("torch_dtype") or raw.get("dtype")
    if importlib.util.find_spec("torch") is None:
        warnings.append("the model's architecture was not checked (the engine's model code needs torch)")
        return facts
    from pagoda.engine.models.config import ModelConfig  # the engine's own reading of config.json

    mc = ModelConfig.from_hf_config(raw)
    facts.num_heads, facts.num_kv_heads, facts.head_dim = (
        mc.num_attention_heads,
        mc.num_key_value_heads,
        mc.head_dim,
    )
    facts.num_layers, facts.max_position_embeddings = mc.num_hidden_layers, mc.max_position_embeddings
    facts.checkpoint_dtype = mc.torch_dtype
    return facts


def model_facts(config: EngineConfig, model_shape: str | None, warnings: list[str]) -> ModelFacts:
    """The model's shape as the real start would read it; a DryRunError where it would fail."""
    if model_shape is not None:
        return _given_shape(model_shape)
    from pagoda.engine.loader.resolve import ModelNotFoundError, is_hub_id, locate_model

    try:
        path = locate_model(config.model, config.revision)
    except ModelNotFoundError as exc:
        # Checking a pod's command before deploying, where the weights are not: a model Pagoda knows by its
        # hub id is sized from its published shape, as the operator sizes it.
        known = well_known_shape(config.model) if config.model and is_hub_id(config.model) else None
        if known is None:
            raise DryRunError(
                f"cannot start the engine: {exc} (for a dry run without the weights, pass --model-shape)"
            ) from None
        warnings.append(
            f"{config.model} is not in the local Hugging Face cache: its shape comes from Pagoda's catalogue of "
            "known models; the real start needs the weights there"
        )
        return _facts(known, "catalogue of known models", None, known.dtype)
    except (ValueError, OSError) as exc:
        raise DryRunError(f"cannot start the engine: {exc}") from None
    try:
        if config.revision is not None and (config.model is None or Path(config.model).expanduser().exists()):
            warnings.append(f"--revision {config.revision} does not apply to a local model, served as it is")
        if path.is_file():
            return _gguf_facts(path)
        return _dir_facts(path, warnings)
    except (ValueError, OSError) as exc:
        raise DryRunError(f"cannot start the engine: {exc}") from None


# ------------------------------------------------------------------------------------------------ device


def _cuda() -> Any:
    """torch.cuda when torch is installed and sees a GPU; None otherwise (torch is never required)."""
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    return torch.cuda if torch.cuda.is_available() else None


def _device_index(device: str) -> int:
    return int(device.split(":", 1)[1]) if ":" in device else 0


def _lookup_gpu(text: str) -> GPUInfo:
    """`PRODUCT` from the catalogue, or `PRODUCT@MiB` for the memory a node reports (any product)."""
    name, _, mib = text.partition("@")
    try:
        if not mib:
            return gpu_info(name)
        memory = int(mib)
        if memory <= 0:
            raise ValueError
    except SizingError as exc:
        raise DryRunError(f"error: --gpu: {exc}") from None
    except ValueError:
        raise DryRunError(
            f"error: --gpu {text!r}: the memory after @ must be a positive number of MiB"
        ) from None
    try:
        known = gpu_info(name)
    except SizingError:
        return GPUInfo(None, name, memory)
    return GPUInfo(known.spec, known.product_label, memory, 1, known.compute_capability, shared=known.shared)


def check_args(args: argparse.Namespace, config: EngineConfig, server: dict[str, Any]) -> DryRunReport:
    """The dry run of parsed `pagoda serve` arguments; raises DryRunError where the real start would fail."""
    warnings: list[str] = []
    facts = model_facts(config, args.model_shape, warnings)
    tp = config.tensor_parallel_size
    try:
        check_tensor_parallel(facts.num_heads, tp)
    except ValueError as exc:
        raise DryRunError(f"cannot start the engine: {exc}") from None
    if tp > 1 and (config.kv_offload_disk_dir or config.kv_offload_host_bytes):
        warnings.append("KV offload tiers are not supported with tensor parallelism yet; tiers are off")

    gpu = _lookup_gpu(args.gpu) if args.gpu else None
    if gpu is not None and config.device == "cpu":
        raise DryRunError("error: --gpu names a GPU but --device is cpu")
    cuda = None if gpu is not None or config.device == "cpu" else _cuda()
    device = "cuda" if gpu is not None or cuda is not None or config.device.startswith("cuda") else "cpu"

    cc = (
        gpu.compute_capability if gpu is not None and gpu.compute_capability != (0, 0) else None
    )  # (0, 0): unknown
    dtype = resolve_dtype_name(config.dtype, device, facts.checkpoint_dtype, cc)
    kv_bpt = kv_bytes_per_token(
        facts.num_layers,
        facts.num_heads,
        facts.num_kv_heads,
        facts.head_dim,
        kv_element_bytes(config.kv_cache_dtype, dtype),
        tp,
        kv_element_scale_bytes(config.kv_cache_dtype),
    )
    weights = -(-facts.shape.weight_bytes_as(dtype) // tp)
    info: dict[str, Any] = {
        "type": device,
        "dtype": dtype,
        "kv_cache_dtype": kv_dtype_name(config.kv_cache_dtype, dtype),
        "tensor_parallel_size": tp,
        "gpu": None,
        "memory_measured": False,
        "weights_bytes_estimated": weights,
    }
    if gpu is not None:
        info["gpu"] = gpu.name
        try:
            if cc is not None:
                check_dtypes(gpu.name, cc, dtype, config.kv_cache_dtype)
        except UnsupportedOnGPU as exc:
            raise DryRunError(f"cannot start the engine: {exc}") from None

    kv_memory, act, total, free, others, source = 0, 0, None, None, None, "none"
    if config.kv_cache_memory_bytes is not None:
        kv_memory, source = int(config.kv_cache_memory_bytes), "--kv-cache-memory-bytes"
    elif device == "cpu":
        from pagoda.engine.sizing.host_memory import cpu_kv_cache_bytes

        kv_memory, source = cpu_kv_cache_bytes(tp), "this machine's available RAM"
        info["memory_measured"] = True
        warnings.append("on CPU the KV cache is sized from the available RAM where the engine starts")
    else:
        tokens = profile_tokens(config.max_num_batched_tokens, facts.max_position_embeddings)
        act = activation_bytes(facts.shape, tokens, 1, tp, dtype)  # as the engine profiles it (no scratch KV)
        info["activation_bytes_estimated"] = act
        if cuda is not None:
            index = _device_index(config.device)
            if tp > cuda.device_count():
                raise DryRunError(
                    f"cannot start the engine: tensor_parallel_size {tp} needs {tp} GPUs, {cuda.device_count()} visible"
                )
            free, total = cuda.mem_get_info(index)
            source = f"cuda:{index} ({cuda.get_device_name(index)})"
            info["memory_measured"] = True
        elif gpu is not None:
            total = gpu.memory_bytes
            free = total - cuda_context_bytes(total, tp)
            source = f"catalogue:{gpu.name}" if "@" not in args.gpu else f"given:{gpu.name}"
        if total is not None:
            kv_memory, others = gpu_kv_budget(total, free, 0, config.gpu_memory_utilization, weights, act)
    info["memory_source"] = source
    plan = None
    if source == "none":
        warnings.append(
            "device memory not measured (no CUDA GPU here): the KV fit was not checked; pass --gpu PRODUCT to "
            "plan with the GPU catalogue's memory"
        )
    else:
        try:
            plan = engine_plan(
                config,
                model_max_len=facts.max_position_embeddings,
                kv_bytes_per_token=kv_bpt,
                kv_memory_bytes=kv_memory,
                weights_bytes=weights,
                activation_bytes=act,
                device=device,
                device_total_bytes=total,
                device_free_bytes=free,
                other_bytes=others,
                measured=False,
                source=source,
            )
        except (SizingError, ValueError) as exc:
            raise DryRunError(f"cannot start the engine: {exc}") from None
        config.max_model_len = plan.max_model_len
        config.max_num_batched_tokens = plan.max_num_batched_tokens
    return DryRunReport(config, server, facts, info, plan, warnings)


def server_summary(settings: Any) -> dict[str, Any]:
    """The server settings for the report, the API key reduced to whether one is set."""
    from dataclasses import asdict

    out = asdict(settings)
    out["api_key"] = "(set)" if out.get("api_key") else None
    return out


def check(argv: list[str]) -> DryRunReport:
    """The dry run of a `pagoda serve` command line (without the program name), in this process: the same
    parser, EngineConfig and start-up arithmetic as the real start. Raises DryRunError where it would fail."""
    from pagoda.engine.cli import serve_args as serve

    try:
        args = serve.parse_args(list(argv), exit_on_error=False)
    except (serve.UnknownFlagError, argparse.ArgumentError) as exc:
        raise DryRunError(f"error: {exc}") from None
    except SystemExit as exc:  # --help, or an argparse error that always exits
        raise DryRunError(f"error: the command line exits before starting (status {exc.code})") from None
    return check_parsed(args)


def check_parsed(args: argparse.Namespace) -> DryRunReport:
    from pagoda.engine.cli import serve_args as serve

    try:
        config = EngineConfig(**serve.engine_config_kwargs(args))
        settings = serve.server_settings(args)
    except ValueError as exc:
        raise DryRunError(f"error: {exc}") from None
    return check_args(args, config, server_summary(settings))
