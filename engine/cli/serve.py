"""`pagoda serve [MODEL]`: the OpenAI-compatible server, with vLLM's flag names and defaults."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

from pagoda.engine import envs
from pagoda.engine.cli.serve_args import (
    UnknownFlagError,
    engine_config_kwargs,
    parse_args,
    server_settings,
)
from pagoda.engine.exit_codes import (
    EXIT_ENGINE_DIED,
    EXIT_OK,
    EXIT_PORT_IN_USE,
    EXIT_START_FAILED,
    EXIT_USAGE,
    write_termination_message,
)
from pagoda.engine.server.settings import ServerSettings

__all__ = ["main"]


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
    for warning in args.compat_warnings:
        print(f"pagoda serve: warning: {warning}", file=sys.stderr)
    if args.dry_run:
        return _dry_run(args)
    if args.model_shape is not None or args.gpu is not None:
        print("pagoda serve: error: --model-shape and --gpu apply to --dry-run only", file=sys.stderr)
        return EXIT_USAGE

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    from pagoda.engine.config import EngineConfig

    settings = server_settings(args)
    try:
        config = EngineConfig(**engine_config_kwargs(args))
    except ValueError as exc:
        print(f"pagoda serve: error: {exc}", file=sys.stderr)
        return 2
    if config.headless:  # a host of a replica spanning hosts other than the leader: its ranks, no server
        from pagoda.engine.worker.pp_workers import run_headless

        return run_headless(config)
    # The port first, as vLLM does: a busy port is its own exit code, before minutes of loading (and never
    # mistaken for an out-of-memory start by the operator).
    sock = bind_socket(settings.host, settings.port)
    if isinstance(sock, str):
        print(f"pagoda serve: error: {sock}", file=sys.stderr)
        return EXIT_PORT_IN_USE
    try:
        started = _start_engine(config, settings)
        if isinstance(started, int):
            return started
        return _serve(started, settings, args, sock)
    finally:
        sock.close()


def bind_socket(host: str, port: int) -> socket.socket | str:
    """A socket bound to (host, port), not yet listening (uvicorn listens on it once the engine is up);
    or why it cannot be bound."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot resolve --host {host!r}: {exc}"
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no conflict
    if family == socket.AF_INET6:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        why = exc.strerror or str(exc)
        return (
            f"cannot listen on {host}:{port}: {why} (is another server on that port? choose one with --port)"
        )
    return sock


def _start_engine(config: Any, settings: ServerSettings) -> Any:
    """The engine client, started up to serving (model loaded, KV cache sized); or the exit code of a
    start-up that failed (its termination message written)."""
    from pagoda.engine.core.startup import startup_failure
    from pagoda.engine.frontend.async_engine import AsyncEngine, CoreThread
    from pagoda.engine.frontend.core_process import CoreProcess, CoreStartError
    from pagoda.engine.loader import load_tokenizer, resolve_model
    from pagoda.engine.loader.tokenizer import tokenizer_path
    from pagoda.engine.sizing.engine_plan import forget_last_profile

    forget_last_profile()
    try:
        tokenizer = None
        if not config.skip_tokenizer_init:
            tokenizer = load_tokenizer(
                tokenizer_path(config.tokenizer, resolve_model(config.model, config.revision))
            )
        if settings.engine_process:
            core: Any = CoreProcess(config, threads=envs.core_threads(), share_cores=envs.core_share_cores())
        else:
            from pagoda.engine.core import engine_core

            core = CoreThread(engine_core.EngineCore(config, tokenizer=tokenizer, publish_kv_events=True))
    except CoreStartError as exc:
        failure: Any = (str(exc), exc.exit_code, exc.termination)
    except Exception as exc:
        failure = startup_failure(exc)
        if failure is None:
            raise
    else:
        return AsyncEngine(core, tokenizer)
    message, code, termination = failure
    print(f"pagoda serve: {message}", file=sys.stderr)
    if termination is not None:
        write_termination_message(termination)
    return code


def _serve(engine: Any, settings: ServerSettings, args: argparse.Namespace, sock: socket.socket) -> int:
    """Serve until SIGTERM (drained: 0) or until the engine core stops (EXIT_ENGINE_DIED)."""
    import uvicorn
    from pagoda.engine.metrics import LoggingStatLogger
    from pagoda.engine.server.app import build_app

    log = logging.getLogger("pagoda.engine")
    log.info("start-up memory profile: %s", json.dumps(engine.info.memory_profile))
    exporter = build_exporter(engine.info, settings)
    engine.add_stat_logger(exporter)
    if not args.disable_log_stats:
        engine.add_stat_logger(LoggingStatLogger(settings.log_stats_interval_s))
    app = build_app(engine, settings, exporter)
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
    died: list[str] = []

    def engine_died(reason: str) -> None:
        # In-flight requests have their error already; /health answers 503 until the server is gone.
        log.error("the engine stopped (%s): the server exits so that it is restarted", reason)
        died.append(reason)
        server.should_exit = True

    engine.add_dead_listener(engine_died)
    try:
        code = run_server(server, sock)
    finally:
        engine.shutdown()  # once more, in case the app never started (idempotent)
    if code != EXIT_OK:
        return code
    return EXIT_ENGINE_DIED if died else EXIT_OK


def run_server(server: Any, sock: socket.socket) -> int:
    """Run uvicorn on the bound socket until it stops: EXIT_OK, or EXIT_START_FAILED where uvicorn itself
    failed to start (it exits 3 then, which is Pagoda's out-of-memory code: never passed on)."""
    try:
        server.run(sockets=[sock])
    except SystemExit as exc:
        if exc.code in (None, 0):
            return EXIT_OK
        logging.getLogger("pagoda.engine").error(
            "the HTTP server failed to start (uvicorn exit %s)", exc.code
        )
        return EXIT_START_FAILED
    return EXIT_OK


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


def build_exporter(info: Any, settings: ServerSettings) -> Any:
    """The Prometheus exporter for an engine of `info` (its EngineInfo), with vLLM's cache_config_info labels."""
    from pagoda.engine.metrics import PrometheusStatLogger

    name = (settings.served_model_names or [info.model_name])[0]
    return PrometheusStatLogger(
        str(name),
        max_model_len=info.max_model_len,
        cache_config=dict(info.cache_config),
        max_model_len_fitted=info.max_model_len_fitted,
        block_size=info.block_size,
        cpu_kernels=info.cpu_kernels,
        num_speculative_tokens=getattr(info, "num_speculative_tokens", 0),
    )
