"""Anthropic Messages API."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

from ..messages import Attachment, Message, Observation
from ..settings import ModelSettings, check_tool_choice
from ..tools import ToolDefinition, ToolRegistry
from ._assemble import ResponseBuilder, token_count
from ._base import ModelEvent, ModelRequest, ModelResponse, ProviderError, StopReason, Usage
from ._http import HTTPModel, load_json, refuse_settings
from ._sse import SSEEvent
from ._wire import (
    AttachmentPlan,
    ToolNameMap,
    arguments_object,
    refused_media,
    sent_media_type,
    system_text,
)

ANTHROPIC_BASE_URL = "https://api.anthropic.com"
ANTHROPIC_VERSION = "2023-06-01"

_STOP_REASONS: Mapping[str, StopReason] = {
    "end_turn": "end_turn",
    "tool_use": "tool_use",
    "max_tokens": "max_tokens",
    "model_context_window_exceeded": "max_tokens",
    "stop_sequence": "stop_sequence",
    "refusal": "content_filter",
}
# Error events in a stream that a retry may cure (before anything was yielded).
_RETRYABLE_ERRORS = frozenset(
    {"overloaded_error", "api_error", "rate_limit_error", "timeout_error"}
)

# What a tool_result may hold besides text: image blocks and PDF document blocks.
_IMAGE_TYPES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})
_DOCUMENT_TYPES = frozenset({"application/pdf"})
# The API refuses an image whose base64 text is over 5 MiB ("image exceeds 5 MB
# maximum: 6275800 bytes > 5242880 bytes": it counts the base64, not the bytes).
_MAX_IMAGE_BASE64 = 5 * 1024 * 1024
# A request is at most 32 MB and 100 images: leave room for the conversation's text.
_ATTACHMENT_BUDGET = 24 * 1024 * 1024
_MAX_ATTACHMENTS = 100
_refused_media = refused_media("anthropic", _IMAGE_TYPES | _DOCUMENT_TYPES)


def _refusal(attachment: Attachment) -> str | None:
    reason = _refused_media(attachment)
    if reason is None and len(attachment.data) > _MAX_IMAGE_BASE64:
        if sent_media_type(attachment) in _IMAGE_TYPES:
            return "over the 5 MiB of base64 anthropic takes for an image"
    return reason


def anthropic_tools(definitions: Iterable[ToolDefinition]) -> list[dict[str, Any]]:
    """The ``tools`` list of a Messages request, names as sent (``fs.read`` is
    ``fs__read``); ``tak tools --format anthropic`` prints this.

    Raises:
        UsageError: two tools share a wire name, or one is too long on the wire.
    """
    definitions = list(definitions)
    names = ToolNameMap(d.name for d in definitions)
    return [
        {
            "name": names.to_wire(d.name),
            "description": d.description,
            "input_schema": copy.deepcopy(d.parameters),
        }
        for d in definitions
    ]


def _tool_choice(settings: ModelSettings, names: ToolNameMap) -> dict[str, Any] | None:
    """``tool_choice`` as the Messages API spells it (``parallel_tool_calls: false``
    is its ``disable_parallel_tool_use``)."""
    choice = settings.tool_choice
    if choice is None:
        spelled: dict[str, Any] | None = None
    elif choice == "auto":
        spelled = {"type": "auto"}
    elif choice == "required":
        spelled = {"type": "any"}
    elif choice == "none":
        return {"type": "none"}  # no calls: nothing to run in parallel
    else:
        spelled = {"type": "tool", "name": names.to_wire(choice)}
    if settings.parallel_tool_calls is False:
        spelled = {**(spelled or {"type": "auto"}), "disable_parallel_tool_use": True}
    return spelled


class AnthropicModel(HTTPModel):
    """A model behind ``{base_url}/v1/messages``.

    Tool results go back as ``tool_result`` blocks, all of them first in the
    next user message, in declared order, with ``is_error: true`` for error
    observations. A result with attachments has a list of blocks for its
    content: its text, then an ``image`` block for each JPEG, PNG, GIF or
    WebP image and a ``document`` block for each PDF; other media, and images
    past the API's limits, are named in the text (``AttachmentPlan``). The
    system prompt is the top-level ``system``.
    """

    provider = "anthropic"
    default_base_url = ANTHROPIC_BASE_URL
    tool_specs = staticmethod(anthropic_tools)

    def build(self, request: ModelRequest, *, stream: bool) -> tuple[str, dict[str, str], Any]:
        names = ToolNameMap(t.name for t in request.tools)
        plan = AttachmentPlan(
            request.messages,
            refusal=_refusal,
            budget=_ATTACHMENT_BUDGET,
            max_count=_MAX_ATTACHMENTS,
        )
        messages: list[dict[str, Any]] = []
        for message in request.messages:
            role, blocks = _blocks(message, names, plan)
            if not blocks:
                continue
            if messages and messages[-1]["role"] == role:
                # Roles must alternate; and in a user message every
                # tool_result block comes before any other block.
                merged = messages[-1]["content"] + blocks
                results = [b for b in merged if b["type"] == "tool_result"]
                messages[-1]["content"] = results + [
                    b for b in merged if b["type"] != "tool_result"
                ]
            else:
                messages.append({"role": role, "content": blocks})
        settings = request.effective_settings()
        check_tool_choice(settings, [t.name for t in request.tools])
        refuse_settings(self.provider, settings, ("seed", "reasoning_effort"))
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": settings.max_tokens,
            "messages": messages,
        }
        system = system_text(request)
        if system:
            body["system"] = system
        if request.tools:
            body["tools"] = anthropic_tools(ToolRegistry(request.tools).definitions())
            choice = _tool_choice(settings, names)
            if choice is not None:
                body["tool_choice"] = choice
        if settings.temperature is not None:
            body["temperature"] = settings.temperature
        if settings.top_p is not None:
            body["top_p"] = settings.top_p
        if settings.stop is not None:
            body["stop_sequences"] = list(settings.stop)
        if settings.extra:
            body.update(settings.extra)
        if stream:
            body["stream"] = True
        headers = {"content-type": "application/json", "anthropic-version": ANTHROPIC_VERSION}
        if stream:
            headers["accept"] = "text/event-stream"
        if self.api_key:
            headers["x-api-key"] = self.api_key
        return f"{self.base_url}/v1/messages", headers, body

    def decoder(self, request: ModelRequest, id_prefix: str) -> _Decoder:
        return _Decoder(self._builder(id_prefix), ToolNameMap(t.name for t in request.tools))

    def parse(self, request: ModelRequest, body: Any, id_prefix: str) -> ModelResponse:
        builder = self._builder(id_prefix)
        names = ToolNameMap(t.name for t in request.tools)
        for block in body["content"]:
            if block["type"] == "text":
                builder.text(block["text"])
            elif block["type"] == "tool_use":
                index, _ = builder.start_call(block["id"], names.to_kernel(block["name"]))
                builder.arguments_object(index, block.get("input") or {})
        builder.raw_stop_reason = body.get("stop_reason")
        builder.model = body.get("model") or builder.model
        builder.usage = _usage(Usage(), body.get("usage") or {})
        return builder.response()

    def error_details(self, body: Any) -> tuple[str | None, str | None, float | None]:
        error = body.get("error") if isinstance(body, Mapping) else None
        if isinstance(error, Mapping):
            return error.get("type"), error.get("message"), None
        return None, None, None

    def _builder(self, id_prefix: str) -> ResponseBuilder:
        return ResponseBuilder(
            model=self.model, stop_reasons=_STOP_REASONS, id_prefix=id_prefix, prices=self.prices
        )


def _blocks(
    message: Message, names: ToolNameMap, plan: AttachmentPlan
) -> tuple[str, list[dict[str, Any]]]:
    if message.role == "system":
        return "system", []  # sent as the top-level system prompt
    blocks: list[dict[str, Any]] = []
    if message.role == "tool":
        for o in message.observations:
            result: dict[str, Any] = {
                "type": "tool_result",
                "tool_use_id": o.call_id,
                "content": _result_content(o, plan),
            }
            if o.is_error:
                result["is_error"] = True
            blocks.append(result)
    if message.text:
        blocks.append({"type": "text", "text": message.text})
    if message.role == "assistant":
        blocks += [
            {
                "type": "tool_use",
                "id": call.id,
                "name": names.to_wire(call.name),
                "input": arguments_object(call.arguments),
            }
            for call in message.tool_calls
        ]
        return "assistant", blocks
    return "user", blocks


def _result_content(observation: Observation, plan: AttachmentPlan) -> str | list[dict[str, Any]]:
    """A ``tool_result``'s content: the text alone, or blocks when media is sent."""
    if not observation.attachments:
        return observation.content
    text, sent = plan.split(observation)
    if not sent:
        return text
    # The API refuses an empty text block: a result of media alone has none.
    blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    for attachment in sent:
        media_type = sent_media_type(attachment)
        source = {"type": "base64", "media_type": media_type, "data": attachment.data}
        if media_type in _IMAGE_TYPES:
            blocks.append({"type": "image", "source": source})
        else:
            document: dict[str, Any] = {"type": "document", "source": source}
            title = attachment.name or attachment.uri
            if title:
                document["title"] = title
            blocks.append(document)
    return blocks


