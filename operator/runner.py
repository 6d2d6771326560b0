"""Run the operator in the current event loop: what `pagoda-operator`, the tests and the benchmark share."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import kopf
from pagoda.operator.handlers import OperatorState, build_registry
from pagoda.operator.metrics import DEFAULT, OperatorMetrics


@dataclass
class OperatorConfig:
    namespaces: list[str] = field(default_factory=list)  # empty = cluster-wide
    standalone: bool = False  # True: no peering (one replica); False: kopf peering for HA
    peering_name: str | None = None  # None: kopf's "default" peering if its CRD exists, else standalone
    priority: int = 0
    liveness_endpoint: str | None = None  # e.g. http://0.0.0.0:8081/healthz
    connection: kopf.ConnectionInfo | None = None  # fixed credentials; None = service account or kubeconfig
    metrics: OperatorMetrics = DEFAULT  # tests pass a fresh one to count only their own operator
    allowed_images: list[str] = field(default_factory=list)  # spec.image allow-list (globs); empty = any


async def run(
    config: OperatorConfig,
    *,
    stop_flag: asyncio.Event | None = None,
    ready_flag: asyncio.Event | None = None,
) -> OperatorState:
    """Run until `stop_flag` is set (or the operator is signalled); returns the state for inspection."""
    state = OperatorState(
        connection=config.connection,
        namespaces=list(config.namespaces),
        metrics=config.metrics,
        allowed_images=tuple(config.allowed_images),
    )
    registry = build_registry(state)
    await kopf.operator(
        registry=registry,
        standalone=True if config.standalone else None,
        peering_name=None if config.standalone else config.peering_name,
        priority=config.priority,
        clusterwide=not config.namespaces,
        namespaces=config.namespaces,
        liveness_endpoint=config.liveness_endpoint,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )
    return state
