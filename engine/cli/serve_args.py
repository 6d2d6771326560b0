"""`pagoda serve`'s command line: the parser (vLLM's flag names, generated from EngineConfig for the engine's
own flags), and what it turns into: the engine's config and the server's settings. `serve` runs it, the dry
run checks it, and the operator's rendered commands are checked against it."""

from __future__ import annotations

import argparse
import difflib
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pagoda.engine import envs
from pagoda.engine.cli import vllm_compat
from pagoda.engine.cli.engine_args import (
    add_engine_args,
    engine_config_from_args,
    parse_bytes,
)
from pagoda.engine.server.settings import (
    DEFAULT_MAX_NUM_QUEUED_REQS,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    ServerSettings,
)
from pagoda.engine.tool_parsers.parsers import FORMATS as TOOL_PARSERS


def add_dry_run_args(parser: argparse.ArgumentParser) -> None:
    """`--dry-run` and the two facts it may be given instead of the model files and the GPU."""
    g = parser.add_argument_group("dry run")
    g.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the configuration, print the engine config and memory plan as JSON and exit "
        "(0, or 2 with the error the real start would give); loads no weights",
    )
    g.add_argument(
        "--model-shape",
        default=None,
        metavar="JSON",
        help="with --dry-run: the model's shape (config.json keys, or a JSON file) instead of reading the model",
    )
    g.add_argument(
        "--gpu",
        default=None,
        metavar="PRODUCT",
        help="with --dry-run: plan for this GPU (GFD product label or short name, e.g. NVIDIA-L4) with the GPU "
        "catalogue's memory instead of measuring one; PRODUCT@MiB gives the memory (what nvidia.com/gpu.memory "
        "reports)",
    )


# ------------------------------------------------------------------------------------------------- model


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
        epilog="Every other flag of `vllm serve` is accepted with a warning where it means nothing here, or refused "
        "with what to use instead (the table: docs/serving.md, engine/cli/vllm_compat.py); --flag_name "
        "spellings read as --flag-name.",
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
        default=DEFAULT_MAX_NUM_QUEUED_REQS,
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
        help="how tool calls are read from outputs; auto: from the chat template (harmony for gpt-oss's, hermes when it has none)",
    )
    s.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        default=envs.allow_runtime_lora_updating(),
        help="offer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (env VLLM_ALLOW_RUNTIME_LORA_UPDATING); "
        "without it they are 404s",
    )
    s.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM command lines: tool_choice auto is always on",
    )
    s.add_argument(
        "--strict-api",
        action="store_true",
        help="a request field the API does not know is a 400 naming it (default: logged and ignored, as vLLM)",
    )
    add_dry_run_args(p)
    return p


class UnknownFlagError(Exception):
    pass


@functools.cache
def implemented_flags() -> frozenset[str]:
    """Every option string of `pagoda serve` (what vllm_compat answers as implemented)."""
    return frozenset(o for a in build_parser()._actions for o in a.option_strings)


@functools.cache
def flag_choices() -> dict[str, tuple[str, ...]]:
    """The values of each `pagoda serve` flag that takes a fixed set, by its option strings."""
    return {
        o: tuple(map(str, a.choices)) for a in build_parser()._actions if a.choices for o in a.option_strings
    }


@functools.cache
def _actions() -> dict[str, argparse.Action]:
    """serve's parser's actions by destination (an EngineConfig field, or a server setting's name)."""
    return {a.dest: a for a in build_parser()._actions if a.option_strings}


def flag(name: str) -> str:
    """The `pagoda serve` flag of an EngineConfig field or a server setting (max_model_len ->
    --max-model-len): what the operator and `pagoda plan` render, so no flag is spelled outside engine/cli."""
    action = _actions().get(name)
    if action is None:
        raise KeyError(f"`pagoda serve` has no flag for {name!r}")
    return next(o for o in action.option_strings if o.startswith("--"))


def to_argv(settings: Mapping[str, Any]) -> list[str]:
    """Flags for settings named as EngineConfig fields (or server settings), in their order: None is left out,
    a boolean is --flag or --no-flag, a list follows one flag, anything else is its str()."""
    argv: list[str] = []
    for name, value in settings.items():
        if value is None:
            continue
        option = flag(name)
        action = _actions()[name]
        if isinstance(value, bool):
            if isinstance(action, argparse.BooleanOptionalAction):
                argv.append(option if value else "--no-" + option.removeprefix("--"))
            elif value:
                argv.append(option)
            continue
        if isinstance(value, list | tuple):
            argv += [option, *map(str, value)]
        else:
            argv += [option, str(value)]
    return argv


def parse_args(argv: list[str], *, exit_on_error: bool = True) -> argparse.Namespace:
    """Parse, turning unknown flags into an error that lists the closest known ones (exit_on_error=False:
    a bad value raises argparse.ArgumentError instead of exiting)."""
    parser = build_parser(exit_on_error=exit_on_error)
    try:
        argv, warnings = vllm_compat.translate(list(argv), implemented_flags(), flag_choices())
    except vllm_compat.CompatRefusal as exc:
        raise UnknownFlagError(str(exc)) from None
    args, unknown = parser.parse_known_args(argv)
    args.compat_warnings = warnings
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
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        strict_api=args.strict_api,
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
