"""`pagoda serve [MODEL]`: the OpenAI-compatible server, with vLLM's flag names and defaults."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import difflib
import json
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pagoda.engine import envs
from pagoda.engine.cli.dry_run import add_dry_run_args
from pagoda.engine.cli.engine_args import (
    add_engine_args,
    engine_config_from_args,
    parse_bytes,
    parse_max_model_len,
)
from pagoda.engine.cli.exit_codes import (
    EXIT_ENGINE_DIED,
    EXIT_OK,
    EXIT_USAGE,
    write_termination_message,
)
from pagoda.engine.config import DEFAULT_GPU_MEMORY_UTILIZATION
from pagoda.engine.server.settings import DEFAULT_MAX_REQUEST_BODY_BYTES, ServerSettings
from pagoda.engine.tool_parsers.parsers import PARSERS as TOOL_PARSERS

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
        default=envs.api_key(),
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
    s.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine core in a process of its own; --no-engine-process: on a thread of the server's",
    )
    s.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template (a file, or the template itself) to use instead of the model's",
    )
    s.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=["auto", *TOOL_PARSERS],
        help="how tool calls are read from outputs; auto: from the chat template (hermes when it has none)",
    )
    s.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM command lines: tool_choice auto is always on",
    )
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
    args.chat_template = read_chat_template(args.chat_template)
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
        engine_process=args.engine_process,
        chat_template=args.chat_template,
        tool_call_parser=args.tool_call_parser,
    )


def read_chat_template(value: str | None) -> str | None:
    """--chat-template is a file's path or the template's text (as vLLM takes it)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if "{" not in value and path.is_file():
        return path.read_text()
    if "{" not in value:
        raise UnknownFlagError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


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
    from pagoda.engine.config import EngineConfig

    settings = server_settings(args)
    try:
        config = EngineConfig(**engine_config_kwargs(args))
    except ValueError as exc:
        print(f"pagoda serve: error: {exc}", file=sys.stderr)
        return 2
    started = _start_engine(config, settings)
    if isinstance(started, int):
        return started
    return _serve(started, settings, args)


def _start_engine(config: Any, settings: ServerSettings) -> Any:
    """The engine client, started up to serving (model loaded, KV cache sized); or the exit code of a
    start-up that failed (its termination message written)."""
    from pagoda.engine.async_engine import AsyncEngine, CoreThread
    from pagoda.engine.cli.startup import startup_failure
    from pagoda.engine.core_process import CoreProcess, CoreStartError
    from pagoda.engine.loader import load_tokenizer, resolve_model
    from pagoda.engine.sizing.engine_plan import forget_last_profile

    forget_last_profile()
    try:
        tokenizer = None
        if not config.skip_tokenizer_init:
            tokenizer = load_tokenizer(resolve_model(config.model, config.revision))
        if settings.engine_process:
            core: Any = CoreProcess(config, threads=envs.core_threads(), share_cores=envs.core_share_cores())
        else:
            from pagoda.engine import engine_core

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


def _serve(engine: Any, settings: ServerSettings, args: argparse.Namespace) -> int:
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
        server.run()
    finally:
        engine.shutdown()  # once more, in case the app never started (idempotent)
    return EXIT_ENGINE_DIED if died else EXIT_OK


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
    )
