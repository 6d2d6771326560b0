"""Engine configuration: one dataclass, field names as vLLM's flags (dashes become underscores)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
DTYPES = ("auto", "float32", "float16", "bfloat16", "fp32", "fp16", "bf16", "half", "float")


@dataclass
class EngineConfig:
    model: str | None = None  # HF directory, GGUF file, hub id with a local copy, or None = embedded default
    served_model_name: str | None = None
    dtype: str = "auto"  # auto = float32 on CPU, the checkpoint's dtype on CUDA
    device: str = "auto"  # auto | cpu | cuda
    block_size: int = 16
    max_model_len: int | str | None = None  # None = the model's limit, "auto" = largest that fits
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None = per-device default
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_cache_dtype: str = "auto"
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    scheduling_policy: str = "fcfs"  # fcfs | priority
    preemption_mode: str = "recompute"  # recompute | swap
    attention_backend: str = "auto"  # auto | torch | triton
    tensor_parallel_size: int = 1
    seed: int = 0
    # Offload tiers (issue: KV offload).
    kv_offload_host_bytes: int | None = None
    kv_offload_disk_dir: str | None = None
    kv_offload_disk_bytes: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if self.block_size not in (8, 16, 32, 64, 128):
            bad("block_size", "must be one of 8, 16, 32, 64, 128")
        if isinstance(self.max_model_len, str) and self.max_model_len != "auto":
            try:
                self.max_model_len = int(self.max_model_len)
            except ValueError:
                bad("max_model_len", "must be an integer or 'auto'")
        if isinstance(self.max_model_len, int) and self.max_model_len < 1:
            bad("max_model_len", "must be at least 1")
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
        if self.scheduling_policy not in ("fcfs", "priority"):
            bad("scheduling_policy", "must be 'fcfs' or 'priority'")
        if self.preemption_mode not in ("recompute", "swap"):
            bad("preemption_mode", "must be 'recompute' or 'swap'")
        if self.attention_backend not in ("auto", "torch", "triton"):
            bad("attention_backend", "must be 'auto', 'torch' or 'triton'")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            bad("device", "must be 'auto', 'cpu' or 'cuda'")
        if self.tensor_parallel_size != 1:
            bad("tensor_parallel_size", "must be 1 (tensor parallelism is not implemented yet)")

    def to_dict(self) -> dict:
        return asdict(self)
