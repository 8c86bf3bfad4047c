"""JSON Schema to a validator, for tools known by their schema alone (a worker's tools).

Such a tool's arguments are checked here, in the kernel, and sent on as the
JSON object they are (defaults filled in): the worker structures them into
its function's parameters itself. The check is a tree of small closures
compiled once per schema, so a good call costs a walk over its arguments.

A bad call's message must read exactly as the strict converter words it
(``$.lines[0].n: expected int, got str``): only then, the schema is also
turned into an attrs class (built on first need) and the converter says
what is wrong. The two agree on what they accept: each closure below
mirrors the converter's hook for the hint ``_hint_from_schema`` makes.
"""

from __future__ import annotations

import copy
import keyword
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Union

import attrs

from ..errors import UsageError
from ._failures import ArgumentError
from ._hints import SCALAR_TYPE_NAMES, json_scalar_type, literal_matches
from ._strict import STRUCTURE_ERRORS, converter, describe_argument_error, fresh_default

Check = Callable[[Any], Any]
"""Returns the value, checked (numbers made floats where the schema says so), or raises
``_Invalid``. A value that needs no change is returned as is, not copied."""


class _Invalid(Exception):
    """The value fails the schema; the converter, asked again, says where and why."""


_JSON_SCALAR_HINTS: dict[str, Any] = {name: t for t, name in SCALAR_TYPE_NAMES.items()}


def _check_any(value: Any) -> Any:
    return value


def _check_string(value: Any) -> Any:
    if type(value) is not str:
        raise _Invalid
    return value


def _check_integer(value: Any) -> Any:
    if type(value) is not int:
        raise _Invalid
    return value


def _check_number(value: Any) -> Any:
    # As the converter does: an int is a float's valid value, and becomes one.
    if type(value) is float:
        return value
    if type(value) is not int:
        raise _Invalid
    return float(value)


def _check_boolean(value: Any) -> Any:
    if type(value) is not bool:
        raise _Invalid
    return value


def _check_null(value: Any) -> Any:
    if value is not None:
        raise _Invalid
    return value


_SCALAR_CHECKS: dict[str, Check] = {
    "string": _check_string,
    "integer": _check_integer,
    "number": _check_number,
    "boolean": _check_boolean,
    "null": _check_null,
}


def _enum_check(values: Sequence[Any]) -> Check:
    def check_enum(value: Any) -> Any:
        for allowed in values:
            if literal_matches(allowed, value):
                return allowed
        raise _Invalid

    return check_enum


def _union_check(checks: Sequence[Check]) -> Check:
    if len(checks) == 1:
        return checks[0]

    def check_union(value: Any) -> Any:
        # The converter tries the alternatives of the value's shape in order and
        # keeps the first that takes it; a shape that does not fit fails here too.
        for check in checks:
            try:
                return check(value)
            except _Invalid:
                pass
        raise _Invalid

    return check_union


def _array_check(items: Check) -> Check:
    def check_array(value: Any) -> Any:
        if type(value) is not list:
            raise _Invalid
        out: list[Any] | None = None
        for index, item in enumerate(value):
            checked = items(item)
            if checked is not item:
                if out is None:
                    out = list(value)
                out[index] = checked
        return value if out is None else out

    return check_array


def _map_check(values: Check) -> Check:
    def check_map(value: Any) -> Any:
        if type(value) is not dict:
            raise _Invalid
        out: dict[str, Any] | None = None
        for key, item in value.items():
            checked = values(item)
            if checked is not item:
                if out is None:
                    out = dict(value)
                out[key] = checked
        return value if out is None else out

    return check_map


def _object_check(schema: Mapping[str, Any], path: str) -> Check:
    required = set(schema.get("required", ()))
    checks: dict[str, Check] = {}
    defaults: dict[str, Any] = {}
    for name, sub in schema.get("properties", {}).items():
        if not name.isidentifier() or keyword.iskeyword(name):
            raise UsageError(f"{path}: property name {name!r} is not a Python identifier")
        if name not in required and isinstance(sub, Mapping) and "default" in sub:
            defaults[name] = sub["default"]
        checks[name] = compile_check(sub, f"{path}.{name}")
    # In the converter's order (fields as declared), so the first missing one is its too.
    required_names = [name for name in checks if name in required]
    count = len(checks)

    def check_object(value: Any) -> Any:
        if type(value) is not dict:
            raise _Invalid
        out: dict[str, Any] | None = None
        for key, item in value.items():
            check = checks.get(key)
            if check is None:
                raise _Invalid  # an unknown key
            checked = check(item)
            if checked is not item:
                if out is None:
                    out = dict(value)
                out[key] = checked
        if len(value) < count:
            for name in required_names:
                if name not in value:
                    raise _Invalid
            for name, default in defaults.items():
                if name not in value:
                    if out is None:
                        out = dict(value)
                    # Each call its own copy: a worker may change what it gets.
                    out[name] = copy.deepcopy(default)
        return value if out is None else out

    return check_object


