"""Every environment variable Pagoda reads (``PAGODA_*``, and one of vLLM's), read here and nowhere else.

Each is read when asked for (not at import), so a test or a supervisor that sets one before a call sees it
take effect. Importing this module needs nothing beyond the standard library: the operator and the router
read their variables here too.

| variable | default | meaning |
|---|---|---|
| PAGODA_CACHE | the user cache dir + /pagoda | converted models, content hashes |
| PAGODA_API_KEY | unset | the key `pagoda serve` and `pagoda router` require (``--api-key``) |
| PAGODA_TERMINATION_LOG | /dev/termination-log | where a failed start-up writes its termination message |
| PAGODA_NATIVE_KERNELS | auto | the CPU path's C kernels: auto (the best variant this CPU runs), 0/off (torch fallbacks), or a variant name |
| PAGODA_KERNEL_CACHE | unset | directories (':' between) of kernels compiled ahead of time (the deployment's, the engine image's) to seed the cache from |
| PAGODA_ONEDNN_LINEAR | 1 | 0: CPU linears run `F.linear` instead of oneDNN's packed weights |
| PAGODA_CPU_LINEAR | auto | CPU linears of 1-64 rows: auto (the product measured fastest on this host, kept in the kernel cache), ours (the kernels library's small-rows product) or onednn |
| PAGODA_GGUF_ACTIVATIONS | float32 | `--quantization gguf` at decode: float32 (exact) or int8 (activations quantized per 32 values, integer dot products; Q4_0/Q4_1/Q8_0) |
| PAGODA_HOST_MALLOC_TUNING | 1 | 0: glibc may return freed heap to the system (see host_allocator.py) |
| PAGODA_CORE_THREADS | all cores | compute threads of the engine core process (`pagoda serve`) |
| PAGODA_CORE_SHARE_CORES | 0 | 1: the engine core process computes on one thread fewer for steps of at most 2 new tokens |
| PAGODA_ENGINE_IMAGE | unset | the operator: engine image to render instead of its default |
| PAGODA_PROMETHEUS_URL | unset | the operator: Prometheus it reads load from |
| PAGODA_DOWNLOAD_IMAGE | unset | the operator: image of the model-download Jobs instead of its default |

And one of vLLM's, under its own name so its deployments carry over:

| variable | default | meaning |
|---|---|---|
| VLLM_ALLOW_RUNTIME_LORA_UPDATING | unset | 1/true: `pagoda serve` offers POST /v1/load_lora_adapter and /v1/unload_lora_adapter (as `--allow-runtime-lora-updating`) |
"""

from __future__ import annotations

import os
from pathlib import Path

TERMINATION_LOG_DEFAULT = "/dev/termination-log"  # Kubernetes' default terminationMessagePath
_OFF = ("0", "false", "no", "off")


def _get(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value else None


def _switch(name: str, default: str = "1") -> bool:
    """On unless set to 0 / false / no / off (or unset with an off ``default``)."""
    return os.environ.get(name, default).strip().lower() not in _OFF


def cache_dir() -> str | None:
    return _get("PAGODA_CACHE")


def cache_root() -> Path:
    """`$PAGODA_CACHE`, else the user's cache dir + /pagoda: converted models, content hashes, CPU kernels."""
    env = cache_dir()
    if env:
        return Path(env).expanduser()
    import platformdirs  # (the engine's; only the engine and its kernels keep a cache)

    return Path(platformdirs.user_cache_dir("pagoda"))


def api_key() -> str | None:
    return _get("PAGODA_API_KEY")


def termination_log() -> str:
    return _get("PAGODA_TERMINATION_LOG") or TERMINATION_LOG_DEFAULT


def native_kernels() -> str:
    """As set, lower-cased ("auto" when unset); kernels/cpu/loader.py reads the choice out of it."""
    return os.environ.get("PAGODA_NATIVE_KERNELS", "auto").strip().lower()


def kernel_cache_seed() -> str | None:
    return _get("PAGODA_KERNEL_CACHE")


def onednn_linear() -> bool:
    return _switch("PAGODA_ONEDNN_LINEAR")


def cpu_linear() -> str:
    """As set, lower-cased ("auto" when unset); engine/models/cpu_linear_choice.py reads the choice out of it."""
    return os.environ.get("PAGODA_CPU_LINEAR", "auto").strip().lower()


def host_malloc_tuning() -> bool:
    return _switch("PAGODA_HOST_MALLOC_TUNING")


def core_threads() -> int | None:
    value = _get("PAGODA_CORE_THREADS")
    return int(value) if value else None


def core_share_cores() -> bool:
    return _switch("PAGODA_CORE_SHARE_CORES", default="0")


def engine_image() -> str | None:
    return _get("PAGODA_ENGINE_IMAGE")


def prometheus_url() -> str | None:
    return _get("PAGODA_PROMETHEUS_URL")


def download_image() -> str | None:
    return _get("PAGODA_DOWNLOAD_IMAGE")


def allow_runtime_lora_updating() -> bool:
    """vLLM's switch for the runtime LoRA routes: on for 1 or true (any case), as vLLM reads it."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")


def gguf_activations() -> str:
    """``PAGODA_GGUF_ACTIVATIONS``: how `--quantization gguf` multiplies its blocks at decode; ``float32``
    (the default: exact float32 activations against the decoded weights) or ``int8`` (activations quantized
    per 32 values, integer dot products). Anything else is refused where it is read."""
    return (_get("PAGODA_GGUF_ACTIVATIONS") or "float32").strip().lower()
