"""A model that answers from a recorded conversation, to run a finished session again.

``ReplayModel(messages)`` answers request ``n`` with the ``n``-th recorded
assistant message, exactly as recorded (its text, its tool calls and their
ids); the tools run again, so a fix to a tool, the executor or the sandbox
can be checked against a run that already happened, with no model and no
network. ``await ReplayModel.from_session(session)`` reads the recording
from a session, with what the transcript says of each answer besides the
message: its usage and cost (so ``RunLimits`` stop a turn where they
stopped it; nothing is spent), a reply the token limit cut
(``stop_reason`` ``max_tokens``), and a reply cut short mid-stream
(``partial``: its text is streamed again, then the request fails, as it
did), and the recordings of the session's subagents.

Each request is checked against the recording before it is answered: what
the model was last shown must be what it was shown then: the same user
prompt, or the results of the same calls. A run that went another way (a
different number of calls answered, a turn that ended or began elsewhere,
another prompt, a request past the last recorded answer) gets a
``ProviderError`` (a ``ModelAPIError``, ``error_type="replay_diverged"``,
never retried) saying in one line at which step and what differed. Results
are not compared: they are what a replay is for.

Subagents: ``delegate`` asks the parent's model, so a child conversation's
requests reach the same ``ReplayModel``. Each child transcript
(``Session.child``) is a conversation of its own (``children=``; read by
``from_session``); a request goes to the conversation that began with the
same first message (the delegated task) and has answered as many requests
as the request holds answers; a request no conversation began with is the
main one's. Within a conversation the steps are counted as requests come. A
compaction's summary is not a message, so replay with compaction off
(``compact_after_tokens=None``, the default): a compaction request would be
refused as a divergence.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import Any, Protocol

import attrs
import trio

from ..errors import UsageError
from ..messages import Message
from ._assemble import events_of
from ._base import (
    STOP_REASONS,
    ModelEvent,
    ModelRequest,
    ModelResponse,
    ProviderError,
    StopReason,
    TextDelta,
    Usage,
)

_SHOWN = 60  # characters of a prompt quoted in an error
_SUBAGENTS = "subagents/"  # where Session.child keeps a subagent's transcript


class RecordedSession(Protocol):
    """What ``from_session`` reads: a ``kernel.session.Session`` is one.

    (``kernel.session`` sits above the models, so it is named by its shape.)
    A session that also has ``entries()`` gives each answer's usage, stop
    reason and partial mark; one with ``store``, ``key`` and ``child(id)``
    gives its subagents' recordings.
    """

    async def messages(self) -> list[Message]: ...


@attrs.frozen
class _Details:
    """What a transcript's assistant entry says besides its message."""

    usage: Usage = attrs.field(factory=Usage)
    stop_reason: StopReason | None = None  # None: tool_use or end_turn, by the answer
    partial: bool = False  # cut short mid-stream: the request failed after this text


@attrs.frozen
class _Step:
    """One recorded answer, what the model had been shown before it, and how it ended."""

    before: Message | None
    answer: Message
    details: _Details


class _Conversation:
    """The steps of one recorded conversation (the session's or a subagent's)."""

    def __init__(
        self, label: str, messages: Sequence[Message], details: Sequence[_Details]
    ) -> None:
        recorded = [m for m in messages if m.role != "system"]  # the agent sends its own
        answers = [i for i, m in enumerate(recorded) if m.role == "assistant"]
        if len(details) != len(answers):
            details = [_Details()] * len(answers)  # entries that do not line up: messages only
        self.label = label
        self.first = recorded[0] if recorded else None
        self.steps = [
            _Step(recorded[i - 1] if i > 0 else None, recorded[i], d)
            for i, d in zip(answers, details, strict=True)
        ]
        self.served = 0

    def began_with(self, message: Message | None) -> bool:
        first = self.first
        if first is None or message is None or first.role != message.role:
            return False
        return first.role != "user" or first.text == message.text


