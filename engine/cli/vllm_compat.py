"""What `pagoda serve` answers to each of `vllm serve`'s flags, so that a vLLM command line either works, or
says plainly what differs.

Every long flag of the vLLM release we track (engine/cli/vllm_flags.txt) has one answer here:

- implemented: `pagoda serve` has the flag and does what vLLM's does (its own parser holds it);
- ignored: accepted with a one-line warning, because it has no meaning in Pagoda (say, a switch for a feature
  Pagoda does not have, whose absence changes nothing for the client);
- refused: exit 2 with a message that says what to use instead.

`only` narrows an answer by value: the flag is accepted (with the warning) with those values, which ask for
what Pagoda does anyway, and refused otherwise (e.g. --pipeline-parallel-size 1). Underscore spellings
(`--max_num_seqs 8`) are read as the dashed ones for every flag, as vLLM's parser reads them.

docs/serving.md's flag table is generated from TABLE (python -m pagoda.engine.cli.doc_tables).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

FLAGS_FILE = Path(__file__).with_name("vllm_flags.txt")

IMPLEMENTED, IGNORED, REFUSED = "implemented", "ignored", "refused"


@dataclass(frozen=True)
class Answer:
    kind: str
    note: str = ""
    arity: str = "1"  # what follows the flag: "0" a switch (also --no-FLAG), "1" one value, "+" values
    only: tuple[str, ...] = ()  # accepted with a warning with these values only, refused with others


def _ignored(note: str, arity: str = "1", only: tuple[str, ...] = ()) -> Answer:
    return Answer(IGNORED, note, arity, only)


def _refused(note: str, arity: str = "1", only: tuple[str, ...] = ()) -> Answer:
    return Answer(REFUSED, note, arity, only)


_SWITCH = "0"
_TEXT_ONLY = "Pagoda serves text-only models; leave it out"
_NO_TLS = "Pagoda serves plain HTTP: terminate TLS in front of it (an Ingress, a Gateway or a proxy)"
_NO_DP = (
    "Pagoda runs one engine per server: for data parallelism run replicas (the operator's `replicas`, "
    "behind the KV-aware router)"
)
_NO_EP = "experts are not sharded across GPUs in Pagoda; --tensor-parallel-size splits MoE layers too"
_NO_PLUGINS = "Pagoda loads no plugins or classes by name; leave it out"
_NO_DOWNLOAD = "Pagoda never downloads at run time: a model is a local path or a Hugging Face cache copy"
_NO_COMPILE = "Pagoda compiles no graphs with torch.compile (CUDA graphs: --enforce-eager turns them off)"
_NO_TRACING = "Pagoda exports Prometheus metrics (/metrics), not OpenTelemetry traces; leave it out"
_ONLY_GENERATE = ("auto", "generate")
_NO_LINEAR_ATTN = "Pagoda serves no linear-attention (GDN, KDA) layers"
_NO_MAMBA = "Pagoda serves no Mamba layers"
_NO_SLEEP = "sleep mode is not in Pagoda (--enable-sleep-mode is refused)"
_NO_NUMA = "Pagoda binds to no NUMA node itself: pin the process with numactl or the pod's CPU manager"
_NO_CP = "context parallelism is not in Pagoda (its size is 1)"
_NO_WEIGHT_OFFLOAD = "Pagoda keeps model weights on the device (it offloads KV only: --kv-offload-host-bytes)"
_NO_MOE_LORA = "LoRA on mixture-of-experts models is not supported"
_OWN_KERNELS = "Pagoda picks its own kernels (pagoda kernels warm compiles them)"

# Flags of vllm_flags.txt that `pagoda serve` does not implement, and what it says instead.
_ANSWERS: dict[str, Answer] = {
    # frontend
    "--uds": _refused("Pagoda listens on TCP only: use --host and --port"),
    "--disable-uvicorn-access-log": _ignored("Pagoda's server writes no per-request access log", _SWITCH),
    "--disable-access-log-for-endpoints": _ignored("Pagoda's server writes no per-request access log"),
    "--allow-credentials": _ignored(
        "Pagoda adds no CORS headers (put a proxy in front for browsers)", _SWITCH
    ),
    "--allowed-origins": _ignored("Pagoda adds no CORS headers (put a proxy in front for browsers)"),
    "--allowed-methods": _ignored("Pagoda adds no CORS headers (put a proxy in front for browsers)"),
    "--allowed-headers": _ignored("Pagoda adds no CORS headers (put a proxy in front for browsers)"),
    "--chat-template-content-format": _ignored(
        "Pagoda passes text content to the chat template as a string", only=("auto", "string")
    ),
    "--trust-request-chat-template": _refused(
        "a request cannot bring its own chat template; use --chat-template"
    ),
    "--default-chat-template-kwargs": _refused(
        "not supported yet: requests may send chat_template_kwargs, or give --chat-template a template"
    ),
    "--response-role": _ignored("the generated message's role is always assistant", only=("assistant",)),
    "--ssl-keyfile": _refused(_NO_TLS),
    "--ssl-certfile": _refused(_NO_TLS),
    "--ssl-ca-certs": _refused(_NO_TLS),
    "--enable-ssl-refresh": _refused(_NO_TLS, _SWITCH),
    "--ssl-cert-reqs": _refused(_NO_TLS),
    "--ssl-ciphers": _refused(_NO_TLS),
    "--root-path": _refused("serve at the root and let the proxy strip its prefix"),
    "--middleware": _refused(_NO_PLUGINS, "+"),
    "--return-tokens-as-token-ids": _refused(
        "not supported: logprobs carry tokens as text and bytes", _SWITCH
    ),
    "--disable-frontend-multiprocessing": _ignored(
        "the front end always runs in the server's process (--no-engine-process puts the core there too)",
        _SWITCH,
    ),
    "--enable-request-id-headers": _ignored("responses carry no X-Request-Id header", _SWITCH),
    "--exclude-tools-when-tool-choice-none": _ignored(
        "tools are always rendered into the chat template as the request gives them", _SWITCH
    ),
    "--tool-parser-plugin": _refused(_NO_PLUGINS + " (the built-in parsers: --tool-call-parser)"),
    "--tool-server": _refused("Pagoda calls no tools itself; the client runs them"),
    "--log-config-file": _ignored("Pagoda logs with Python's default logging set-up"),
    "--max-log-len": _ignored("Pagoda does not log prompts"),
    "--disable-fastapi-docs": _ignored("the OpenAPI schema and docs pages are served as they are", _SWITCH),
    "--enable-offline-docs": _ignored("the OpenAPI schema and docs pages are served as they are", _SWITCH),
    "--enable-prompt-tokens-details": _ignored("usage carries prompt_tokens only", _SWITCH),
    "--enable-server-load-tracking": _ignored("load is in /metrics (vllm:num_requests_running)", _SWITCH),
    "--enable-force-include-usage": _ignored(
        "streams include usage when stream_options.include_usage asks for it", _SWITCH
    ),
    "--enable-tokenizer-info-endpoint": _ignored("Pagoda has no /tokenizer_info endpoint", _SWITCH),
    "--enable-log-outputs": _ignored("Pagoda does not log outputs", _SWITCH),
    "--h11-max-incomplete-event-size": _ignored("uvicorn's own limits apply (and --max-request-body-bytes)"),
    "--h11-max-header-count": _ignored("uvicorn's own limits apply (and --max-request-body-bytes)"),
    "--log-error-stack": _ignored("error responses are logged without their stack", _SWITCH),
    "--tokens-only": _refused("Pagoda serves the whole OpenAI API; leave it out", _SWITCH),
    "--enable-log-deltas": _ignored("Pagoda does not log outputs", _SWITCH),
    "--enable-per-request-metrics": _ignored("per-request timings are in /metrics histograms", _SWITCH),
    "--enable-flash-late-interaction": _ignored("Pagoda has no pooling or scoring models", _SWITCH),
    "--cohere-is-reasoning-model": _ignored("Pagoda has no Cohere /v2/chat endpoint", _SWITCH),
    "--cohere-format": _ignored("Pagoda has no Cohere /v2/chat endpoint"),
    "--fingerprint-mode": _ignored("responses carry Pagoda's own system_fingerprint"),
    "--fingerprint-value": _ignored("responses carry Pagoda's own system_fingerprint"),
    "--data-parallel-supervisor-port": _refused(_NO_DP),
    "--dp-supervisor-probe-interval-s": _refused(_NO_DP),
    "--dp-supervisor-probe-timeout-s": _refused(_NO_DP),
    "--dp-supervisor-probe-failure-threshold": _refused(_NO_DP),
    # serve subcommand
    "--grpc": _refused("Pagoda serves the OpenAI API over HTTP only", _SWITCH),
    "--api-server-count": _refused(
        "one API server process runs per engine; run more replicas for more", only=("1",)
    ),
    "--config": _refused("Pagoda reads no YAML config file: pass the flags on the command line"),
    "--enable-log-requests": _ignored("Pagoda does not log requests", _SWITCH),
    "--disable-log-requests": _ignored("Pagoda does not log requests anyway", _SWITCH),
    # model
    "--runner": _refused("Pagoda runs generative models only; leave it out", only=_ONLY_GENERATE),
    "--convert": _refused("Pagoda runs generative models only; leave it out", only=("auto", "none")),
    "--task": _refused("Pagoda runs generative models only; leave it out", only=_ONLY_GENERATE),
    "--tokenizer-mode": _ignored(
        "Pagoda reads the fast tokenizer (tokenizer.json) or the GGUF file's", only=("auto", "hf")
    ),
    "--trust-remote-code": _ignored(
        "Pagoda never runs code from a model folder: architectures come from its own model table", _SWITCH
    ),
    "--hf-config-path": _refused("config.json is read from the model folder; put it there"),
    "--allowed-local-media-path": _ignored(_TEXT_ONLY),
    "--allowed-media-domains": _ignored(_TEXT_ONLY, "+"),
    "--code-revision": _ignored("Pagoda never runs code from a model folder"),
    "--tokenizer-revision": _refused("use --tokenizer with the directory of that revision"),
    "--logprobs-mode": _refused(
        "logprobs are always of the processed distribution", only=("processed_logprobs",)
    ),
    "--disable-sliding-window": _refused(
        "sliding-window layers always use their window; lower --max-model-len instead", _SWITCH
    ),
    "--disable-cascade-attn": _ignored("Pagoda has no cascade attention", _SWITCH),
    "--enable-prompt-embeds": _refused("prompts are text or token ids; embeddings are not accepted", _SWITCH),
    "--config-format": _ignored("config.json (or the GGUF header) is read", only=("auto", "hf")),
    "--hf-token": _ignored(_NO_DOWNLOAD),
    "--hf-overrides": _refused("edit config.json in a copy of the model folder"),
    "--pooler-config": _refused("Pagoda runs generative models only; leave it out"),
    "--logits-processor-pattern": _refused(_NO_PLUGINS),
    "--override-generation-config": _refused(
        "put the values in a generation_config.json and pass its folder with --generation-config DIR"
    ),
    "--enable-sleep-mode": _refused("not supported: scale to zero with the operator instead", _SWITCH),
    "--model-impl": _ignored("Pagoda runs its own model implementations", only=("auto", "vllm")),
    "--override-attention-dtype": _refused("attention runs in the model's dtype (--dtype)"),
    "--logits-processors": _refused(_NO_PLUGINS, "+"),
    "--io-processor-plugin": _refused(_NO_PLUGINS),
    # load
    "--load-format": _ignored(
        "Pagoda reads safetensors or a GGUF file, whichever the model is (never pickled .bin/.pt weights)",
        only=("auto", "safetensors", "gguf"),
    ),
    "--download-dir": _ignored(_NO_DOWNLOAD),
    "--safetensors-load-strategy": _ignored("safetensors files are memory-mapped and read once"),
    "--model-loader-extra-config": _refused("Pagoda's loader takes no extra configuration"),
    "--ignore-patterns": _ignored(_NO_DOWNLOAD, "+"),
    "--use-tqdm-on-load": _ignored("loading shows no progress bar", _SWITCH),
    "--pt-load-map-location": _ignored("Pagoda never loads pickled .pt weights"),
    # structured outputs
    "--reasoning-parser": _ignored(
        "reasoning is not split into reasoning_content yet: it arrives in content as the model writes it"
    ),
    "--reasoning-parser-plugin": _refused(_NO_PLUGINS),
    # parallel
    "--distributed-executor-backend": _ignored(
        "tensor-parallel ranks are always local processes", only=("auto", "mp", "uni")
    ),
    "--decode-context-parallel-size": _refused(
        "context parallelism is not in Pagoda; use --tensor-parallel-size", only=("1",)
    ),
    "--data-parallel-size": _refused(_NO_DP, only=("1",)),
    "--data-parallel-rank": _refused(_NO_DP),
    "--data-parallel-start-rank": _refused(_NO_DP),
    "--data-parallel-size-local": _refused(_NO_DP),
    "--data-parallel-address": _refused(_NO_DP),
    "--data-parallel-rpc-port": _refused(_NO_DP),
    "--data-parallel-backend": _refused(_NO_DP),
    "--data-parallel-hybrid-lb": _refused(_NO_DP, _SWITCH),
    "--data-parallel-external-lb": _refused(_NO_DP, _SWITCH),
    "--data-parallel-multi-port-external-lb": _refused(_NO_DP, _SWITCH),
    "--enable-expert-parallel": _refused(_NO_EP, _SWITCH),
    "--enable-eplb": _refused(_NO_EP, _SWITCH),
    "--eplb-config": _refused(_NO_EP),
    "--expert-placement-strategy": _refused(_NO_EP),
    "--all2all-backend": _ignored("experts are not sharded, so there is no all-to-all"),
    "--enable-dbo": _refused("dual-batch overlap is not in Pagoda; leave it out", _SWITCH),
    "--dbo-decode-token-threshold": _refused("dual-batch overlap is not in Pagoda; leave it out"),
    "--dbo-prefill-token-threshold": _refused("dual-batch overlap is not in Pagoda; leave it out"),
    "--max-parallel-loading-workers": _ignored("every rank loads its own shard"),
    "--ray-workers-use-nsight": _ignored("Pagoda does not use Ray", _SWITCH),
    "--disable-custom-all-reduce": _ignored("Pagoda uses torch.distributed's all-reduce only", _SWITCH),
    "--worker-cls": _refused(_NO_PLUGINS, only=("auto",)),
    "--worker-extension-cls": _refused(_NO_PLUGINS, only=("",)),
    # cache
    "--num-gpu-blocks-override": _refused("size the KV cache with --kv-cache-memory-bytes"),
    "--prefix-caching-hash-algo": _ignored("Pagoda's block hashes are its own (SHA-256 chained per block)"),
    "--cpu-offload-gb": _refused(
        "vLLM's flag offloads model weights to host memory, which Pagoda does not do (weights stay on the "
        "device): use a GPU with more memory or --tensor-parallel-size",
        only=("0",),
    ),
    "--calculate-kv-scales": _ignored(
        "FP8 KV scales are computed per layer as the cache is written", _SWITCH
    ),
    "--kv-sharing-fast-prefill": _ignored("Pagoda shares no KV between layers", _SWITCH),
    "--mamba-cache-dtype": _ignored("Pagoda serves no Mamba layers"),
    "--mamba-ssm-cache-dtype": _ignored("Pagoda serves no Mamba layers"),
    "--kv-offloading-size": _refused(
        "Pagoda's host KV tier is --kv-offload-host-bytes, in bytes (e.g. 8GiB; vLLM's flag is in GiB)"
    ),
    "--kv-offloading-backend": _refused(
        "Pagoda's KV tiers are its own: --kv-offload-host-bytes (host RAM) and --kv-offload-disk-dir (disk)"
    ),
    # multimodal
    "--limit-mm-per-prompt": _ignored(_TEXT_ONLY),
    "--media-io-kwargs": _ignored(_TEXT_ONLY),
    "--mm-processor-kwargs": _ignored(_TEXT_ONLY),
    "--mm-processor-cache-gb": _ignored(_TEXT_ONLY),
    "--mm-processor-cache-type": _ignored(_TEXT_ONLY),
    "--mm-shm-cache-max-object-size-mb": _ignored(_TEXT_ONLY),
    "--mm-encoder-tp-mode": _ignored(_TEXT_ONLY),
    "--interleave-mm-strings": _ignored(_TEXT_ONLY, _SWITCH),
    "--skip-mm-profiling": _ignored(_TEXT_ONLY, _SWITCH),
    "--video-pruning-rate": _ignored(_TEXT_ONLY),
    # LoRA
    "--enable-lora-bias": _refused("LoRA adapters with bias are not supported; train without bias", _SWITCH),
    "--lora-dtype": _ignored("LoRA weights run in the model's dtype"),
    "--fully-sharded-loras": _ignored("LoRA is not combined with tensor parallelism yet", _SWITCH),
    "--default-mm-loras": _refused(_TEXT_ONLY),
    # observability
    "--show-hidden-metrics-for-version": _ignored("Pagoda exports its deprecated vLLM metric names always"),
    "--otlp-traces-endpoint": _refused(_NO_TRACING),
    "--collect-detailed-traces": _refused(_NO_TRACING),
    "--kv-cache-metrics": _ignored("KV cache metrics are always in /metrics", _SWITCH),
    "--aggregate-engine-logging": _ignored(
        "one engine per server: its log line is already the total", _SWITCH
    ),
    # scheduler
    "--max-num-partial-prefills": _ignored("chunked prefill runs one partial prefill at a time"),
    "--max-long-partial-prefills": _ignored("chunked prefill runs one partial prefill at a time"),
    "--long-prefill-token-threshold": _ignored("chunk sizes follow --max-num-batched-tokens"),
    "--cuda-graph-sizes": _ignored("CUDA graphs are recorded for Pagoda's own batch sizes", "+"),
    "--disable-chunked-mm-input": _ignored(_TEXT_ONLY, _SWITCH),
    "--scheduler-cls": _refused(_NO_PLUGINS),
    "--stream-interval": _ignored("streams send every step's tokens", only=("1",)),
    # vllm
    "--kv-events-config": _refused("Pagoda's KV events are served at its own endpoint for the router"),
    "--ec-transfer-config": _refused(_TEXT_ONLY),
    "--compilation-config": _ignored(_NO_COMPILE),
    "--additional-config": _refused(_NO_PLUGINS),
    "--structured-outputs-config": _ignored("structured outputs use Pagoda's own grammar backend"),
    "--disable-nccl-for-dp-synchronization": _refused(_NO_DP, _SWITCH),
    "--mamba-block-size": _ignored("Pagoda serves no Mamba layers"),
    "--enable-mm-embeds": _refused(_TEXT_ONLY, _SWITCH),
    "--mm-encoder-attn-backend": _ignored(_TEXT_ONLY),
    "--cudagraph-capture-sizes": _ignored("CUDA graphs are recorded for Pagoda's own batch sizes", "+"),
    "--max-cudagraph-capture-size": _ignored("CUDA graphs are recorded for Pagoda's own batch sizes"),
    # new in the vLLM release tracked now (checked against its parser: benchmarks/peers_vllm_flags.py)
    # serve subcommand
    "--fail-on-environ-validation": _ignored(
        "Pagoda has no vLLM environment validation to make strict", _SWITCH
    ),
    "--gdn-prefill-backend": _ignored(_NO_LINEAR_ATTN),
    "--kda-prefill-backend": _ignored(_NO_LINEAR_ATTN),
    "--kda-decode-backend": _ignored(_NO_LINEAR_ATTN),
    # frontend
    "--trust-request-mm-kwargs": _ignored(_TEXT_ONLY, _SWITCH),
    "--tool-strict-level": _ignored(
        "tool calls are read the way Pagoda's tool parsers do (docs/api.md)", only=("auto",)
    ),
    "--sse-keep-alive-interval": _ignored(
        "streams send no keep-alive comments: a proxy's idle timeout must cover the longest gap between tokens"
    ),
    "--anthropic-disabled-thinking-effort": _ignored("Pagoda has no Anthropic /v1/messages endpoint"),
    "--enable-scale-out": _refused(
        "Pagoda has no /render or /inference/v1/generate endpoints; scale out with replicas behind its router",
        _SWITCH,
    ),
    "--grpc-port": _refused("Pagoda serves the OpenAI API over HTTP only"),
    # model
    "--quantization-config": _refused(
        "Pagoda reads the quantization from the checkpoint's own config.json; edit it in a copy of the folder"
    ),
    "--allow-deprecated-quantization": _ignored(
        "Pagoda reads the quantization from the checkpoint's own config", _SWITCH
    ),
    "--enable-return-routed-experts": _refused("responses carry no routed-expert ids", _SWITCH),
    "--return-sampling-mask": _refused("responses carry no sampling masks", _SWITCH),
    "--use-fp64-gumbel": _ignored("Pagoda samples with float32 random numbers", _SWITCH),
    "--enable-trace-replay": _refused(
        "requests cannot force a decode trace; score a given text with echo and max_tokens 0", _SWITCH
    ),
    "--model-class-overrides": _refused(_NO_PLUGINS),
    "--sleep-mode-offload-cudagraph": _ignored(_NO_SLEEP, _SWITCH),
    "--sleep-preserve-parameter-names": _ignored(_NO_SLEEP, "+"),
    "--enable-cumem-allocator": _ignored("Pagoda uses torch's caching allocator", _SWITCH),
    "--enable-nccl-comm-suspend": _ignored(_NO_SLEEP, _SWITCH),
    "--renderer-num-workers": _ignored("tokenizing runs on the server's pool of two worker threads"),
    # load
    "--safetensors-prefetch-num-threads": _ignored("safetensors files are memory-mapped and read once"),
    "--safetensors-prefetch-block-size": _ignored("safetensors files are memory-mapped and read once"),
    # mamba
    "--mamba-backend": _ignored(_NO_MAMBA),
    "--mamba-ssu-algorithm": _ignored(_NO_MAMBA),
    "--enable-mamba-cache-stochastic-rounding": _ignored(_NO_MAMBA, _SWITCH),
    "--mamba-cache-philox-rounds": _ignored(_NO_MAMBA),
    "--mamba-cache-mode": _ignored(_NO_MAMBA),
    "--enable-mamba-shared-prefix-checkpoint": _ignored(_NO_MAMBA, _SWITCH),
    "--replayssm-buffer-len": _ignored(_NO_MAMBA),
    "--use-replayssm": _ignored(_NO_MAMBA, _SWITCH),
    # parallel
    "--distributed-timeout-seconds": _ignored(
        "tensor-parallel ranks use torch.distributed's default timeout"
    ),
    "--cpu-distributed-timeout-seconds": _ignored(
        "tensor-parallel ranks use torch.distributed's default timeout"
    ),
    "--numa-bind": _ignored(_NO_NUMA, _SWITCH),
    "--numa-bind-nodes": _ignored(_NO_NUMA, "+"),
    "--numa-bind-cpus": _ignored(_NO_NUMA, "+"),
    "--device-ids": _refused("choose the GPUs with CUDA_VISIBLE_DEVICES (the operator sets it per pod)"),
    "--dcp-comm-backend": _ignored(_NO_CP),
    "--dcp-q-replicate": _ignored(_NO_CP, _SWITCH),
    "--dcp-kv-cache-interleave-size": _ignored(_NO_CP),
    "--cp-kv-cache-interleave-size": _ignored(_NO_CP),
    "--prefill-context-parallel-size": _refused(
        "context parallelism is not in Pagoda; use --tensor-parallel-size", only=("1",)
    ),
    "--enable-hc-sp": _ignored("Pagoda has no HyperConnection layers", _SWITCH),
    "--enable-batch-sharded-sampling": _ignored("Pagoda samples the whole batch on the first rank", _SWITCH),
    "--enable-ep-weight-filter": _ignored(_NO_EP, _SWITCH),
    "--enable-shm-tensor-arena": _ignored("Pagoda's processes hand tensors over their own way", _SWITCH),
    "--ubatch-size": _refused("dual-batch overlap is not in Pagoda; leave it out", only=("0",)),
    "--enable-elastic-ep": _refused(_NO_EP, _SWITCH),
    "--elastic-ep-max-dp-size": _refused(_NO_EP),
    "--dp-sync-interval": _ignored(_NO_DP),
    "--enable-fault-tolerance": _ignored(
        "a failed engine exits and its pod restarts (the operator); there is no in-process recovery", _SWITCH
    ),
    "--fault-tolerance-config": _ignored(
        "a failed engine exits and its pod restarts (the operator); there is no in-process recovery"
    ),
    # cache
    "--prefix-cache-retention-interval": _ignored("cached blocks stay until the cache needs them (LRU)"),
    "--kv-cache-dtype-skip-layers": _refused("--kv-cache-dtype applies to every layer", "+"),
    "--swa-bounded-replay": _ignored(
        "sliding-window layers keep their window's KV in the prefix cache (docs/models.md)", _SWITCH
    ),
    "--prefix-match-unit": _ignored("prefix-cache hits land on whole blocks (--block-size)"),
    # offload (model weights)
    "--offload-backend": _ignored(_NO_WEIGHT_OFFLOAD),
    "--cpu-offload-params": _refused(_NO_WEIGHT_OFFLOAD, "+"),
    "--offload-group-size": _refused(_NO_WEIGHT_OFFLOAD, only=("0",)),
    "--offload-num-in-group": _ignored(_NO_WEIGHT_OFFLOAD),
    "--offload-prefetch-step": _ignored(_NO_WEIGHT_OFFLOAD),
    "--offload-params": _refused(_NO_WEIGHT_OFFLOAD, "+"),
    # multimodal
    "--language-model-only": _ignored("Pagoda serves the language model only anyway", _SWITCH),
    "--mm-hasher-algorithm": _ignored(_TEXT_ONLY),
    "--mm-encoder-only": _refused(_TEXT_ONLY, _SWITCH),
    "--mm-encoder-attn-dtype": _ignored(_TEXT_ONLY),
    "--mm-encoder-fp8-scale-path": _ignored(_TEXT_ONLY),
    "--mm-encoder-fp8-scale-save-path": _ignored(_TEXT_ONLY),
    "--mm-encoder-fp8-scale-save-margin": _ignored(_TEXT_ONLY),
    "--video-pruning-method": _ignored(_TEXT_ONLY),
    "--mm-tensor-ipc": _ignored(_TEXT_ONLY),
    "--mm-processor-device": _ignored(_TEXT_ONLY),
    "--mm-ipc-gpu-memory-gb": _ignored(_TEXT_ONLY),
    "--mm-device-do-normalize": _ignored(_TEXT_ONLY, _SWITCH),
    # LoRA
    "--enable-tower-connector-lora": _ignored(_TEXT_ONLY, _SWITCH),
    "--lora-target-modules": _ignored(
        "each adapter applies to the modules its adapter_config.json names", "+"
    ),
    "--specialize-active-lora": _ignored("Pagoda's LoRA kernels are its own", _SWITCH),
    "--enable-mixed-moe-lora-format": _refused(_NO_MOE_LORA, _SWITCH),
    "--enable-moe-shared-loras": _refused(_NO_MOE_LORA, _SWITCH),
    "--max-lora-cls-labels": _ignored("Pagoda has no classification models"),
    # logging
    "--logging-config": _ignored("Pagoda logs with Python's default logging set-up"),
    "--log-level": _ignored("Pagoda logs at INFO; --uvicorn-log-level sets the HTTP server's level"),
    # observability
    "--per-request-spec-decode-metrics": _ignored(
        "speculative decoding's metrics are per server (vllm:spec_decode_*), not per request"
    ),
    "--kv-cache-metrics-sample": _ignored("KV cache metrics are always in /metrics"),
    "--custom-histogram-buckets": _ignored("/metrics histograms have fixed buckets (vLLM's defaults)"),
    "--cudagraph-metrics": _ignored("CUDA graph use is not exported as metrics", _SWITCH),
    "--enable-layerwise-nvtx-tracing": _ignored("Pagoda adds no NVTX ranges", _SWITCH),
    "--enable-mfu-metrics": _ignored("Pagoda exports no model-FLOPs-utilization metrics", _SWITCH),
    "--enable-logging-iteration-details": _ignored("the periodic log line is Pagoda's own", _SWITCH),
    "--jit-monitor-mode": _ignored(_NO_COMPILE),
    "--jit-monitor-verbose": _ignored(_NO_COMPILE, _SWITCH),
    # scheduler
    "--max-num-scheduled-tokens": _ignored(
        "a step schedules up to --max-num-batched-tokens, proposed tokens included"
    ),
    "--max-num-active-seqs": _refused("--max-num-seqs is the number of running sequences"),
    "--max-num-queued-tokens": _refused("Pagoda bounds the queue by requests: --max-num-queued-reqs"),
    "--long-prefill-token-threshold-adaptive": _ignored(
        "chunk sizes follow --max-num-batched-tokens", _SWITCH
    ),
    "--scheduler-reserve-full-isl": _ignored(
        "a request is admitted when its first chunk fits; a later shortage preempts the lowest-ranked running request",
        _SWITCH,
    ),
    "--watermark": _ignored("Pagoda keeps no free-block watermark", only=("0", "0.0")),
    "--prefill-schedule-interval": _ignored("prefills are scheduled at every step", only=("1",)),
    # kernels
    "--ir-op-priority": _ignored(_OWN_KERNELS),
    "--enable-flashinfer-autotune": _ignored(_OWN_KERNELS, _SWITCH),
    "--moe-backend": _ignored(_OWN_KERNELS),
    "--linear-backend": _ignored(_OWN_KERNELS),
    "--sparse-indexer-topk-backend": _ignored(_OWN_KERNELS),
    "--kernel-config": _ignored(_OWN_KERNELS),
    # vllm
    "--spec-method": _refused("use --speculative-config's JSON (method, model, num_speculative_tokens)"),
    "--spec-model": _refused("use --speculative-config's JSON (method, model, num_speculative_tokens)"),
    "--spec-tokens": _refused("use --speculative-config's JSON (method, model, num_speculative_tokens)"),
    "--watermark-config": _refused("Pagoda does not watermark its outputs"),
    "--diffusion-config": _refused("Pagoda runs autoregressive text models only"),
    "--ec-manager-config": _ignored(_TEXT_ONLY),
    "--attention-config": _ignored("vLLM's attention backends are not Pagoda's; it picks its own"),
    "--engram-config": _refused("Pagoda has no n-gram embedding (Engram) layers; leave it out"),
    "--reasoning-config": _ignored(
        "reasoning is not split into reasoning_content yet: it arrives in content as the model writes it"
    ),
    "--aux-output-config": _refused("responses carry no auxiliary model outputs"),
    "--profiler-config": _ignored("Pagoda has no profiler endpoints"),
    "--optimization-level": _ignored(_NO_COMPILE),
    "--performance-mode": _ignored("Pagoda has one scheduling mode; tune it with --max-num-batched-tokens"),
    "--weight-transfer-config": _refused("weights are loaded once from the model folder; none are sent in"),
    # earlier releases
    "--override-pooler-config": _refused("Pagoda runs generative models only; leave it out"),
    "--guided-decoding-disable-fallback": _ignored(
        "structured outputs use Pagoda's own grammar backend", _SWITCH
    ),
    "--guided-decoding-disable-any-whitespace": _ignored(
        "structured outputs use Pagoda's own grammar backend", _SWITCH
    ),
    "--guided-decoding-disable-additional-properties": _ignored(
        "structured outputs use Pagoda's own grammar backend", _SWITCH
    ),
    "--num-redundant-experts": _refused(_NO_EP),
    "--eplb-window-size": _refused(_NO_EP),
    "--eplb-step-interval": _refused(_NO_EP),
    "--eplb-log-balancedness": _refused(_NO_EP, _SWITCH),
    "--enable-multimodal-encoder-data-parallel": _ignored(_TEXT_ONLY, _SWITCH),
    "--disable-mm-preprocessor-cache": _ignored(_TEXT_ONLY, _SWITCH),
    "--lora-extra-vocab-size": _ignored("LoRA adapters add no vocabulary in Pagoda"),
    "--guided-decoding-backend": _ignored("structured outputs use Pagoda's own grammar backend"),
    "--rope-scaling": _refused("edit rope_scaling in config.json in a copy of the model folder"),
    "--rope-theta": _refused("edit rope_theta in config.json in a copy of the model folder"),
    "--max-seq-len-to-capture": _ignored("CUDA graphs are recorded for Pagoda's own batch sizes"),
    "--num-scheduler-steps": _ignored("one scheduler step per model step", only=("1",)),
    "--multi-step-stream-outputs": _ignored("streams send every step's tokens", _SWITCH),
    "--num-lookahead-slots": _ignored("Pagoda schedules no lookahead slots", only=("0",)),
    "--use-v2-block-manager": _ignored("Pagoda has one block manager", _SWITCH),
    "--tokenizer-pool-size": _ignored("tokenizing runs on the server's pool of two worker threads"),
}

# Short spellings vLLM accepts for flags answered above.
SHORT: dict[str, str] = {
    "-dp": "--data-parallel-size",
    "-dpn": "--data-parallel-rank",
    "-dpr": "--data-parallel-start-rank",
    "-dpl": "--data-parallel-size-local",
    "-dpa": "--data-parallel-address",
    "-dpp": "--data-parallel-rpc-port",
    "-dpb": "--data-parallel-backend",
    "-dph": "--data-parallel-hybrid-lb",
    "-dpe": "--data-parallel-external-lb",
    "-dpm": "--data-parallel-multi-port-external-lb",
    "-ep": "--enable-expert-parallel",
    "-n": "--nnodes",
    "-r": "--node-rank",
    "-dcp": "--decode-context-parallel-size",
    "-pcp": "--prefill-context-parallel-size",
    "-asc": "--api-server-count",
    "-sc": "--speculative-config",
    "-dc": "--diffusion-config",
    "-cc": "--compilation-config",
    "-ac": "--attention-config",
    "-O": "--optimization-level",  # -O3, -O 3, -O=3
}

# vLLM's names for what `pagoda serve` implements under another name: read as Pagoda's flag, no warning.
ALIASES: dict[str, str] = {
    "--device-memory-utilization": "--gpu-memory-utilization",  # one flag with two names in vLLM
    "--shutdown-timeout": "--shutdown-grace-seconds",  # seconds in-flight requests may finish on shutdown
}
# vLLM's switches that are one of a Pagoda flag's values: read as that flag and value, no warning.
SWITCH_ALIASES: dict[str, tuple[str, str]] = {
    # one KV layout for every layer instead of a smaller pool for the sliding layers' windows
    "--disable-hybrid-kv-cache-manager": ("--sliding-window-cache", "off"),
}


@functools.cache
def vllm_flags() -> tuple[str, ...]:
    """vllm_flags.txt's flag names, in its order."""
    lines = FLAGS_FILE.read_text().splitlines()
    return tuple(line.strip() for line in lines if line.strip().startswith("--"))


