"""Build a ``ModelResponse`` from pieces, as streams and whole responses deliver them.

Every adapter feeds one ``ResponseBuilder``: text as it comes, each tool call
when it starts and each fragment of its arguments, usage, the stop reason.
The builder hands back the stream events for those pieces, so what the
caller saw streamed and the final response cannot disagree.

What a provider sends is decoded into something a transcript can record:
lone surrogates in text, call ids and names become U+FFFD; in arguments
they are kept as ``\\uXXXX`` escapes (as are NaN and infinities, in JSON
text), so the executor refuses that call alone as ``bad_arguments``, with the
path. Token counts that are not whole non-negative numbers are refused.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any, cast

from ..messages import (
    Message,
    Part,
    Text,
    ToolCall,
    escape_surrogates,
    json_problem,
    replace_lone_surrogates,
)
from ._base import (
    ModelEvent,
    ModelResponse,
    ResponseComplete,
    StopReason,
    TextDelta,
    ToolCallDelta,
    Usage,
)
from ._prices import Price, cost_of, find_price


def token_count(fields: Mapping[str, Any], key: str) -> int:
    """``fields[key]`` as a token count (0 when missing).

    Raises:
        ValueError: the provider sent something that is not a whole number of
            tokens (NaN, an infinity, a negative or fractional number, a string);
            the adapters' ``response_shape`` makes it a ``ProviderError``.
    """
    value = fields.get(key)
    if value is None:
        return 0
    if type(value) is int and value >= 0:
        return value
    if type(value) is float and math.isfinite(value) and value >= 0 and value.is_integer():
        return int(value)
    raise ValueError(f"usage {key}: {value!r} is not a token count")


def assistant_message(parts: Iterable[Part]) -> Message:
    # Message's tuple converter leaves mypy a bare type variable to match.
    return Message("assistant", cast(Any, tuple(parts)))


class _PendingCall:
    __slots__ = ("arguments", "fragments", "id", "name")

    def __init__(self, id: str, name: str) -> None:
        self.id = id
        self.name = name
        self.fragments: list[str] = []
        self.arguments: dict[str, Any] | None = None


class ResponseBuilder:
    """Collects one response.

    ``model`` is the model asked for; an adapter sets ``self.model`` to the
    one the provider says answered. ``id_prefix`` names calls whose provider sent no id (Gemini, some
    OpenAI-compatible servers): call ``i`` becomes ``f"{id_prefix}-{i}"``.
    """

    def __init__(
        self,
        *,
        model: str,
        stop_reasons: Mapping[str, StopReason],
        id_prefix: str,
        prices: Mapping[str, Price] | None = None,
    ) -> None:
        self.model = model
        self._configured_model = model
        self.usage = Usage()
        self.raw_stop_reason: str | None = None
        self._stop_reasons = stop_reasons
        self._id_prefix = id_prefix
        self._prices = prices
        self._text: list[str] = []
        self._calls: list[_PendingCall] = []

    @property
    def call_count(self) -> int:
        return len(self._calls)

    def call_id(self, index: int) -> str:
        return self._calls[index].id

    def text(self, text: str) -> list[ModelEvent]:
        if not text:
            return []
        text = replace_lone_surrogates(text)
        self._text.append(text)
        return [TextDelta(text)]

    def start_call(self, id: str | None, name: str) -> tuple[int, ToolCallDelta]:
        """Open the next call; returns its index and the delta that announces it."""
        index = len(self._calls)
        call = _PendingCall(
            replace_lone_surrogates(id or f"{self._id_prefix}-{index}"),
            replace_lone_surrogates(name),
        )
        self._calls.append(call)
        return index, ToolCallDelta(index, call.id, call.name, "")

    def arguments(self, index: int, fragment: str) -> list[ModelEvent]:
        """More of call ``index``'s JSON arguments."""
        if not fragment:
            return []
        # A surrogate stays an escape: the call is refused, with its path, and recorded.
        fragment = escape_surrogates(fragment)
        self._calls[index].fragments.append(fragment)
        return [ToolCallDelta(index, None, None, fragment)]

    def arguments_object(self, index: int, arguments: dict[str, Any]) -> list[ModelEvent]:
        """Call ``index``'s arguments, sent whole as an object (Gemini, Anthropic non-streamed).

        An object a transcript cannot hold (a lone surrogate, NaN, an infinity)
        is kept as its JSON text, escaped: the executor refuses it.
        """
        if json_problem(arguments) is not None:
            return self.arguments(index, json.dumps(arguments, ensure_ascii=True))
        self._calls[index].arguments = arguments
        return [ToolCallDelta(index, None, None, json.dumps(arguments, ensure_ascii=False))]

    def response(self) -> ModelResponse:
        parts: list[Part] = []
        if self._text:
            parts.append(Text("".join(self._text)))
        for index, call in enumerate(self._calls):
            arguments = call.arguments if call.arguments is not None else "".join(call.fragments)
            parts.append(ToolCall(id=call.id, name=call.name, arguments=arguments, index=index))
        stop = self._stop_reasons.get(self.raw_stop_reason or "", "other")
        if self._calls and stop == "end_turn":
            # Gemini and some OpenAI-compatible servers say "stop" for a turn of calls.
            stop = "tool_use"
        # The provider names a dated snapshot or an alias; either may be priced.
        price = find_price(self.model, self._prices) or find_price(
            self._configured_model, self._prices
        )
        usage = self.usage
        if price is not None:
            usage = Usage(
                input_tokens=usage.input_tokens,
                output_tokens=usage.output_tokens,
                cache_read_tokens=usage.cache_read_tokens,
                cache_write_tokens=usage.cache_write_tokens,
                cost_usd=cost_of(usage, price),
            )
        return ModelResponse(
            message=assistant_message(parts),
            usage=usage,
            stop_reason=stop,
            model=replace_lone_surrogates(self.model),
            raw_stop_reason=self.raw_stop_reason,
        )


def events_of(response: ModelResponse) -> list[ModelEvent]:
    """The events a stream of ``response`` would have given: text, each call, completion."""
    events: list[ModelEvent] = []
    if response.message.text:
        events.append(TextDelta(response.message.text))
    for index, call in enumerate(response.message.tool_calls):
        arguments = call.arguments
        fragment = (
            arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        )
        events.append(ToolCallDelta(index, call.id, call.name, fragment))
    events.append(ResponseComplete(response))
    return events
