"""A model that needs no network: canned responses, a function of the request, or a replay."""

from __future__ import annotations

import collections
import contextlib
import inspect
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeAlias

import attrs
import trio

from ..errors import UsageError
from ..messages import Message, Part, Text, ToolCall
from ._assemble import assistant_message, events_of
from ._base import ModelEvent, ModelRequest, ModelResponse, StopReason, TextDelta, Usage

ScriptFunction: TypeAlias = Callable[
    [ModelRequest], "ModelResponse | str | Awaitable[ModelResponse | str]"
]
ScriptStep: TypeAlias = "ModelResponse | str | BaseException | ScriptFunction"
CallSpec: TypeAlias = "ToolCall | tuple[str, dict[str, Any] | str]"


class ScriptedModel:
    """A ``Model`` that answers from a script.

    ``responses`` is a sequence of steps, one per request, each a
    ``ModelResponse``, a string (a final answer), an exception (raised, to
    test failures) or a function of the request that returns a response or
    a string, sync or async; or ``responses`` is one such function that
    answers every request. Streaming gives the same response as events:
    text word by word, then each call, then ``ResponseComplete``;
    ``chunk_delay`` seconds pass between events (for demos; without it, the
    request is the stream's one checkpoint).

    Tool call ids already used earlier in the conversation get a
    ``-t<turn>`` suffix, so a script may reuse ids (``reply`` numbers calls
    from 0 in every response) and a transcript still never repeats one.

    ``requests`` holds the last ``keep_requests`` requests the model was
    given (100 by default), oldest first: enough for a test to look at what
    it sent, while a long-running ``tak serve`` on a scripted model does not
    grow. ``keep_requests=None`` keeps them all.

    Raises:
        UsageError: ``responses`` is a lone string or response rather than a list;
            a request arrives after the last step.
    """

    def __init__(
        self,
        responses: Sequence[ScriptStep] | ScriptFunction,
        *,
        name: str = "scripted:test",
        chunk_delay: float = 0.0,
        keep_requests: int | None = 100,
    ) -> None:
        if isinstance(responses, str | ModelResponse):
            raise UsageError(f"ScriptedModel takes a list of steps: ScriptedModel([{responses!r}])")
        if keep_requests is not None and (
            isinstance(keep_requests, bool)
            or not isinstance(keep_requests, int)
            or keep_requests < 0
        ):
            raise UsageError(f"keep_requests: expected 0 or more (or None), got {keep_requests!r}")
        self._name = name
        self._steps: list[ScriptStep] | None = None if callable(responses) else list(responses)
        self._function: ScriptFunction | None = responses if callable(responses) else None
        self.chunk_delay = chunk_delay
        self._requests: collections.deque[ModelRequest] = collections.deque(maxlen=keep_requests)
        self._served = 0
        self._ids = _UsedIds()

    @property
    def requests(self) -> list[ModelRequest]:
        """The most recent requests (at most ``keep_requests``), oldest first."""
        return list(self._requests)

    @property
    def name(self) -> str:
        return self._name

    def __repr__(self) -> str:
        return f"ScriptedModel(name={self._name!r})"

    @staticmethod
    def reply(
        text: str = "",
        calls: Iterable[CallSpec] = (),
        *,
        stop_reason: StopReason | None = None,
        usage: Usage | None = None,
        model: str = "scripted",
    ) -> ModelResponse:
        """A response with ``text`` and tool ``calls``.

        Each call is a ``ToolCall`` or ``(name, arguments)``; the latter gets
        id ``call_<index>``. ``stop_reason`` is ``tool_use`` when there are
        calls, else ``end_turn``, unless given.
        """
        parts: list[Part] = [Text(text)] if text else []
        for index, spec in enumerate(calls):
            if isinstance(spec, ToolCall):
                parts.append(attrs.evolve(spec, index=index))
            else:
                name, arguments = spec
                parts.append(
                    ToolCall(id=f"call_{index}", name=name, arguments=arguments, index=index)
                )
        has_calls = any(isinstance(p, ToolCall) for p in parts)
        return ModelResponse(
            message=assistant_message(parts),
            usage=usage or Usage(),
            stop_reason=stop_reason or ("tool_use" if has_calls else "end_turn"),
            model=model,
        )

    @classmethod
    def from_messages(
        cls, messages: Iterable[Message], *, name: str = "scripted:replay", chunk_delay: float = 0.0
    ) -> ScriptedModel:
        """Replay a recorded conversation: its assistant messages, one per request, in order."""
        steps: list[ScriptStep] = [
            cls.reply(calls=m.tool_calls, text=m.text, model=name)
            for m in messages
            if m.role == "assistant"
        ]
        return cls(steps, name=name, chunk_delay=chunk_delay)

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self._requests.append(request)
        served = self._served
        self._served += 1
        if self._function is not None:
            step: ScriptStep = self._function
        else:
            assert self._steps is not None
            if served >= len(self._steps):
                raise UsageError(
                    f"{self._name} has {len(self._steps)} scripted responses and was asked "
                    f"for response {served + 1}"
                )
            step = self._steps[served]
        await trio.lowlevel.checkpoint()
        if isinstance(step, BaseException):
            raise step
        if callable(step):
            result = step(request)
            answer = await result if inspect.isawaitable(result) else result
        else:
            answer = step
        if isinstance(answer, str):
            answer = self.reply(answer, model=self._name)
        return self._ids.unique(answer, request)

    @contextlib.asynccontextmanager
    async def stream(self, request: ModelRequest) -> AsyncIterator[AsyncIterator[ModelEvent]]:
        response = await self.complete(request)
        events = self._events(response)
        try:
            yield events
        finally:
            await events.aclose()

    async def _events(self, response: ModelResponse) -> AsyncGenerator[ModelEvent, None]:
        for event in events_of(response):
            if isinstance(event, TextDelta):
                for word in _words(event.text):
                    await self._pause()
                    yield TextDelta(word)
            else:
                await self._pause()
                yield event

    async def _pause(self) -> None:
        # Without a delay, ``complete`` was the stream's checkpoint: one more per
        # event would cost a trip through the scheduler each, several a turn.
        if self.chunk_delay:
            await trio.sleep(self.chunk_delay)


