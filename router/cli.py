"""`pagoda router`'s command line: the parser and the validated config, without the router's app (the operator
checks every router command it renders with them, and its image has no server); main.py runs the router."""

from __future__ import annotations

import argparse

from pagoda.engine import envs
from pagoda.engine.cli.engine_args import parse_bytes
from pagoda.router.config import POLICIES, RouterConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagoda router",
        description="KV-aware router in front of `pagoda serve` replicas (docs/router.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = RouterConfig()
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--policy", choices=POLICIES, default=d.policy)
    p.add_argument("--backend", action="append", default=[], metavar="URL", help="a replica (repeatable)")
    p.add_argument(
        "--backend-dns",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a headless Service: every A record is a replica (repeatable)",
    )
    p.add_argument(
        "--prefill-backend",
        action="append",
        default=[],
        metavar="URL",
        help="a prefill replica (repeatable): prefill/decode disaggregation, the --backend replicas decode "
        "and each request they get names a prefill replica in x-prefiller-host-port",
    )
    p.add_argument(
        "--prefill-backend-dns",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a headless Service of prefill replicas (repeatable), as --prefill-backend",
    )
    p.add_argument("--dns-interval", type=float, default=d.dns_interval, help="seconds between DNS lookups")
    p.add_argument("--health-interval", type=float, default=d.health_interval, help="seconds between checks")
    p.add_argument("--events-interval", type=float, default=d.events_interval, help="KV event poll seconds")
    p.add_argument("--model", default=None, help="served model name (answers /v1/models if no replica is up)")
    p.add_argument(
        "--api-key",
        default=envs.api_key(),
        help="forwarded to the replicas and required from clients (env PAGODA_API_KEY)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="model source to hash prompts locally (default: the engines' default model; 'backend' asks a "
        "replica's /tokenize)",
    )
    p.add_argument("--load-slack", type=int, default=d.load_slack, help="extra requests a cache hit may cost")
    p.add_argument(
        "--max-retries",
        type=int,
        default=d.max_retries,
        help="other replicas tried when one refuses, drops the connection or answers 503 before any byte "
        "reached the client",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=d.read_timeout,
        help="seconds a replica may stay silent (before its answer and between two reads of a stream); the "
        "whole answer has no limit",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=parse_bytes,
        default=d.max_request_body_bytes,
        help="413 for larger request bodies (the engine's default)",
    )
    p.add_argument(
        "--max-index-blocks",
        type=int,
        default=d.max_index_blocks,
        help="block hashes remembered per replica, all tiers together (oldest forgotten first)",
    )
    p.add_argument(
        "--hold-seconds",
        type=float,
        default=d.hold_seconds,
        help="how long a request waits for a ready replica (scale to zero) before 503 + Retry-After; 0: no wait "
        "(503 + Retry-After at once)",
    )
    p.add_argument(
        "--hold-max-requests",
        type=int,
        default=d.hold_max_requests,
        help="requests held at once (with --hold-seconds); more get 503 + Retry-After at once",
    )
    p.add_argument(
        "--hold-max-bytes",
        type=parse_bytes,
        default=d.hold_max_bytes,
        help="bytes of request bodies held at once (with --hold-seconds); more get 503 + Retry-After at once",
    )
    p.add_argument(
        "--ext-proc-port",
        type=int,
        default=None,
        help="also serve Envoy's ext_proc v3 gRPC protocol here: the router as a Gateway API Inference "
        "Extension endpoint picker, with gRPC health checking (docs/router.md)",
    )
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--dry-run", action="store_true", help="validate, print the config as JSON, exit")
    return p


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        host=args.host,
        port=args.port,
        policy=args.policy,
        backends=list(args.backend),
        backend_dns=list(args.backend_dns),
        prefill_backends=list(args.prefill_backend),
        prefill_backend_dns=list(args.prefill_backend_dns),
        dns_interval=args.dns_interval,
        health_interval=args.health_interval,
        events_interval=args.events_interval,
        model=args.model,
        api_key=args.api_key or None,
        tokenizer=args.tokenizer,
        load_slack=args.load_slack,
        max_retries=args.max_retries,
        read_timeout=args.read_timeout,
        max_request_body_bytes=args.max_request_body_bytes,
        max_index_blocks=args.max_index_blocks,
        hold_seconds=args.hold_seconds,
        hold_max_requests=args.hold_max_requests,
        hold_max_bytes=args.hold_max_bytes,
        ext_proc_port=args.ext_proc_port,
    ).validate()
