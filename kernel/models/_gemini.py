"""Gemini API: ``generateContent`` and ``streamGenerateContent?alt=sse``."""

from __future__ import annotations

import copy
import json
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import httpx

from ..errors import UsageError
from ..messages import Message, Observation
from ..settings import check_tool_choice
from ..tools import ToolDefinition, ToolRegistry
from ._assemble import ResponseBuilder, token_count
from ._base import ModelEvent, ModelRequest, ModelResponse, ProviderError, StopReason, Usage
from ._budget import ModelBudget
from ._http import HTTPModel, load_json, refuse_settings
from ._prices import Price
from ._retry import RetryPolicy
from ._sse import SSEEvent
from ._wire import AttachmentPlan, arguments_object, refused_media, sent_media_type, system_text

GEMINI_BASE_URL = "https://generativelanguage.googleapis.com/v1beta"

# Google's documented stand-in for a thought signature the client does not
# have (history from another model, or from before a restart). Gemini 3
# refuses a function call turn whose first call carries no signature.
DUMMY_THOUGHT_SIGNATURE = "skip_thought_signature_validator"
_MAX_SIGNATURES = 10_000

_STOP_REASONS: Mapping[str, StopReason] = {
    "STOP": "end_turn",
    "MAX_TOKENS": "max_tokens",
    "SAFETY": "content_filter",
    "RECITATION": "content_filter",
    "BLOCKLIST": "content_filter",
    "PROHIBITED_CONTENT": "content_filter",
    "SPII": "content_filter",
    "IMAGE_SAFETY": "content_filter",
}
_RETRYABLE_STATUSES = frozenset(
    {"UNAVAILABLE", "RESOURCE_EXHAUSTED", "INTERNAL", "DEADLINE_EXCEEDED"}
)

# Gemini 3 takes media inside a functionResponse ("multimodal function
# responses"): these types only. Earlier models answer such a request with
# HTTP 400, but take media as inline parts of the same turn, of more types.
_FUNCTION_RESPONSE_MEDIA = frozenset(
    {"image/png", "image/jpeg", "image/webp", "application/pdf", "text/plain"}
)
_INLINE_MEDIA = _FUNCTION_RESPONSE_MEDIA | {
    "image/heic",
    "image/heif",
    "audio/wav",
    "audio/mp3",
    "audio/aiff",
    "audio/aac",
    "audio/ogg",
    "audio/flac",
}
_BEFORE_GEMINI_3 = re.compile(r"gemini-[12]\.")
# Inline data is at most 20 MB a request, base64 and the rest together.
_ATTACHMENT_BUDGET = 14 * 1024 * 1024


class _NotForGemini(Exception):
    """The schema needs JSON Schema that Gemini's OpenAPI subset cannot say."""


def _gemini_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """Convert one of our schemas to the OpenAPI subset of Gemini's ``parameters``.

    Gemini wants ``nullable`` instead of a null alternative, string-only
    enums, and no ``additionalProperties`` or ``default``; it rejects an
    object with no properties.
    """
    out: dict[str, Any] = {}
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


def gemini_tools(definitions: Iterable[ToolDefinition]) -> list[dict[str, Any]]:
    """The ``tools`` list of a ``generateContent`` request; ``tak tools --format
    gemini`` prints this.

    One entry holding every function declaration (an empty list when there
    are no tools); names go as they are (Gemini accepts ``.``). ``parameters``
    is converted to Gemini's OpenAPI subset and left out for a tool without
    parameters (Gemini refuses an object with no properties). A tool whose
    schema that subset cannot express (``dict[str, T]``, ``Any``) is declared
    with ``parametersJsonSchema`` instead, which takes JSON Schema as is.
    """
    declarations = []
    for d in definitions:
        declaration: dict[str, Any] = {"name": d.name, "description": d.description}
        if d.parameters.get("properties"):
            try:
                declaration["parameters"] = _gemini_schema(d.parameters)
            except _NotForGemini:
                declaration["parametersJsonSchema"] = copy.deepcopy(d.parameters)
        declarations.append(declaration)
    return [{"functionDeclarations": declarations}] if declarations else []


