"""Sizing: model shape x GPU type x workload hints -> engine settings, each with its reason.

Pure Python (no torch) so the operator and the engine share one set of rules.
"""

from pagoda.engine.sizing.engine_plan import EnginePlan, MemoryProfile, engine_plan
from pagoda.engine.sizing.errors import SizingError, StartupFitError, UnsupportedGPUError
from pagoda.engine.sizing.fit import fit_max_model_len, num_blocks_for
from pagoda.engine.sizing.gpus import (
    ENGINE_MIN_COMPUTE,
    GPU_CATALOGUE,
    GPUInfo,
    GPUSpec,
    gpu_info,
    lookup_gpu,
    parse_gfd_labels,
    split_product_label,
)
from pagoda.engine.sizing.planner import (
    Hints,
    Plan,
    activation_bytes,
    cuda_context_bytes,
    kaito_kv_cache_bytes,
    plan,
)
from pagoda.engine.sizing.shapes import (
    ModelShape,
    dtype_bytes,
    shape_from_config,
    shape_from_path,
    well_known_model_ids,
    well_known_shape,
)
from pagoda.engine.sizing.units import human_bytes, parse_bytes

__all__ = [
    "ENGINE_MIN_COMPUTE",
    "GPU_CATALOGUE",
    "EnginePlan",
    "MemoryProfile",
    "StartupFitError",
    "UnsupportedGPUError",
    "engine_plan",
    "GPUInfo",
    "GPUSpec",
    "Hints",
    "ModelShape",
    "Plan",
    "SizingError",
    "activation_bytes",
    "cuda_context_bytes",
    "dtype_bytes",
    "fit_max_model_len",
    "gpu_info",
    "human_bytes",
    "kaito_kv_cache_bytes",
    "lookup_gpu",
    "num_blocks_for",
    "parse_bytes",
    "parse_gfd_labels",
    "plan",
    "shape_from_config",
    "shape_from_path",
    "split_product_label",
    "well_known_model_ids",
    "well_known_shape",
]
