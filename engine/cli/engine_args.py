"""Engine flags generated from EngineConfig's fields (name, type, default, help, choices).

One source of truth: adding a field to EngineConfig adds its flag to `pagoda serve`, with the field's
default and help, and every parsed flag lands in the config (nothing is accepted and then dropped).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from typing import Any

from pagoda.engine.config import EngineConfig

_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'1073741824', '512MiB', '2G', '1.5GiB' -> bytes (K/M/G/T are powers of 1000, Ki/Mi/Gi/Ti of 1024)."""
    m = _BYTES.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 536870912, 512MiB, 2GB)")
    number, unit, binary = float(m.group(1)), m.group(2).lower(), bool(m.group(3))
    power = " kmgt".index(unit or " ")
    return int(number * (1024 if binary else 1000) ** power)


def parse_max_model_len(text: str) -> int | str:
    """An integer, 'auto' (largest that fits), or vLLM's shorthand: 4k = 4000, 4K = 4096."""
    if text == "auto":
        return text
    m = re.fullmatch(r"(\d+)([kKmM]?)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"must be an integer, 'auto', or like 4k/4K, got {text!r}")
    value, suffix = int(m.group(1)), m.group(2)
    scale = {"": 1, "k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}[suffix]
    if value * scale < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value * scale


_PARSERS = {"bytes": parse_bytes, "max_model_len": parse_max_model_len}


def _base_type(annotation: Any) -> type:
    """int | None -> int; str -> str (annotations are strings under `from __future__ import annotations`)."""
    if isinstance(annotation, str):
        annotation = eval(annotation, {"int": int, "str": str, "float": float, "bool": bool, "None": None})  # noqa: S307 - our own annotations
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0]
    return annotation


def cli_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineConfig) if f.metadata.get("cli", True)]


def flag_name(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """One flag per EngineConfig field (except those marked cli=False)."""
    for f in cli_fields():
        meta = f.metadata
        names = [flag_name(f), *meta.get("aliases", ())]
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": meta.get("help")}
        base = _base_type(f.type)
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _PARSERS[meta["parser"]] if "parser" in meta else base
            if "choices" in meta:
                kwargs["choices"] = list(meta["choices"])
            if "nargs" in meta:  # a list field: values after one flag, and the flag repeated, add up
                kwargs.update(nargs=meta["nargs"], action="extend", type=str)
        parser.add_argument(*names, **kwargs)


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    """The EngineConfig keyword arguments of parsed flags (plus ``overrides`` for the cli=False fields)."""
    values = {f.name: getattr(args, f.name) for f in cli_fields()}
    values.update(overrides)
    return values
