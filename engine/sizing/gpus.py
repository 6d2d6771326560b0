"""GPU catalogue and the parsing of GPU Feature Discovery (GFD) node labels.

GFD writes `nvidia.com/gpu.product` as the NVML name with spaces turned to dashes, appends `-SHARED` under
time-slicing and `-MIG-<profile>` under the MIG single strategy, and old drivers drop the `NVIDIA-` prefix.
Memory values move with driver and ECC settings, so memory is only ever compared as a range.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pagoda.engine.sizing.errors import SizingError, UnsupportedGPUError, UnsupportedOnGPU
from pagoda.engine.sizing.kv_dtypes import BF16_MIN_COMPUTE, FP8_MIN_COMPUTE, check_kv_cache_dtype

# Shared memory one thread block may opt in to, by compute capability (CUDA C++ Programming Guide,
# "Technical Specifications per Compute Capability": 96, 64, 163, 99, 163, 99, 227, 227, 99 KB): the
# budget the Triton kernels' tiles must fit (pagoda.kernels.launch_config).
SHARED_MEMORY_PER_BLOCK = {
    (7, 0): 98_304, (7, 5): 65_536, (8, 0): 166_912, (8, 6): 101_376, (8, 7): 166_912, (8, 9): 101_376,
    (9, 0): 232_448, (10, 0): 232_448, (12, 0): 101_376,
}  # fmt: skip
# The torch build of the engine image (images/engine/Dockerfile, docs/images.md): PyPI's torch 2.13.0, the
# CUDA 13.0 build, and the CUDA architectures it carries kernels for (what torch.cuda.get_arch_list() reported
# on an H100; CUDA 13 has no Volta: 7.0 is gone). A GPU runs code built for its major version and a minor at
# most its own (8.9 runs sm_86 code). CUDA 13.0 needs an NVIDIA driver of 580 or newer.
ENGINE_CUDA = "13.0"
ENGINE_MIN_DRIVER = 580
ENGINE_TORCH_BUILD = f"torch 2.13.0 (CUDA {ENGINE_CUDA}, PyPI)"
TORCH_WHEEL_ARCHS = ((7, 5), (8, 0), (8, 6), (9, 0), (10, 0), (12, 0))
ENGINE_MIN_COMPUTE = TORCH_WHEEL_ARCHS[0]

# How far a reported memory may stray from the catalogue value and still be the same card.
MEMORY_TOLERANCE = 0.06

LABEL_PRODUCT = "nvidia.com/gpu.product"
LABEL_MEMORY = "nvidia.com/gpu.memory"
LABEL_COUNT = "nvidia.com/gpu.count"
LABEL_MAJOR = "nvidia.com/gpu.compute.major"
LABEL_MINOR = "nvidia.com/gpu.compute.minor"


@dataclass(frozen=True)
class GPUSpec:
    """One GPU model as the datasheet and GFD describe it."""

    name: str  # short name: "H100-SXM", "L4", "A100-80GB-SXM"
    labels: tuple[str, ...]  # GFD product strings (first is canonical)
    memory_mib: int  # as nvidia.com/gpu.memory reports it
    compute_capability: tuple[int, int]
    bandwidth_gbps: float  # memory bandwidth, GB/s (datasheet)
    interconnect: str
    aliases: tuple[str, ...] = ()  # other short names people type

    @property
    def fp8(self) -> bool:
        return self.compute_capability >= FP8_MIN_COMPUTE

    @property
    def shared_memory_per_block(self) -> int:
        return SHARED_MEMORY_PER_BLOCK[self.compute_capability]

    @property
    def product_labels(self) -> tuple[str, ...]:
        return self.labels

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib << 20


def _spec(name, labels, memory_mib, cc, bandwidth, interconnect, aliases=()) -> GPUSpec:
    return GPUSpec(name, tuple(labels), memory_mib, cc, float(bandwidth), interconnect, tuple(aliases))


GPU_CATALOGUE: tuple[GPUSpec, ...] = (
    _spec("H100-SXM", ["NVIDIA-H100-80GB-HBM3"], 81559, (9, 0), 3350, "NVLink 4 (900 GB/s)",
          ["H100", "H100-80GB", "H100-SXM5", "H100-80GB-HBM3"]),
    _spec("H100-PCIe", ["NVIDIA-H100-PCIe"], 81559, (9, 0), 2000, "PCIe Gen5", ["H100-PCIE-80GB"]),
    _spec("H100-NVL", ["NVIDIA-H100-NVL"], 95830, (9, 0), 3900, "NVLink bridge (600 GB/s)", ["H100-94GB"]),
    _spec("H200", ["NVIDIA-H200", "NVIDIA-H200-141GB-HBM3e"], 143771, (9, 0), 4800, "NVLink 4 (900 GB/s)",
          ["H200-SXM", "H200-141GB"]),
    _spec("H200-NVL", ["NVIDIA-H200-NVL"], 143771, (9, 0), 4800, "NVLink bridge (900 GB/s)"),
    _spec("H20", ["NVIDIA-H20"], 97871, (9, 0), 4000, "NVLink 4 (900 GB/s)", ["H20-96GB"]),
    _spec("GH200", ["NVIDIA-GH200-480GB"], 97871, (9, 0), 4000, "NVLink-C2C (900 GB/s)", ["GH200-96GB"]),
    _spec("GH200-144GB", ["NVIDIA-GH200-144G-HBM3e"], 146831, (9, 0), 4900, "NVLink-C2C (900 GB/s)"),
    _spec("B200", ["NVIDIA-B200"], 183359, (10, 0), 8000, "NVLink 5 (1800 GB/s)", ["B200-180GB"]),
    _spec("A100-40GB-SXM", ["NVIDIA-A100-SXM4-40GB"], 40960, (8, 0), 1555, "NVLink 3 (600 GB/s)",
          ["A100", "A100-40GB", "A100-SXM4-40GB"]),
    _spec("A100-80GB-SXM", ["NVIDIA-A100-SXM4-80GB"], 81920, (8, 0), 2039, "NVLink 3 (600 GB/s)",
          ["A100-80GB", "A100-SXM4-80GB"]),
    _spec("A100-40GB-PCIe", ["NVIDIA-A100-PCIE-40GB"], 40960, (8, 0), 1555, "PCIe Gen4",
          ["A100-PCIE-40GB"]),
    _spec("A100-80GB-PCIe", ["NVIDIA-A100-80GB-PCIe"], 81920, (8, 0), 1935, "PCIe Gen4",
          ["A100-PCIE-80GB"]),
    _spec("A10G", ["NVIDIA-A10G"], 23028, (8, 6), 600, "PCIe Gen4"),
    _spec("A10", ["NVIDIA-A10"], 23028, (8, 6), 600, "PCIe Gen4"),
    _spec("L4", ["NVIDIA-L4"], 23034, (8, 9), 300, "PCIe Gen4"),
    _spec("L40", ["NVIDIA-L40"], 46068, (8, 9), 864, "PCIe Gen4"),
    _spec("L40S", ["NVIDIA-L40S"], 46068, (8, 9), 864, "PCIe Gen4"),
    _spec("RTX-4090", ["NVIDIA-GeForce-RTX-4090"], 24564, (8, 9), 1008, "PCIe Gen4",
          ["RTX4090", "GeForce-RTX-4090", "4090"]),
    _spec("RTX-6000-Ada", ["NVIDIA-RTX-6000-Ada-Generation"], 49140, (8, 9), 960, "PCIe Gen4",
          ["RTX6000-Ada", "RTX-6000-Ada-Generation"]),
    _spec("T4", ["Tesla-T4"], 15360, (7, 5), 320, "PCIe Gen3", ["Tesla-T4"]),
    _spec("V100-16GB", ["Tesla-V100-SXM2-16GB", "Tesla-V100-PCIE-16GB"], 16160, (7, 0), 900,
          "NVLink 2 (300 GB/s)", ["V100", "V100-SXM2-16GB", "V100-PCIE-16GB"]),
    _spec("V100-32GB", ["Tesla-V100-SXM2-32GB", "Tesla-V100-PCIE-32GB", "Tesla-V100S-PCIE-32GB"], 32510,
          (7, 0), 900, "NVLink 2 (300 GB/s)", ["V100-SXM2-32GB", "V100-PCIE-32GB", "V100S"]),
)  # fmt: skip

_MIG = re.compile(r"-MIG-(\d+g\.(\d+)gb(?:\+me)?)$", re.IGNORECASE)
_SHARED = re.compile(r"-SHARED$", re.IGNORECASE)
_VENDOR = re.compile(r"^(NVIDIA-|TESLA-)", re.IGNORECASE)


def _key(text: str) -> str:
    """Compare labels case-blind, with spaces or underscores read as dashes and no vendor prefix."""
    text = re.sub(r"[\s_]+", "-", text.strip()).upper()
    while True:
        stripped = _VENDOR.sub("", text)
        if stripped == text:
            return text
        text = stripped


def _index() -> dict[str, GPUSpec]:
    index: dict[str, GPUSpec] = {}
    for spec in GPU_CATALOGUE:
        for text in (spec.name, *spec.labels, *spec.aliases):
            index.setdefault(_key(text), spec)
    return index


_INDEX = _index()


def _memory_matches(spec: GPUSpec, memory_mib: int) -> bool:
    return abs(memory_mib - spec.memory_mib) <= MEMORY_TOLERANCE * spec.memory_mib


def _find(product: str, memory_mib: int | None = None) -> GPUSpec | None:
    key = _key(product)
    if key in _INDEX:
        return _INDEX[key]
    # A product string we do not list verbatim (e.g. "NVIDIA-H100-80GB-HBM3-XYZ" or "A100-SXM4"): take
    # the catalogue entries whose label starts with it or that it starts with, then let memory decide.
    found = {
        spec
        for text, spec in _INDEX.items()
        if len(text) >= 3 and (key.startswith(text + "-") or text.startswith(key + "-"))
    }
    if memory_mib is not None:
        found = {s for s in found if _memory_matches(s, memory_mib)}
    if len(found) == 1:
        return found.pop()
    return None


def check_dtypes(gpu: str, compute_capability: tuple[int, int], dtype: str, kv_cache_dtype: str) -> None:
    """Refuse what this GPU cannot run, naming the GPU, its compute capability and what to use instead: an
    FP8 KV cache below compute capability 8.9 (Triton has no e4m3 there; the planner never picks FP8
    there) and bfloat16 below 8.0 (no bfloat16 tensor cores; `--dtype auto` picks float16 there)."""
    major, minor = compute_capability
    check_kv_cache_dtype(kv_cache_dtype, gpu, compute_capability)
    where = f"{gpu} (compute capability {major}.{minor})"
    if dtype == "bfloat16" and tuple(compute_capability) < BF16_MIN_COMPUTE:
        raise UnsupportedOnGPU(
            f"--dtype bfloat16 needs compute capability {BF16_MIN_COMPUTE[0]}.{BF16_MIN_COMPUTE[1]} or newer; "
            f"{where} has no bfloat16 tensor cores. Use --dtype float16 (or auto, which picks it there)"
        )


def lookup_gpu(name_or_label: str) -> GPUSpec:
    """Find a GPU by short name ("H100", "L4", "A100-80GB") or GFD product label (suffixes allowed)."""
    product, _, _ = split_product_label(name_or_label)
    spec = _find(product)
    if spec is None:
        known = ", ".join(s.name for s in GPU_CATALOGUE)
        raise SizingError(f"unknown GPU {name_or_label!r}; known GPUs: {known} (or their GFD product labels)")
    return spec


def split_product_label(label: str) -> tuple[str, bool, str | None]:
    """ "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb-SHARED" -> ("NVIDIA-A100-SXM4-40GB", shared=True, mig="1g.5gb")."""
    text = label.strip()
    shared = bool(_SHARED.search(text))
    text = _SHARED.sub("", text)
    mig = None
    m = _MIG.search(text)
    if m:
        mig = m.group(1)
        text = text[: m.start()]
    return text, shared, mig


@dataclass
class GPUInfo:
    """What a node (or a user) tells us about its GPUs, normalised. memory_mib is per GPU, or per MIG slice."""

    spec: GPUSpec | None
    product_label: str
    memory_mib: int
    count: int = 1
    compute_capability: tuple[int, int] = (0, 0)
    warnings: list[str] = field(default_factory=list)
    shared: bool = False  # time-sliced: other pods may use the same GPU
    mig_profile: str | None = None

    @property
    def name(self) -> str:
        base = self.spec.name if self.spec else self.product_label or "unknown GPU"
        return f"{base} MIG {self.mig_profile}" if self.mig_profile else base

    @property
    def fp8(self) -> bool:
        return self.compute_capability >= FP8_MIN_COMPUTE

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib << 20

    @classmethod
    def from_spec(cls, spec: GPUSpec, count: int = 1) -> GPUInfo:
        return cls(spec, spec.labels[0], spec.memory_mib, count, spec.compute_capability)


def torch_supports(cc: tuple[int, int], archs: tuple[tuple[int, int], ...] = TORCH_WHEEL_ARCHS) -> bool:
    return any(major == cc[0] and minor <= cc[1] for major, minor in archs)


def check_engine_runs_on(gpu: GPUInfo) -> None:
    """Raise UnsupportedGPUError for a GPU the engine image's torch build cannot run (an unknown compute
    capability passes: the engine's own start-up says more)."""
    cc = gpu.compute_capability
    if cc != (0, 0) and not torch_supports(cc):
        archs = ", ".join(f"{major}.{minor}" for major, minor in TORCH_WHEEL_ARCHS)
        raise UnsupportedGPUError(
            f"{gpu.name} has compute capability {cc[0]}.{cc[1]}; the engine image's {ENGINE_TORCH_BUILD} has "
            f"kernels for compute capability {archs} (Turing and newer; NVIDIA driver {ENGINE_MIN_DRIVER} or "
            "newer): use another GPU, or gpu.count: 0 for CPU pods"
        )


