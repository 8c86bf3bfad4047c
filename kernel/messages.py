"""Core records: tool calls, observations, messages, and their one converter.

Every record is an ``@attrs.frozen`` class. ``converter`` turns them into
JSON-ready dicts and back; unknown keys are rejected, and
``describe_structure_error`` renders a failure as ``$.path: what was wrong``.
"""

from __future__ import annotations

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
        """An error observation whose content tells the model what went wrong."""
        return cls(
            call_id=call.id,
            name=call.name,
            index=index,
            content=f"Error ({error.kind}): {error.message}",
            is_error=True,
            error=error,
            duration_s=duration_s,
        )


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


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True, unstruct_collection_overrides={Sequence: list})

    def structure_arguments(value: Any, _: Any) -> dict[str, Any] | str:
        if isinstance(value, str):
            return value
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return dict(value)
        raise TypeError(f"expected an object or a JSON string, got {type(value).__name__}")

    conv.register_structure_hook(dict[str, Any] | str, structure_arguments)

    def structure_strict(expected: type) -> Any:
        def hook(value: Any, _: Any) -> Any:
            # bool is an int in Python, and cattrs would turn "3" into 3: refuse both.
            if type(value) is not expected and not (expected is float and type(value) is int):
                raise TypeError(f"expected {expected.__name__}, got {type(value).__name__}")
            return cast(Any, expected)(value)

        return hook

    for t in (str, int, float, bool):
        conv.register_structure_hook(t, structure_strict(t))
    configure_tagged_union(Part, conv, tag_name="type", tag_generator=lambda cl: _PART_TAGS[cl])
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


def observations_content(observations: Sequence[Observation]) -> list[str]:
    """The text of each observation, in the given order."""
    return [o.content for o in observations]
