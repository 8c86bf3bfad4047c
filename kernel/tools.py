"""Tools: ``@tool`` turns a typed function into a ``Tool``; ``ToolRegistry`` holds them.

A tool's parameters are described twice from one source, the type hints:
as a JSON Schema for the model (``Tool.parameters``) and as a private attrs
class that the tool's cattrs converter structures the model's arguments
into (``Tool.validate``). Validation is strict JSON typing: ``"3"`` is not
an int, ``true`` is not an int, ``3`` is a float, unknown keys are refused.

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

import copy
import enum
import functools
import inspect
import json
import keyword
import math
import re
import types
import typing
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from typing import Annotated, Any, Literal, TypeAlias, Union, overload

import attrs
import cattrs
import cattrs.gen
from cattrs.errors import ForbiddenExtraKeysError, IterableValidationError, IterableValidationNote

from .errors import UsageError
from .messages import ErrorKind, structure_error_paths
from .messages import converter as _messages_converter


class ArgumentError(Exception):
    """Arguments failed the tool's schema.

    ``str(exc)`` names each failing path and why, joined by ``; ``:
    ``$.items[2].name: expected int, got str``.
    """


class ToolFailure(Exception):
    """Raised by a tool (or whatever runs it) to choose the observation's error kind.

    ``raise ToolFailure("denied", "network access to example.org:443 was not declared")``
    """

    def __init__(self, kind: ErrorKind, message: str, *, type: str | None = None) -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind
        self.message = message
        self.type = type or "ToolFailure"


def describe_exception(exc: BaseException) -> str:
    """How a tool's exception reads in its observation: its message, or for an
    exception group one ``Type: message`` per sub-exception, on one line."""
    if isinstance(exc, BaseExceptionGroup):
        leaves = [f"{type(e).__name__}: {describe_exception(e)}" for e in exc.exceptions]
        return f"{exc.message} ({len(exc.exceptions)} sub-exceptions): " + "; ".join(leaves)
    return str(exc) or type(exc).__name__


JSONSchema: TypeAlias = dict[str, Any]

TOOL_NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
"""What a tool name must match (in full).

OpenAI and Anthropic accept ``[a-zA-Z0-9_-]{1,64}``; Gemini accepts
letters, digits, ``_ . : -`` up to 64 characters, starting with a letter or
an underscore. This is the strictest rule they share, except that ``.`` is
allowed for namespacing (``fs.read``): OpenAI and Anthropic reject it, so an
adapter for them must map ``.`` to something they accept, and back.
"""


def _check_name(instance: Any, attribute: Any, name: str) -> None:
    if not isinstance(name, str) or not TOOL_NAME_PATTERN.fullmatch(name):
        raise UsageError(
            f"invalid tool name {name!r}: a name starts with a letter or '_' and has at "
            "most 64 letters, digits, '_', '.' or '-'"
        )


def _check_positive(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    # Finite too: a worker reports its tools' limits as JSON, which allows Infinity,
    # and an endless deadline would let one plugin hold a turn forever.
    if value is not None and not (
        isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < math.inf
    ):
        raise UsageError(f"{attribute.name} must be a positive finite number, got {value!r}")


# --- docstrings --------------------------------------------------------------------

_SECTION_HEADER = re.compile(r"([A-Za-z][A-Za-z ]*):")
_ARGS_SECTIONS = frozenset({"args", "arguments", "parameters", "params"})
# Sections that describe the call to a Python caller, not to the model.
_DROPPED_SECTIONS = _ARGS_SECTIONS | {"returns", "return", "yields", "yield", "raises"}
_ARG_ENTRY = re.compile(r"\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)")


def _parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into the description and per-argument texts."""
    lines = inspect.cleandoc(doc or "").splitlines()
    kept: list[str] = []
    arguments: dict[str, list[str]] = {}
    section: str | None = None
    entry_indent: int | None = None
    current: list[str] | None = None
    for line in lines:
        text = line.strip()
        if text and not line[0].isspace():
            header = _SECTION_HEADER.fullmatch(text)
            name = header.group(1).lower() if header else None
            section = name if name in _DROPPED_SECTIONS else None
            entry_indent, current = None, None
            if section is not None:
                continue
        if section is None:
            kept.append(line)
            continue
        if section not in _ARGS_SECTIONS or not text:
            continue
        indent = len(line) - len(line.lstrip())
        if entry_indent is None:
            entry_indent = indent
        entry = _ARG_ENTRY.fullmatch(text) if indent <= entry_indent else None
        if entry is not None:
            current = arguments.setdefault(entry.group(1), [])
            if entry.group(2):
                current.append(entry.group(2))
        elif current is not None:
            current.append(text)
    description = re.sub(r"\n{3,}", "\n\n", "\n".join(kept)).strip()
    return description, {name: " ".join(parts) for name, parts in arguments.items()}