class ReplayModel:
    """A ``Model`` answering with the assistant messages of ``messages``, in order.

    ``messages`` is a recorded conversation (user, assistant and tool
    messages, as ``Session.messages()`` gives them); ``children`` are the
    conversations of its subagents (see the module docstring). Streaming
    gives the same answers as events. Built from messages alone, usage is
    zero and every answer ends as its calls say (``from_session`` knows more).

    Raises:
        UsageError: ``messages`` holds no assistant message.
    """

    def __init__(
        self,
        messages: Sequence[Message],
        *,
        name: str = "replay:recording",
        children: Sequence[Sequence[Message]] = (),
    ) -> None:
        main = _Conversation("", messages, ())
        kids = [_Conversation(f"subagent {i + 1}", c, ()) for i, c in enumerate(children)]
        self._init(main, kids, name)

    def _init(self, main: _Conversation, children: list[_Conversation], name: str) -> None:
        if not main.steps:
            raise UsageError("ReplayModel: the recording has no assistant message to replay")
        self._main = main
        self._children = [c for c in children if c.steps]
        self._name = name

    @classmethod
    async def from_session(
        cls, session: RecordedSession, *, name: str | None = None, children: bool = True
    ) -> ReplayModel:
        """The model that replays ``session``'s conversation (all of it, compactions
        included) and, with ``children``, those of its subagents.

        Raises:
            UsageError: the session has no assistant message.
            StoreError: the transcript cannot be read.
        """
        key = getattr(session, "key", None)
        main = await _read(session, "")
        kids: list[_Conversation] = []
        if children:
            for sub_id in await _subagents(session):
                child = session.child(sub_id)  # type: ignore[attr-defined]
                kids.append(await _read(child, f"subagent {sub_id}"))
        self = cls.__new__(cls)
        self._init(main, kids, name or f"replay:{key or 'session'}")
        return self

    @property
    def name(self) -> str:
        return self._name

    @property
    def steps(self) -> int:
        """How many answers the recording holds (its subagents' included)."""
        return sum(len(c.steps) for c in self._conversations())

    @property
    def served(self) -> int:
        """How many requests were answered so far."""
        return sum(c.served for c in self._conversations())

    def __repr__(self) -> str:
        return f"ReplayModel({self._name!r}, steps={self.steps}, served={self.served})"

    def _conversations(self) -> list[_Conversation]:
        return [self._main, *self._children]

    async def complete(self, request: ModelRequest) -> ModelResponse:
        """The next recorded answer.

        Raises:
            ProviderError: the request is past the recording or diverged from
                it, or the recorded reply was cut short mid-stream.
        """
        response, step = self._answer(request)
        await trio.lowlevel.checkpoint()
        if step.details.partial:
            raise self._cut_short()
        return response

    def _answer(self, request: ModelRequest) -> tuple[ModelResponse, _Step]:
        conversation = self._route(request)
        steps = conversation.steps
        number = conversation.served
        if number >= len(steps):
            raise self._diverged(
                conversation,
                number,
                f"the recording has {len(steps)} answers; there is no answer {number + 1}",
            )
        expected = steps[number]
        difference = _difference(
            expected.before, request.messages[-1] if request.messages else None
        )
        if difference is not None:
            raise self._diverged(conversation, number, difference)
        conversation.served += 1
        answer = expected.answer
        details = expected.details
        stop = details.stop_reason or ("tool_use" if answer.tool_calls else "end_turn")
        response = ModelResponse(
            message=answer, usage=details.usage, stop_reason=stop, model=self._name
        )
        return response, expected

    def _route(self, request: ModelRequest) -> _Conversation:
        """The conversation ``request`` continues: see the module docstring."""
        if not self._children:
            return self._main
        first = request.messages[0] if request.messages else None
        answered = sum(1 for m in request.messages if m.role == "assistant")
        began = [c for c in self._conversations() if c.began_with(first)]
        for conversation in began:
            if conversation.served == answered:
                return conversation
        return began[0] if began else self._main

    @contextlib.asynccontextmanager
    async def stream(self, request: ModelRequest) -> AsyncIterator[AsyncIterator[ModelEvent]]:
        response, step = self._answer(request)
        await trio.lowlevel.checkpoint()
        partial = step.details.partial
        events = self._partial(response) if partial else _events(response)
        try:
            yield events
        finally:
            await events.aclose()

    async def _partial(self, response: ModelResponse) -> AsyncGenerator[ModelEvent, None]:
        """What the recording streamed before it was cut: the text, then the failure."""
        if response.message.text:
            yield TextDelta(response.message.text)
        raise self._cut_short()

    def _cut_short(self) -> ProviderError:
        return ProviderError(
            "replay",
            f"{self._name}: the recorded reply was cut short here (a partial answer); "
            "replayed as it was: its text, then this failure",
            error_type="replay_partial",
        )

    def _diverged(self, conversation: _Conversation, step: int, what: str) -> ProviderError:
        where = f" {conversation.label}" if conversation.label else ""
        return ProviderError(
            "replay",
            f"{self._name}{where} step {step + 1} of {len(conversation.steps)}: {what}",
            error_type="replay_diverged",
        )


