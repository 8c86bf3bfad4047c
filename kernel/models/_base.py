"""What every model speaks: requests, responses, usage, stream events, the ``Model`` protocol."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import AbstractAsyncContextManager
from typing import Literal, Protocol, TypeAlias, get_args, runtime_checkable

import attrs

from ..errors import ModelAPIError
from ..messages import Message
from ..settings import DEFAULT_MAX_TOKENS, ModelSettings, merge
from ..tools import Tool

StopReason: TypeAlias = Literal[
    "end_turn", "tool_use", "max_tokens", "stop_sequence", "content_filter", "other"
]
STOP_REASONS: tuple[StopReason, ...] = get_args(StopReason)


def _add_costs(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return a + b


@attrs.frozen
class Usage:
    """Tokens one response used, and what they cost when the price is known.

    The four counts are disjoint, as Anthropic reports them: ``input_tokens``
    are prompt tokens read neither from nor into the provider's cache, so the
    whole prompt is ``total_input_tokens``. OpenAI and Gemini count cached
    tokens inside the prompt; their adapters subtract them.
    """

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    cost_usd: float | None = None

    @property
    def total_input_tokens(self) -> int:
        return self.input_tokens + self.cache_read_tokens + self.cache_write_tokens

    @property
    def total_tokens(self) -> int:
        return self.total_input_tokens + self.output_tokens

    def __add__(self, other: Usage) -> Usage:
        if not isinstance(other, Usage):
            return NotImplemented
        return Usage(
            input_tokens=self.input_tokens + other.input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            cache_read_tokens=self.cache_read_tokens + other.cache_read_tokens,
            cache_write_tokens=self.cache_write_tokens + other.cache_write_tokens,
            cost_usd=_add_costs(self.cost_usd, other.cost_usd),
        )


# Typed converters: with a bare ``tuple`` mypy sees a type variable it cannot match.
def _messages_tuple(messages: Iterable[Message]) -> tuple[Message, ...]:
    return tuple(messages)


def _tools_tuple(tools: Iterable[Tool]) -> tuple[Tool, ...]:
    # Accepts a ToolRegistry as well as a sequence.
    return tuple(tools)


@attrs.frozen
class ModelRequest:
    """One call to a model.

    ``messages`` use the roles ``user``, ``assistant`` and ``tool``: an
    assistant message holds ``Text`` and ``ToolCall`` parts; the ``tool``
    message after it holds the ``Observation`` of each of its calls, in
    declared order. A ``system`` message, if any, is added to ``system``.
    """

    messages: tuple[Message, ...] = attrs.field(converter=_messages_tuple)
    system: str | None = None
    tools: tuple[Tool, ...] = attrs.field(default=(), converter=_tools_tuple)
    max_tokens: int | None = None
    temperature: float | None = None
    #: Every other setting; its ``max_tokens`` / ``temperature`` win over the
    #: fields above, which stay for callers that set only those.
    settings: ModelSettings | None = None

    def effective_settings(self) -> ModelSettings:
        """The settings to send: ``settings`` over ``max_tokens`` / ``temperature``,
        with the default ``max_tokens`` when none is set."""
        return merge(
            ModelSettings(max_tokens=DEFAULT_MAX_TOKENS),
            ModelSettings(max_tokens=self.max_tokens, temperature=self.temperature),
            self.settings,
        )


def _assistant_message(instance: object, attribute: object, message: Message) -> None:
    if message.role != "assistant":
        raise ValueError(f"a response message has role 'assistant', not {message.role!r}")


@attrs.frozen
class ModelResponse:
    """What a model answered.

    ``message`` is an assistant message: one ``Text`` part (when there is
    text), then the ``ToolCall`` parts in declared order, each with ``index``
    set to its position among the calls and ``arguments`` as the provider sent
    them (the raw JSON text; an object for Gemini and for a non-streamed
    Anthropic response). ``stop_reason`` is one of ``STOP_REASONS``;
    ``raw_stop_reason`` is the provider's own word for it. ``model`` is the
    model that answered, as the provider names it.
    """

    message: Message = attrs.field(validator=_assistant_message)
    usage: Usage = Usage()
    stop_reason: StopReason = "end_turn"
    model: str = ""
    raw_stop_reason: str | None = None


@attrs.frozen
class TextDelta:
    """More text of the answer."""

    text: str


@attrs.frozen
class ToolCallDelta:
    """Part of tool call ``index`` (its position among the response's calls).

    The first delta of a call carries its ``id`` and ``name``; later ones
    carry ``None`` there and more of the JSON ``arguments_fragment``.
    """

    index: int
    id: str | None
    name: str | None
    arguments_fragment: str


@attrs.frozen
class ResponseComplete:
    """The whole response: the last event of every stream that succeeds."""

    response: ModelResponse


ModelEvent: TypeAlias = TextDelta | ToolCallDelta | ResponseComplete


@runtime_checkable
class Model(Protocol):
    """A language model.

    ``stream`` is an async context manager around the events of one response;
    leaving the block, or being cancelled, closes the HTTP response at once::

        async with model.stream(request) as events:
            async for event in events:
                ...

    The last event is ``ResponseComplete``; a stream that ends without it
    raises ``ModelAPIError`` instead.
    """

    @property
    def name(self) -> str:
        """``provider:model``, as ``resolve_model`` takes it."""
        ...

    def stream(
        self, request: ModelRequest
    ) -> AbstractAsyncContextManager[AsyncIterator[ModelEvent]]: ...

    async def complete(self, request: ModelRequest) -> ModelResponse: ...


class ProviderError(ModelAPIError):
    """A provider answered with an error, or the connection to it failed.

    Attributes:
        provider: ``"openai"``, ``"anthropic"``, ``"gemini"``, ...
        status: the HTTP status, or ``None`` (connection error, error event in a stream).
        error_type: the provider's name for the error (``"invalid_request_error"``,
            ``"INVALID_ARGUMENT"``), or one of ours: ``"connection_error"``,
            ``"incomplete_stream"``, ``"bad_response"``.
        message: the provider's message.
        retryable: trying the same request again later may succeed.
        retry_after: seconds the provider asked us to wait, if it said.
        attempts: how many attempts were made before giving up.
    """

    def __init__(
        self,
        provider: str,
        message: str,
        *,
        status: int | None = None,
        error_type: str | None = None,
        retryable: bool = False,
        retry_after: float | None = None,
        attempts: int = 1,
    ) -> None:
        self.provider = provider
        self.message = message
        self.status = status
        self.error_type = error_type
        self.retryable = retryable
        self.retry_after = retry_after
        self.attempts = attempts
        super().__init__(str(self))

    def __str__(self) -> str:
        where = f"HTTP {self.status}" if self.status is not None else None
        head = " ".join(p for p in (where, self.error_type) if p)
        text = (
            f"{self.provider}: {head}: {self.message}"
            if head
            else f"{self.provider}: {self.message}"
        )
        if self.attempts > 1:
            text += f" (gave up after {self.attempts} attempts)"
        return text
