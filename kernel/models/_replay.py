"""A model that answers from a recorded conversation, to run a finished session again.

``ReplayModel(messages)`` answers request ``n`` with the ``n``-th recorded
assistant message, exactly as recorded (its text, its tool calls and their
ids); the tools run again, so a fix to a tool, the executor or the sandbox
can be checked against a run that already happened, with no model and no
network. ``await ReplayModel.from_session(session)`` reads the recording
from a session.

Each request is checked against the recording before it is answered: what
the model was last shown must be what it was shown then: the same user
prompt, or the results of the same calls. A run that went another way (a
different number of calls answered, a turn that ended or began elsewhere,
another prompt, a request past the last recorded answer) gets a
``ProviderError`` (a ``ModelAPIError``, ``error_type="replay_diverged"``,
never retried) saying in one line at which step and what differed. Results
are not compared: they are what a replay is for.

One conversation at a time: the steps are counted as requests come. Only
the conversation's own answers are recorded: a subagent's are in its own
transcript (``Session.child``), and a compaction's summary is not a message,
so replay with compaction off (``compact_after_tokens=None``, the default):
a compaction request would be refused as a divergence.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Protocol

import attrs
import trio

from ..errors import UsageError
from ..messages import Message
from ._assemble import events_of
from ._base import ModelEvent, ModelRequest, ModelResponse, ProviderError

_SHOWN = 60  # characters of a prompt quoted in an error


class RecordedSession(Protocol):
    """What ``from_session`` reads: a ``kernel.session.Session`` is one.

    (``kernel.session`` sits above the models, so it is named by its shape.)
    """

    async def messages(self) -> list[Message]: ...


@attrs.frozen
class _Step:
    """One recorded answer and what the model had been shown before it."""

    before: Message | None
    answer: Message


class ReplayModel:
    """A ``Model`` answering with the assistant messages of ``messages``, in order.

    ``messages`` is a recorded conversation (user, assistant and tool
    messages, as ``Session.messages()`` gives them). Streaming gives the same
    answers as events. Usage is zero: nothing was spent.

    Raises:
        UsageError: ``messages`` holds no assistant message.
    """

    def __init__(self, messages: Sequence[Message], *, name: str = "replay:recording") -> None:
        recorded = list(messages)
        self._steps = [
            _Step(recorded[i - 1] if i > 0 else None, m)
            for i, m in enumerate(recorded)
            if m.role == "assistant"
        ]
        if not self._steps:
            raise UsageError("ReplayModel: the recording has no assistant message to replay")
        self._name = name
        self._served = 0

    @classmethod
    async def from_session(
        cls, session: RecordedSession, *, name: str | None = None
    ) -> ReplayModel:
        """The model that replays ``session``'s conversation (all of it, compactions included).

        Raises:
            UsageError: the session has no assistant message.
            StoreError: the transcript cannot be read.
        """
        key = getattr(session, "key", None)
        return cls(await session.messages(), name=name or f"replay:{key or 'session'}")

    @property
    def name(self) -> str:
        return self._name

    @property
    def steps(self) -> int:
        """How many answers the recording holds."""
        return len(self._steps)

    @property
    def served(self) -> int:
        """How many requests were answered so far."""
        return self._served

    def __repr__(self) -> str:
        return f"ReplayModel({self._name!r}, steps={len(self._steps)}, served={self._served})"

    async def complete(self, request: ModelRequest) -> ModelResponse:
        """The next recorded answer.

        Raises:
            ProviderError: the request is past the recording or diverged from it.
        """
        await trio.lowlevel.checkpoint()
        step = self._served
        if step >= len(self._steps):
            raise self._diverged(
                step, f"the recording has {len(self._steps)} answers; there is no answer {step + 1}"
            )
        expected = self._steps[step]
        difference = _difference(
            expected.before, request.messages[-1] if request.messages else None
        )
        if difference is not None:
            raise self._diverged(step, difference)
        self._served += 1
        answer = expected.answer
        return ModelResponse(
            message=answer,
            stop_reason="tool_use" if answer.tool_calls else "end_turn",
            model=self._name,
        )

    @contextlib.asynccontextmanager
    async def stream(self, request: ModelRequest) -> AsyncIterator[AsyncIterator[ModelEvent]]:
        response = await self.complete(request)
        events = _events(response)
        try:
            yield events
        finally:
            await events.aclose()

    def _diverged(self, step: int, what: str) -> ProviderError:
        return ProviderError(
            "replay",
            f"{self._name} step {step + 1} of {len(self._steps)}: {what}",
            error_type="replay_diverged",
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
