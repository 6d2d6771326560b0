"""The operator-to-engine contract, checked before any pod exists.

Every engine command the operator renders goes through the engine's own dry run
(pagoda.engine.cli.dry_run.check: the parser, EngineConfig and start-up arithmetic `pagoda serve --dry-run`
runs), with the two facts the operator has and the pod will find for itself: the model's shape (the operator
never sees the weights) and the GPU's memory (from the node's labels). A command the engine would refuse
becomes a condition and an Event on the InferenceDeployment, never a crash-looping pod.
"""

from __future__ import annotations

import json

from pagoda.engine.cli.dry_run import DryRunError, DryRunReport, check, shape_config
from pagoda.operator.planning import Decision
from pagoda.operator.spec import SpecError

REASON = "EngineWouldRefuse"


def dry_run_argv(decision: Decision, args: list[str]) -> list[str]:
    """The pod's `pagoda serve` arguments plus what the dry run cannot find where the operator runs."""
    if decision.shape is None:
        raise ValueError("a decision without the model shape it was sized for")
    extra = ["--dry-run", "--model-shape", json.dumps(shape_config(decision.shape), separators=(",", ":"))]
    if decision.gpu is not None:
        extra += [
            "--gpu",
            f"{decision.product_label or decision.gpu.product_label}@{decision.gpu.memory_mib}",
        ]
    return [*args, *extra]


def check_engine_args(decision: Decision, args: list[str]) -> DryRunReport:
    """The engine's dry run of `args`; a SpecError (reason EngineWouldRefuse) carrying the engine's own
    words where the real start would refuse."""
    try:
        return check(dry_run_argv(decision, args))
    except DryRunError as exc:
        raise SpecError(
            "engine", f"the engine would refuse to start with this plan: {exc}", reason=REASON
        ) from None
