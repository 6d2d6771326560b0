"""Engine configuration: one dataclass, field names as vLLM's flags (dashes become underscores).

Every field carries its flag's help (and choices, parser, aliases) in its metadata: `pagoda serve`'s
engine flags are generated from this class (engine/cli/engine_args.py), so a default, a choice list or a
help text is stated once, here, and no flag can exist that the engine does not read.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from pagoda.engine.kv_transfer_config import KVTransferConfig, parse_kv_transfer_config
from pagoda.engine.sizing.kv_dtypes import KV_CACHE_DTYPES
from pagoda.engine.sizing.kv_split import WINDOW_CACHE_MODES
from pagoda.engine.spec_decode.config import SpeculativeConfig, parse_speculative_config

BLOCK_SIZES = (8, 16, 32, 64, 128)  # tokens per KV cache block
DTYPES = ("auto", "float32", "float16", "bfloat16", "fp32", "fp16", "bf16", "half", "float")
KV_EVICTION = ("none", "streaming")
# --quantization: vLLM's names for what Pagoda runs (engine/loader/gguf_quant.py checks them against the model)
QUANTIZATION_METHODS = ("gguf", "fp8", "awq", "gptq", "compressed-tensors")
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92  # vLLM 0.33's default
DEFAULT_STREAMING_MAX_TOKENS = 32768
MAX_LORA_RANK = 512


# A branch, tag or commit as Hugging Face names them (refs/pr/1 included); never a path that climbs out.
_REVISION = re.compile(r"^[A-Za-z0-9][\w.\-/]*$")


def check_revision(revision: str) -> str:
    """`revision` if it can name a branch, tag or commit; a ValueError naming it otherwise."""
    if not _REVISION.match(revision) or ".." in revision or revision.endswith("/"):
        raise ValueError(f"revision {revision!r} is not a branch, tag or commit name")
    return revision


def parse_lora_module(entry: str) -> tuple[str, str]:
    """One --lora-modules entry, NAME=PATH or vLLM's JSON form {"name": ..., "path": ...} -> (name, path)."""
    text = str(entry).strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError:
            raise ValueError(f"{entry!r} is not valid JSON") from None
        name, path = (obj.get("name"), obj.get("path")) if isinstance(obj, dict) else (None, None)
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"{entry!r} must be NAME=PATH")
    if not isinstance(name, str) or not isinstance(path, str) or not name.strip() or not path.strip():
        raise ValueError(f"{entry!r} must name an adapter and its path")
    return name.strip(), path.strip()


def _opt(default: Any, help: str, **flag: Any) -> Any:
    """A config field with its command-line flag's help and options (choices, parser, aliases, cli=False)."""
    return field(default=default, metadata={"help": help, **flag})