# --- type hints -> JSON Schema -----------------------------------------------------

_NoneType = type(None)
_UNION_ORIGINS = (Union, types.UnionType)
_ARRAY_ORIGINS = (list, tuple, Sequence)
_MAP_ORIGINS = (dict, Mapping)
_SCALAR_TYPE_NAMES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    _NoneType: "null",
}


def _is_none_type(hint: Any) -> bool:
    return hint is None or hint is _NoneType


def _is_literal(hint: Any) -> bool:
    return typing.get_origin(hint) is Literal


def _is_annotated(hint: Any) -> bool:
    return typing.get_origin(hint) is Annotated


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in _UNION_ORIGINS


def _is_enum_class(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, enum.Enum)


def _is_attrs_class(hint: Any) -> bool:
    return isinstance(hint, type) and attrs.has(hint)


def _is_array_hint(hint: Any) -> bool:
    return hint in (list, tuple) or typing.get_origin(hint) in _ARRAY_ORIGINS


def _is_map_hint(hint: Any) -> bool:
    return hint is dict or typing.get_origin(hint) in _MAP_ORIGINS


class _Unsupported(Exception):
    """A hint the schema cannot express; the decorator adds which tool and parameter."""


def _label(hint: Any) -> str:
    """A short human name for a type, for error messages."""
    if hint is _NoneType or hint is None:
        return "None"
    if isinstance(hint, type) and not typing.get_args(hint):
        return hint.__name__
    if _is_union(hint):
        return " | ".join(_label(a) for a in typing.get_args(hint))
    return repr(hint).replace("typing.", "")


def _json_scalar_type(value: Any) -> str | None:
    """The JSON Schema type of a Literal or Enum value; None if it is not a JSON scalar."""
    if value is None or type(value) in (str, int, float, bool):
        return _SCALAR_TYPE_NAMES[type(value)]
    return None


