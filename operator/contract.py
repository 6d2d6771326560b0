"""The operator-to-engine contract, checked before any pod exists.

Every engine command the operator renders goes through the engine's own check
(pagoda.engine.cli.serve_check.check: the parser, EngineConfig and start-up arithmetic `pagoda serve --dry-run`
runs, torch-free), with the two facts the operator has and the pod will find for itself: the model's shape
(the operator never sees the weights) and the GPU's memory (from the node's labels). Router commands go
through the router's own parser and validation (pagoda.router.cli, without the router's app). A command the engine would refuse
becomes a condition and an Event on the InferenceDeployment, never a crash-looping pod.
"""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

from pagoda.engine.cli.serve_args import to_argv
from pagoda.engine.cli.serve_check import DryRunError, DryRunReport, check, shape_config
from pagoda.operator.planning import Decision
from pagoda.operator.spec import InferenceSpec, SpecError

REASON = "EngineWouldRefuse"
ROUTER_REASON = "RouterWouldRefuse"


def dry_run_argv(decision: Decision, args: list[str]) -> list[str]:
    """The pod's `pagoda serve` arguments plus what the dry run cannot find where the operator runs."""
    if decision.shape is None:
        raise ValueError("a decision without the model shape it was sized for")
    gpu = decision.gpu
    extra = {
        "dry_run": True,
        "model_shape": json.dumps(shape_config(decision.shape), separators=(",", ":")),
        "gpu": None if gpu is None else f"{decision.product_label or gpu.product_label}@{gpu.memory_mib}",
    }
    return [*args, *to_argv(extra)]


def check_engine_args(decision: Decision, args: list[str]) -> DryRunReport:
    """The engine's dry run of `args`; a SpecError (reason EngineWouldRefuse) carrying the engine's own
    words where the real start would refuse."""
    try:
        return check(dry_run_argv(decision, args))
    except DryRunError as exc:
        raise SpecError(
            "engine", f"the engine would refuse to start with this plan: {exc}", reason=REASON
        ) from None


def check_engine_commands(body: dict[str, Any], spec: InferenceSpec, decision: Decision) -> DryRunReport:
    """The engine's dry run of every command the engine pods run (render.engine_commands: a group's leader
    and each worker rank, each pool's); the first one's report. A SpecError (EngineWouldRefuse) names the
    pod whose command the engine would refuse."""
    from pagoda.operator import render

    report = None
    for what, args in render.engine_commands(body, spec, decision):
        try:
            found = check(dry_run_argv(decision, args))
        except DryRunError as exc:
            raise SpecError(
                "engine",
                f"the engine would refuse to start{' ' + what if what else ''} with this plan: {exc}",
                reason=REASON,
            ) from None
        report = report or found
    assert report is not None
    return report


def check_router_args(args: list[str]) -> None:
    """`pagoda router ARGS --dry-run` in process (the router's parser and validation); a SpecError (reason
    RouterWouldRefuse) with the router's words where the router pod would refuse to start. A build without
    the router package checks nothing here (tests/contract/test_router_args.py does)."""
    try:
        from pagoda.router.cli import build_parser, config_from_args
        from pagoda.router.config import ConfigError
    except ImportError:
        return
    said = io.StringIO()
    parser = build_parser()
    try:
        with contextlib.redirect_stderr(said):
            parsed = parser.parse_args([*args, "--dry-run"])
        config_from_args(parsed)
    except SystemExit:  # argparse: an unknown flag or a bad value
        words = said.getvalue().strip().splitlines()
        raise SpecError(
            "routing",
            f"the router would refuse to start: {words[-1] if words else 'bad arguments'}",
            ROUTER_REASON,
        ) from None
    except ConfigError as exc:
        raise SpecError("routing", f"the router would refuse to start: {exc}", reason=ROUTER_REASON) from None
