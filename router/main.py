"""`pagoda router`: parse, validate (--dry-run prints the config as JSON), then serve."""

from __future__ import annotations

import json
import logging
import sys

from pagoda.router.cli import build_parser, config_from_args
from pagoda.router.config import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a bad value (2)
        return int(exc.code or 0)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"pagoda router: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(json.dumps(config.to_dict(), indent=2))
        return 0
    logging.basicConfig(
        level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s"
    )
    from pagoda.router.app import run

    run(config)
    return 0
