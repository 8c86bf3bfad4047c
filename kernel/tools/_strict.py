"""The strict converter: JSON arguments in, the Python values a tool declared out.

Strict JSON typing: ``"3"`` is not an int, ``true`` is not an int, ``3`` is
a float, unknown keys are refused. Failures become one ``ArgumentError``
whose message names each failing path (``$.items[2].name: expected int, got
str``).
"""

from __future__ import annotations

import copy
import enum
import functools
import typing
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import cattrs
import cattrs.gen
from cattrs.errors import ForbiddenExtraKeysError, IterableValidationError, IterableValidationNote

from ..messages import converter as _messages_converter
from ..messages import structure_error_paths
from ._failures import ArgumentError
from ._hints import (
    is_annotated,
    is_array_hint,
    is_attrs_class,
    is_enum_class,
    is_literal,
    is_map_hint,
    is_none_type,
    is_union,
    label,
    literal_matches,
    strip_annotated,
)


def type_error(expected: str, value: Any) -> TypeError:
    return TypeError(f"expected {expected}, got {type(value).__name__}")


def _structure_literal(value: Any, hint: Any) -> Any:
    for allowed in typing.get_args(hint):
        if literal_matches(allowed, value):
            return allowed
    choices = ", ".join(repr(a) for a in typing.get_args(hint))
    raise ValueError(f"expected one of {choices}, got {value!r}")


def _structure_enum(value: Any, cls: type[enum.Enum]) -> enum.Enum:
    for member in cls:
        if literal_matches(member.value, value):
            return member
    choices = ", ".join(repr(m.value) for m in cls)
    raise ValueError(f"expected one of {choices}, got {value!r}")


def register_enum(cls: type[enum.Enum]) -> None:
    # Registered per class: a str- or int-based enum would otherwise reach the
    # converter's strict str/int hook, which returns a plain value.
    converter.register_structure_hook(cls, _structure_enum)


def _structure_none(value: Any, _: Any) -> None:
    if value is not None:
        raise type_error("None", value)


def _fits(hint: Any, value: Any) -> bool:
    """Whether the value has the JSON shape the hint wants (not whether it is valid)."""
    hint, _ = strip_annotated(hint)
    if hint is Any:
        return True
    if is_none_type(hint):
        return value is None
    if hint is float:
        return type(value) in (int, float)
    if hint in (str, int, bool):
        return type(value) is hint
    if is_literal(hint):
        return any(literal_matches(a, value) for a in typing.get_args(hint))
    if is_enum_class(hint):
        return any(literal_matches(m.value, value) for m in hint)
    if is_union(hint):
        return any(_fits(arg, value) for arg in typing.get_args(hint))
    if is_array_hint(hint):
        return type(value) is list
    return type(value) is dict


def _structure_union(value: Any, hint: Any) -> Any:
    fitting = [arg for arg in typing.get_args(hint) if _fits(arg, value)]
    if not fitting:
        raise type_error(label(hint), value)
    first_error: Exception | None = None
    for arg in fitting:
        try:
            return converter.structure(value, arg)
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
            out.append(converter.structure(item, item_type))
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
        raise type_error("list", value)
    args = typing.get_args(hint)
    items = _structure_items(enumerate(value), args[0] if args else Any, hint)
    return tuple(items) if hint is tuple or typing.get_origin(hint) is tuple else items


def _structure_map(value: Any, hint: Any) -> dict[str, Any]:
    if type(value) is not dict:
        raise type_error("dict", value)
    args = typing.get_args(hint)
    values = _structure_items(value.items(), args[1] if args else Any, hint)
    return dict(zip(value, values, strict=True))


def _attrs_hook_factory(cls: type, conv: cattrs.Converter) -> Callable[[Any, Any], Any]:
    inner: Callable[[Any, Any], Any] = cattrs.gen.make_dict_structure_fn(cls, conv)

    def structure_object(value: Any, hint: Any) -> Any:
        # Without this, a string or list would reach the generated code and
        # fail with an unhelpful "indices must be integers".
        if type(value) is not dict:
            raise type_error("dict", value)
        return inner(value, hint)

    return structure_object


def _structure_annotated(value: Any, hint: Any) -> Any:
    return converter.structure(value, typing.get_args(hint)[0])


def _make_converter() -> cattrs.Converter:
    # Built on the kernel's converter: same strict str/int/float/bool hooks,
    # same refusal of unknown keys; the hooks below make every other kind of
    # value as strict.
    conv = _messages_converter.copy(forbid_extra_keys=True, detailed_validation=True)
    conv.register_structure_hook_func(is_none_type, _structure_none)
    conv.register_structure_hook_func(is_literal, _structure_literal)
    conv.register_structure_hook_func(is_enum_class, _structure_enum)
    conv.register_structure_hook_func(is_array_hint, _structure_array)
    conv.register_structure_hook_func(is_map_hint, _structure_map)
    conv.register_structure_hook_factory(is_attrs_class, _attrs_hook_factory)
    conv.register_structure_hook_func(is_union, _structure_union)
    conv.register_structure_hook_func(is_annotated, _structure_annotated)
    return conv


converter = _make_converter()
"""The tools' own converter (a copy of the kernel's, never the shared one)."""

# What bad input raises while structuring: cattrs' own errors, the hooks'
# TypeError/ValueError, and whatever attrs validators of a user's class raise
# for a bad value (ValueError/TypeError by convention).
STRUCTURE_ERRORS = (
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


def describe_argument_error(exc: BaseException) -> str:
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


def fresh_default(default: Any) -> Any:
    """An attrs default that gives each call its own copy of a mutable value."""
    if isinstance(default, list | dict | set):
        return attrs.Factory(functools.partial(copy.deepcopy, default))
    return default


def kwargs_structurer(cls: type) -> Callable[[Any], dict[str, Any]]:
    """A function from JSON arguments to the keyword arguments of a tool function whose
    parameters ``cls`` (an attrs class made from the signature) describes.

    The hot path structures each argument with its field's own hook and fills in
    the defaults, without making an instance of ``cls`` and reading it back (what
    cattrs' generated code would do, at twice the cost). Anything unusual (an
    unknown or missing argument, a value a hook refuses) goes to that generated
    code, so that errors are its errors, word for word.

    Raises:
        ArgumentError: (from the returned function) each failing path and why.
    """
    full = converter.get_structure_hook(cls)
    fields = [f for f in attrs.fields(cls) if f.init]
    hooks = {f.alias or f.name: (converter.get_structure_hook(f.type), f.type) for f in fields}
    required = [f.alias or f.name for f in fields if f.default is attrs.NOTHING]
    defaults = [(f.alias or f.name, f.default) for f in fields if f.default is not attrs.NOTHING]
    count = len(fields)

    def slow(arguments: Any) -> dict[str, Any]:
        try:
            structured = full(arguments, cls)
        except STRUCTURE_ERRORS as exc:
            raise ArgumentError(describe_argument_error(exc)) from exc
        return {f.name: getattr(structured, f.name) for f in fields}

    def structure(arguments: Any) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        try:
            for key, value in arguments.items():
                hook, hint = hooks[key]
                kwargs[key] = hook(value, hint)
        except Exception:
            return slow(arguments)
        if len(kwargs) < count:
            for name in required:
                if name not in kwargs:
                    return slow(arguments)
            for name, default in defaults:
                if name not in kwargs:
                    kwargs[name] = (
                        default.factory() if isinstance(default, attrs.Factory) else default  # type: ignore[arg-type]
                    )
        return kwargs

    return structure
