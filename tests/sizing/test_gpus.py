"""GFD label parsing and the GPU catalogue (REFERENCE.md's table)."""

import pytest
from pagoda.engine.sizing import (
    GPU_CATALOGUE,
    SizingError,
    lookup_gpu,
    parse_gfd_labels,
    plan,
    well_known_shape,
)

P, M, C = "nvidia.com/gpu.product", "nvidia.com/gpu.memory", "nvidia.com/gpu.count"
MAJ, MIN = "nvidia.com/gpu.compute.major", "nvidia.com/gpu.compute.minor"

# (gpu.product, gpu.memory MiB, compute capability, expected catalogue name) from REFERENCE.md
TABLE = [
    ("NVIDIA-H100-80GB-HBM3", 81559, (9, 0), "H100-SXM"),
    ("NVIDIA-H100-PCIe", 81559, (9, 0), "H100-PCIe"),
    ("NVIDIA-H100-NVL", 95830, (9, 0), "H100-NVL"),
    ("NVIDIA-H200", 143771, (9, 0), "H200"),
    ("NVIDIA-GH200-480GB", 97871, (9, 0), "GH200"),
    ("NVIDIA-A100-SXM4-40GB", 40960, (8, 0), "A100-40GB-SXM"),
    ("NVIDIA-A100-SXM4-80GB", 81920, (8, 0), "A100-80GB-SXM"),
    ("NVIDIA-A100-PCIE-40GB", 40960, (8, 0), "A100-40GB-PCIe"),
    ("NVIDIA-A100-80GB-PCIe", 81920, (8, 0), "A100-80GB-PCIe"),
    ("NVIDIA-L40S", 46068, (8, 9), "L40S"),
    ("NVIDIA-L4", 23034, (8, 9), "L4"),
    ("NVIDIA-A10G", 23028, (8, 6), "A10G"),
    ("NVIDIA-A10", 23028, (8, 6), "A10"),
    ("NVIDIA-GeForce-RTX-4090", 24564, (8, 9), "RTX-4090"),
    ("Tesla-T4", 15360, (7, 5), "T4"),
    ("NVIDIA-B200", 183359, (10, 0), "B200"),
]


def labels(product, memory=None, count=None, cc=None):
    out = {P: product}
    if memory is not None:
        out[M] = str(memory)
    if count is not None:
        out[C] = str(count)
    if cc is not None:
        out[MAJ], out[MIN] = str(cc[0]), str(cc[1])
    return out


def variants(product):
    bare = product.removeprefix("NVIDIA-")
    return [product, product + "-SHARED", bare, bare + "-SHARED"]


@pytest.mark.parametrize("product, memory, cc, name", TABLE)
def test_reference_table_parses(product, memory, cc, name):
    for text in variants(product):
        info = parse_gfd_labels(labels(text, memory, 4, cc))
        assert info.spec is not None and info.spec.name == name, text
        assert info.memory_mib == memory and info.count == 4 and info.compute_capability == cc
        assert info.shared == text.endswith("-SHARED")
        assert not [w for w in info.warnings if "catalogue" in w]
        # memory is a range: a driver reporting a little less is still the same card
        info = parse_gfd_labels(labels(text, int(memory * 0.98)))
        assert info.spec.name == name
        assert not [w for w in info.warnings if "outside" in w]


@pytest.mark.parametrize("product, memory, cc, name", TABLE)
def test_reference_table_parses_with_a_mig_suffix(product, memory, cc, name):
    for text in variants(product):
        mig = text.replace("-SHARED", "") + "-MIG-1g.5gb" + ("-SHARED" if text.endswith("-SHARED") else "")
        info = parse_gfd_labels(labels(mig, 4864, 7, cc))
        assert info.spec is not None and info.spec.name == name, mig
        assert info.memory_mib == 4864 and info.mig_profile == "1g.5gb" and info.compute_capability == cc
        assert not [w for w in info.warnings if "outside" in w or "catalogue" in w]


@pytest.mark.parametrize("product, memory, cc, name", TABLE)
def test_product_alone_is_enough(product, memory, cc, name):
    info = parse_gfd_labels({P: product})
    assert info.spec.name == name and info.memory_mib == memory and info.compute_capability == cc
    assert lookup_gpu(product).name == name