def gpu_info(name_or_label: str, count: int = 1) -> GPUInfo:
    """A GPUInfo for a short name or product label (what `pagoda plan --gpu` takes)."""
    return parse_gfd_labels({LABEL_PRODUCT: name_or_label, LABEL_COUNT: str(count)})


def _int_label(labels: dict[str, str], key: str) -> int | None:
    value = labels.get(key)
    if value is None or str(value).strip() == "":
        return None
    try:
        return int(str(value).strip())
    except ValueError:
        raise SizingError(f"label {key}={value!r} is not an integer") from None


def parse_gfd_labels(labels: dict[str, str]) -> GPUInfo:
    """Read a node's GFD labels into a GPUInfo; unknown but described GPUs pass with a warning."""
    product_label = str(labels.get(LABEL_PRODUCT, "") or "").strip()
    memory = _int_label(labels, LABEL_MEMORY)
    count = _int_label(labels, LABEL_COUNT)
    major, minor = _int_label(labels, LABEL_MAJOR), _int_label(labels, LABEL_MINOR)
    count = 1 if count is None else count
    if count < 0:
        raise SizingError(f"label {LABEL_COUNT}={count} must not be negative")
    warnings: list[str] = []

    product, shared, mig = split_product_label(product_label) if product_label else ("", False, None)
    spec = _find(product, memory) if product else None

    if spec is not None:
        if memory is None:
            memory = _mig_memory_mib(mig) if mig else spec.memory_mib
        elif not mig and not _memory_matches(spec, memory):
            warnings.append(
                f"{LABEL_MEMORY}={memory} MiB is outside the expected range for {spec.name} "
                f"({spec.memory_mib} MiB ±{MEMORY_TOLERANCE:.0%}); sizing with the reported {memory} MiB"
            )
        cc = spec.compute_capability
        if major is not None and (major, minor or 0) != cc:
            warnings.append(
                f"compute capability labels say {major}.{minor or 0} but {spec.name} is {cc[0]}.{cc[1]}; "
                f"trusting the labels"
            )
            cc = (major, minor or 0)
    else:
        if memory is None and mig:
            memory = _mig_memory_mib(mig)
        if memory is None or major is None:
            read = {k: v for k, v in labels.items() if k.startswith("nvidia.com/")} or dict(labels)
            missing = [k for k, v in ((LABEL_MEMORY, memory), (LABEL_MAJOR, major)) if v is None]
            what = f"unknown GPU product {product_label!r}" if product_label else f"no {LABEL_PRODUCT} label"
            raise SizingError(
                f"cannot size for this GPU: {what} and no {' or '.join(missing)} label to go on; "
                f"labels read: {read}"
            )
        cc = (major, minor or 0)
        warnings.append(
            f"GPU {product_label or '(no product label)'} is not in the catalogue; sizing from its labels "
            f"({memory} MiB, compute capability {cc[0]}.{cc[1]}) with no bandwidth or interconnect data"
        )
    if shared:
        warnings.append(
            "GPU is time-sliced (-SHARED): other pods share its memory, so the plan's memory figures are "
            "optimistic; set a lower gpu_memory_utilization if the sharers are known"
        )
    return GPUInfo(spec, product_label or (spec.labels[0] if spec else ""), memory, count, cc, warnings,
                   shared, mig)  # fmt: skip


def _mig_memory_mib(profile: str) -> int:
    m = re.match(r"\d+g\.(\d+)gb", profile, re.IGNORECASE)
    return int(m.group(1)) * 1024 if m else 0
