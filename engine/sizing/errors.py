"""The exceptions sizing raises, so callers (operator, CLI, engine start-up) can catch them by name."""

from __future__ import annotations

from typing import Any


class SizingError(ValueError):
    """The inputs cannot be served as asked; the message says what fits and what to change."""


class UnsupportedModelError(SizingError):
    """The model itself is one the engine does not run (its architecture, a quantized checkpoint, a multimodal
    checkpoint, an embedding model, a RoPE scaling it lacks): no setting or GPU would change that, so the
    operator reports it as `UnsupportedModel` rather than as a plan the engine would refuse."""


class StartupFitError(SizingError):
    """The KV cache for the configured length does not fit the memory left at start-up.

    `profile` (a MemoryProfile, when the caller had one) carries the figures the refusal was made from, so
    a supervisor can re-plan from facts rather than guesses.
    """

    def __init__(self, message: str, profile: Any = None) -> None:
        super().__init__(message)
        self.profile = profile


class UnsupportedOnGPU(SizingError):
    """A dtype or KV dtype this GPU cannot run (FP8 below compute capability 8.9): a configuration error
    (`pagoda serve` and `pagoda kernels warm` exit with code 2), never something memory would fix."""


class UnsupportedGPUError(UnsupportedOnGPU):
    """The GPU itself is one the engine image's torch build has no kernels for (compute capability too old)."""