@pytest.mark.parametrize(
    "product, mig_memory, name",
    [
        ("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", 4864, "A100-40GB-SXM"),
        ("NVIDIA-A100-SXM4-80GB-MIG-3g.40gb", 40192, "A100-80GB-SXM"),
        ("NVIDIA-H100-80GB-HBM3-MIG-1g.10gb", 9856, "H100-SXM"),
        ("NVIDIA-H100-80GB-HBM3-MIG-1g.10gb+me", 9856, "H100-SXM"),
        ("NVIDIA-H200-MIG-2g.35gb", 33280, "H200"),
        ("A100-SXM4-40GB-MIG-2g.10gb-SHARED", 9984, "A100-40GB-SXM"),
    ],
)
def test_mig_uses_the_slice_memory(product, mig_memory, name):
    info = parse_gfd_labels(labels(product, mig_memory, 7))
    assert info.spec.name == name
    assert info.memory_mib == mig_memory  # the slice, not the card
    assert info.mig_profile and info.mig_profile in product
    assert "MIG" in info.name
    # without a memory label, the profile name gives the slice size
    no_memory = parse_gfd_labels({P: product})
    gb = int(info.mig_profile.split(".")[1].split("gb")[0])
    assert no_memory.memory_mib == gb * 1024


def test_mig_slice_plans_smaller_than_the_card():
    small = well_known_shape("SmolLM2-135M")
    whole = plan(small, parse_gfd_labels(labels("NVIDIA-A100-SXM4-40GB", 40960)))
    slice_ = plan(small, parse_gfd_labels(labels("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", 4864)))
    assert slice_.num_gpu_blocks < whole.num_gpu_blocks / 5


def test_memory_outside_the_range_warns_and_uses_the_label():
    info = parse_gfd_labels(labels("NVIDIA-L4", 16000))
    assert info.spec.name == "L4" and info.memory_mib == 16000
    assert any("outside the expected range" in w for w in info.warnings)


def test_memory_decides_between_cards_of_one_family():
    # a product string we do not list verbatim, told apart by memory
    assert parse_gfd_labels(labels("NVIDIA-A100-SXM4", 81920)).spec.name == "A100-80GB-SXM"
    assert parse_gfd_labels(labels("NVIDIA-A100-SXM4", 40960)).spec.name == "A100-40GB-SXM"
    assert parse_gfd_labels(labels("Tesla-V100-SXM2", 32510)).spec.name == "V100-32GB"


@pytest.mark.parametrize(
    "short, name",
    [("H100", "H100-SXM"), ("L4", "L4"), ("A100-80GB", "A100-80GB-SXM"), ("a100", "A100-40GB-SXM"),
     ("h200", "H200"), ("L40S", "L40S"), ("RTX-4090", "RTX-4090"), ("T4", "T4"), ("V100", "V100-16GB"),
     ("B200", "B200"), ("H20", "H20"), ("L40", "L40"), ("RTX-6000-Ada", "RTX-6000-Ada"), ("A10", "A10")],
)  # fmt: skip
def test_short_names(short, name):
    assert lookup_gpu(short).name == name


def test_lookup_unknown_names_the_known():
    with pytest.raises(SizingError, match="unknown GPU 'Z9000'.*H100-SXM"):
        lookup_gpu("Z9000")


def test_unknown_product_with_memory_and_compute_warns():
    info = parse_gfd_labels(labels("NVIDIA-Z9000", 65536, 2, (9, 0)))
    assert info.spec is None and info.memory_mib == 65536 and info.compute_capability == (9, 0)
    assert info.fp8 and info.count == 2
    assert any("not in the catalogue" in w for w in info.warnings)
    p = plan(well_known_shape("Llama-3.1-8B"), info)
    assert any("not in the catalogue" in w for w in p.warnings)
    assert p.num_gpu_blocks > 0


def test_unknown_product_without_memory_or_compute_names_the_labels():
    read = {P: "NVIDIA-Z9000", C: "1", "nvidia.com/gpu.family": "mystery"}
    with pytest.raises(SizingError) as e:
        parse_gfd_labels(read)
    msg = str(e.value)
    assert "NVIDIA-Z9000" in msg and "nvidia.com/gpu.family" in msg and M in msg and MAJ in msg


def test_no_labels_at_all_is_an_error():
    with pytest.raises(SizingError, match="no nvidia.com/gpu.product label"):
        parse_gfd_labels({"kubernetes.io/hostname": "node-1"})


