"""Pieces of request mapping that the adapters share.

Tool names on the wire: ``fs.read`` is ``fs__read`` for OpenAI and Anthropic.

Kernel tool names may hold ``.`` for namespacing (``kernel.tools.
TOOL_NAME_PATTERN``); OpenAI and Anthropic accept only ``[A-Za-z0-9_-]{1,64}``.
Their adapters send ``.`` as ``__`` and map names back through the table of
the request's own tools, so the mapping is exact both ways; a request whose
tools would collide on the wire (``fs.read`` beside ``fs__read``) or grow
past 64 characters is refused before anything is sent.

Attachments on the wire: ``AttachmentPlan``.

Each adapter says which attachments its provider takes in a tool result,
and how much base64 one request may carry. The plan walks the request from
its newest message back and sends what fits; an attachment not sent becomes
a line of its result's text (``[image: image/png, 1234 bytes, not sent:
...]``), so the model knows it was there and why it cannot see it. Older
ones give way first: a long conversation with screenshots keeps sending the
latest, and never grows past what the provider takes (a refused request
would be refused again at every turn). For the same reason an image or a
PDF goes with the media type its bytes show (``sent_media_type``): a server
that calls a JPEG ``image/png`` is common, and providers refuse the mismatch.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..errors import UsageError
from ..messages import Attachment, Message, Observation, escape_surrogates, json_problem
from ..tools import wire_form
from ._base import ModelRequest

_MAX_WIRE_NAME = 64


def wire_name(name: str) -> str:
    return wire_form(name)  # the registry's rule: two names of one wire form are one


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
    """A call's arguments as JSON text, as OpenAI wants them back.

    Text that is not JSON (the executor refused that call, and its error
    observation says why) goes back as ``{}``: servers that render the history
    through a chat template parse it, and refuse the whole request otherwise
    (llama-server: HTTP 500 "Failed to parse tool call arguments as JSON").
    """
    if isinstance(arguments, str):
        # A call without arguments may have streamed none at all.
        if not arguments.strip():
            return "{}"
        try:
            json.loads(arguments)
        except (ValueError, RecursionError):
            return "{}"
        return escape_surrogates(arguments)
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


class AttachmentPlan:
    """Which attachments of a request's tool results go to the provider.

    ``refusal`` gives the reason an attachment cannot be sent (``None``:
    it can); of those that can, the newest are sent while their base64 fits
    ``budget`` characters and their number ``max_count``.
    """

    def __init__(
        self,
        messages: Sequence[Message],
        *,
        refusal: Callable[[Attachment], str | None],
        budget: int,
        max_count: int | None = None,
    ) -> None:
        # By observation (its id: the request holds it while the plan is used), the
        # reason for each of its attachments not sent, None for those sent. Keyed by
        # the observation, not the attachment: one Attachment may appear twice.
        self._reasons: dict[int, list[str | None]] = {}
        used = count = 0
        for message in reversed(messages):
            for observation in reversed(message.observations):
                if not observation.attachments or id(observation) in self._reasons:
                    continue
                reasons: list[str | None] = [None] * len(observation.attachments)
                for position in range(len(observation.attachments) - 1, -1, -1):
                    attachment = observation.attachments[position]
                    reason = refusal(attachment)
                    if reason is None:
                        if used + len(attachment.data) > budget or (
                            max_count is not None and count >= max_count
                        ):
                            reason = (
                                "newer attachments took the room one request has for them "
                                f"({_amount(budget, max_count)})"
                            )
                        else:
                            used += len(attachment.data)
                            count += 1
                    reasons[position] = reason
                self._reasons[id(observation)] = reasons

    def split(self, observation: Observation) -> tuple[str, list[Attachment]]:
        """``(text, sent)``: the observation's content with a line for each
        attachment not sent, and the attachments to send, in order."""
        sent: list[Attachment] = []
        lines = [observation.content] if observation.content else []
        reasons = self._reasons.get(id(observation)) or [None] * len(observation.attachments)
        for attachment, reason in zip(observation.attachments, reasons, strict=True):
            if reason is None:
                sent.append(attachment)
            else:
                lines.append(f"[{attachment.describe()}, not sent: {reason}]")
        return "\n".join(lines), sent


def _amount(budget: int, max_count: int | None) -> str:
    size = f"{budget / (1 << 20):.3g} MiB of base64"
    return size if max_count is None else f"{size}, {max_count} attachments"


# The first bytes of the media whose type providers check against the bytes.
_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"%PDF-", "application/pdf"),
)
_SNIFFED = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp", "application/pdf"})


def sent_media_type(attachment: Attachment) -> str | None:
    """The media type to send ``attachment`` as: for a PNG, JPEG, GIF, WebP or PDF
    the one its bytes show, whatever it was called; ``None`` when it was called
    one of them and its bytes are none of them. Other types as declared."""
    declared = attachment.base_type
    if declared not in _SNIFFED:
        return declared
    head = base64.b64decode(attachment.data[:16])  # 12 bytes: enough for each magic
    for magic, media_type in _MAGIC:
        if head.startswith(magic):
            return media_type
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    return None


def refused_media(provider: str, taken: Iterable[str]) -> Callable[[Attachment], str | None]:
    """A ``refusal`` for a provider that takes the media types ``taken`` and no other."""
    media_types = frozenset(taken)

    def refusal(attachment: Attachment) -> str | None:
        media_type = sent_media_type(attachment)
        if media_type is None:
            return f"its bytes are not {attachment.base_type}"
        if media_type in media_types:
            return None
        return f"{provider} does not take {media_type} in tool results"

    return refusal
