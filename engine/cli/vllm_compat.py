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
_NO_MULTINODE = "Pagoda runs on one node; use --tensor-parallel-size within it"
_NO_PLUGINS = "Pagoda loads no plugins or classes by name; leave it out"
_NO_DOWNLOAD = "Pagoda never downloads at run time: a model is a local path or a Hugging Face cache copy"
_NO_COMPILE = "Pagoda compiles no graphs with torch.compile (CUDA graphs: --enforce-eager turns them off)"
_NO_TRACING = "Pagoda exports Prometheus metrics (/metrics), not OpenTelemetry traces; leave it out"
_ONLY_GENERATE = ("auto", "generate")

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
    "--headless": _refused(_NO_MULTINODE, _SWITCH),
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
    "--quantization": _ignored("Pagoda reads the quantization from the checkpoint's own config"),
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
    "--pipeline-parallel-size": _refused(
        "pipeline parallelism is not in Pagoda yet (planned in issue 43); use --tensor-parallel-size",
        only=("1",),
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
    "--nnodes": _refused(_NO_MULTINODE, only=("1",)),
    "--node-rank": _refused(_NO_MULTINODE, only=("0",)),
    "--master-addr": _refused(_NO_MULTINODE),
    "--master-port": _refused(_NO_MULTINODE),
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
    "--disable-hybrid-kv-cache-manager": _ignored("Pagoda has one KV cache manager for all layers", _SWITCH),
    "--async-scheduling": _ignored("Pagoda schedules each step after the last one's outputs", _SWITCH),
    "--stream-interval": _ignored("streams send every step's tokens", only=("1",)),
    # vllm
    "--speculative-config": _refused("speculative decoding is not in Pagoda yet; leave it out"),
    "--kv-transfer-config": _refused(
        "KV transfer between engines is not in Pagoda; its KV tiers are --kv-offload-host-bytes and "
        "--kv-offload-disk-dir"
    ),
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
    "-pp": "--pipeline-parallel-size",
    "-dp": "--data-parallel-size",
    "-O": "--compilation-config",
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
        out[name] = Answer(IMPLEMENTED) if name in implemented else _ANSWERS[name]
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
        if re.fullmatch(r"-O\d", name):  # vLLM's -O3: the compilation level, attached
            name, has_value, inline = "-O", "=", name[2:]
        name = SHORT.get(name, name)
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
