"""Pieces of request mapping that the adapters share.

Tool names on the wire: ``fs.read`` is ``fs__read`` for OpenAI and Anthropic.

Kernel tool names may hold ``.`` for namespacing (``kernel.tools.
TOOL_NAME_PATTERN``); OpenAI and Anthropic accept only ``[A-Za-z0-9_-]{1,64}``.
Their adapters send ``.`` as ``__`` and map names back through the table of
the request's own tools, so the mapping is exact both ways; a request whose
tools would collide on the wire (``fs.read`` beside ``fs__read``) or grow
past 64 characters is refused before anything is sent.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from ..errors import UsageError
from ..messages import escape_surrogates, json_problem
from ._base import ModelRequest

_MAX_WIRE_NAME = 64


def wire_name(name: str) -> str:
    return name.replace(".", "__")


class ToolNameMap:
    """Kernel names to wire names and back, for the tools of one request."""

    def __init__(self, names: Iterable[str]) -> None:
        self._to_kernel: dict[str, str] = {}
        for name in names:
            wire = wire_name(name)
            if len(wire) > _MAX_WIRE_NAME:
                raise UsageError(
                    f"tool {name!r} is {wire!r} on the wire, longer than {_MAX_WIRE_NAME} "
                    "characters; use a shorter name"
                )
            other = self._to_kernel.setdefault(wire, name)
            if other != name:
                raise UsageError(
                    f"tools {other!r} and {name!r} have the same name on the wire ({wire!r}); "
                    "rename one of them"
                )

    def to_wire(self, name: str) -> str:
        return wire_name(name)

    def to_kernel(self, wire: str) -> str:
        """The kernel name of a tool the model called; an unknown name is kept as sent."""
        return self._to_kernel.get(wire, wire)


def system_text(request: ModelRequest) -> str | None:
    """``request.system`` and the text of any ``system`` messages, in order."""
    texts = [request.system] if request.system else []
    texts += [m.text for m in request.messages if m.role == "system" and m.text]
    return "\n\n".join(texts) if texts else None


def arguments_text(arguments: dict[str, Any] | str) -> str:
    """A call's arguments as JSON text, as OpenAI wants them back."""
    if isinstance(arguments, str):
        # A call without arguments may have streamed none at all.
        return escape_surrogates(arguments) if arguments.strip() else "{}"
    # Escaped, a lone surrogate can still be sent (the executor refused that call).
    return escape_surrogates(json.dumps(arguments, ensure_ascii=False))


def arguments_object(arguments: dict[str, Any] | str) -> dict[str, Any]:
    """A call's arguments as an object, as Anthropic and Gemini want them back.

    Arguments that are not a JSON object, or hold what JSON text cannot carry
    (a lone surrogate, NaN, an infinity), were refused by the executor (its
    error observation tells the model so); they go back as ``{}``, since
    these providers accept nothing else there.
    """
    if isinstance(arguments, dict):
        value: Any = arguments
    else:
        try:
            value = json.loads(arguments)
        except (ValueError, RecursionError):
            return {}
    if not isinstance(value, dict):
        return {}
    try:
        return {} if json_problem(value) is not None else value
    except RecursionError:
        return {}
