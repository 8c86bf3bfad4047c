"""OpenAI Chat Completions, and every server that speaks it (vLLM, Ollama, llama.cpp, OpenRouter)."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from ..messages import Message
from ..settings import TOOL_CHOICES, check_tool_choice
from ..tools import ToolDefinition, ToolRegistry
from ._assemble import ResponseBuilder, token_count
from ._base import ModelEvent, ModelRequest, ModelResponse, ProviderError, StopReason, Usage
from ._http import HTTPModel, load_json
from ._sse import SSEEvent
from ._wire import (
    AttachmentPlan,
    ToolNameMap,
    arguments_text,
    refused_media,
    sent_media_type,
    system_text,
)

OPENAI_BASE_URL = "https://api.openai.com/v1"

_STOP_REASONS: Mapping[str, StopReason] = {
    "stop": "end_turn",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "length": "max_tokens",
    "content_filter": "content_filter",
}

# A tool message takes text parts only; a user message takes images as
# image_url parts (data: URLs), which every server speaking the API for a
# vision model reads. 50 MB of images a request: leave room for the rest.
_IMAGE_TYPES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})
_ATTACHMENT_BUDGET = 32 * 1024 * 1024
_refusal = refused_media("openai", _IMAGE_TYPES)


def openai_tools(definitions: Iterable[ToolDefinition]) -> list[dict[str, Any]]:
    """The ``tools`` list of a Chat Completions request, names as sent (``fs.read`` is
    ``fs__read``); ``tak tools --format openai`` prints this.

    Raises:
        UsageError: two tools share a wire name, or one is too long on the wire.
    """
    definitions = list(definitions)
    names = ToolNameMap(d.name for d in definitions)
    return [
        {
            "type": "function",
            "function": {
                "name": names.to_wire(d.name),
                "description": d.description,
                "parameters": copy.deepcopy(d.parameters),
            },
        }
        for d in definitions
    ]


class OpenAIModel(HTTPModel):
    """A model behind ``{base_url}/chat/completions``.

    Tool results go back as one ``role: tool`` message per observation, in
    declared order. A tool message holds text alone, so the images of the
    results (JPEG, PNG, GIF, WebP) follow them in one ``user`` message, each
    after a line naming its call, and each result's text says where its
    images went; other media is named in the text (``AttachmentPlan``). A
    model that takes no images refuses such a request: keep tools that
    return images away from it. Against api.openai.com the output limit is sent as
    ``max_completion_tokens`` (its reasoning models refuse ``max_tokens``);
    against other servers as ``max_tokens``, which they all know.
    """

    provider = "openai"
    default_base_url = OPENAI_BASE_URL
    tool_specs = staticmethod(openai_tools)

    def build(self, request: ModelRequest, *, stream: bool) -> tuple[str, dict[str, str], Any]:
        names = ToolNameMap(t.name for t in request.tools)
        messages: list[dict[str, Any]] = []
        system = system_text(request)
        if system:
            messages.append({"role": "system", "content": system})
        plan = AttachmentPlan(request.messages, refusal=_refusal, budget=_ATTACHMENT_BUDGET)
        for message in request.messages:
            messages.extend(_messages(message, names, plan))
        settings = request.effective_settings()
        check_tool_choice(settings, [t.name for t in request.tools])
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        if request.tools:
            body["tools"] = openai_tools(ToolRegistry(request.tools).definitions())
            choice = settings.tool_choice
            if choice is not None:
                body["tool_choice"] = (
                    choice
                    if choice in TOOL_CHOICES
                    else {"type": "function", "function": {"name": names.to_wire(choice)}}
                )
            if settings.parallel_tool_calls is not None:  # refused without tools
                body["parallel_tool_calls"] = settings.parallel_tool_calls
        official = urlsplit(self.base_url).hostname == "api.openai.com"
        body["max_completion_tokens" if official else "max_tokens"] = settings.max_tokens
        for name, wire in (("temperature", "temperature"), ("top_p", "top_p"), ("seed", "seed")):
            if (value := getattr(settings, name)) is not None:
                body[wire] = value
        if settings.stop is not None:
            body["stop"] = list(settings.stop)
        if settings.reasoning_effort is not None:
            body["reasoning_effort"] = settings.reasoning_effort
        if settings.extra:
            body.update(settings.extra)
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        headers = {"content-type": "application/json"}
        if stream:
            headers["accept"] = "text/event-stream"
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        return f"{self.base_url}/chat/completions", headers, body

    def decoder(self, request: ModelRequest, id_prefix: str) -> _Decoder:
        return _Decoder(self._builder(id_prefix), ToolNameMap(t.name for t in request.tools))

    def parse(self, request: ModelRequest, body: Any, id_prefix: str) -> ModelResponse:
        builder = self._builder(id_prefix)
        names = ToolNameMap(t.name for t in request.tools)
        _check_error(body)
        choice = body["choices"][0]
        message = choice["message"]
        builder.text(message.get("content") or "")
        builder.text(message.get("refusal") or "")
        for call in message.get("tool_calls") or []:
            function = call["function"]
            index, _ = builder.start_call(call.get("id"), names.to_kernel(function["name"]))
            _add_arguments(builder, index, function.get("arguments"))
        builder.raw_stop_reason = choice.get("finish_reason")
        _update(builder, body)
        return builder.response()

    def error_details(self, body: Any) -> tuple[str | None, str | None, float | None]:
        return _error_details(body)

    def _builder(self, id_prefix: str) -> ResponseBuilder:
        return ResponseBuilder(
            model=self.model, stop_reasons=_STOP_REASONS, id_prefix=id_prefix, prices=self.prices
        )


def _messages(message: Message, names: ToolNameMap, plan: AttachmentPlan) -> list[dict[str, Any]]:
    if message.role == "system":
        return []  # folded into the leading system message
    if message.role == "user":
        return [{"role": "user", "content": message.text}]
    if message.role == "assistant":
        entry: dict[str, Any] = {"role": "assistant", "content": message.text or None}
        calls = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": names.to_wire(call.name),
                    "arguments": arguments_text(call.arguments),
                },
            }
            for call in message.tool_calls
        ]
        if calls:
            entry["tool_calls"] = calls
        elif entry["content"] is None:
            entry["content"] = ""
        return [entry]
    out: list[dict[str, Any]] = []
    shown: list[dict[str, Any]] = []  # the user message's parts after the results
    for o in message.observations:
        if not o.attachments:
            out.append({"role": "tool", "tool_call_id": o.call_id, "content": o.content})
            continue
        text, sent = plan.split(o)
        lines = [text] if text else []
        for attachment in sent:
            number = len(shown) // 2 + 1
            lines.append(
                f"[{attachment.describe()}: image {number} of the user message after the "
                "tool results]"
            )
            shown.append(
                {"type": "text", "text": f"Image {number}, from {o.name} (call {o.call_id}):"}
            )
            url = f"data:{sent_media_type(attachment)};base64,{attachment.data}"
            shown.append({"type": "image_url", "image_url": {"url": url}})
        out.append({"role": "tool", "tool_call_id": o.call_id, "content": "\n".join(lines)})
    if shown:
        if message.text:
            shown.append({"type": "text", "text": message.text})
        out.append({"role": "user", "content": shown})
    elif message.text:
        out.append({"role": "user", "content": message.text})
    return out


def _add_arguments(builder: ResponseBuilder, index: int, arguments: Any) -> list[ModelEvent]:
    if isinstance(arguments, dict):
        # Not OpenAI's format, but some compatible servers send an object.
        return builder.arguments_object(index, arguments)
    return builder.arguments(index, arguments or "")


def _update(builder: ResponseBuilder, chunk: Mapping[str, Any]) -> None:
    if chunk.get("model"):
        builder.model = chunk["model"]
    usage = chunk.get("usage")
    if usage:
        prompt = token_count(usage, "prompt_tokens")
        cached = token_count(usage.get("prompt_tokens_details") or {}, "cached_tokens")
        builder.usage = Usage(
            input_tokens=prompt - cached,
            output_tokens=token_count(usage, "completion_tokens"),
            cache_read_tokens=cached,
        )


def _error_details(body: Any) -> tuple[str | None, str | None, float | None]:
    error = body.get("error") if isinstance(body, Mapping) else None
    if isinstance(error, Mapping):
        kind = error.get("type") or error.get("code")
        return (str(kind) if kind else None), error.get("message"), None
    if isinstance(error, str):
        return None, error, None
    return None, None, None


# In-band error codes worth another attempt: the server says it is busy or
# briefly away. A plain 500 in a 200 response is what a server sends when the
# model's output cannot be parsed ("does not match the expected format"):
# asking again asks for the same refusal.
_TRANSIENT_CODES = frozenset({408, 409, 429, 502, 503, 504})


def _check_error(chunk: Any) -> None:
    """An error sent as the body of a 200 response, or in the middle of a stream.

    Retried (before the first event) only when it says rate limit or carries
    a transient code; otherwise it is the server's deterministic refusal.
    """
    if isinstance(chunk, Mapping) and chunk.get("error"):
        error_type, message, _ = _error_details(chunk)
        error = chunk["error"]
        code = error.get("code") if isinstance(error, Mapping) else None
        try:
            transient = int(code) in _TRANSIENT_CODES if code is not None else False
        except (TypeError, ValueError):
            transient = False
        raise ProviderError(
            "openai",
            message or str(error),
            error_type=error_type,
            retryable=error_type == "rate_limit_exceeded" or transient,
        )


class _Decoder:
    """Chat completion chunks: text deltas, and tool calls assembled by their ``index``.

    A call's id and name come once, in its first delta; argument fragments
    of parallel calls interleave. Complete at ``data: [DONE]``.
    """

    def __init__(self, builder: ResponseBuilder, names: ToolNameMap) -> None:
        self.done = False
        self._builder = builder
        self._names = names
        # The provider's call index -> ours (its position in the response).
        self._indexes: dict[Any, int] = {}

    def feed(self, event: SSEEvent) -> list[ModelEvent]:
        if event.data.strip() == "[DONE]":
            self.done = True
            return []
        chunk = load_json("openai", event.data)
        _check_error(chunk)
        _update(self._builder, chunk)
        events: list[ModelEvent] = []
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            events += self._builder.text(delta.get("content") or "")
            events += self._builder.text(delta.get("refusal") or "")
            for call in delta.get("tool_calls") or []:
                events += self._call_delta(call)
            if choice.get("finish_reason"):
                self._builder.raw_stop_reason = choice["finish_reason"]
        return events

    def _call_delta(self, call: Mapping[str, Any]) -> list[ModelEvent]:
        key = call.get("index")
        if key is None:
            # Some servers leave out the index: a new id starts a new call.
            count = self._builder.call_count
            is_new = count == 0 or (
                call.get("id") and call["id"] != self._builder.call_id(count - 1)
            )
            key = f"#{count}" if is_new else f"#{count - 1}"
        function = call.get("function") or {}
        events: list[ModelEvent] = []
        index = self._indexes.get(key)
        if index is None:
            name = self._names.to_kernel(function.get("name") or "")
            index, started = self._builder.start_call(call.get("id"), name)
            self._indexes[key] = index
            events.append(started)
        events += _add_arguments(self._builder, index, function.get("arguments"))
        return events

    def response(self) -> ModelResponse:
        return self._builder.response()