def compile_check(schema: Any, path: str) -> Check:
    """The check for one schema; mirrors ``_hint_from_schema`` branch for branch.

    Raises:
        UsageError: a schema this module cannot validate (the message names where).
    """
    if not isinstance(schema, Mapping):
        raise UsageError(f"{path}: a schema must be an object, got {schema!r}")
    if "enum" in schema:
        values = list(schema["enum"])
        if not values or any(json_scalar_type(v) is None for v in values):
            raise UsageError(f"{path}: enum values must be JSON strings, numbers, booleans or null")
        return _enum_check(values)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return _union_check([compile_check(s, path) for s in schema[key]])
    json_type = schema.get("type")
    if json_type is None:
        return _check_any
    if isinstance(json_type, list):
        return _union_check([compile_check({**schema, "type": t}, path) for t in json_type])
    if isinstance(json_type, str) and json_type in _SCALAR_CHECKS:
        return _SCALAR_CHECKS[json_type]
    if json_type == "array":
        return _array_check(compile_check(schema.get("items", {}), f"{path}[]"))
    if json_type == "object":
        if "properties" in schema:
            return _object_check(schema, path)
        extra = schema.get("additionalProperties", True)
        if extra is True or extra == {}:
            return _map_check(_check_any)
        return _map_check(compile_check(extra, f"{path}.*"))
    raise UsageError(f"{path}: unsupported JSON Schema type {json_type!r}")


# --- the same schema as an attrs class: what the converter words errors with ------


class _SchemaObject:
    """Base of the classes made from a JSON Schema (not from Python hints)."""

    __slots__ = ()


def _union_of(hints: Sequence[Any]) -> Any:
    return hints[0] if len(hints) == 1 else Union[tuple(hints)]  # noqa: UP007


def _hint_from_schema(schema: Mapping[str, Any], path: str) -> Any:
    # compile_check has refused every schema this cannot turn into a hint.
    if "enum" in schema:
        return Literal[tuple(schema["enum"])]
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return _union_of([_hint_from_schema(s, path) for s in schema[key]])
    json_type = schema.get("type")
    if json_type is None:
        return Any
    if isinstance(json_type, list):
        return _union_of([_hint_from_schema({**schema, "type": t}, path) for t in json_type])
    if json_type in _JSON_SCALAR_HINTS:
        return _JSON_SCALAR_HINTS[json_type]
    if json_type == "array":
        return list[_hint_from_schema(schema.get("items", {}), f"{path}[]")]  # type: ignore[misc]
    if "properties" in schema:
        return _class_from_schema(schema, path)
    extra = schema.get("additionalProperties", True)
    value = Any if extra is True or extra == {} else _hint_from_schema(extra, f"{path}.*")
    return dict[str, value]  # type: ignore[valid-type]


def _class_from_schema(schema: Mapping[str, Any], path: str) -> type:
    required = set(schema.get("required", ()))
    fields: dict[str, Any] = {}
    for name, sub in schema.get("properties", {}).items():
        default: Any
        if name in required:
            default = attrs.NOTHING
        elif isinstance(sub, Mapping) and "default" in sub:
            default = fresh_default(sub["default"])
        else:
            default = None  # absent: the check has the answer in that case
        fields[name] = attrs.field(
            type=_hint_from_schema(sub, f"{path}.{name}"), default=default, alias=name
        )
    return attrs.make_class(
        "SchemaObject", fields, bases=(_SchemaObject,), frozen=True, kw_only=True
    )


class SchemaValidator:
    """Validates JSON arguments against an object schema and returns them as JSON.

    Defaults the schema gives are filled in; an optional property without one
    stays absent. Strict as the converter is for typed tools.

    Raises:
        UsageError: (on construction) ``parameters`` is not an object schema
            this module can validate.
    """

    def __init__(self, parameters: Any, where: str) -> None:
        if not isinstance(parameters, Mapping) or parameters.get("type") != "object":
            raise UsageError(f"{where}: parameters must be a JSON Schema of type object")
        self._parameters = parameters
        self._path = f"{where} parameters"
        # The top level is an object of named arguments, with properties or not.
        self._check = _object_check(parameters, self._path)
        self._structure: Callable[[Any], Any] | None = None

    def __call__(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The arguments, checked, defaults filled in.

        Raises:
            ArgumentError: the message names each failing path and why.
        """
        try:
            checked: dict[str, Any] = self._check(arguments)
        except _Invalid:
            pass
        else:
            return checked
        raise ArgumentError(self._explain(arguments))

    def _explain(self, arguments: dict[str, Any]) -> str:
        if self._structure is None:
            cls = _class_from_schema(self._parameters, self._path)
            hook = converter.get_structure_hook(cls)
            self._structure = lambda value: hook(value, cls)
        try:
            self._structure(arguments)
        except STRUCTURE_ERRORS as exc:
            return describe_argument_error(exc)
        # Unreachable while the check mirrors the converter; say so rather than pass it.
        return "$: arguments do not match the schema"
