"""`pagoda serve [MODEL]`: the OpenAI-compatible server, with vLLM's flag names and defaults."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import difflib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from pagoda.engine.cli.dry_run import add_dry_run_args
from pagoda.engine.cli.engine_args import (
    add_engine_args,
    engine_config_from_args,
    parse_bytes,
    parse_max_model_len,
)
from pagoda.engine.cli.exit_codes import (
    EXIT_OK,
    EXIT_OUT_OF_MEMORY,
    EXIT_START_FAILED,
    EXIT_USAGE,
    REASON_CUDA_OOM,
    REASON_KV_TOO_SMALL,
    termination_message,
    write_termination_message,
)
from pagoda.engine.config import DEFAULT_GPU_MEMORY_UTILIZATION
from pagoda.engine.server.settings import DEFAULT_MAX_REQUEST_BODY_BYTES, ServerSettings

__all__ = ["DEFAULT_GPU_MEMORY_UTILIZATION", "main", "parse_args", "parse_bytes", "parse_max_model_len"]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be non-negative, got {value}")
    return value


def build_parser(*, exit_on_error: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagoda serve",
        description="Serve a model over an OpenAI-compatible HTTP API (flags follow vLLM's).",
        allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        exit_on_error=exit_on_error,
    )
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF directory, GGUF file or local hub id; default: the embedded SmolLM2-135M-Instruct",
    )
    p.add_argument("--model", dest="model_flag", default=None, help="same as the positional MODEL")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use in 'model'; the first is reported in metrics",
    )
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("PAGODA_API_KEY"),
        help="require 'Authorization: Bearer KEY' (env PAGODA_API_KEY)",
    )
    p.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    add_engine_args(p.add_argument_group("engine"))
    s = p.add_argument_group("server")
    s.add_argument(
        "--max-num-queued-reqs",
        type=_positive_int,
        default=None,
        help="answer 503 + Retry-After when more requests would wait",
    )
    s.add_argument(
        "--max-request-body-bytes",
        type=parse_bytes,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="413 for larger request bodies",
    )
    s.add_argument(
        "--shutdown-grace-seconds",
        type=float,
        default=30.0,
        help="on SIGTERM, how long in-flight requests may run",
    )
    s.add_argument("--disable-log-stats", action="store_true", help="no periodic engine log line")
    add_dry_run_args(p)
    return p


class UnknownFlagError(Exception):
    pass


def parse_args(argv: list[str], *, exit_on_error: bool = True) -> argparse.Namespace:
    """Parse, turning unknown flags into an error that lists the closest known ones (exit_on_error=False:
    a bad value raises argparse.ArgumentError instead of exiting)."""
    parser = build_parser(exit_on_error=exit_on_error)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        known = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
        lines = []
        for token in unknown:
            flag = token.split("=", 1)[0]
            if flag.startswith("-"):
                close = difflib.get_close_matches(flag, known, n=3, cutoff=0.6)
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                lines.append(f"unknown flag {flag}{hint}")
            else:
                lines.append(f"unexpected argument {token!r}")
        raise UnknownFlagError("; ".join(lines))
    if args.model and args.model_flag and args.model != args.model_flag:
        raise UnknownFlagError(f"two models given: {args.model!r} and --model {args.model_flag!r}")
    args.model = args.model or args.model_flag
    return args


def engine_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return engine_config_from_args(
        args,
        model=args.model,
        served_model_name=args.served_model_name[0] if args.served_model_name else None,
    )


def server_settings(args: argparse.Namespace) -> ServerSettings:
    return ServerSettings(
        host=args.host,
        port=args.port,
        served_model_names=list(args.served_model_name or []),
        api_key=args.api_key or None,
        max_num_queued_reqs=args.max_num_queued_reqs,
        max_request_body_bytes=args.max_request_body_bytes,
        shutdown_grace_seconds=args.shutdown_grace_seconds,
        uvicorn_log_level=args.uvicorn_log_level,
    )


def _make_uvicorn_server(config: Any) -> Any:
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn re-raises SIGTERM after a graceful shutdown (exit 143); a drained server exits 0.
        SIGTERM first drains (engine/server/drain.py): /health says 503 "draining" while requests finish."""

        async def startup(self, sockets: Any = None) -> None:
            self._drain_loop = asyncio.get_running_loop()
            await super().startup(sockets)

        def handle_exit(self, sig: int, frame: Any) -> None:
            state = getattr(getattr(self.config, "app", None), "state", None)
            loop = getattr(self, "_drain_loop", None)
            if sig != signal.SIGTERM or loop is None or state is None or getattr(state, "draining", True):
                return super().handle_exit(sig, frame)
            from pagoda.engine.server.drain import drain_then_exit

            state.draining = True
            grace = self.config.timeout_graceful_shutdown or 0.0

            def start() -> None:  # keep a reference: the loop holds tasks only weakly
                self._drain_task = loop.create_task(drain_then_exit(self, self.config.app, grace))

            loop.call_soon_threadsafe(start)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return GracefulServer(config)


