"""Typed spec fields that are also their CRD schema: one declaration gives the dataclass field, the OpenAPI
schema of the CustomResourceDefinition (crd.py writes crds/ from it) and the operator's own check.

A field is declared with `prop(TYPE, "camelName", "description", default=RAW)`: RAW is the JSON default the
API server fills in (and the CRD shows); the dataclass default is RAW parsed by TYPE, so both come from one
value. `Rule`s carry a CEL expression for the API server and the same check in Python for the operator
(which must not trust the server: older servers, `pagoda render` with no server); tests/operator/
test_crd_generation.py evaluates both on the same values.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

from pagoda.operator.quantity import parse_quantity

MISSING = dataclasses.MISSING


class SpecError(ValueError):
    """A spec the operator cannot serve; `reason` is the condition reason, `field` the spec path."""

    def __init__(self, field: str, message: str, reason: str = "InvalidSpec") -> None:
        super().__init__(f"spec.{field}: {message}")
        self.field = field
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class Rule:
    """A validation rule: `cel` for the API server (x-kubernetes-validations), `check` the same in Python
    (called with the field's raw JSON value, or the object's for a rule on an object)."""

    cel: str
    message: str
    check: Callable[[Any], bool]
    field_path: str | None = None  # for a rule on an object: the field the message is about (".gpu.count")
    reason: str = "InvalidSpec"


def _join(values: Sequence[Any]) -> str:
    return ", ".join(str(v) for v in values)


@dataclasses.dataclass(frozen=True)
class Type:
    """A JSON type: its OpenAPI schema, and how a raw value becomes the typed one (raising ValueError)."""

    def schema(self) -> dict[str, Any]:
        raise NotImplementedError

    def parse(self, value: Any) -> Any:
        return value


@dataclasses.dataclass(frozen=True)
class Str(Type):
    enum: tuple[str, ...] = ()
    min_length: int | None = None
    pattern: str | None = None  # a whole-string regular expression (the CRD's `pattern`)
    max_length: int | None = None

    def schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "string"}
        if self.enum:
            out["enum"] = list(self.enum)
        if self.min_length is not None:
            out["minLength"] = self.min_length
        if self.max_length is not None:
            out["maxLength"] = self.max_length
        if self.pattern:
            out["pattern"] = f"^({self.pattern})$"
        return out

    def parse(self, value: Any) -> str:
        if not isinstance(value, str):
            raise ValueError(f"must be a string, got {value!r}")
        if self.enum and value not in self.enum:
            raise ValueError(f"must be one of {_join(self.enum)}, got {value!r}")
        if self.min_length is not None and len(value) < self.min_length:
            raise ValueError(f"must not be empty, got {value!r}")
        if self.max_length is not None and len(value) > self.max_length:
            raise ValueError(f"must be at most {self.max_length} characters, got {len(value)}")
        if self.pattern and not re.fullmatch(self.pattern, value):
            raise ValueError(f"{value!r} does not match {self.pattern}")
        return value


@dataclasses.dataclass(frozen=True)
class Int(Type):
    minimum: int | None = None
    maximum: int | None = None

    def schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "integer"}
        if self.minimum is not None:
            out["minimum"] = self.minimum
        if self.maximum is not None:
            out["maximum"] = self.maximum
        return out

    def parse(self, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"must be an integer, got {value!r}")
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"must be at least {self.minimum}, got {value}")
        if self.maximum is not None and value > self.maximum:
            raise ValueError(f"must be at most {self.maximum}, got {value}")
        return value


@dataclasses.dataclass(frozen=True)
class Num(Type):
    """A number; bounds are checked by Rules (the API server's `minimum` has no exclusive form in CEL-free
    schemas that JSON Schema tools read the same way)."""

    def schema(self) -> dict[str, Any]:
        return {"type": "number"}

    def parse(self, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"must be a number, got {value!r}")
        return float(value)


@dataclasses.dataclass(frozen=True)
class Bool(Type):
    def schema(self) -> dict[str, Any]:
        return {"type": "boolean"}

    def parse(self, value: Any) -> bool:
        if not isinstance(value, bool):
            raise ValueError(f"must be true or false, got {value!r}")
        return value


@dataclasses.dataclass(frozen=True)
class IntOrAuto(Type):
    """An integer or the string `auto` (parsed as None); `choices` or `minimum` bound the integer."""

    minimum: int = 1
    choices: tuple[int, ...] = ()

    def schema(self) -> dict[str, Any]:
        return {"x-kubernetes-int-or-string": True}

    def rules(self, name: str) -> list[Rule]:
        if self.choices:
            cel = f"type(self) == string ? self == 'auto' : self in [{_join(self.choices)}]"
            return [Rule(cel, f"{name} must be auto or one of {_join(self.choices)}", lambda v: True)]
        cel = f"type(self) == string ? self == 'auto' : self >= {self.minimum}"
        return [Rule(cel, f"{name} must be auto or an integer of at least {self.minimum}", lambda v: True)]

    def parse(self, value: Any) -> int | None:
        if value is None or value == "auto":
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"must be an integer or auto, got {value!r}")
        if self.choices and value not in self.choices:
            raise ValueError(f"must be auto or one of {_join(self.choices)}, got {value}")
        if value < self.minimum:
            raise ValueError(f"must be at least {self.minimum}, got {value}")
        return value


@dataclasses.dataclass(frozen=True)
class QuantityOrAuto(Type):
    """A Kubernetes Quantity (bytes) or `auto` (None)."""

    def schema(self) -> dict[str, Any]:
        return {"x-kubernetes-int-or-string": True}

    def parse(self, value: Any) -> int | None:
        if value is None or value == "auto":
            return None
        try:
            return parse_quantity(value)
        except ValueError as exc:
            raise ValueError(f"{exc}, or auto") from None


@dataclasses.dataclass(frozen=True)
class Obj(Type):
    """A nested spec dataclass; `optional`: None when absent (else its defaults)."""

    cls: type = object
    optional: bool = False

    def schema(self) -> dict[str, Any]:
        return object_schema(self.cls)

    def parse(self, value: Any) -> Any:
        raise AssertionError("parsed by parse_object")


@dataclasses.dataclass(frozen=True)
class ListOf(Type):
    """A list of nested spec dataclasses, at most `max_items`, unique by the `key` field (a list-map to the API
    server, which then refuses a repeated key itself)."""

    cls: type = object
    key: str = "name"
    max_items: int = 64

    def schema(self) -> dict[str, Any]:
        return {
            "type": "array",
            "maxItems": self.max_items,
            "items": object_schema(self.cls),
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": [self.key],
        }

    def parse_items(self, value: Any, path: str) -> list[Any]:
        if not isinstance(value, list):
            raise SpecError(path, f"must be a list, got {value!r}")
        if len(value) > self.max_items:
            raise SpecError(path, f"must have at most {self.max_items} items, got {len(value)}")
        items = [parse_object(self.cls, item, f"{path}[{i}]") for i, item in enumerate(value)]
        attr = next(f.name for f in spec_fields(self.cls) if f.metadata["name"] == self.key)
        seen: set[Any] = set()
        for i, item in enumerate(items):
            if getattr(item, attr) in seen:
                raise SpecError(f"{path}[{i}].{self.key}", f"{getattr(item, attr)!r} is repeated")
            seen.add(getattr(item, attr))
        return items


@dataclasses.dataclass(frozen=True)
class Raw(Type):
    """A value passed through as JSON (a Kubernetes type the operator hands on), with its schema as given;
    `check` (optional) validates it in Python."""

    openapi: dict[str, Any] = dataclasses.field(default_factory=dict)
    kind: type | tuple[type, ...] = object
    check: Callable[[Any], None] | None = None

    def schema(self) -> dict[str, Any]:
        return dict(self.openapi)

    def parse(self, value: Any) -> Any:
        if not isinstance(value, self.kind):
            names = {dict: "an object", list: "a list", str: "a string"}
            want = names.get(self.kind, getattr(self.kind, "__name__", "JSON"))  # type: ignore[call-overload]
            raise ValueError(f"must be {want}, got {value!r}")
        if self.check is not None:
            self.check(value)
        return value


def prop(
    kind: Type,
    name: str,
    description: str = "",
    *,
    default: Any = MISSING,
    rules: Sequence[Rule] = (),
    required: bool = False,
    reason: str = "InvalidSpec",
    show_default: bool = True,
) -> Any:
    """A spec field: `name` in the CRD, `default` the raw JSON default (parsed for the dataclass)."""
    meta = {
        "kind": kind,
        "name": name,
        "description": description,
        "default": default,
        "rules": tuple(rules),
        "required": required,
        "reason": reason,
        "show_default": show_default,
    }
    if isinstance(kind, Obj):
        if kind.optional:
            return dataclasses.field(default=None, metadata=meta)
        return dataclasses.field(default_factory=kind.cls, metadata=meta)
    if default is MISSING:
        return dataclasses.field(default=None, metadata=meta)
    value = kind.parse(default)
    if isinstance(value, list | dict):
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=meta)
    return dataclasses.field(default=value, metadata=meta)


def spec_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "kind" in f.metadata]


def object_schema(cls: type) -> dict[str, Any]:
    """The OpenAPI schema of a spec dataclass: its props, required ones, descriptions, rules."""
    props: dict[str, Any] = {}
    required: list[str] = []
    for f in spec_fields(cls):
        m = f.metadata
        kind: Type = m["kind"]
        schema = kind.schema()
        if m["description"]:
            schema = {**schema, "description": m["description"]}
        if m["default"] is not MISSING and m["show_default"]:
            schema["default"] = m["default"]
        elif isinstance(kind, Obj) and not (m["required"] or kind.optional) and m["show_default"]:
            schema["default"] = {}
        rules = [*m["rules"], *(kind.rules(m["name"]) if isinstance(kind, IntOrAuto) else [])]
        if rules:
            schema["x-kubernetes-validations"] = [_cel(r) for r in rules]
        if m["required"]:
            required.append(m["name"])
        props[m["name"]] = schema
    out: dict[str, Any] = {"type": "object"}
    doc = (cls.__doc__ or "").strip()
    if doc and not doc.startswith(cls.__name__ + "("):
        out["description"] = " ".join(doc.split())
    if required:
        out["required"] = required
    rules = getattr(cls, "RULES", ())
    if rules:
        out["x-kubernetes-validations"] = [_cel(r) for r in rules]
    out["properties"] = props
    return out


def _cel(rule: Rule) -> dict[str, Any]:
    out = {"rule": rule.cel, "message": rule.message}
    if rule.field_path:
        out["fieldPath"] = rule.field_path
    return out


def parse_object(cls: type, data: Any, path: str = "") -> Any:
    """`data` (a spec object's JSON) as `cls`, defaults applied; raises SpecError naming the first bad field.

    Fields are parsed in declaration order, then the class's RULES are checked on the raw object."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(path or "spec", f"must be an object, got {type(data).__name__}")
    values: dict[str, Any] = {}
    for f in spec_fields(cls):
        m = f.metadata
        where = f"{path}.{m['name']}" if path else m["name"]
        kind: Type = m["kind"]
        raw = data.get(m["name"])
        if raw is None:
            if m["required"]:
                raise SpecError(where, "is required", m["reason"])
            if isinstance(kind, Obj) and not kind.optional:
                values[f.name] = parse_object(kind.cls, {}, where)
            continue  # the dataclass default is the parsed CRD default
        try:
            if isinstance(kind, Obj):
                values[f.name] = parse_object(kind.cls, raw, where)
            elif isinstance(kind, ListOf):
                values[f.name] = kind.parse_items(raw, where)
            else:
                values[f.name] = kind.parse(raw)
        except ValueError as exc:
            if isinstance(exc, SpecError):
                raise
            raise SpecError(where, str(exc), m["reason"]) from None
        for rule in m["rules"]:
            if not rule.check(raw):
                raise SpecError(where, rule.message, rule.reason)
    for rule in getattr(cls, "RULES", ()):
        if not rule.check(data):
            where = f"{path}{rule.field_path}" if path else (rule.field_path or ".").lstrip(".")
            raise SpecError(where.lstrip("."), rule.message, rule.reason)
    return cls(**values)