def _usage(usage: Usage, fields: Mapping[str, Any]) -> Usage:
    """``usage`` updated with the counts ``fields`` has (message_delta repeats only some)."""

    def count(key: str, default: int) -> int:
        return default if fields.get(key) is None else token_count(fields, key)

    return Usage(
        input_tokens=count("input_tokens", usage.input_tokens),
        output_tokens=count("output_tokens", usage.output_tokens),
        cache_read_tokens=count("cache_read_input_tokens", usage.cache_read_tokens),
        cache_write_tokens=count("cache_creation_input_tokens", usage.cache_write_tokens),
    )


class _Decoder:
    """Message stream events: text and ``tool_use`` content blocks, by block index.

    A ``tool_use`` block's id and name come in ``content_block_start``; its
    input as ``input_json_delta`` fragments. Complete at ``message_stop``.
    """

    def __init__(self, builder: ResponseBuilder, names: ToolNameMap) -> None:
        self.done = False
        self._builder = builder
        self._names = names
        self._calls: dict[int, int] = {}  # content block index -> call index

    def feed(self, event: SSEEvent) -> list[ModelEvent]:
        data = load_json("anthropic", event.data)
        kind = data.get("type", event.event)
        builder = self._builder
        if kind == "message_start":
            message = data["message"]
            builder.model = message.get("model") or builder.model
            builder.usage = _usage(builder.usage, message.get("usage") or {})
        elif kind == "content_block_start":
            block = data["content_block"]
            if block["type"] == "text":
                return builder.text(block.get("text") or "")
            if block["type"] == "tool_use":
                index, started = builder.start_call(
                    block["id"], self._names.to_kernel(block["name"])
                )
                self._calls[data["index"]] = index
                return [started]
        elif kind == "content_block_delta":
            delta = data["delta"]
            if delta["type"] == "text_delta":
                return builder.text(delta["text"])
            if delta["type"] == "input_json_delta" and data["index"] in self._calls:
                return builder.arguments(self._calls[data["index"]], delta["partial_json"])
        elif kind == "message_delta":
            stop = (data.get("delta") or {}).get("stop_reason")
            if stop:
                builder.raw_stop_reason = stop
            builder.usage = _usage(builder.usage, data.get("usage") or {})
        elif kind == "message_stop":
            self.done = True
        elif kind == "error":
            error = data.get("error") or {}
            error_type = error.get("type")
            raise ProviderError(
                "anthropic",
                error.get("message") or "error event in the stream",
                error_type=error_type,
                retryable=error_type in _RETRYABLE_ERRORS,
            )
        # ping, content_block_stop, thinking blocks and new event types: nothing to do.
        return []

    def response(self) -> ModelResponse:
        return self._builder.response()