async def _read(session: Any, label: str) -> _Conversation:
    """A session's conversation, with its assistant entries' details when it has ``entries``."""
    messages = await session.messages()
    details: list[_Details] = []
    entries = getattr(session, "entries", None)
    if entries is not None:
        details = [_details(e) for e in await entries() if e.get("type") == "assistant"]
    return _Conversation(label, messages, details)


async def _subagents(session: Any) -> list[str]:
    """The ids of ``session``'s subagents (``subagents/<id>`` below its key), in name order."""
    store, key = getattr(session, "store", None), getattr(session, "key", None)
    if store is None or key is None or not hasattr(session, "child"):
        return []
    prefix = ("" if key.subpath is None else key.subpath + "/") + _SUBAGENTS
    found = []
    for subpath in await store.list_subkeys(key):
        rest = subpath.removeprefix(prefix)
        if rest != subpath and rest and "/" not in rest:
            found.append(rest)
    return found


def _details(entry: Mapping[str, Any]) -> _Details:
    """The usage, stop reason and partial mark of an assistant entry (unknown: left out)."""
    usage = entry.get("usage")
    counts: dict[str, int] = {}
    if isinstance(usage, Mapping):
        for field in ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens"):
            value = usage.get(field)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                counts[field] = value
    # The entry's input_tokens are the whole prompt; Usage's leave the cache out.
    cached = counts.get("cache_read_tokens", 0) + counts.get("cache_write_tokens", 0)
    counts["input_tokens"] = max(counts.get("input_tokens", 0) - cached, 0)
    cost = entry.get("cost_usd")
    if isinstance(cost, bool) or not isinstance(cost, int | float) or not cost >= 0:
        cost = None
    stop = entry.get("stop_reason")
    return _Details(
        usage=Usage(**counts, cost_usd=cost),
        stop_reason=stop if stop in STOP_REASONS else None,
        partial=entry.get("partial") is True,
    )


async def _events(response: ModelResponse) -> AsyncGenerator[ModelEvent, None]:
    for event in events_of(response):
        yield event


def _describe(message: Message | None) -> str:
    if message is None:
        return "nothing"
    if message.role == "tool":
        count = len(message.observations)
        return f"the results of {count} call{'s' if count != 1 else ''}"
    if message.role == "user":
        text = message.text
        shown = text if len(text) <= _SHOWN else text[: _SHOWN - 1] + "…"
        return f"a user message {shown!r}"
    return f"a {message.role} message"


def _difference(recorded: Message | None, given: Message | None) -> str | None:
    """What differs between what the model was shown last then and now, or ``None``."""
    if recorded is None or given is None or recorded.role != given.role:
        same = recorded is None and given is None
    elif recorded.role == "user":
        same = recorded.text == given.text
    elif recorded.role == "tool":
        then = [o.call_id for o in recorded.observations]
        now = [o.call_id for o in given.observations]
        if len(then) != len(now):
            return (
                f"the recording answered the results of {len(then)} calls, "
                f"the request brings {len(now)}"
            )
        missing = sorted(set(then) - set(now))
        if missing:
            return (
                "the request's results answer other calls than the recording's "
                f"(missing {', '.join(missing)})"
            )
        same = True
    else:
        same = True
    if same:
        return None
    return f"the recording answered {_describe(recorded)}, the request ends with {_describe(given)}"
