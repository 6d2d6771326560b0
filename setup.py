"""Maps the folders engine/, kernels/, operator/, router/ and cli/ onto the pagoda.* namespace.

A bare `operator` would shadow the standard library and a bare `kernels` collides with a Hugging Face
package, so the folders are only ever importable as pagoda.engine, pagoda.kernels and pagoda.operator.
"""

import importlib.util
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

FOLDERS = {
    "engine": "pagoda.engine",
    "kernels": "pagoda.kernels",
    "operator": "pagoda.operator",
    "cli": "pagoda.cli",  # the `pagoda` command, over both halves
    "router": "pagoda.router",  # the KV-aware router in front of the replicas
}

packages, package_dir = [], {}
for folder, name in FOLDERS.items():
    packages.append(name)
    package_dir[name] = folder
    for sub in find_packages(folder):
        packages.append(f"{name}.{sub}")
        package_dir[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"


class BuildPyWithCpuKernels(build_py):
    """Also builds the C kernels of the CPU path (kernels/cpu/build.py, every variant) into the package, so
    nothing is compiled at run time. Into the source tree for an editable install (its package directory).
    Without a compiler the install still succeeds: the engine then compiles on first use or runs torch."""

    def run(self) -> None:
        super().run()
        spec = importlib.util.spec_from_file_location(
            "_pagoda_cpu_build", Path(__file__).parent / "kernels/cpu/build.py"
        )
        builder = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # (dataclasses look it up)
        spec.loader.exec_module(builder)
        dest = builder.DEFAULT_DEST if self.editable_mode else Path(self.build_lib, "pagoda/kernels/cpu/lib")
        try:
            manifest = builder.build(dest)
        except RuntimeError as exc:
            print(f"warning: the CPU kernels were not built ahead: {exc}", file=sys.stderr)
            return
        for lib, err in manifest["errors"].items():
            print(f"warning: CPU kernel library {lib} was not built: {err}", file=sys.stderr)


setup(packages=packages, package_dir=package_dir, cmdclass={"build_py": BuildPyWithCpuKernels})
