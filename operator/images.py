"""The engine-image allow-list: which `spec.image` values the operator will run.

Whoever may create an InferenceDeployment chooses the image its pods run, with the API-key Secret and model
volumes mounted and a GPU attached; a cluster admin narrows that with `--allowed-image` (the chart's
`engine.allowedImages`). Patterns are shell globs (`registry.corp/ml/*`) matched against the reference as
written and in its normalised form (`python:3.12` is `docker.io/library/python:3.12`); a pattern with no
wildcard, tag or digest names a repository and allows any tag or digest of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase

from pagoda.operator.spec import SpecError

DEFAULT_REGISTRY = "docker.io"
_GLOB = frozenset("*?[")


def _split_domain(image: str) -> tuple[str | None, str]:
    first, sep, rest = image.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return first, rest
    return None, image


def normalize_image(image: str) -> str:
    """The fully qualified reference the container runtime pulls: registry, path and a tag or digest."""
    domain, path = _split_domain(image)
    if domain is None:
        domain = DEFAULT_REGISTRY
        if "/" not in path:
            path = f"library/{path}"
    last = path.rsplit("/", 1)[-1]
    if "@" not in last and ":" not in last:
        path += ":latest"
    return f"{domain}/{path}"


def repository(image: str) -> str:
    """The reference without its tag or digest."""
    image = image.split("@", 1)[0]
    head, _, last = image.rpartition("/")
    return f"{head}/{last.split(':', 1)[0]}" if head else last.split(":", 1)[0]


def _matches(pattern: str, image: str) -> bool:
    if fnmatchcase(image, pattern):
        return True
    return not (_GLOB & set(pattern)) and repository(image) == pattern


def image_allowed(image: str, patterns: Sequence[str]) -> bool:
    """Whether `image` matches one of `patterns`; an empty allow-list allows every image."""
    if not patterns:
        return True
    candidates = {image, normalize_image(image)}
    return any(_matches(p, c) for p in patterns for c in candidates)


def check_image(image: str | None, patterns: Sequence[str]) -> None:
    """Raise SpecError (reason ImageNotAllowed) for a `spec.image` off the allow-list.

    No `spec.image` means the operator's own engine image, which the admin configured and is always allowed.
    """
    if image is None or image_allowed(image, patterns):
        return
    raise SpecError(
        "image",
        f"{image!r} is not on this operator's engine-image allow-list ({', '.join(patterns)}); use an image "
        "that matches it, or leave spec.image unset for the default engine image (the allow-list is the "
        "cluster admin's: Helm value engine.allowedImages, pagoda-operator --allowed-image)",
        reason="ImageNotAllowed",
    )