class GeminiModel(HTTPModel):
    """A model behind ``{base_url}/models/{model}:generateContent``.

    Gemini names function calls only sometimes: a call without an ``id``
    gets ``gemini-<hash>-<index>``, where ``<hash>`` is the first 10 hex
    digits of the SHA-256 of the request body (the same request gives the
    same ids; two turns never share them). Such ids stay on our side; an id
    Gemini sent goes back with the call and its ``functionResponse``.
    ``functionResponse`` parts return in declared order, named after the
    function, with ``{"result": content}`` or, for an error observation,
    ``{"error": content}``.

    A result's attachments go as ``inlineData`` in the ``functionResponse``'s
    ``parts`` (PNG, JPEG, WebP, PDF, plain text), and for models before
    Gemini 3, which refuse that, as ``inlineData`` parts after the turn's
    function responses, each after a line naming its call; other media is
    named in the result's text (``AttachmentPlan``).

    Thought signatures (Gemini 2.5 and 3 sign their function calls, and
    Gemini 3 refuses a history without them) are kept in memory by call id
    and sent back with their calls; a turn whose signature is not known gets
    Google's documented placeholder, so a transcript reloaded after a
    restart still works.
    """

    provider = "gemini"
    default_base_url = GEMINI_BASE_URL
    tool_specs = staticmethod(gemini_tools)

    def __init__(
        self,
        model: str,
        *,
        client: httpx.AsyncClient,
        api_key: str | None = None,
        base_url: str | None = None,
        retry: RetryPolicy | None = None,
        prices: Mapping[str, Price] | None = None,
        budget: ModelBudget | None = None,
    ) -> None:
        super().__init__(
            model.removeprefix("models/"),
            client=client,
            api_key=api_key,
            base_url=base_url,
            retry=retry,
            prices=prices,
            budget=budget,
        )
        self._signatures: OrderedDict[str, str] = OrderedDict()

    def build(self, request: ModelRequest, *, stream: bool) -> tuple[str, dict[str, str], Any]:
        contents: list[dict[str, Any]] = []
        taken = _INLINE_MEDIA if self._media_after_responses else _FUNCTION_RESPONSE_MEDIA
        plan = AttachmentPlan(
            request.messages,
            refusal=refused_media(self.provider, taken),
            budget=_ATTACHMENT_BUDGET,
        )
        for message in request.messages:
            role, parts = self._parts(message, plan)
            if not parts:
                continue
            if contents and contents[-1]["role"] == role:
                contents[-1]["parts"] += parts  # roles alternate
            else:
                contents.append({"role": role, "parts": parts})
        body: dict[str, Any] = {"contents": contents}
        system = system_text(request)
        if system:
            body["systemInstruction"] = {"parts": [{"text": system}]}
        settings = request.effective_settings()
        check_tool_choice(settings, [t.name for t in request.tools])
        refuse_settings(self.provider, settings, ("reasoning_effort",))
        if settings.parallel_tool_calls is False:
            raise UsageError(
                "gemini: parallel_tool_calls false cannot be expressed (the API has no "
                "such switch); leave it unset"
            )
        if request.tools:
            body["tools"] = gemini_tools(ToolRegistry(request.tools).definitions())
            choice = settings.tool_choice
            if choice is not None:
                mode = {"auto": "AUTO", "required": "ANY", "none": "NONE"}.get(choice)
                calling: dict[str, Any] = {"mode": mode or "ANY"}
                if mode is None:  # one named tool
                    calling["allowedFunctionNames"] = [choice]
                body["toolConfig"] = {"functionCallingConfig": calling}
        config: dict[str, Any] = {"maxOutputTokens": settings.max_tokens}
        for name, wire in (("temperature", "temperature"), ("top_p", "topP"), ("seed", "seed")):
            if (value := getattr(settings, name)) is not None:
                config[wire] = value
        if settings.stop is not None:
            config["stopSequences"] = list(settings.stop)
        extra = dict(settings.extra or {})
        more = extra.pop("generationConfig", None)
        if isinstance(more, Mapping):  # its own keys, under the ones set above
            config = {**more, **config}
        body["generationConfig"] = config
        body.update(extra)
        headers = {"content-type": "application/json"}
        if self.api_key:
            headers["x-goog-api-key"] = self.api_key
        if stream:
            headers["accept"] = "text/event-stream"
            url = f"{self.base_url}/models/{self.model}:streamGenerateContent?alt=sse"
        else:
            url = f"{self.base_url}/models/{self.model}:generateContent"
        return url, headers, body

    def decoder(self, request: ModelRequest, id_prefix: str) -> _Decoder:
        return _Decoder(self, self._builder(id_prefix))

    def parse(self, request: ModelRequest, body: Any, id_prefix: str) -> ModelResponse:
        decoder = _Decoder(self, self._builder(id_prefix))
        decoder.feed_chunk(body)
        return decoder.response()

    def error_details(self, body: Any) -> tuple[str | None, str | None, float | None]:
        if isinstance(body, list) and body:
            body = body[0]
        error = body.get("error") if isinstance(body, Mapping) else None
        if not isinstance(error, Mapping):
            return None, None, None
        return error.get("status"), error.get("message"), _retry_delay(error)

    def remember_signature(self, call_id: str, signature: str) -> None:
        self._signatures[call_id] = signature
        self._signatures.move_to_end(call_id)
        while len(self._signatures) > _MAX_SIGNATURES:
            self._signatures.popitem(last=False)

    def _builder(self, id_prefix: str) -> ResponseBuilder:
        return ResponseBuilder(
            model=self.model, stop_reasons=_STOP_REASONS, id_prefix=id_prefix, prices=self.prices
        )

    def _own_id(self, call_id: str) -> bool:
        return call_id.startswith(f"{self.provider}-")

    @property
    def _media_after_responses(self) -> bool:
        """Whether media goes after the function responses, not inside them."""
        return _BEFORE_GEMINI_3.match(self.model) is not None

    def _function_response(
        self, o: Observation, plan: AttachmentPlan, after: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """``o`` as a ``functionResponse`` part; media for after the responses
        goes to ``after``."""
        text, sent = plan.split(o) if o.attachments else (o.content, [])
        media = [
            {"inlineData": {"mimeType": sent_media_type(attachment), "data": attachment.data}}
            for attachment in sent
        ]
        if media and self._media_after_responses:
            lines = [text] if text else []
            for attachment, part in zip(sent, media, strict=True):
                lines.append(f"[{attachment.describe()}: sent after the function responses]")
                line = f"{attachment.describe()}, from {o.name} (call {o.call_id}):"
                after += [{"text": line}, part]
            text, media = "\n".join(lines), []
        response = {"error": text} if o.is_error else {"result": text}
        function_response: dict[str, Any] = {"name": o.name, "response": response}
        if not self._own_id(o.call_id):
            function_response["id"] = o.call_id
        if media:
            function_response["parts"] = media
        return {"functionResponse": function_response}

    def _parts(self, message: Message, plan: AttachmentPlan) -> tuple[str, list[dict[str, Any]]]:
        parts: list[dict[str, Any]] = []
        if message.role == "system":
            return "user", []  # sent as systemInstruction
        if message.role == "tool":
            after: list[dict[str, Any]] = []
            parts += [self._function_response(o, plan, after) for o in message.observations]
            parts += after
        if message.text:
            parts.append({"text": message.text})
        if message.role != "assistant":
            return "user", parts
        signed = False
        first_call: dict[str, Any] | None = None
        for call in message.tool_calls:
            function_call: dict[str, Any] = {
                "name": call.name,
                "args": arguments_object(call.arguments),
            }
            if not self._own_id(call.id):
                function_call["id"] = call.id
            part: dict[str, Any] = {"functionCall": function_call}
            signature = self._signatures.get(call.id)
            if signature is not None:
                part["thoughtSignature"] = signature
                signed = True
            first_call = first_call or part
            parts.append(part)
        if first_call is not None and not signed:
            first_call["thoughtSignature"] = DUMMY_THOUGHT_SIGNATURE
        return "model", parts


def _retry_delay(error: Mapping[str, Any]) -> float | None:
    """The ``RetryInfo.retryDelay`` ("37s") of a Google error, if there is one."""
    for detail in error.get("details") or []:
        if isinstance(detail, Mapping) and str(detail.get("@type", "")).endswith("RetryInfo"):
            delay = str(detail.get("retryDelay", ""))
            try:
                return float(delay.removesuffix("s"))
            except ValueError:
                return None
    return None


def _usage(metadata: Mapping[str, Any]) -> Usage:
    prompt = token_count(metadata, "promptTokenCount")
    cached = token_count(metadata, "cachedContentTokenCount")
    return Usage(
        input_tokens=prompt - cached,
        # Thinking tokens are billed as output.
        output_tokens=token_count(metadata, "candidatesTokenCount")
        + token_count(metadata, "thoughtsTokenCount"),
        cache_read_tokens=cached,
    )


class _Decoder:
    """``GenerateContentResponse`` chunks; each ``functionCall`` part arrives whole.

    Complete at the chunk with a ``finishReason`` (or a blocked prompt).
    """

    def __init__(self, model: GeminiModel, builder: ResponseBuilder) -> None:
        self.done = False
        self._model = model
        self._builder = builder

    def feed(self, event: SSEEvent) -> list[ModelEvent]:
        return self.feed_chunk(load_json("gemini", event.data))

    def feed_chunk(self, chunk: Any) -> list[ModelEvent]:
        builder = self._builder
        error = chunk.get("error")
        if error:
            status, message, delay = self._model.error_details(chunk)
            raise ProviderError(
                "gemini",
                message or str(error),
                error_type=status,
                retryable=status in _RETRYABLE_STATUSES,
                retry_after=delay,
            )
        if chunk.get("modelVersion"):
            builder.model = chunk["modelVersion"]
        if chunk.get("usageMetadata"):
            # Each chunk repeats the running totals: the last one counts.
            builder.usage = _usage(chunk["usageMetadata"])
        events: list[ModelEvent] = []
        candidates = chunk.get("candidates") or []
        if not candidates:
            blocked = (chunk.get("promptFeedback") or {}).get("blockReason")
            if blocked:
                builder.raw_stop_reason = blocked
                self.done = True
            return events
        candidate = candidates[0]
        for part in (candidate.get("content") or {}).get("parts") or []:
            if "functionCall" in part:
                call = part["functionCall"]
                index, started = builder.start_call(call.get("id"), call["name"])
                events.append(started)
                events += builder.arguments_object(index, call.get("args") or {})
                if part.get("thoughtSignature"):
                    self._model.remember_signature(builder.call_id(index), part["thoughtSignature"])
            elif "text" in part and not part.get("thought"):
                events += builder.text(part["text"])
        if candidate.get("finishReason"):
            builder.raw_stop_reason = candidate["finishReason"]
            self.done = True
        return events

    def response(self) -> ModelResponse:
        return self._builder.response()