@functools.cache
def table(implemented: frozenset[str]) -> dict[str, Answer]:
    """Every vLLM flag's answer: IMPLEMENTED where `pagoda serve`'s parser has it (`implemented`: its option
    strings), else the answer above; a flag with neither is missing (KeyError: a test keeps it from happening)."""
    out = {}
    for name in vllm_flags():
        if name in implemented:
            out[name] = Answer(IMPLEMENTED)
        elif ALIASES.get(name) in implemented:
            out[name] = Answer(IMPLEMENTED, f"read as {ALIASES[name]}")
        elif name in SWITCH_ALIASES and SWITCH_ALIASES[name][0] in implemented:
            out[name] = Answer(IMPLEMENTED, f"read as {' '.join(SWITCH_ALIASES[name])}")
        else:
            out[name] = _ANSWERS[name]
    return out


def normalize(token: str) -> str:
    """--max_num_seqs=8 -> --max-num-seqs=8 (the name only: a value keeps its underscores)."""
    if not token.startswith("--"):
        return token
    name, sep, value = token.partition("=")
    return name.replace("_", "-") + sep + value


class CompatRefusal(Exception):
    """A vLLM flag Pagoda refuses, with what to use instead."""


def _is_value(token: str) -> bool:
    """A token that is a flag's value, not the next flag (negative numbers are values)."""
    return not token.startswith("-") or re.fullmatch(r"-\d+(\.\d+)?", token) is not None