def _enum_schema(values: Sequence[Any]) -> JSONSchema:
    """One ``{"type", "enum"}`` per JSON type among the values, in first-seen order."""
    groups: dict[str, list[Any]] = {}
    for value in values:
        json_type = _json_scalar_type(value)
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
        unstructured = _converter.unstructure(value)
        json.dumps(unstructured, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return False, None
    return True, unstructured


def _strip_annotated(hint: Any) -> tuple[Any, str | None]:
    if _is_annotated(hint):
        inner, *metadata = typing.get_args(hint)
        texts = [m for m in metadata if isinstance(m, str)]
        inner, nested = _strip_annotated(inner)
        return inner, texts[0] if texts else nested
    return hint, None


def _schema_for(hint: Any, stack: tuple[type, ...] = ()) -> JSONSchema:
    """The JSON Schema for one type hint; ``stack`` holds the attrs classes being expanded."""
    hint, description = _strip_annotated(hint)
    schema = _bare_schema_for(hint, stack)
    if description:
        schema["description"] = description
    return schema


def _bare_schema_for(hint: Any, stack: tuple[type, ...]) -> JSONSchema:
    args = typing.get_args(hint)
    if hint is Any:
        return {}
    if _is_none_type(hint):
        return {"type": "null"}
    if hint in _SCALAR_TYPE_NAMES:
        return {"type": _SCALAR_TYPE_NAMES[hint]}
    if _is_literal(hint):
        return _enum_schema(args)
    if _is_enum_class(hint):
        _register_enum(hint)
        return _enum_schema([member.value for member in hint])
    if _is_union(hint):
        return {"anyOf": [_schema_for(arg, stack) for arg in args]}
    if _is_array_hint(hint):
        if typing.get_origin(hint) is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            raise _Unsupported(f"{_label(hint)}: only tuple[T, ...] is supported")
        return {"type": "array", "items": _schema_for(args[0] if args else Any, stack)}
    if _is_map_hint(hint):
        key, value = args if args else (str, Any)
        if key is not str:
            raise _Unsupported(f"{_label(hint)}: object keys must be str")
        return {"type": "object", "additionalProperties": _schema_for(value, stack)}
    if _is_attrs_class(hint):
        if hint in stack:
            raise _Unsupported(
                f"{hint.__name__} refers to itself; recursive types are not supported"
            )
        return _attrs_schema(hint, (*stack, hint))
    raise _Unsupported(f"unsupported type {_label(hint)}")


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


def _fresh_default(default: Any) -> Any:
    """An attrs default that gives each call its own copy of a mutable value."""
    if isinstance(default, list | dict | set):
        return attrs.Factory(functools.partial(copy.deepcopy, default))
    return default


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


# --- the converter: strict JSON in, Python values out ------------------------------


def _type_error(expected: str, value: Any) -> TypeError:
    return TypeError(f"expected {expected}, got {type(value).__name__}")


def _literal_matches(allowed: Any, value: Any) -> bool:
    # Python equality is too loose for JSON: True == 1 and 1 == 1.0.
    exact = type(value) is type(allowed) or (type(allowed) is float and type(value) is int)
    return exact and value == allowed


def _structure_literal(value: Any, hint: Any) -> Any:
    for allowed in typing.get_args(hint):
        if _literal_matches(allowed, value):
            return allowed
    choices = ", ".join(repr(a) for a in typing.get_args(hint))
    raise ValueError(f"expected one of {choices}, got {value!r}")


def _structure_enum(value: Any, cls: type[enum.Enum]) -> enum.Enum:
    for member in cls:
        if _literal_matches(member.value, value):
            return member
    choices = ", ".join(repr(m.value) for m in cls)
    raise ValueError(f"expected one of {choices}, got {value!r}")


def _register_enum(cls: type[enum.Enum]) -> None:
    # Registered per class: a str- or int-based enum would otherwise reach the
    # converter's strict str/int hook, which returns a plain value.
    _converter.register_structure_hook(cls, _structure_enum)


def _structure_none(value: Any, _: Any) -> None:
    if value is not None:
        raise _type_error("None", value)


def _fits(hint: Any, value: Any) -> bool:
    """Whether the value has the JSON shape the hint wants (not whether it is valid)."""
    hint, _ = _strip_annotated(hint)
    if hint is Any:
        return True
    if _is_none_type(hint):
        return value is None
    if hint is float:
        return type(value) in (int, float)
    if hint in _SCALAR_TYPE_NAMES:
        return type(value) is hint
    if _is_literal(hint):
        return any(_literal_matches(a, value) for a in typing.get_args(hint))
    if _is_enum_class(hint):
        return any(_literal_matches(m.value, value) for m in hint)
    if _is_union(hint):
        return any(_fits(arg, value) for arg in typing.get_args(hint))
    if _is_array_hint(hint):
        return type(value) is list
    return type(value) is dict


def _structure_union(value: Any, hint: Any) -> Any:
    fitting = [arg for arg in typing.get_args(hint) if _fits(arg, value)]
    if not fitting:
        raise _type_error(_label(hint), value)
    first_error: Exception | None = None
    for arg in fitting:
        try:
            return _converter.structure(value, arg)
        except Exception as exc:
            first_error = first_error or exc
    # Every alternative of the value's shape refused it. The first one's own
    # errors keep their paths ($.order.items[0].name), which a bare "matches
    # none of" would lose.
    assert first_error is not None
    raise first_error


def _structure_items(
    items: Iterable[tuple[int | str, Any]], item_type: Any, hint: Any
) -> list[Any]:
    out: list[Any] = []
    errors: list[Exception] = []
    for index, item in items:
        try:
            out.append(_converter.structure(item, item_type))
        except Exception as exc:
            exc.add_note(
                IterableValidationNote(f"Structuring {hint!r} @ {index!r}", index, item_type)
            )
            errors.append(exc)
    if errors:
        raise IterableValidationError(f"While structuring {hint!r}", errors, hint)
    return out


def _structure_array(value: Any, hint: Any) -> Any:
    if type(value) is not list:
        raise _type_error("list", value)
    args = typing.get_args(hint)
    items = _structure_items(enumerate(value), args[0] if args else Any, hint)
    return tuple(items) if hint is tuple or typing.get_origin(hint) is tuple else items


def _structure_map(value: Any, hint: Any) -> dict[str, Any]:
    if type(value) is not dict:
        raise _type_error("dict", value)
    args = typing.get_args(hint)
    values = _structure_items(value.items(), args[1] if args else Any, hint)
    return dict(zip(value, values, strict=True))


def _attrs_hook_factory(cls: type, conv: cattrs.Converter) -> Callable[[Any, Any], Any]:
    inner: Callable[[Any, Any], Any] = cattrs.gen.make_dict_structure_fn(cls, conv)

    def structure_object(value: Any, hint: Any) -> Any:
        # Without this, a string or list would reach the generated code and
        # fail with an unhelpful "indices must be integers".
        if type(value) is not dict:
            raise _type_error("dict", value)
        return inner(value, hint)

    return structure_object


def _structure_annotated(value: Any, hint: Any) -> Any:
    return _converter.structure(value, typing.get_args(hint)[0])


def _make_converter() -> cattrs.Converter:
    # Built on the kernel's converter: same strict str/int/float/bool hooks,
    # same refusal of unknown keys; the hooks below make every other kind of
    # value as strict.
    conv = _messages_converter.copy(forbid_extra_keys=True, detailed_validation=True)
    conv.register_structure_hook_func(_is_none_type, _structure_none)
    conv.register_structure_hook_func(_is_literal, _structure_literal)
    conv.register_structure_hook_func(_is_enum_class, _structure_enum)
    conv.register_structure_hook_func(_is_array_hint, _structure_array)
    conv.register_structure_hook_func(_is_map_hint, _structure_map)
    conv.register_structure_hook_factory(_is_attrs_class, _attrs_hook_factory)
    conv.register_structure_hook_func(_is_union, _structure_union)
    conv.register_structure_hook_func(_is_annotated, _structure_annotated)
    return conv


_converter = _make_converter()

# What bad input raises while structuring: cattrs' own errors, the hooks'
# TypeError/ValueError, and whatever attrs validators of a user's class raise
# for a bad value (ValueError/TypeError by convention).
_STRUCTURE_ERRORS = (
    cattrs.BaseValidationError,
    cattrs.errors.CattrsError,
    TypeError,
    ValueError,
    KeyError,
)


def _reason(exc: BaseException, hint: Any) -> str:
    if isinstance(exc, KeyError):
        return "required field missing"
    if isinstance(exc, ForbiddenExtraKeysError):
        return f"unexpected field(s): {', '.join(sorted(exc.extra_fields))}"
    return str(exc) or type(exc).__name__


def _describe_argument_error(exc: BaseException) -> str:
    """``$.path: reason`` for each failure; top-level ones speak of arguments."""
    lines = []
    for path, reason in structure_error_paths(exc, "$", _reason):
        top_level = path == "$" or (path.startswith("$.") and path[2:].isidentifier())
        if top_level:
            reason = reason.replace("required field", "required argument").replace(
                "unexpected field(s)", "unexpected argument(s)"
            )
        lines.append(f"{path}: {reason}")
    return "; ".join(lines)


# --- JSON Schema -> a structuring class, for tools defined by a schema alone -------


class _SchemaObject:
    """Base of the classes made from a JSON Schema (not from Python hints)."""

    __slots__ = ()


class _Absent:
    """An optional property the caller left out and the schema gives no default for."""

    def __repr__(self) -> str:
        return "<absent>"


_ABSENT = _Absent()
_JSON_SCALAR_HINTS: dict[str, Any] = {name: t for t, name in _SCALAR_TYPE_NAMES.items()}


def _union_of(hints: Sequence[Any]) -> Any:
    return hints[0] if len(hints) == 1 else Union[tuple(hints)]  # noqa: UP007


def _hint_from_schema(schema: Mapping[str, Any], path: str) -> Any:
    if not isinstance(schema, Mapping):
        raise UsageError(f"{path}: a schema must be an object, got {schema!r}")
    if "enum" in schema:
        values = list(schema["enum"])
        if not values or any(_json_scalar_type(v) is None for v in values):
            raise UsageError(f"{path}: enum values must be JSON strings, numbers, booleans or null")
        return Literal[tuple(values)]
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
    if json_type == "object":
        if "properties" in schema:
            return _class_from_schema(schema, path)
        extra = schema.get("additionalProperties", True)
        value = Any if extra is True or extra == {} else _hint_from_schema(extra, f"{path}.*")
        return dict[str, value]  # type: ignore[valid-type]
    raise UsageError(f"{path}: unsupported JSON Schema type {json_type!r}")


def _class_from_schema(schema: Mapping[str, Any], path: str) -> type:
    required = set(schema.get("required", ()))
    fields: dict[str, Any] = {}
    for name, sub in schema.get("properties", {}).items():
        if not name.isidentifier() or keyword.iskeyword(name):
            raise UsageError(f"{path}: property name {name!r} is not a Python identifier")
        default: Any
        if name in required:
            default = attrs.NOTHING
        elif isinstance(sub, Mapping) and "default" in sub:
            default = _fresh_default(sub["default"])
        else:
            default = _ABSENT
        fields[name] = attrs.field(
            type=_hint_from_schema(sub, f"{path}.{name}"), default=default, alias=name
        )
    return attrs.make_class(
        "SchemaObject", fields, bases=(_SchemaObject,), frozen=True, kw_only=True
    )


def _schema_object_to_json(value: Any) -> Any:
    if isinstance(value, _SchemaObject):
        return {
            field.name: _schema_object_to_json(getattr(value, field.name))
            for field in attrs.fields(type(value))  # type: ignore[arg-type]
            if getattr(value, field.name) is not _ABSENT
        }
    if isinstance(value, list):
        return [_schema_object_to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _schema_object_to_json(v) for k, v in value.items()}
    return value


def _arguments_class_from_parameters(tool: Tool) -> type:
    if not isinstance(tool.parameters, Mapping) or tool.parameters.get("type") != "object":
        raise UsageError(f"tool {tool.name!r}: parameters must be a JSON Schema of type object")
    return _class_from_schema(tool.parameters, f"tool {tool.name!r} parameters")


# --- Tool --------------------------------------------------------------------------


@attrs.frozen
class Tool:
    """A function a model may call, with the JSON Schema of its arguments.

    ``fn`` is the original function (``None`` for a tool that runs
    elsewhere, such as a sandbox worker, which sets ``invoke`` instead).
    ``timeout`` is in seconds, ``max_output`` in bytes; an ``exclusive``
    tool runs alone.

    A ``Tool`` may be built from a JSON Schema alone (``parameters``): it
    then validates arguments against that schema and returns JSON values.

    Raises:
        UsageError: the name breaks ``TOOL_NAME_PATTERN``, ``timeout`` or
            ``max_output`` is not positive, or ``parameters`` is not an object
            schema this module can validate.
    """

    name: str = attrs.field(validator=_check_name)
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any] | None
    is_async: bool
    timeout: float | None = attrs.field(default=None, validator=_check_positive)
    exclusive: bool = False
    max_output: int | None = attrs.field(default=None, validator=_check_positive)
    invoke: Callable[[dict[str, Any]], Awaitable[Any]] | None = None
    # The attrs class arguments are structured into: made from the function's
    # signature by @tool, otherwise from ``parameters``.
    _arguments_class: type = attrs.field(
        default=attrs.Factory(_arguments_class_from_parameters, takes_self=True),
        eq=False,
        repr=False,
        alias="arguments_class",
    )

    # Looked up once: validation runs for every call, on the executor's hot path.
    _structure_hook: Callable[[Any, Any], Any] = attrs.field(
        init=False, eq=False, repr=False, default=None
    )
    _field_names: tuple[str, ...] = attrs.field(init=False, eq=False, repr=False, default=())

    def __attrs_post_init__(self) -> None:
        # cattrs generates the structuring code on first use; do it now so
        # that a definition it cannot handle fails here, not at the first call.
        hook = _converter.get_structure_hook(self._arguments_class)
        object.__setattr__(self, "_structure_hook", hook)
        if not issubclass(self._arguments_class, _SchemaObject):
            cls: Any = self._arguments_class
            names = tuple(f.name for f in attrs.fields(cls))
            object.__setattr__(self, "_field_names", names)

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Check JSON arguments and return the keyword arguments for ``fn(**kwargs)``.

        Values become what the function declared (attrs instances, Enum
        members, tuples) and defaults are filled in. A tool built from a JSON
        Schema alone returns JSON values, as ``validate_json`` does.

        Raises:
            ArgumentError: the message names each failing path and why.
        """
        try:
            structured: Any = self._structure_hook(arguments, self._arguments_class)
        except _STRUCTURE_ERRORS as exc:
            raise ArgumentError(_describe_argument_error(exc)) from exc
        if isinstance(structured, _SchemaObject):
            result: dict[str, Any] = _schema_object_to_json(structured)
            return result
        return {name: getattr(structured, name) for name in self._field_names}

    def validate_json(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Check JSON arguments and return them as JSON, defaults filled in.

        This is what ``invoke`` (a worker in another process) should receive.

        Raises:
            ArgumentError: the message names each failing path and why.
        """
        kwargs = self.validate(arguments)
        if issubclass(self._arguments_class, _SchemaObject):
            return kwargs
        result: dict[str, Any] = _converter.unstructure(kwargs)
        return result


