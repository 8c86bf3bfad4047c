"""Type hints to JSON Schema, and a function's parameters to a schema and an attrs class.

Supported hints: ``str``, ``int``, ``float``, ``bool``, ``None``, ``Any``,
``Literal[...]``, ``Enum`` subclasses, ``list[T]`` / ``Sequence[T]`` /
``tuple[T, ...]``, ``dict[str, T]`` / ``Mapping[str, T]``, unions and
``Optional``, attrs classes (nested as objects), and ``Annotated[T, "text"]``
whose string becomes the description.

Schema conventions:

- ``T | None`` is ``{"anyOf": [<T>, {"type": "null"}]}`` for every ``T``,
  scalars included: one rule, whatever ``T`` is.
- Objects (the parameters themselves and attrs classes) list every
  property, the ``required`` ones (those without a default) and
  ``"additionalProperties": false``.
- A default that serializes to JSON appears as ``"default"``.
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from ..errors import UsageError
from ._docstrings import parse_docstring
from ._hints import (
    SCALAR_TYPE_NAMES,
    JSONSchema,
    is_array_hint,
    is_attrs_class,
    is_enum_class,
    is_literal,
    is_map_hint,
    is_none_type,
    is_union,
    json_scalar_type,
    label,
    strip_annotated,
)
from ._strict import converter, fresh_default, register_enum


class _Unsupported(Exception):
    """A hint the schema cannot express; the decorator adds which tool and parameter."""


def _enum_schema(values: Sequence[Any]) -> JSONSchema:
    """One ``{"type", "enum"}`` per JSON type among the values, in first-seen order."""
    groups: dict[str, list[Any]] = {}
    for value in values:
        json_type = json_scalar_type(value)
        if json_type is None:
            raise _Unsupported(f"value {value!r} is not a JSON string, number, boolean or null")
        groups.setdefault(json_type, []).append(value)
    schemas = [
        {"type": "null"} if json_type == "null" else {"type": json_type, "enum": members}
        for json_type, members in groups.items()
    ]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _json_default(value: Any) -> tuple[bool, Any]:
    """``(True, json_value)`` when a default can be shown to the model as JSON."""
    try:
        unstructured = converter.unstructure(value)
        json.dumps(unstructured, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return False, None
    return True, unstructured


def _schema_for(hint: Any, stack: tuple[type, ...] = ()) -> JSONSchema:
    """The JSON Schema for one type hint; ``stack`` holds the attrs classes being expanded."""
    hint, description = strip_annotated(hint)
    schema = _bare_schema_for(hint, stack)
    if description:
        schema["description"] = description
    return schema


def _bare_schema_for(hint: Any, stack: tuple[type, ...]) -> JSONSchema:
    args = typing.get_args(hint)
    if hint is Any:
        return {}
    if is_none_type(hint):
        return {"type": "null"}
    if hint in SCALAR_TYPE_NAMES:
        return {"type": SCALAR_TYPE_NAMES[hint]}
    if is_literal(hint):
        return _enum_schema(args)
    if is_enum_class(hint):
        register_enum(hint)
        return _enum_schema([member.value for member in hint])
    if is_union(hint):
        return {"anyOf": [_schema_for(arg, stack) for arg in args]}
    if is_array_hint(hint):
        if typing.get_origin(hint) is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            raise _Unsupported(f"{label(hint)}: only tuple[T, ...] is supported")
        return {"type": "array", "items": _schema_for(args[0] if args else Any, stack)}
    if is_map_hint(hint):
        key, value = args if args else (str, Any)
        if key is not str:
            raise _Unsupported(f"{label(hint)}: object keys must be str")
        return {"type": "object", "additionalProperties": _schema_for(value, stack)}
    if is_attrs_class(hint):
        if hint in stack:
            raise _Unsupported(
                f"{hint.__name__} refers to itself; recursive types are not supported"
            )
        return _attrs_schema(hint, (*stack, hint))
    raise _Unsupported(f"unsupported type {label(hint)}")


def _object_schema(properties: dict[str, JSONSchema], required: list[str]) -> JSONSchema:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def _show_default(schema: JSONSchema, default: Any) -> None:
    shown, value = _json_default(default)
    if shown:
        schema["default"] = value


def _attrs_schema(cls: type, stack: tuple[type, ...]) -> JSONSchema:
    try:
        attrs.resolve_types(cls, include_extras=True)
    except Exception as exc:
        raise _Unsupported(f"cannot resolve the type hints of {cls.__name__}: {exc}") from exc
    properties: dict[str, JSONSchema] = {}
    required: list[str] = []
    for field in attrs.fields(cls):
        if not field.init:
            continue
        if field.type is None:
            raise _Unsupported(f"{cls.__name__}.{field.name} has no type hint")
        try:
            schema = _schema_for(field.type, stack)
        except _Unsupported as exc:
            raise _Unsupported(f"{cls.__name__}.{field.name}: {exc}") from None
        if field.default is attrs.NOTHING:
            required.append(field.name)
        elif isinstance(field.default, attrs.Factory):  # type: ignore[arg-type]
            if not field.default.takes_self:
                _show_default(schema, field.default.factory())
        else:
            _show_default(schema, field.default)
        properties[field.name] = schema
    return _object_schema(properties, required)


def parameters_of(fn: Callable[..., Any], name: str) -> tuple[JSONSchema, type]:
    """The JSON Schema of fn's parameters and the attrs class to structure them into.

    Raises:
        UsageError: ``*args``/``**kwargs``, a positional-only parameter, or a
            parameter without a type hint or with one the schema cannot express.
    """
    qualname = getattr(fn, "__qualname__", name)
    where = f"tool {name!r}" if qualname == name else f"tool {name!r} ({qualname})"
    try:
        signature = inspect.signature(fn)
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception as exc:  # NameError for an undefined forward reference, and kin
        raise UsageError(f"{where}: cannot read the signature: {exc}") from exc
    _, arg_docs = parse_docstring(inspect.getdoc(fn))
    properties: dict[str, JSONSchema] = {}
    required: list[str] = []
    fields: dict[str, Any] = {}
    for parameter in signature.parameters.values():
        pname = parameter.name
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise UsageError(f"{where}: parameter {pname!r}: *args and **kwargs are not supported")
        if parameter.kind is parameter.POSITIONAL_ONLY:
            raise UsageError(f"{where}: parameter {pname!r} is positional-only")
        if pname not in hints:
            raise UsageError(f"{where}: parameter {pname!r} has no type hint")
        try:
            schema = _schema_for(hints[pname])
        except _Unsupported as exc:
            raise UsageError(f"{where}: parameter {pname!r}: {exc}") from None
        if "description" not in schema and pname in arg_docs:
            schema["description"] = arg_docs[pname]
        if parameter.default is parameter.empty:
            required.append(pname)
            default: Any = attrs.NOTHING
        else:
            _show_default(schema, parameter.default)
            default = fresh_default(parameter.default)
        properties[pname] = schema
        hint, _ = strip_annotated(hints[pname])
        fields[pname] = attrs.field(type=hint, default=default, alias=pname)
    # The class name ends up in generated code: it must be an identifier.
    class_name = re.sub(r"\W", "_", name) + "_arguments"
    arguments_class = attrs.make_class(class_name, fields, frozen=True, kw_only=True)
    return _object_schema(properties, required), arguments_class