def test_bad_integer_label_names_it():
    with pytest.raises(SizingError, match="nvidia.com/gpu.memory='lots'"):
        parse_gfd_labels({P: "NVIDIA-L4", M: "lots"})


def test_catalogue_covers_the_issue_list():
    names = {s.name for s in GPU_CATALOGUE}
    for want in ["H100-SXM", "H100-PCIe", "H100-NVL", "H200", "H20", "GH200", "B200", "A100-40GB-SXM",
                 "A100-80GB-SXM", "A100-40GB-PCIe", "A100-80GB-PCIe", "A10", "A10G", "L4", "L40", "L40S",
                 "RTX-4090", "RTX-6000-Ada", "T4", "V100-16GB", "V100-32GB"]:  # fmt: skip
        assert want in names
    for spec in GPU_CATALOGUE:
        assert spec.memory_mib > 10_000 and spec.bandwidth_gbps > 0 and spec.interconnect
        assert spec.fp8 == (spec.compute_capability >= (8, 9))


@pytest.mark.parametrize("gpu", ["A100-40GB", "A100-80GB", "NVIDIA-A100-80GB-PCIe", "A10", "A10G", "T4"])  # fmt: skip
def test_fp8_never_on_older_gpus(gpu):
    shape = well_known_shape("SmolLM2-135M")
    info = parse_gfd_labels({P: lookup_gpu(gpu).labels[0]})
    assert not info.fp8
    assert plan(shape, info).kv_cache_dtype == "auto"
    assert "below 8.9" in plan(shape, info).reasons["kv_cache_dtype"]


@pytest.mark.parametrize("gpu", ["H100", "H100-PCIe", "H200", "L40S", "L4", "RTX-4090", "B200", "H20"])
def test_fp8_offered_on_new_gpus_unless_quality_first(gpu):
    from pagoda.engine.sizing import Hints

    shape = well_known_shape("Llama-3.1-8B")
    info = parse_gfd_labels({P: lookup_gpu(gpu).labels[0]})
    assert info.fp8
    p = plan(shape, info)
    assert p.kv_cache_dtype == "fp8" and p.kv_bytes_per_token == 65_536
    q = plan(shape, info, Hints(quality_first=True))
    assert q.kv_cache_dtype == "auto" and q.kv_bytes_per_token == 131_072
    assert "quality first" in q.reasons["kv_cache_dtype"]
    assert q.num_gpu_blocks < p.num_gpu_blocks


def test_shared_memory_per_block_of_the_catalogue():
    """The opt-in shared memory per block by compute capability (CUDA C++ Programming Guide): what the
    Triton kernels' tiles must fit."""
    want = {"T4": 65_536, "A10": 101_376, "A10G": 101_376, "L4": 101_376, "L40S": 101_376, "RTX-4090": 101_376,
            "A100-40GB-SXM": 166_912, "A100-80GB-PCIe": 166_912, "H100-SXM": 232_448, "H200": 232_448,
            "GH200": 232_448, "B200": 232_448, "V100-16GB": 98_304}  # fmt: skip
    for name, smem in want.items():
        assert lookup_gpu(name).shared_memory_per_block == smem, name
    assert all(spec.shared_memory_per_block >= 65_536 for spec in GPU_CATALOGUE)


@pytest.mark.parametrize("kv", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_is_refused_below_compute_capability_8_9_naming_gpu_and_alternatives(kv):
    from pagoda.engine.sizing.errors import UnsupportedOnGPU
    from pagoda.engine.sizing.gpus import check_dtypes

    with pytest.raises(UnsupportedOnGPU) as e:
        check_dtypes("A100-80GB-SXM", (8, 0), "bfloat16", kv)
    msg = str(e.value)
    assert "A100-80GB-SXM" in msg and "compute capability 8.0" in msg and f"--kv-cache-dtype {kv}" in msg
    assert "--kv-cache-dtype int8" in msg and "auto" in msg
    check_dtypes("L4", (8, 9), "bfloat16", kv)  # Ada has FP8
    with pytest.raises(UnsupportedOnGPU, match=r"T4 \(compute capability 7\.5\).*--dtype float16"):
        check_dtypes("T4", (7, 5), "bfloat16", "auto")
    check_dtypes("T4", (7, 5), "float16", "int8")
