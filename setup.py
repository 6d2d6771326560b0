"""Maps the folders engine/, kernels/, operator/, router/ and cli/ onto the pagoda.* namespace.

A bare `operator` would shadow the standard library and a bare `kernels` collides with a Hugging Face
package, so the folders are only ever importable as pagoda.engine, pagoda.kernels and pagoda.operator.
"""

from setuptools import find_packages, setup

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

setup(packages=packages, package_dir=package_dir)
