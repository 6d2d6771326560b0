"""`pagoda-operator`: run the InferenceDeployment operator (cluster-wide or in given namespaces)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from pagoda.operator import metrics
from pagoda.operator.runner import OperatorConfig, run


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagoda-operator", description=__doc__.splitlines()[0])
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n", "--namespace", action="append", default=[], help="watch this namespace (repeatable)"
    )
    scope.add_argument(
        "-A", "--all-namespaces", action="store_true", help="watch every namespace (the default)"
    )
    ha = parser.add_mutually_exclusive_group()
    ha.add_argument("--standalone", action="store_true", help="no peering: for a single replica")
    ha.add_argument(
        "--peering",
        default=None,
        help="kopf peering object for HA (the chart's: pagoda-operator), which must then exist; default: kopf's "
        "'default' peering where its CRD is installed, standalone where not",
    )
    parser.add_argument(
        "--priority",
        type=int,
        default=None,
        help="peering priority; the highest replica is active (default: random when peering, so replicas "
        "never tie: kopf pauses every replica that shares the top priority)",
    )
    parser.add_argument(
        "--liveness", default="http://0.0.0.0:8081/healthz", help="kopf liveness endpoint ('' to disable)"
    )
    parser.add_argument(
        "--metrics-port", type=int, default=8080, help="Prometheus metrics port (0 to disable)"
    )
    parser.add_argument(
        "--allowed-image",
        action="append",
        default=[],
        metavar="PATTERN",
        help="allow spec.image values matching this glob (repeatable; a bare repository allows any tag); "
        "without any, every image is allowed. A refused InferenceDeployment gets Ready=False, reason "
        "ImageNotAllowed, and no pods",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser.parse_args(argv)


def _default_priority(peering: str | None) -> int:
    if peering is None:
        return 0
    import secrets

    return secrets.randbelow(1_000_000) + 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.metrics_port:
        metrics.serve(args.metrics_port)
    config = OperatorConfig(
        namespaces=list(args.namespace),
        standalone=args.standalone,
        peering_name=args.peering,
        priority=args.priority if args.priority is not None else _default_priority(args.peering),
        liveness_endpoint=args.liveness or None,
        allowed_images=list(args.allowed_image),
    )
    try:
        asyncio.run(run(config))
    except KeyboardInterrupt:  # pragma: no cover
        return 130
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
