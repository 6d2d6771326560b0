"""The packages the check carries to a GPU machine that reaches no package index, and their installation.

`make gpu-check-prepare` downloads these wheels into `.whl/` (ignored by git; a device run names it in
`carry`). At start the check installs, into a temporary `--target` folder on PYTHONPATH, only those the
machine does not already have: its own torch, Triton, transformers, numpy ... are what it runs on.

CARRIED is what `pagoda serve` and the check's other steps import beyond what a typical CUDA machine image
holds (GPU_IMAGE: the package list of the lent H100/H200 image, 2026-11), pinned to the versions the
project's environment resolves. The dry mode checks that every distribution its imports load is in one
of the two lists (or OPTIONAL: used when present, not needed).
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WHEEL_DIR = REPO / ".whl"

# name==version; pure Python unless marked. The server (FastAPI over uvicorn, pydantic models), the engine
# core's process (ZMQ, msgspec), the grammar engine built at start-up (xgrammar + its FFI runtime).
CARRIED = (
    "fastapi==0.165.0",
    "starlette==1.10.0",
    "opentelemetry-api==1.45.2",  # fastapi requires it
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",  # native
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "uvicorn==0.54.0",
    "msgspec==0.22.0",  # native
    "pyzmq==27.3.0",  # native
    "platformdirs==4.14.8",
    "xgrammar==0.2.8",  # native
    "apache-tvm-ffi==0.1.15.post2",  # native (xgrammar's runtime)
)

# The lent GPU image's Python packages (.library/device/KINDS.md, read 2026-11-17), normalised names.
GPU_IMAGE = frozenset(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
    certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
    jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
    linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
    mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
    numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
    nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
    nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
    onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
    orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
    propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
    pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
    pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
    scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
    sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
    tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
    torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
    wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split()
)

# Imported when installed, never needed: uvicorn's faster HTTP parser, reloaders and websockets, optional
# codecs and transports of httpx, form parsing and e-mail validation of FastAPI/pydantic.
OPTIONAL = frozenset(
    """httptools websockets watchfiles python-dotenv python-multipart email-validator dnspython brotli
    h2 hpack hyperframe socksio sniffio httpcore2 httpx2 importlib-metadata jsonschema
    jsonschema-specifications referencing rpds-py truststore""".split()
)

PYTHON_VERSIONS = ("3.12",)  # the lent GPU machines' Python; `make gpu-check-prepare PYTHONS="3.11 3.12"`
PLATFORMS = ("manylinux1_x86_64", "manylinux2014_x86_64", *(f"manylinux_2_{n}_x86_64" for n in range(17, 40)))


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def carried_names() -> list[str]:
    return [normalise(req.split("==")[0]) for req in CARRIED]


def prepare(dest: Path = WHEEL_DIR, pythons: tuple[str, ...] = PYTHON_VERSIONS) -> list[str]:
    """Download CARRIED for each Python version (x86-64 Linux wheels, no dependencies: the list is closed)
    with this machine's pip and its index configuration; returns the wheel files now in ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for python in pythons:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               python, "--implementation", "cp", "-d", str(dest), *CARRIED]  # fmt: skip
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
        subprocess.run(cmd, check=True)
    return sorted(p.name for p in dest.glob("*.whl"))


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def install(target: Path, source: Path = WHEEL_DIR) -> dict:
    """Install into ``target`` the carried packages this Python lacks, from the wheels in ``source`` (pip
    picks each one's wheel for this interpreter); returns what was found, installed or missing."""
    have = {name: installed_version(name) for name in carried_names()}
    need = [name for name, version in have.items() if version is None]
    report: dict = {
        "machine_has": {k: v for k, v in have.items() if v},
        "installed": [],
        "wheel_dir": str(source),
        "wheels": sorted(p.name for p in source.glob("*.whl")) if source.is_dir() else [],
    }
    if not need:
        return report
    if not report["wheels"]:
        report["error"] = (
            f"{', '.join(need)} missing here and no wheels in {source} (run `make gpu-check-prepare` where "
            "a package index is reachable, and carry .whl)"
        )
        return report
    target.mkdir(parents=True, exist_ok=True)
    pinned = [req for req in CARRIED if normalise(req.split("==")[0]) in need]
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--disable-pip-version-check", "--find-links", str(source), "--target", str(target), *pinned]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        report["error"] = f"pip install from {source} failed: {(done.stderr or done.stdout)[-1500:]}"
    else:
        report["installed"] = pinned
    return report


def unexpected(distributions: set[str]) -> list[str]:
    """Distributions that an import loaded and that the GPU image may lack: neither there, carried nor
    optional. Empty when the carried list is complete."""
    known = GPU_IMAGE | set(carried_names()) | OPTIONAL
    return sorted(d for d in map(normalise, distributions) if d not in known)


def loaded_distributions() -> set[str]:
    """The distributions whose top-level modules this interpreter has imported (the standard library and
    our own code excluded). A namespace package several distributions share (`google`: protobuf, and the
    router's xds-protos) is attributed by its second level, so importing protobuf does not count them all."""
    mapping = importlib.metadata.packages_distributions()
    stdlib = set(sys.stdlib_module_names)
    shared = {top for top, dists in mapping.items() if len(set(dists)) > 1}
    by_second = _second_level_owners(shared) if shared else {}
    found: set[str] = set()
    for module in list(sys.modules):
        top, _, rest = module.partition(".")
        if top in stdlib or top.startswith("_") or top in ("pagoda", "gpu_check", "pagoda_testkit"):
            continue
        if top in shared:
            second = rest.partition(".")[0]
            found.update(by_second.get((top, second), []) if second else [])
            continue
        found.update(mapping.get(top, []))
    return found


def _second_level_owners(tops: set[str]) -> dict[tuple[str, str], list[str]]:
    """(namespace, sub-package) -> the distributions whose files lie under it."""
    owners: dict[tuple[str, str], list[str]] = {}
    for dist in importlib.metadata.distributions():
        seen: set[tuple[str, str]] = set()
        for f in dist.files or ():
            parts = f.parts
            if len(parts) > 2 and parts[0] in tops and (parts[0], parts[1]) not in seen:
                key = (parts[0], parts[1].removesuffix(".py"))
                seen.add(key)
                owners.setdefault(key, []).append(dist.metadata["Name"])
    return owners
