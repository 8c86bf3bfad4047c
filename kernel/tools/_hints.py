"""What kind of type hint is this: the predicates the schema and the converter share."""

from __future__ import annotations

import enum
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, TypeAlias, Union

import attrs

JSONSchema: TypeAlias = dict[str, Any]

NoneType = type(None)
_UNION_ORIGINS = (Union, types.UnionType)
_ARRAY_ORIGINS = (list, tuple, Sequence)
_MAP_ORIGINS = (dict, Mapping)
SCALAR_TYPE_NAMES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    NoneType: "null",
}


def is_none_type(hint: Any) -> bool:
    return hint is None or hint is NoneType


def is_literal(hint: Any) -> bool:
    return typing.get_origin(hint) is Literal


def is_annotated(hint: Any) -> bool:
    return typing.get_origin(hint) is Annotated


def is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in _UNION_ORIGINS


def is_enum_class(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, enum.Enum)


def is_attrs_class(hint: Any) -> bool:
    return isinstance(hint, type) and attrs.has(hint)


def is_array_hint(hint: Any) -> bool:
    return hint in (list, tuple) or typing.get_origin(hint) in _ARRAY_ORIGINS


def is_map_hint(hint: Any) -> bool:
    return hint is dict or typing.get_origin(hint) in _MAP_ORIGINS


def label(hint: Any) -> str:
    """A short human name for a type, for error messages."""
    if hint is NoneType or hint is None:
        return "None"
    if isinstance(hint, type) and not typing.get_args(hint):
        return hint.__name__
    if is_union(hint):
        return " | ".join(label(a) for a in typing.get_args(hint))
    return repr(hint).replace("typing.", "")


def json_scalar_type(value: Any) -> str | None:
    """The JSON Schema type of a Literal or Enum value; None if it is not a JSON scalar."""
    if value is None or type(value) in (str, int, float, bool):
        return SCALAR_TYPE_NAMES[type(value)]
    return None


def literal_matches(allowed: Any, value: Any) -> bool:
    # Python equality is too loose for JSON: True == 1 and 1 == 1.0.
    exact = type(value) is type(allowed) or (type(allowed) is float and type(value) is int)
    return exact and value == allowed


def strip_annotated(hint: Any) -> tuple[Any, str | None]:
    """The hint inside ``Annotated[...]`` and its first string (the description), if any."""
    if is_annotated(hint):
        inner, *metadata = typing.get_args(hint)
        texts = [m for m in metadata if isinstance(m, str)]
        inner, nested = strip_annotated(inner)
        return inner, texts[0] if texts else nested
    return hint, None