def _parameters_of(fn: Callable[..., Any], name: str) -> tuple[JSONSchema, type]:
    """The JSON Schema of fn's parameters and the attrs class to structure them into."""
    qualname = getattr(fn, "__qualname__", name)
    where = f"tool {name!r}" if qualname == name else f"tool {name!r} ({qualname})"
    try:
        signature = inspect.signature(fn)
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception as exc:  # NameError for an undefined forward reference, and kin
        raise UsageError(f"{where}: cannot read the signature: {exc}") from exc
    _, arg_docs = _parse_docstring(inspect.getdoc(fn))
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
            default = _fresh_default(parameter.default)
        properties[pname] = schema
        hint, _ = _strip_annotated(hints[pname])
        fields[pname] = attrs.field(type=hint, default=default, alias=pname)
    # The class name ends up in generated code: it must be an identifier.
    class_name = re.sub(r"\W", "_", name) + "_arguments"
    arguments_class = attrs.make_class(class_name, fields, frozen=True, kw_only=True)
    return _object_schema(properties, required), arguments_class


def _make_tool(
    fn: Callable[..., Any],
    *,
    name: str | None,
    timeout: float | None,
    exclusive: bool,
    max_output: int | None,
) -> Tool:
    if not callable(fn):
        raise UsageError(f"@tool needs a function, got {fn!r}")
    tool_name = name if name is not None else getattr(fn, "__name__", None)
    if tool_name is None:
        raise UsageError(f"@tool: {fn!r} has no __name__; pass name=")
    parameters, arguments_class = _parameters_of(fn, tool_name)
    description, _ = _parse_docstring(inspect.getdoc(fn))
    return Tool(
        name=tool_name,
        description=description,
        parameters=parameters,
        fn=fn,
        is_async=inspect.iscoroutinefunction(fn),
        timeout=timeout,
        exclusive=exclusive,
        max_output=max_output,
        arguments_class=arguments_class,
    )


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...


