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

An observation may carry ``attachments``: images, audio, binary resources a
tool returned (``ToolOutput``), as base64 text checked once, when the record
is made. The executor keeps at most ``MAX_ATTACHMENT_BYTES`` each and
``MAX_ATTACHMENTS_BYTES`` per observation (``ToolOutput.for_observation``);
what is past that becomes a line of the observation's text. Each model
adapter sends what its provider takes and says the rest in text.
"""

from __future__ import annotations

import binascii
import json
import math
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, TypeAlias, cast, get_args

import attrs
import cattrs
from cattrs.errors import AttributeValidationNote, ClassValidationError
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override
from cattrs.strategies import configure_tagged_union
from cattrs.v import format_exception

from .errors import UsageError

__all__ = [
    "ERROR_KINDS",
    "MAX_ATTACHMENTS_BYTES",
    "MAX_ATTACHMENT_BYTES",
    "Attachment",
    "AttachmentKind",
    "ErrorKind",
    "FieldRefused",
    "Message",
    "Observation",
    "Part",
    "Role",
    "Text",
    "ToolCall",
    "ToolError",
    "ToolOutput",
    "converter",
    "describe_structure_error",
    "escape_surrogates",
    "json_problem",
    "recordable",
    "replace_lone_surrogates",
    "structure_error_paths",
]

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

AttachmentKind: TypeAlias = Literal["image", "audio", "resource"]

#: The most bytes (decoded) one attachment keeps; a bigger one becomes a line of text.
MAX_ATTACHMENT_BYTES = 5 * 1024 * 1024
#: The most bytes (decoded) the attachments of one observation keep, together.
MAX_ATTACHMENTS_BYTES = 20 * 1024 * 1024

# type "/" subtype, then optional parameters (RFC 6838 names; "; charset=utf-8").
_MEDIA_TYPE = re.compile(
    r"[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}"
    r"(?:[ \t]*;[ \t]*[!-~]+(?:[ \t]*[!-~]+)*)?"
)


class FieldRefused(UsageError, ValueError):
    """A record's validator refused a field's value: ``field`` names it, the
    message says why (``describe_structure_error`` shows it at the field's path)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def _check_media_type(instance: Attachment, attribute: Any, value: str) -> None:
    if type(value) is not str or _MEDIA_TYPE.fullmatch(value) is None:
        raise FieldRefused("media_type", f"{value!r} is not a media type such as 'image/png'")


def _check_base64(instance: Attachment, attribute: Any, value: str) -> None:
    if type(value) is not str:
        raise FieldRefused("data", f"expected base64 text, got {type(value).__name__}")
    try:
        # Strict: the standard alphabet, whole quads, padding only at the end;
        # what a provider would refuse is refused here, where it is made.
        binascii.a2b_base64(value, strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        raise FieldRefused("data", f"not base64 ({exc})") from None


def _short_data(data: str) -> str:
    # A repr (a log line, a failed assertion) shows the size, not megabytes of base64.
    return f"<{len(data)} base64 characters>"


@attrs.frozen
class Attachment:
    """Media a tool returned beside its text: an image, audio, or a binary resource.

    ``data`` is the standard base64 of the bytes (checked when the record is
    made, so a transcript cannot hold one a provider would refuse);
    ``media_type`` is what they are (``image/png``); ``uri`` and ``name`` say
    where they came from, when the tool said so (an MCP resource's URI).
    """

    kind: AttachmentKind
    media_type: str = attrs.field(validator=_check_media_type)
    data: str = attrs.field(validator=_check_base64, repr=_short_data)
    uri: str | None = None
    name: str | None = None

    @classmethod
    def of_bytes(
        cls,
        kind: AttachmentKind,
        media_type: str,
        data: bytes,
        *,
        uri: str | None = None,
        name: str | None = None,
    ) -> Attachment:
        """An attachment holding ``data`` (encoded here)."""
        return cls(kind, media_type, base64_text(data), uri=uri, name=name)

    @property
    def size(self) -> int:
        """How many bytes ``data`` decodes to."""
        return len(self.data) // 4 * 3 - self.data[-2:].count("=")

    @property
    def base_type(self) -> str:
        """``media_type`` without parameters, in lower case (``image/png``)."""
        return self.media_type.partition(";")[0].strip().lower()

    def describe(self) -> str:
        """One line naming it, for placeholders: ``image: image/png, 1234 bytes``."""
        where = ", ".join(x for x in (self.name, self.uri) if x)
        return f"{self.kind}: {where + ', ' if where else ''}{self.media_type}, {self.size} bytes"


def base64_text(data: bytes) -> str:
    """``data`` as standard base64 text, as ``Attachment.data`` holds it."""
    return binascii.b2a_base64(data, newline=False).decode("ascii")


def _attachments(values: Iterable[Attachment]) -> tuple[Attachment, ...]:
    return tuple(values)


@attrs.frozen
class ToolOutput:
    """What a tool may return instead of plain text: text, and media beside it.

    The executor makes the call's observation from it: ``text`` is its
    content, and the attachments within ``MAX_ATTACHMENT_BYTES`` each and
    ``MAX_ATTACHMENTS_BYTES`` together are kept (``for_observation``).
    """

    text: str = ""
    attachments: tuple[Attachment, ...] = attrs.field(default=(), converter=_attachments)

    def for_observation(
        self,
        max_bytes: int = MAX_ATTACHMENT_BYTES,
        max_total: int = MAX_ATTACHMENTS_BYTES,
    ) -> tuple[str, tuple[Attachment, ...]]:
        """``(content, attachments)`` of the observation: an attachment over
        ``max_bytes``, or past ``max_total`` with those before it, is left out
        and a line of ``content`` says so (never an error: the call succeeded)."""
        kept: list[Attachment] = []
        notes: list[str] = []
        total = 0
        for attachment in self.attachments:
            size = attachment.size
            if size > max_bytes:
                notes.append(
                    f"[{attachment.describe()}, not kept: over the {max_bytes} bytes "
                    "an attachment may have]"
                )
            elif total + size > max_total:
                notes.append(
                    f"[{attachment.describe()}, not kept: over the {max_total} bytes "
                    "the attachments of one result may have together]"
                )
            else:
                total += size
                kept.append(attachment)
        if not notes:
            return self.text, tuple(kept)
        lines = [self.text] if self.text else []
        return "\n".join(lines + notes), tuple(kept)


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
    #: Media beside ``content`` (``ToolOutput``); absent from a record without any.
    attachments: tuple[Attachment, ...] = attrs.field(default=(), converter=_attachments)

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
        cls,
        call: ToolCall,
        index: int,
        content: str,
        *,
        duration_s: float = 0.0,
        attachments: tuple[Attachment, ...] = (),
    ) -> Observation:
        """A successful observation: ``content`` as the model will see it, no error.

        The same record as ``Observation(call.id, call.name, index, content,
        duration_s=duration_s, attachments=attachments)`` (``attachments`` a
        tuple: no converter runs), made at half the cost: the executor makes one
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
        _set_attachments(self, attachments)
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
_set_attachments = _slot_setter("attachments")


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


def _structure_attachment(conv: cattrs.Converter) -> Callable[[Any, Any], Attachment]:
    fields = make_dict_structure_fn(Attachment, conv)

    def hook(value: Any, cls: Any) -> Attachment:
        try:
            return fields(value, cls)
        except ClassValidationError as exc:
            # A validator's refusal comes from __init__, after cattrs' per-field
            # checks, so cattrs gives it no path: give it its field's.
            for inner in exc.exceptions:
                if isinstance(inner, FieldRefused) and not getattr(inner, "__notes__", None):
                    inner.__notes__ = [
                        AttributeValidationNote(
                            f"Structuring class Attachment @ attribute {inner.field}",
                            inner.field,
                            str,
                        )
                    ]
            raise

    return hook


def _make_converter() -> cattrs.Converter:
    conv = _Converter(forbid_extra_keys=True, unstruct_collection_overrides={Sequence: list})
    for t in (str, int, float, bool):
        conv.register_structure_hook(t, _structure_strict(t))
    # An observation without attachments is written as before they existed: a
    # transcript (or a frame) without any reads the same in an older kernel.
    conv.register_structure_hook(Attachment, _structure_attachment(conv))
    conv.register_unstructure_hook(
        Observation,
        make_dict_unstructure_fn(Observation, conv, attachments=override(omit_if_default=True)),
    )
    _register_unions(conv)
    return conv


converter: cattrs.Converter = _make_converter()
"""The one converter for kernel records (``unstructure`` / ``structure``)."""


def _format_exception(exc: BaseException, type_: type | None) -> str:
    if isinstance(exc, FieldRefused):
        return exc.reason
    return format_exception(exc, type_)


def structure_error_paths(
    exc: BaseException,
    root: str = "$",
    format_exception: Callable[[BaseException, type | None], str] = _format_exception,
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
    attachments = part.attachments
    if attachments:
        attachments = tuple(_recordable_attachment(a) for a in attachments)
        if all(new is old for new, old in zip(attachments, part.attachments, strict=True)):
            attachments = part.attachments
    if (
        call_id is part.call_id
        and name is part.name
        and content is part.content
        and error is part.error
        and attachments is part.attachments
    ):
        return part
    return attrs.evolve(
        part, call_id=call_id, name=name, content=content, error=error, attachments=attachments
    )


def _recordable_attachment(attachment: Attachment) -> Attachment:
    # data is base64 and media_type ASCII (both checked); a URI or a name came from a tool.
    uri = attachment.uri if attachment.uri is None else replace_lone_surrogates(attachment.uri)
    name = attachment.name if attachment.name is None else replace_lone_surrogates(attachment.name)
    if uri is attachment.uri and name is attachment.name:
        return attachment
    return attrs.evolve(attachment, uri=uri, name=name)


def recordable(message: Message) -> Message:
    """``message`` as a transcript can hold it (``message`` itself when it already can).

    Text, ids, names, observation content and attachments' URIs and names get
    U+FFFD for each lone surrogate.
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
