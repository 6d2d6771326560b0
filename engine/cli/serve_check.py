"""A `pagoda serve` command line checked as the real start would check it, given the model's shape and GPU.

The command goes through serve's own parser (serve_args) and EngineConfig; the model's shape is `--model-shape`
(config.json keys) and the device memory the GPU catalogue's for `--gpu` (or what the caller measured); the
start-up arithmetic is the engine's own (pagoda.engine.sizing.engine_plan). The operator runs this on every
pod it renders, so no invalid spec becomes a pod: this module and everything it imports is torch-free (the
operator image has no torch; the import contract in pyproject.toml checks it). `pagoda serve --dry-run`
(dry_run.py) adds what needs the machine: reading the model's files and measuring a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pagoda.engine.cli import serve_args
from pagoda.engine.config import EngineConfig
from pagoda.engine.sizing import GPUInfo, ModelShape, SizingError, gpu_info, shape_from_config
from pagoda.engine.sizing.architectures import architecture
from pagoda.engine.sizing.engine_plan import (
    EnginePlan,
    check_tensor_parallel,
    engine_plan,
    gpu_kv_budget,
    kv_bytes_per_token,
    profile_tokens,
    resolve_dtype_name,
)
from pagoda.engine.sizing.errors import UnsupportedOnGPU
from pagoda.engine.sizing.gpus import check_dtypes
from pagoda.engine.sizing.host_memory import cpu_kv_cache_bytes
from pagoda.engine.sizing.kv_dtypes import kv_cache_dtype
from pagoda.engine.sizing.kv_split import engine_sliding_layout
from pagoda.engine.sizing.planner import activation_bytes, cuda_context_bytes
from pagoda.engine.sizing.shapes import check_published_config, dtype_bytes
from pagoda.engine.sizing.stages import max_stage_layers, stage_layers, stage_weight_bytes, stages_report
from pagoda.engine.sizing.weight_format import WeightFormat, held_quantized
from pagoda.engine.sizing.windows import shape_windows


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
    pipeline: dict[str, Any] | None = None  # pipeline parallelism / several hosts: the stages (stages.py)

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
            **({"pipeline": self.pipeline} if self.pipeline is not None else {}),
        }


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
        # the family (its dtype rule, its per-layer windows) and the attention facts the kernels specialise on
        **({"model_type": architecture(shape.architecture).model_types[0]} if shape.architecture else {}),
        **({"sliding_window": shape.sliding_window} if shape.sliding_window else {}),
        **({"attn_logit_softcapping": shape.attn_logit_softcapping} if shape.attn_logit_softcapping else {}),
        # a quantized checkpoint's linears as sizing counted them (engine/sizing/weight_format.py)
        **({"weight_format": _weight_format(shape)} if shape.weight_format else {}),
    }


def _weight_format(shape: ModelShape) -> dict[str, Any]:
    return {
        "format": shape.weight_format,
        "label": shape.weight_format_label,
        "quantized_params": shape.quantized_params,
        "quantized_bytes": shape.quantized_bytes,
        "extra_bytes": shape.quantized_extra_bytes,
    }


def facts(shape: ModelShape, shape_from: str, path: str | None, checkpoint_dtype: str | None) -> ModelFacts:
    """The facts of a shape, as sizing read it."""
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


def given_shape(text: str) -> ModelFacts:
    """The facts of `--model-shape` (config.json keys, inline or in a file)."""
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
    fmt = data.get("weight_format")
    if isinstance(fmt, dict):
        try:
            shape = shape.with_weight_format(
                WeightFormat(str(fmt["format"]), str(fmt.get("label") or fmt["format"]),
                             int(fmt["quantized_params"]), int(fmt["quantized_bytes"]),
                             int(fmt.get("extra_bytes") or 0))
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise DryRunError(f"error: --model-shape weight_format is not readable ({exc!r})") from None
    dtype = data.get("torch_dtype") or data.get("dtype")
    return facts(shape, "--model-shape", None, str(dtype) if dtype else None)


def lookup_gpu(text: str) -> GPUInfo:
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


def _device_index(device: str) -> int:
    return int(device.split(":", 1)[1]) if ":" in device else 0


def check_published(model: str | None) -> None:
    """Refuse a catalogue hub id whose published checkpoint the engine refuses (Gemma 3 4B-27B are multimodal),
    with the engine's own message, where its config.json is not at hand (the operator, a dry run without the
    weights); a local path is read for itself."""
    if not model or model.count("/") != 1 or Path(model).expanduser().exists():
        return
    try:
        check_published_config(model)
    except SizingError as exc:
        raise DryRunError(f"cannot start the engine: {exc}") from None


def check_args(
    args: argparse.Namespace,
    config: EngineConfig,
    server: dict[str, Any],
    model: ModelFacts,
    cuda: Any = None,
) -> DryRunReport:
    """The start-up checks and arithmetic of parsed arguments for a model of `model`'s facts; `cuda`: torch.cuda
    where the caller measured a GPU (dry_run.py), else the memory comes from `--gpu` or this host's RAM.
    Raises DryRunError where the real start would fail."""
    warnings: list[str] = list(getattr(args, "compat_warnings", ()))  # vLLM flags accepted and ignored
    check_published(config.model)
    tp = config.tensor_parallel_size
    try:
        check_tensor_parallel(model.num_heads, tp)
    except ValueError as exc:
        raise DryRunError(f"cannot start the engine: {exc}") from None
    if tp * config.pipeline_parallel_size * config.nnodes > 1 and (
        config.kv_offload_disk_dir or config.kv_offload_host_bytes
    ):
        warnings.append(
            "KV offload tiers are not supported with tensor or pipeline parallelism yet; tiers are off"
        )

    gpu = lookup_gpu(args.gpu) if args.gpu else None
    if gpu is not None and config.device == "cpu":
        raise DryRunError("error: --gpu names a GPU but --device is cpu")
    device = "cuda" if gpu is not None or cuda is not None or config.device.startswith("cuda") else "cpu"

    cc = (
        gpu.compute_capability if gpu is not None and gpu.compute_capability != (0, 0) else None
    )  # (0, 0): unknown
    try:
        dtype = resolve_dtype_name(config.dtype, device, model.checkpoint_dtype, cc, model.shape.float16)
    except ValueError as exc:  # float16 for a family that overflows it, refused as the real start does
        raise DryRunError(f"cannot start the engine: {exc}") from None
    kv = kv_cache_dtype(config.kv_cache_dtype, dtype)
    pp = config.pipeline_parallel_size
    try:
        stage_layers(model.num_layers, pp)
    except ValueError as exc:
        raise DryRunError(f"cannot start the engine: {exc}") from None
    kv_bpt = kv_bytes_per_token(
        max_stage_layers(model.num_layers, pp),  # the largest stage's layers size every stage's blocks
        model.num_heads,
        model.num_kv_heads,
        model.head_dim,
        kv.element_bytes,
        tp,
        kv.scale_bytes,
    )
    quantized = held_quantized(model.shape.weight_format, device, getattr(config, "quantization", None))
    weights = -(-model.shape.weight_bytes_as(dtype, quantized) // tp)
    stage_weights = [weights * tp]
    if pp > 1:  # every rank holds its stage's layers only: the largest stage's share sizes a GPU
        stage_weights = stage_weight_bytes(
            model.shape.weight_bytes_as(dtype, quantized),
            model.num_layers,
            pp,
            model.shape.vocab_size,
            model.shape.hidden_size,
            dtype_bytes(dtype),
            model.shape.tie_word_embeddings,
        )
        weights = -(-max(stage_weights) // tp)
    host_ranks = tp * pp // config.nnodes
    info: dict[str, Any] = {
        "type": device,
        "dtype": dtype,
        "kv_cache_dtype": kv.torch_dtype,
        "tensor_parallel_size": tp,
        "gpu": None,
        "memory_measured": False,
        "weights_bytes_estimated": weights,
        "weight_format": model.shape.weights_in_words(dtype, quantized),
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
        kv_memory, source = cpu_kv_cache_bytes(host_ranks), "this machine's available RAM"
        info["memory_measured"] = True
        warnings.append("on CPU the KV cache is sized from the available RAM where the engine starts")
    else:
        tokens = profile_tokens(
            config.max_num_batched_tokens,
            model.max_position_embeddings,
            enable_chunked_prefill=config.enable_chunked_prefill,
            max_model_len=config.max_model_len,
        )
        act = activation_bytes(model.shape, tokens, 1, tp, dtype)  # as the engine profiles it (no scratch KV)
        info["activation_bytes_estimated"] = act
        if cuda is not None:
            index = _device_index(config.device)
            if host_ranks > cuda.device_count():
                raise DryRunError(
                    f"cannot start the engine: {host_ranks} ranks on this host (tensor x pipeline parallel size "
                    f"/ nnodes) need {host_ranks} GPUs, {cuda.device_count()} visible"
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
            sliding, info["window_cache"] = engine_sliding_layout(config, shape_windows(model.shape))
            plan = engine_plan(
                config,
                sliding=sliding,
                model_max_len=model.max_position_embeddings,
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
    pipeline = None
    if pp > 1 or config.nnodes > 1:
        per_layer = kv_bpt // max_stage_layers(model.num_layers, pp)
        pipeline = {
            "pipeline_parallel_size": pp,
            "tensor_parallel_size": tp,
            "world_size": tp * pp,
            "nnodes": config.nnodes,
            "node_rank": config.node_rank,
            "headless": config.headless,
            "master": f"{config.master_addr}:{config.master_port}",
            "micro_batches_per_step": pp,
            "stages": stages_report(
                model.num_layers,
                tp,
                pp,
                config.nnodes,
                config.node_rank,
                per_layer,
                stage_weights,
                plan.num_blocks if plan is not None else None,
                config.block_size,
            ),
        }
    return DryRunReport(config, server, model, info, plan, warnings, pipeline)


def server_summary(settings: Any) -> dict[str, Any]:
    """The server settings for the report, the API key reduced to whether one is set."""
    out = asdict(settings)
    out["api_key"] = "(set)" if out.get("api_key") else None
    return out


def parse(argv: list[str]) -> argparse.Namespace:
    """serve's own parsing of a command line (without the program name); a DryRunError where it would exit."""
    try:
        return serve_args.parse_args(list(argv), exit_on_error=False)
    except (serve_args.UnknownFlagError, argparse.ArgumentError) as exc:
        raise DryRunError(f"error: {exc}") from None
    except SystemExit as exc:  # --help, or an argparse error that always exits
        raise DryRunError(f"error: the command line exits before starting (status {exc.code})") from None


def configure(args: argparse.Namespace) -> tuple[EngineConfig, dict[str, Any]]:
    """The EngineConfig and server settings of parsed arguments, validated as the real start validates them."""
    try:
        config = EngineConfig(**serve_args.engine_config_kwargs(args))
        settings = serve_args.server_settings(args)
    except ValueError as exc:
        raise DryRunError(f"error: {exc}") from None
    return config, server_summary(settings)


def check(argv: list[str]) -> DryRunReport:
    """The check of a `pagoda serve` command line that carries `--model-shape` (what the operator renders), in
    this process and without torch. Raises DryRunError where the real start would fail."""
    args = parse(argv)
    config, server = configure(args)
    if args.model_shape is None:
        raise DryRunError(
            "error: checking a command without reading the model needs --model-shape (`pagoda serve --dry-run` "
            "reads the model's files)"
        )
    return check_args(args, config, server, given_shape(args.model_shape))