@overload
def tool(
    *,
    name: str | None = None,
    timeout: float | None = None,
    exclusive: bool = False,
    max_output: int | None = None,
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    timeout: float | None = None,
    exclusive: bool = False,
    max_output: int | None = None,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Turn a typed function (sync or async) into a ``Tool``.

    Use bare (``@tool``) or with options (``@tool(timeout=5, exclusive=True)``).
    The docstring gives the description; its Google-style ``Args:`` section
    gives each parameter's description. Parameters with defaults are not
    required.

    Args:
        fn: the function, when used bare.
        name: the tool's name; the function's name by default.
        timeout: seconds a call may run.
        exclusive: run alone, never beside another call.
        max_output: bytes of output kept; the rest is cut with a marker.

    Raises:
        UsageError: ``*args``/``**kwargs``, a parameter without a type hint or
            with an unsupported one, or an invalid name.
    """
    options: dict[str, Any] = dict(
        name=name, timeout=timeout, exclusive=exclusive, max_output=max_output
    )
    if fn is not None:
        return _make_tool(fn, **options)
    return functools.partial(_make_tool, **options)


# --- registry and provider formats -------------------------------------------------


class _NotForGemini(Exception):
    """The schema needs JSON Schema that Gemini's OpenAPI subset cannot say."""


def _gemini_schema(schema: Mapping[str, Any]) -> JSONSchema:
    """Convert one of our schemas to the OpenAPI subset of Gemini's ``parameters``.

    Gemini wants ``nullable`` instead of a null alternative, string-only
    enums, and no ``additionalProperties`` or ``default``; it rejects an
    object with no properties.
    """
    out: JSONSchema = {}
    description = schema.get("description")
    if "anyOf" in schema:
        members = [m for m in schema["anyOf"] if m != {"type": "null"}]
        if not members:
            raise _NotForGemini("a value that can only be null")
        if len(members) == 1:
            out = _gemini_schema(members[0])
        else:
            out = {"anyOf": [_gemini_schema(m) for m in members]}
        if len(members) < len(schema["anyOf"]):
            out["nullable"] = True
    elif "type" not in schema or schema["type"] == "null":
        raise _NotForGemini("a value of any type")
    else:
        out["type"] = schema["type"]
        if "enum" in schema:
            if schema["type"] == "string":
                out["enum"] = list(schema["enum"])
            else:
                # Gemini enums are strings only; say the choices instead.
                allowed = ", ".join(json.dumps(v) for v in schema["enum"])
                description = (
                    f"{description} (one of {allowed})" if description else f"One of {allowed}."
                )
        if "items" in schema:
            out["items"] = _gemini_schema(schema["items"])
        if schema["type"] == "object":
            if not schema.get("properties"):
                raise _NotForGemini("an object without named properties")
            out["properties"] = {k: _gemini_schema(v) for k, v in schema["properties"].items()}
            out["required"] = list(schema.get("required", []))
    if description:
        out["description"] = description
    return out


class ToolRegistry:
    """Tools by name, in registration order, with exports in the providers' formats.

    Names are kept as given. ``TOOL_NAME_PATTERN`` allows ``.`` for
    namespacing, which OpenAI and Anthropic reject: their adapters map it.

    Raises:
        UsageError: a second tool with a name already registered.
    """

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for t in tools:
            self.add(t)

    def add(self, tool: Tool) -> None:
        """Register a tool.

        Raises:
            UsageError: a tool with this name is already registered.
        """
        if tool.name in self._tools:
            raise UsageError(f"a tool named {tool.name!r} is already registered")
        self._tools[tool.name] = tool

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def names(self) -> list[str]:
        return list(self._tools)

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def openai_specs(self) -> list[dict[str, Any]]:
        """The ``tools`` list of an OpenAI Chat Completions request."""
        return [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": copy.deepcopy(t.parameters),
                },
            }
            for t in self
        ]

    def anthropic_specs(self) -> list[dict[str, Any]]:
        """The ``tools`` list of an Anthropic Messages request."""
        return [
            {
                "name": t.name,
                "description": t.description,
                "input_schema": copy.deepcopy(t.parameters),
            }
            for t in self
        ]

    def gemini_specs(self) -> list[dict[str, Any]]:
        """The ``tools`` list of a Gemini ``generateContent`` request.

        One entry holding every function declaration (an empty list when
        there are no tools). ``parameters`` is converted to Gemini's OpenAPI
        subset and left out for a tool without parameters (Gemini refuses an
        object with no properties). A tool whose schema that subset cannot
        express (``dict[str, T]``, ``Any``) is declared with
        ``parametersJsonSchema`` instead, which takes JSON Schema as is.
        """
        declarations = []
        for t in self:
            declaration: dict[str, Any] = {"name": t.name, "description": t.description}
            if t.parameters.get("properties"):
                try:
                    declaration["parameters"] = _gemini_schema(t.parameters)
                except _NotForGemini:
                    declaration["parametersJsonSchema"] = copy.deepcopy(t.parameters)
            declarations.append(declaration)
        return [{"functionDeclarations": declarations}] if declarations else []
