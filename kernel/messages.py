"""Core records: tool calls, observations, messages, and their one converter.

Every record is an ``@attrs.frozen`` class. ``converter`` turns them into
JSON-ready dicts and back; unknown keys are rejected, and
``describe_structure_error`` renders a failure as ``$.path: what was wrong``.

A transcript is UTF-8 JSON, so it cannot hold a lone surrogate (half of a
UTF-16 pair, which ``json.loads`` happily returns for ``"\\ud800"``) or a
non-finite number. ``json_problem`` finds such a value in arguments (the
executor refuses the call), ``replace_lone_surrogates`` makes text
recordable, and ``recordable`` applies both to a whole message before it is
written, so that a call is always recorded before it runs.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, TypeAlias, cast, get_args

import attrs
import cattrs
from cattrs.strategies import configure_tagged_union
from cattrs.v import format_exception

ErrorKind: TypeAlias = Literal[
    "invalid_call",
    "unknown_tool",
    "bad_arguments",
    "exception",
    "timeout",
    "cancelled",
    "crashed",
    "denied",
    "output_too_large",
]
ERROR_KINDS: tuple[ErrorKind, ...] = get_args(ErrorKind)

Role: TypeAlias = Literal["system", "user", "assistant", "tool"]


@attrs.frozen
class ToolError:
    """Why a call did not produce a normal result.

    ``kind`` is one of ``ERROR_KINDS``; ``type`` is the exception class name
    (or a kind-specific name such as ``"Timeout"``); ``message`` is for people.
    """

    kind: ErrorKind
    type: str
    message: str


@attrs.frozen
class ToolCall:
    """One call a model declared.

    ``arguments`` is a dict, or the raw JSON text a model sent; the executor
    parses and validates it and never trusts it. ``index`` is the declared
    position in the batch; ``None`` means "its position in the list".
    """

    id: str
    name: str
    arguments: dict[str, Any] | str = attrs.field(factory=dict)
    index: int | None = None


def _check_is_error(instance: Observation, attribute: Any, value: bool) -> None:
    if value != (instance.error is not None):
        raise ValueError("is_error must be True exactly when error is set")


@attrs.frozen
class Observation:
    """The result of one call, as the model will see it (``content``)."""

    call_id: str
    name: str
    index: int
    content: str
    is_error: bool = attrs.field(default=False, validator=_check_is_error)
    error: ToolError | None = None
    duration_s: float = 0.0

    @classmethod
    def failure(
        cls,
        call: ToolCall,
        index: int,
        error: ToolError,
        *,
        duration_s: float = 0.0,
    ) -> Observation:
        """An error observation whose content tells the model what went wrong.

        The message may come from a tool or a worker: lone surrogates in it are
        replaced (U+FFFD), so the observation can be recorded.
        """
        error = _recordable_error(error)
        return cls(
            call_id=call.id,
            name=call.name,
            index=index,
            content=f"Error ({error.kind}): {error.message}",
            is_error=True,
            error=error,
            duration_s=duration_s,
        )

    @classmethod
    def success(
        cls, call: ToolCall, index: int, content: str, *, duration_s: float = 0.0
    ) -> Observation:
        """A successful observation: ``content`` as the model will see it, no error.

        The same record as ``Observation(call.id, call.name, index, content,
        duration_s=duration_s)``, made at half the cost: the executor makes one
        per call, and the one validator (``is_error`` exactly when ``error`` is
        set) holds by construction here, so the fields are set through their
        slots without running ``__init__``.
        """
        self = _new_record(cls)
        _set_call_id(self, call.id)
        _set_name(self, call.name)
        _set_index(self, index)
        _set_content(self, content)
        _set_is_error(self, False)
        _set_error(self, None)
        _set_duration_s(self, duration_s)
        return self


def _slot_setter(name: str) -> Callable[[Observation, Any], None]:
    setter: Callable[[Observation, Any], None] = getattr(Observation, name).__set__
    return setter


# Observation.success sets each field through its slot descriptor (attrs makes
# slotted classes). A field added to Observation must be set there too:
# tests/test_messages.py compares every field with what __init__ makes.
_new_record = object.__new__
_set_call_id = _slot_setter("call_id")
_set_name = _slot_setter("name")
_set_index = _slot_setter("index")
_set_content = _slot_setter("content")
_set_is_error = _slot_setter("is_error")
_set_error = _slot_setter("error")
_set_duration_s = _slot_setter("duration_s")


@attrs.frozen
class Text:
    text: str


Part: TypeAlias = Text | ToolCall | Observation


def _parts(parts: Iterable[Part]) -> tuple[Part, ...]:
    return tuple(parts)


@attrs.frozen
class Message:
    role: Role
    parts: tuple[Part, ...] = attrs.field(converter=_parts)

    @property
    def text(self) -> str:
        """All text parts joined."""
        return "".join(p.text for p in self.parts if isinstance(p, Text))

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        return tuple(p for p in self.parts if isinstance(p, ToolCall))

    @property
    def observations(self) -> tuple[Observation, ...]:
        return tuple(p for p in self.parts if isinstance(p, Observation))


_PART_TAGS: dict[type, str] = {Text: "text", ToolCall: "tool_call", Observation: "observation"}


def _structure_arguments(value: Any, _: Any) -> dict[str, Any] | str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return dict(value)
    raise TypeError(f"expected an object or a JSON string, got {type(value).__name__}")


def _structure_strict(expected: type) -> Any:
    def hook(value: Any, _: Any) -> Any:
        # bool is an int in Python, and cattrs would turn "3" into 3: refuse both.
        if type(value) is not expected and not (expected is float and type(value) is int):
            raise TypeError(f"expected {expected.__name__}, got {type(value).__name__}")
        return cast(Any, expected)(value)

    return hook


def _register_unions(conv: cattrs.Converter) -> None:
    conv.register_structure_hook(dict[str, Any] | str, _structure_arguments)
    configure_tagged_union(Part, conv, tag_name="type", tag_generator=lambda cl: _PART_TAGS[cl])


class _Converter(cattrs.Converter):
    """A converter whose ``copy()`` keeps the union hooks.

    cattrs' ``copy()`` drops hooks registered for a union type (the tool
    call's arguments, the message parts); each floor makes its own converter
    as a copy of the shared one, so the copy registers them again.
    """

    def copy(self, *args: Any, **kwargs: Any) -> _Converter:
        new = super().copy(*args, **kwargs)
        assert isinstance(new, _Converter)
        _register_unions(new)
        return new


def _make_converter() -> cattrs.Converter:
    conv = _Converter(forbid_extra_keys=True, unstruct_collection_overrides={Sequence: list})
    for t in (str, int, float, bool):
        conv.register_structure_hook(t, _structure_strict(t))
    _register_unions(conv)
    return conv


converter: cattrs.Converter = _make_converter()
"""The one converter for kernel records (``unstructure`` / ``structure``)."""


def structure_error_paths(
    exc: BaseException,
    root: str = "$",
    format_exception: Callable[[BaseException, type | None], str] = format_exception,
) -> list[tuple[str, str]]:
    """Each failure in a cattrs error as ``(path, reason)``, e.g. ``("$.a[2].b", ...)``."""
    found = []
    for line in cattrs.transform_error(exc, path=root, format_exception=format_exception):
        reason, sep, path = line.rpartition(" @ ")
        found.append((path, reason) if sep else (root, line))
    return found


def describe_structure_error(exc: BaseException, root: str = "$") -> str:
    """Render a cattrs failure as ``$.a[2].b: reason`` lines joined by ``; ``."""
    return "; ".join(f"{path}: {reason}" for path, reason in structure_error_paths(exc, root))


_SURROGATE = re.compile("[\ud800-\udfff]")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NON_FINITE_NAMES = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def replace_lone_surrogates(text: str) -> str:
    """``text`` as valid Unicode: each lone surrogate becomes U+FFFD.

    A surrogate pair held as two code points (a high then a low half) is joined
    into the one character it encodes.
    """
    if text.isascii() or _SURROGATE.search(text) is None:
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def escape_surrogates(json_text: str) -> str:
    """JSON text with each surrogate code point written as a ``\\uXXXX`` escape.

    Inside a JSON string the escape means the same character (so a call's
    arguments parse to the same value, and are refused the same way), but the
    text itself is valid Unicode and can be recorded. Halves of a pair that came
    in separate pieces become two escapes, which JSON joins again.
    """
    if json_text.isascii():
        return json_text
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", json_text)


def json_problem(value: Any, root: str = "$") -> str | None:
    """Why a JSON value cannot be recorded, as ``$.path: reason``, or ``None`` if it can.

    Found: a lone surrogate in a string or a key (a transcript is UTF-8), a NaN
    or an infinity (JSON has none; ``json.loads`` gives them for ``NaN``,
    ``Infinity`` and ``1e999``). Values that are not JSON at all (a set, an
    object) are left to the converter or the encoder to refuse. One pass, and
    an ASCII string costs one ``isascii``.

    Raises:
        RecursionError: the value is nested too deeply to walk.
    """
    found = _find_problem(value)
    if found is None:
        return None
    reason, reversed_path = found
    path = root
    for step in reversed(reversed_path):
        if isinstance(step, int):
            path += f"[{step}]"
        elif _IDENTIFIER.fullmatch(step):
            path += f".{step}"
        else:
            # The key itself may hold the surrogate: escape it, the message is recorded too.
            path += f"[{json.dumps(step)}]"
    return f"{path}: {reason}"


def _surrogate_problem(text: str) -> str | None:
    match = _SURROGATE.search(text)
    if match is None:
        return None
    return f"lone surrogate \\u{ord(match.group()):04x} is not valid Unicode"


def _find_problem(value: Any) -> tuple[str, list[str | int]] | None:
    """``(reason, path from the inside out)`` of the first unrecordable leaf."""
    kind = type(value)
    # Exact types first (the common case); subclasses (a str Enum, an IntEnum) after.
    if kind is str or (kind is not bool and isinstance(value, str)):
        if value.isascii():
            return None
        reason = _surrogate_problem(value)
        return None if reason is None else (reason, [])
    if kind is int or kind is bool or value is None:
        return None
    if kind is dict or isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and not key.isascii():
                reason = _surrogate_problem(key)
                if reason is not None:
                    return f"{reason} (in the key)", [key]
            found = _find_problem(item)
            if found is not None:
                found[1].append(key if isinstance(key, str) else str(key))
                return found
        return None
    if kind is list or kind is tuple or isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = _find_problem(item)
            if found is not None:
                found[1].append(index)
                return found
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return f"{_NON_FINITE_NAMES[repr(float(value))]} is not a JSON number", []
    return None


def _recordable_error(error: ToolError) -> ToolError:
    message = replace_lone_surrogates(error.message)
    type_ = replace_lone_surrogates(error.type)
    if message is error.message and type_ is error.type:
        return error
    return ToolError(error.kind, type_, message)


def _recordable_arguments(arguments: dict[str, Any] | str) -> dict[str, Any] | str:
    if isinstance(arguments, str):
        return escape_surrogates(arguments)
    if _find_problem(arguments) is None:
        return arguments
    try:
        # The JSON text means the same (NaN and escapes included) and can be recorded;
        # the executor parses it and refuses the call with the path of the problem.
        return json.dumps(arguments, ensure_ascii=True)
    except (TypeError, ValueError, RecursionError):
        return arguments  # not JSON at all: the store refuses it, and nothing runs


def _recordable_part(part: Part) -> Part:
    if isinstance(part, Text):
        text = replace_lone_surrogates(part.text)
        return part if text is part.text else Text(text)
    if isinstance(part, ToolCall):
        id_ = replace_lone_surrogates(part.id)
        name = replace_lone_surrogates(part.name)
        arguments = _recordable_arguments(part.arguments)
        if id_ is part.id and name is part.name and arguments is part.arguments:
            return part
        return ToolCall(id_, name, arguments, part.index)
    call_id = replace_lone_surrogates(part.call_id)
    name = replace_lone_surrogates(part.name)
    content = replace_lone_surrogates(part.content)
    error = part.error if part.error is None else _recordable_error(part.error)
    if (
        call_id is part.call_id
        and name is part.name
        and content is part.content
        and error is part.error
    ):
        return part
    return attrs.evolve(part, call_id=call_id, name=name, content=content, error=error)


def recordable(message: Message) -> Message:
    """``message`` as a transcript can hold it (``message`` itself when it already can).

    Text, ids, names and observation content get U+FFFD for each lone surrogate.
    Arguments are never changed in meaning: raw JSON text gets its surrogates
    escaped, and a dict that holds a lone surrogate or a non-finite number is
    kept as the JSON text of it, which the executor refuses as ``bad_arguments``.
    """
    parts = [_recordable_part(p) for p in message.parts]
    if all(new is old for new, old in zip(parts, message.parts, strict=True)):
        return message
    return Message(message.role, parts)


def observations_content(observations: Sequence[Observation]) -> list[str]:
    """The text of each observation, in the given order."""
    return [o.content for o in observations]