def _words(text: str) -> list[str]:
    """``text`` in pieces that join back to it: each word with the space before it."""
    pieces: list[str] = []
    for index, word in enumerate(text.split(" ")):
        pieces.append(word if index == 0 else " " + word)
    return [p for p in pieces if p]


class _UsedIds:
    """The tool call ids of a conversation and its assistant turns, kept between requests.

    An agent sends the same conversation again with a few messages more each
    time: when the message where the last request ended is still there
    (equal: a turn's history is read back from the transcript as new
    objects), only the messages after it are looked at, so a request's cost
    does not grow with the conversation. Any other request is looked at whole.
    """

    __slots__ = ("_end", "_ids", "_last", "_turns")

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._turns = 0
        self._end = 0
        self._last: Message | None = None

    def _update(self, messages: Sequence[Message]) -> None:
        end = self._end
        if not (0 < end <= len(messages) and messages[end - 1] == self._last):
            self._ids, self._turns, end = set(), 0, 0
        for m in messages[end:]:
            if m.role == "assistant":
                self._turns += 1
                self._ids.update(c.id for c in m.tool_calls)
        self._end = len(messages)
        self._last = messages[-1] if messages else None

    def unique(self, response: ModelResponse, request: ModelRequest) -> ModelResponse:
        """``response`` with the call ids already used in ``request`` suffixed ``-t<turn>``."""
        self._update(request.messages)
        used = self._ids
        if not any(c.id in used for c in response.message.tool_calls):
            return response
        turn = self._turns
        parts = [
            attrs.evolve(p, id=f"{p.id}-t{turn}") if isinstance(p, ToolCall) and p.id in used else p
            for p in response.message.parts
        ]
        return attrs.evolve(response, message=assistant_message(parts))


# --- named scripts, for resolve_model("scripted:NAME") --------------------------


def _last_message(request: ModelRequest) -> Message | None:
    return request.messages[-1] if request.messages else None


def echo_script(request: ModelRequest) -> ModelResponse:
    """Repeat the last user message."""
    last = _last_message(request)
    text = last.text if last is not None else ""
    return ScriptedModel.reply(f"You said: {text}", model="scripted:echo")


def demo_script(request: ModelRequest) -> ModelResponse:
    """Call the tools a prompt names, then report how each call went.

    Every prompt line ``/call NAME {json arguments}`` becomes a tool call
    (all in one turn, so they run in parallel); arguments that are not JSON
    are passed on as they are, to show the executor refusing them. When the
    observations come back, the answer lists each call's outcome. A prompt
    without ``/call`` lines is echoed.
    """
    last = _last_message(request)
    if last is None:
        return ScriptedModel.reply("Nothing to do.", model="scripted:demo")
    if last.role == "tool":
        lines = [f"{len(last.observations)} call(s) finished:"]
        for o in last.observations:
            if o.is_error:
                lines.append(f"- {o.name}: failed: {o.content}")
            else:
                first = o.content.strip().splitlines()[0] if o.content.strip() else ""
                lines.append(f"- {o.name}: ok ({len(o.content)} chars) {first[:80]}".rstrip())
        return ScriptedModel.reply("\n".join(lines), model="scripted:demo")
    calls: list[CallSpec] = []
    for line in last.text.splitlines():
        command, _, rest = line.strip().partition(" ")
        if command != "/call" or not rest.strip():
            continue
        name, _, raw = rest.strip().partition(" ")
        text = raw.strip() or "{}"
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
        calls.append((name, parsed if isinstance(parsed, dict) else text))
    if not calls:
        return echo_script(request)
    return ScriptedModel.reply(f"Calling {len(calls)} tool(s).", calls=calls, model="scripted:demo")


_SCRIPTS: dict[str, Callable[[], ScriptedModel]] = {
    "echo": lambda: ScriptedModel(echo_script, name="scripted:echo"),
    "demo": lambda: ScriptedModel(demo_script, name="scripted:demo"),
}


def register_scripted_model(name: str, factory: Callable[[], ScriptedModel]) -> None:
    """Make ``resolve_model(f"scripted:{name}")`` return ``factory()``.

    Raises:
        UsageError: the name is taken.
    """
    if name in _SCRIPTS:
        raise UsageError(f"a scripted model named {name!r} is already registered")
    _SCRIPTS[name] = factory


def scripted_model(name: str) -> ScriptedModel:
    """The scripted model registered as ``name``.

    Raises:
        UsageError: no such name; the message lists the known ones.
    """
    factory = _SCRIPTS.get(name)
    if factory is None:
        known = ", ".join(f"scripted:{n}" for n in sorted(_SCRIPTS))
        raise UsageError(f"no scripted model named {name!r}; known: {known}")
    return factory()
