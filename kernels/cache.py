"""The Triton cache a GPU pod starts with: kernels compiled into the image, linked into a writable cache.

The engine image compiles its kernels at build time (`pagoda kernels warm --cache-dir $PAGODA_KERNEL_CACHE`)
into a directory of the read-only image. Triton must still write at run time (the small C launcher it
builds per kernel signature, anything not warmed), so the engine's cache (`TRITON_CACHE_DIR`, on the pod's
writable /tmp) gets a link to every entry of the image's cache. An entry is a directory named by its
compilation key, which Triton only reads once it exists; what Triton builds later goes into new entries.

$PAGODA_KERNEL_CACHE may name several warmed caches, separated by ':' (an operator's engine pod: the
deployment's own kernels, compiled into the model cache volume by its download Job, then the image's); a
missing one is skipped, and an entry in two of them is linked from the first (its name is its content's key).
"""

from __future__ import annotations

import os

from pagoda.engine import envs


def link_seed_cache(seed: str | None = None, cache: str | None = None) -> int:
    """Link each entry of the warmed caches (``seed``, default $PAGODA_KERNEL_CACHE: directories separated by
    ':') into Triton's cache (``cache``, default Triton's own directory) unless it is there already; returns
    how many were linked."""
    seeds = [s for s in (seed or envs.kernel_cache_seed() or "").split(os.pathsep) if s and os.path.isdir(s)]
    if not seeds:
        return 0
    if cache is None:
        from triton import knobs

        cache = knobs.cache.dir
    os.makedirs(cache, exist_ok=True)
    linked = 0
    for folder in seeds:
        if os.path.samefile(folder, cache):
            continue
        for entry in os.scandir(folder):
            target = os.path.join(cache, entry.name)
            if entry.is_dir() and not os.path.lexists(target):
                os.symlink(entry.path, target)
                linked += 1
    return linked