@dataclass
class EngineConfig:
    model: str | None = _opt(
        None,
        "HF directory, GGUF file or hub id with a local copy; default: the embedded SmolLM2-135M-Instruct",
        cli=False,  # `pagoda serve` takes it as the positional MODEL (or --model)
    )
    served_model_name: str | None = _opt(None, "name clients use in 'model'", cli=False)
    revision: str | None = _opt(
        None,
        "branch, tag or commit of a hub id's snapshot in the local Hugging Face cache; default: main "
        "(a local directory or GGUF file is served as it is)",
    )
    tokenizer: str | None = _opt(
        None, "directory of the tokenizer (tokenizer.json) when it is not the model's; default: the model's"
    )
    generation_config: str = _opt(
        "auto",
        "where the model's generation defaults come from: auto = generation_config.json in the model folder "
        "(its eos_token_id joins the stop ids, its temperature, top_p, top_k, min_p and repetition_penalty "
        "become the defaults of requests that do not set them); vllm = none; or a directory holding one",
    )
    max_logprobs: int = _opt(20, "most logprobs (and prompt_logprobs) a request may ask for; more is a 400")
    dtype: str = _opt(
        "auto",
        "weights and activations; auto = the checkpoint's on CUDA; on CPU bfloat16 where the CPU multiplies it "
        "natively (AVX512-BF16 or AMX), else float32",
        choices=DTYPES,
    )
    device: str = _opt("auto", "auto | cpu | cuda | cuda:N")
    block_size: int = _opt(16, "tokens per KV cache block", choices=BLOCK_SIZES)
    max_model_len: int | str | None = _opt(
        None,
        "context length: an integer (4k = 4000, 4K = 4096), 'auto' = largest that fits; default: the model's",
        parser="max_model_len",
    )
    max_num_seqs: int = _opt(256, "most sequences in one step")
    max_num_batched_tokens: int | None = _opt(None, "per-step token budget; default: 2048 (chunked prefill)")
    enable_prefix_caching: bool = _opt(True, "reuse the KV of cached prompt prefixes")
    enable_chunked_prefill: bool = _opt(True, "split long prompts across steps so decodes keep going")
    kv_cache_dtype: str = _opt(
        "auto",
        "KV cache element type (fp8 needs compute capability 8.9+; int8 with per-token scales runs anywhere)",
        choices=KV_CACHE_DTYPES,
    )
    quantization: str | None = _opt(
        None,
        "gguf: keep a GGUF model's weights in their quantized blocks, run by the CPU kernels (default: "
        "dequantized at load); fp8, awq, gptq, compressed-tensors: the checkpoint's own method, refused if it "
        "differs (a quantized checkpoint's method is read from its config.json anyway)",
        choices=QUANTIZATION_METHODS,
        aliases=("-q",),
    )
    kv_cache_memory_bytes: int | None = _opt(
        None, "KV cache size, e.g. 512MiB (overrides --gpu-memory-utilization)", parser="bytes"
    )
    gpu_memory_utilization: float = _opt(
        DEFAULT_GPU_MEMORY_UTILIZATION,
        "share of the GPU's memory the engine may use (weights, activations, KV)",
    )
    swap_space: float | None = _opt(
        None,
        "host RAM (GiB) for the host KV tier, which also holds preempted sequences' KV under "
        "--preemption-mode swap; default: sized from the machine (ignored when --kv-offload-host-bytes is set)",
    )
    scheduling_policy: str = _opt("fcfs", "order of admission and preemption", choices=("fcfs", "priority"))
    preemption_mode: str = _opt(
        "recompute", "what a preempted sequence's KV becomes", choices=("recompute", "swap")
    )
    attention_backend: str = _opt(
        "auto", "paged attention implementation", choices=("auto", "torch", "triton")
    )
    tensor_parallel_size: int = _opt(
        1,
        "ranks per model replica (one process and GPU each; gloo over CPU cores without a GPU)",
        aliases=("-tp",),
    )
    pipeline_parallel_size: int = _opt(
        1,
        "pipeline stages per model replica: the layers split into this many stages, each a tensor-parallel "
        "group of its own, with micro-batches in flight so stages overlap (gloo over CPU cores without a GPU)",
        aliases=("-pp",),
    )
    nnodes: int = _opt(
        1,
        "hosts (pods) one replica spans, each running the same number of ranks; the operator renders a "
        "LeaderWorkerSet for more than one",
    )
    node_rank: int = _opt(0, "this host's index among --nnodes; 0 is the leader, which serves the API")
    master_addr: str = _opt("127.0.0.1", "address of the leader (node rank 0), where every rank meets")
    master_port: int = _opt(29501, "port on the leader where the ranks of a replica spanning hosts meet")
    headless: bool = _opt(
        False, "run this host's ranks without the API server (every host but the leader, --node-rank > 0)"
    )
    seed: int = _opt(0, "seed of the default random generator")
    kv_offload_host_bytes: int | None = _opt(None, "host-RAM KV tier size, e.g. 8GiB", parser="bytes")
    kv_offload_disk_dir: str | None = _opt(None, "directory of the disk KV tier (e.g. an NVMe volume)")
    kv_offload_disk_bytes: int | None = _opt(None, "disk KV tier size, e.g. 100GiB", parser="bytes")
    kv_eviction: str = _opt(
        "none",
        "what a sequence at max-model-len does: none = stop (finish_reason length); streaming = keep the "
        "first --kv-sink-tokens and the last --kv-window-tokens in the KV cache and go on (attention sinks); "
        "requests may also opt in with kv_eviction in their body (--kv-eviction-per-request)",
        choices=KV_EVICTION,
    )
    kv_eviction_per_request: bool = _opt(
        True,
        "let a request opt into streaming eviction with kv_eviction: streaming in its body; with "
        "--no-kv-eviction-per-request such a request is a 400 (unless --kv-eviction streaming applies to all)",
    )
    kv_eviction_max_tokens: int = _opt(
        DEFAULT_STREAMING_MAX_TOKENS,
        "most tokens a request under streaming eviction may ask for (max_tokens; more is a 400), never less "
        "than max-model-len leaves it: its token ids, text and logprobs grow in host memory as it runs",
    )
    kv_sink_tokens: int = _opt(
        16, "attention-sink tokens kept for good under streaming eviction (rounded up to whole blocks)"
    )
    kv_window_tokens: int | None = _opt(
        None,
        "most recent tokens kept under streaming eviction (blocks between sinks and window are freed); "
        "default: max-model-len minus twice the sink blocks (the sinks are kept as written and as rotated)",
    )
    sliding_window_cache: str = _opt(
        "auto",
        "auto: a model with sliding-window layers (Gemma 2/3 beside full-attention ones, Mistral v0.1 on every "
        "layer) keeps, for its sliding layers, only the blocks still in their window (a KV pool sized for the "
        "window: more sequences fit), unless KV offload tiers, swap preemption or --kv-eviction streaming are asked for; "
        "off: every layer keeps every block",
        choices=WINDOW_CACHE_MODES,
    )
    enable_partial_prefix_reuse: bool = _opt(
        True,
        "on a prefix hit, also reuse the matching first tokens of a cached block after the last whole-block "
        "match (copied into a fresh block)",
    )
    enforce_eager: bool = _opt(
        False,
        "never record CUDA graphs: run every decode step eagerly (graphs are recorded on CUDA with the triton "
        "attention backend, on every tensor-parallel rank)",
    )
    async_scheduling: bool = _opt(
        False,
        "plan step N+1 while step N runs (its device side on a thread of its own); the same tokens as "
        "without; steps whose tokens decide the next (grammars, n > 1 forks, prompt logprobs, attention "
        "sinks) are planned after them; not with tensor parallelism or LoRA",
    )
    speculative_config: str | None = _opt(
        None,
        'speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5} (prompt lookup, no extra weights), or '
        '{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4} (a smaller model sharing the '
        "target's tokenizer, with a KV cache of its own); greedy output is unchanged token for token, "
        "sampled output keeps its distribution; requests with penalties, "
        "logit_bias, logprobs, a grammar, n > 1 or stop strings decode without it; off above 4 running "
        "sequences unless num_speculative_tokens_per_batch_size says otherwise; not with "
        "--async-scheduling, tensor parallelism or LoRA",
    )
    kv_transfer_config: str | None = _opt(
        None,
        'prefill/decode disaggregation, vLLM\'s JSON: {"kv_connector": "PagodaConnector", "kv_role": '
        '"kv_producer" | "kv_consumer" | "kv_both", "kv_port": 14579}: a producer prefills and serves the '
        "finished blocks on kv_port, a consumer fetches them (TCP) and decodes; a failed transfer falls back "
        "to a local prefill (NixlConnector is read as Pagoda's transfer)",
    )
    profile_on_cpu: bool = _opt(
        False,
        "run the start-up profiling forward on CPU too (every rank, as on CUDA); nothing is measured there "
        "(the KV cache is sized from host memory), so this only walks the GPU's start-up path (tests)",
    )
    skip_tokenizer_init: bool = _opt(
        False, "do not load the tokenizer: prompts must be token ids, outputs carry no text"
    )
    enable_lora: bool = _opt(
        False,
        "serve LoRA adapters (PEFT directories) next to the base model: a request picks one by its 'model' "
        "name; load them with --lora-modules or POST /v1/load_lora_adapter",
    )
    max_loras: int = _opt(
        1, "LoRA adapters one step may mix (device slots; others wait in host memory, swapped in LRU)"
    )
    max_lora_rank: int = _opt(16, "largest LoRA rank an adapter may have (each slot is this wide)")
    lora_modules: list[str] | None = _opt(
        None,
        'LoRA adapters to load at start: NAME=PATH (a PEFT directory), or JSON {"name": ..., "path": ...}; '
        "several may follow one flag",
        nargs="+",
    )
    max_cpu_loras: int | None = _opt(
        None,
        "most LoRA adapters loaded at once (each held in host memory; a load past it is refused until one "
        "is unloaded); default: the larger of --max-loras and the number of --lora-modules",
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if self.revision is not None:
            try:
                check_revision(self.revision)
            except ValueError:
                bad("revision", "must name a branch, tag or commit")
        if self.block_size not in BLOCK_SIZES:
            bad("block_size", f"must be one of {', '.join(map(str, BLOCK_SIZES))}")
        if isinstance(self.max_model_len, str) and self.max_model_len != "auto":
            try:
                self.max_model_len = int(self.max_model_len)
            except ValueError:
                bad("max_model_len", "must be an integer or 'auto'")
        if isinstance(self.max_model_len, int) and self.max_model_len < 1:
            bad("max_model_len", "must be at least 1")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            bad("max_logprobs", "must be a non-negative integer")
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(
            os.path.expanduser(str(self.generation_config or ""))
        ):
            bad(
                "generation_config",
                "must be 'auto', 'vllm' or a directory (that holds generation_config.json)",
            )
        if self.max_num_seqs < 1:
            bad("max_num_seqs", "must be at least 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            bad("max_num_batched_tokens", "must be at least 1")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            bad("kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}")
        if self.dtype not in DTYPES:
            bad("dtype", f"must be one of {', '.join(DTYPES)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            bad("gpu_memory_utilization", "must be in (0, 1]")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            bad("kv_cache_memory_bytes", "must be positive")
        if self.swap_space is not None and self.swap_space < 0:
            bad("swap_space", "must be non-negative")
        if self.scheduling_policy not in ("fcfs", "priority"):
            bad("scheduling_policy", "must be 'fcfs' or 'priority'")
        if self.preemption_mode not in ("recompute", "swap"):
            bad("preemption_mode", "must be 'recompute' or 'swap'")
        if self.attention_backend not in ("auto", "torch", "triton"):
            bad("attention_backend", "must be 'auto', 'torch' or 'triton'")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            bad("device", "must be 'auto', 'cpu' or 'cuda'")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            bad("tensor_parallel_size", "must be a positive integer")
        if self.sliding_window_cache not in WINDOW_CACHE_MODES:
            bad("sliding_window_cache", f"must be one of {', '.join(WINDOW_CACHE_MODES)}")
        if self.kv_eviction not in KV_EVICTION:
            bad("kv_eviction", f"must be one of {', '.join(KV_EVICTION)}")
        if not isinstance(self.kv_eviction_max_tokens, int) or self.kv_eviction_max_tokens < 1:
            bad("kv_eviction_max_tokens", "must be a positive integer")
        if not isinstance(self.kv_sink_tokens, int) or self.kv_sink_tokens < 0:
            bad("kv_sink_tokens", "must be a non-negative integer")
        if self.kv_window_tokens is not None and (
            not isinstance(self.kv_window_tokens, int) or self.kv_window_tokens < 2 * self.block_size
        ):
            bad("kv_window_tokens", f"must be an integer of at least 2 blocks ({2 * self.block_size})")
        self._validate_lora(bad)
        self._validate_speculative(bad)
        self._validate_distributed(bad)

    def _validate_distributed(self, bad: Any) -> None:
        if not isinstance(self.pipeline_parallel_size, int) or self.pipeline_parallel_size < 1:
            bad("pipeline_parallel_size", "must be a positive integer")
        if not isinstance(self.nnodes, int) or self.nnodes < 1:
            bad("nnodes", "must be a positive integer")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            bad("node_rank", f"must be from 0 to nnodes - 1 ({self.nnodes - 1})")
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        if world % self.nnodes:
            bad("nnodes", f"must divide the replica's {world} ranks (tensor x pipeline parallel size)")
        if not isinstance(self.master_port, int) or not 1 <= self.master_port <= 65535:
            bad("master_port", "must be a TCP port (1-65535)")
        if self.headless and self.node_rank == 0:
            bad("headless", "is for the hosts that are not the leader (--node-rank > 0)")
        if self.node_rank > 0 and not self.headless:
            bad("node_rank", "above 0 runs no API server: add --headless")
        if self.pipeline_parallel_size > 1 or self.nnodes > 1:  # engine/worker/pp_workers.py
            for flag, on in (
                ("speculative_config", bool(self.speculative_config)),
                ("enable_lora", self.enable_lora),
                ("async_scheduling", self.async_scheduling),
                ("quantization", self.quantization == "gguf"),
            ):
                if on:
                    bad(flag, "is not supported with pipeline parallelism or --nnodes > 1 yet")
        if isinstance(self.kv_transfer_config, dict):
            self.kv_transfer_config = json.dumps(self.kv_transfer_config)
        try:
            parse_kv_transfer_config(self.kv_transfer_config)
        except ValueError as exc:
            bad("kv_transfer_config", f"is invalid: {exc}")

    @property
    def kv_transfer(self) -> KVTransferConfig | None:
        """--kv-transfer-config, parsed (None: this engine neither sends nor receives prefilled blocks)."""
        return parse_kv_transfer_config(self.kv_transfer_config)

    def _validate_speculative(self, bad: Any) -> None:
        if isinstance(self.speculative_config, dict):
            self.speculative_config = json.dumps(self.speculative_config)
        try:
            spec = parse_speculative_config(self.speculative_config)
        except ValueError as exc:
            bad("speculative_config", f"is invalid: {exc}")
        if spec is None:
            return
        for other, on in (
            ("async_scheduling", self.async_scheduling),
            ("tensor_parallel_size > 1", self.tensor_parallel_size > 1),
            ("enable_lora", self.enable_lora),
        ):
            if on:
                bad("speculative_config", f"is not supported with {other} yet")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """--speculative-config, parsed (None: no speculative decoding)."""
        return parse_speculative_config(self.speculative_config)

    def _validate_lora(self, bad: Any) -> None:
        if not isinstance(self.max_loras, int) or self.max_loras < 1:
            bad("max_loras", "must be a positive integer")
        if not isinstance(self.max_lora_rank, int) or not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            bad("max_lora_rank", f"must be an integer from 1 to {MAX_LORA_RANK}")
        if isinstance(self.lora_modules, str):
            self.lora_modules = [self.lora_modules]
        if self.lora_modules:
            if not self.enable_lora:
                bad("lora_modules", "needs enable_lora (--enable-lora)")
            try:
                names = [parse_lora_module(entry)[0] for entry in self.lora_modules]
            except ValueError as exc:
                bad("lora_modules", str(exc))
            if len(set(names)) != len(names):
                bad("lora_modules", "names an adapter twice")
        if self.max_cpu_loras is not None:
            if not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < self.max_loras:
                bad("max_cpu_loras", f"must be an integer of at least max_loras ({self.max_loras})")
            elif len(self.lora_modules or ()) > self.max_cpu_loras:
                bad("max_cpu_loras", f"is below the {len(self.lora_modules or ())} adapters of lora_modules")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            bad("quantization", f"must be one of {', '.join(QUANTIZATION_METHODS)}")
        if self.quantization == "gguf" and self.tensor_parallel_size > 1:
            bad("quantization", "gguf keeps the blocks on one rank: use tensor_parallel_size 1")
        if self.enable_lora and self.tensor_parallel_size > 1:
            bad("enable_lora", "is not supported with tensor_parallel_size > 1 yet")

    @property
    def lora_adapter_limit(self) -> int:
        """--max-cpu-loras, or its default: the larger of --max-loras and the number of --lora-modules."""
        if self.max_cpu_loras is not None:
            return self.max_cpu_loras
        return max(self.max_loras, len(self.lora_modules or ()))

    @property
    def lora_module_paths(self) -> dict[str, str]:
        """--lora-modules as {name: path}, in the order given."""
        return dict(parse_lora_module(entry) for entry in self.lora_modules or ())

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def host_tier_bytes(self) -> int | None:
        """The host KV tier size asked for: --kv-offload-host-bytes, else --swap-space GiB, else None."""
        if self.kv_offload_host_bytes is not None:
            return self.kv_offload_host_bytes
        if self.swap_space is not None:
            return int(self.swap_space * 2**30)
        return None