def main(argv: list[str]) -> int:
    try:
        args = parse_args(argv)
    except UnknownFlagError as exc:
        print(f"pagoda serve: error: {exc}\nRun `pagoda serve --help` for the flags.", file=sys.stderr)
        return 2
    except SystemExit as exc:  # argparse: --help (0) or a bad value (2)
        return int(exc.code or 0)
    if args.dry_run:
        return _dry_run(args)
    if args.model_shape is not None or args.gpu is not None:
        print("pagoda serve: error: --model-shape and --gpu apply to --dry-run only", file=sys.stderr)
        return EXIT_USAGE

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    import uvicorn
    from pagoda.engine.async_engine import AsyncEngine
    from pagoda.engine.config import EngineConfig
    from pagoda.engine.metrics import LoggingStatLogger
    from pagoda.engine.server.app import build_app

    settings = server_settings(args)
    try:
        config = EngineConfig(**engine_config_kwargs(args))
    except ValueError as exc:
        print(f"pagoda serve: error: {exc}", file=sys.stderr)
        return 2
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.engine.sizing.engine_plan import forget_last_profile
    from pagoda.engine.sizing.errors import UnsupportedOnGPU

    forget_last_profile()
    try:
        engine = LLMEngine(config)
    except Exception as exc:
        failure = _out_of_memory(exc)
        if failure is not None:
            print(f"pagoda serve: out of memory at start-up: {exc}", file=sys.stderr)
            write_termination_message(failure)
            return EXIT_OUT_OF_MEMORY
        if isinstance(exc, UnsupportedOnGPU):
            print(f"pagoda serve: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        if isinstance(exc, ValueError | FileNotFoundError | OSError):
            print(f"pagoda serve: cannot start the engine: {exc}", file=sys.stderr)
            return EXIT_START_FAILED
        raise
    from pagoda.engine.server.memory_status import install_memory_status, measured_profile

    profile = measured_profile(engine)
    logging.getLogger("pagoda.engine").info("start-up memory profile: %s", json.dumps(profile))
    exporter = build_exporter(engine, settings)
    engine.add_stat_logger(exporter)
    if not args.disable_log_stats:
        engine.add_stat_logger(LoggingStatLogger(settings.log_stats_interval_s))
    app = build_app(AsyncEngine(engine), settings, exporter)
    install_memory_status(app, profile)
    server = _make_uvicorn_server(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level=settings.uvicorn_log_level,
            timeout_graceful_shutdown=settings.shutdown_grace_seconds,
            timeout_keep_alive=5,
        )
    )
    server.run()
    return 0


def _dry_run(args: argparse.Namespace) -> int:
    """Print the dry run's JSON report (exit 0), or the real start's error (exit 2)."""
    from pagoda.engine.cli.dry_run import DryRunError, check_parsed

    try:
        report = check_parsed(args)
    except DryRunError as exc:
        print(f"pagoda serve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(report.to_dict(), indent=2))
    return EXIT_OK


def _out_of_memory(exc: BaseException) -> str | None:
    """The termination message for a start-up that ran out of memory, or None for any other failure."""
    from pagoda.engine.sizing.engine_plan import last_profile
    from pagoda.engine.sizing.errors import StartupFitError

    if isinstance(exc, StartupFitError):
        profile = exc.profile.to_dict() if hasattr(exc.profile, "to_dict") else None
        return termination_message(REASON_KV_TOO_SMALL, str(exc), profile)
    import torch

    if not (isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()):
        return None
    latest = last_profile()
    profile: dict[str, Any] = latest.to_dict() if latest is not None else {"device": "cuda", "measured": True}
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        profile.update(
            device_total_bytes=total,
            device_free_bytes=free,
            peak_allocated_bytes=torch.cuda.max_memory_allocated(),
        )
    return termination_message(REASON_CUDA_OOM, str(exc), profile)


def build_exporter(engine: Any, settings: ServerSettings) -> Any:
    """The Prometheus exporter for `engine`, with vLLM's cache_config_info labels."""
    from pagoda.engine.metrics import PrometheusStatLogger

    cfg = engine.config
    stats = engine.get_scheduler_stats()
    cache_config = {
        "block_size": cfg.block_size,
        "cache_dtype": cfg.kv_cache_dtype,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "num_gpu_blocks": stats.num_blocks_total,
        "kv_cache_memory_bytes": cfg.kv_cache_memory_bytes,
    }
    name = (settings.served_model_names or [engine.model_name])[0]
    return PrometheusStatLogger(
        str(name),
        max_model_len=int(engine.max_model_len),
        cache_config=cache_config,
        max_model_len_fitted=getattr(engine, "max_model_len_fitted", None),
        block_size=cfg.block_size,
        cpu_kernels=_cpu_kernels_labels(getattr(engine, "cpu_kernels", None)),
    )


def _cpu_kernels_labels(kernels: Any) -> dict[str, str] | None:
    """The info series' labels for a CPU engine's kernels (None on a GPU: no series)."""
    if kernels is None:
        return None
    return {"variant": kernels.variant, "origin": kernels.origin or "none"}