# Implemented flags whose vLLM values Pagoda has no counterpart for: such a value is replaced by Pagoda's
# own choice, with a warning (a value among Pagoda's choices is taken as it is).
FALLBACKS: dict[str, tuple[str, str]] = {
    "--attention-backend": ("auto", "vLLM's attention backends are not Pagoda's; it picks its own"),
    "--tool-call-parser": (
        "auto",
        "Pagoda has no tool-call parser of that name; it reads tool calls the way the chat template writes them",
    ),
}


def translate(
    argv: list[str], implemented: frozenset[str], choices: dict[str, tuple[str, ...]] | None = None
) -> tuple[list[str], list[str]]:
    """`argv` with underscore spellings read as dashes, the ignored vLLM flags (and their values) taken
    out and vLLM-only values of FALLBACKS' flags replaced, and the warnings for them; CompatRefusal for a
    refused flag or value. `choices`: the values `pagoda serve` takes for a flag that has a fixed set."""
    answers = {n: a for n, a in table(implemented).items() if a.kind != IMPLEMENTED}
    out: list[str] = []
    warnings: list[str] = []
    i = 0
    while i < len(argv):
        token = normalize(argv[i])
        i += 1
        if token == "--":
            out += [token, *argv[i:]]
            break
        name, has_value, inline = token.partition("=")
        if re.fullmatch(r"-O\d", name):  # vLLM's -O3: the optimization level, attached
            name, has_value, inline = "-O", "=", name[2:]
        name = SHORT.get(name, name)
        if name in ALIASES:
            name = ALIASES[name]
            token = name + (f"={inline}" if has_value else "")
        if name in SWITCH_ALIASES and not has_value:
            out += SWITCH_ALIASES[name]
            continue
        if name in FALLBACKS and choices and name in choices:
            value = inline if has_value else (argv[i] if i < len(argv) else None)
            if value is not None and value not in choices[name]:
                fallback, note = FALLBACKS[name]
                warnings.append(f"{name} {value} (a vLLM value) is replaced by {fallback}: {note}")
                out += [name, fallback]
                i += 0 if has_value else 1
                continue
        negated = name.startswith("--no-") and answers.get("--" + name[5:], Answer("")).arity == _SWITCH
        key = "--" + name[5:] if negated else name
        answer = answers.get(key)
        if answer is None:
            out.append(token)
            continue
        values: list[str] = []
        if answer.arity != _SWITCH:
            if has_value:
                values = [inline]
            while i < len(argv) and _is_value(argv[i]) and (answer.arity == "+" or not values):
                values.append(argv[i])
                i += 1
        shown = f"{key} {' '.join(values)}".strip()
        if answer.arity != _SWITCH and not values:
            raise CompatRefusal(f"{key} needs a value")
        if answer.only and not all(v in answer.only for v in values):
            raise CompatRefusal(f"{shown}: {answer.note} (accepted only as {', '.join(answer.only)})")
        if answer.kind == REFUSED and not answer.only:
            raise CompatRefusal(f"vLLM's {key} is not supported: {answer.note}")
        warnings.append(f"{shown} (a vLLM flag) is ignored: {answer.note}")
    return out, warnings
