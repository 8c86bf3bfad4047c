"""Class 8: a tool call must never run without a record.

The attacker (a hostile model, or a client of the embedding API) sends what a
transcript cannot hold: a lone surrogate, NaN or an infinity in a call's
arguments, or makes the record fail some other way. Each attempt is refused
when the call is refused and its tool (a marker-writing one) never ran, the
sibling calls still ran, and the transcript holds every call with its result
and loads back into a history a provider accepts. These are kernel-side: the
arena's canaries do not apply, so each attempt checks that nothing ran that
was not recorded, and that the kernel still answers.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from kit import Arena

from kernel import ToolCall, open_kernel, tool
from kernel.agent import Agent, history_from_entries
from kernel.errors import StoreError
from kernel.messages import Message, Observation, Text
from kernel.models import (
    AnthropicModel,
    GeminiModel,
    ModelRequest,
    OpenAIModel,
    RetryPolicy,
    ScriptedModel,
)
from kernel.session import Session
from kernel.store import MemoryStore, SessionKey
from kernel.tools import Tool
from tests.server.wsclient import open_test_kernel

NO_RETRY = RetryPolicy(max_attempts=1)
LONE = "lone surrogate"
NOT_A_NUMBER = "is not a JSON number"


class Marks:
    """A tool that leaves a file per run: the proof that a call ran."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "marks"
        self.dir.mkdir()

        @tool(name="mark")
        def mark(path: str, n: float = 0.0, extra: Any = None) -> str:
            """Leave a mark.

            Args:
                path: the mark's name.
                n: a number.
                extra: anything.
            """
            # A name of its own: two calls run at once, in two threads (counting
            # the files here raced, and one mark overwrote the other).
            (self.dir / f"ran-{uuid.uuid4().hex}").write_text(path)
            return f"marked {path}"

        @tool(name="echo")
        def echo(text: str) -> Any:
            """Give back what a worker might: text, maybe with half a UTF-16 pair."""
            if text == "dict":
                return {"value": "a\udc80b"}
            if text == "half":
                return "half \ud800 pair"
            if text == "raise":
                raise RuntimeError("bad \ud800 news")
            return text

        self.tools: list[Tool] = [mark, echo]

    def ran(self) -> list[str]:
        return sorted(p.read_text() for p in self.dir.iterdir())


def strict_json(data: bytes | str) -> Any:
    """JSON as a provider parses it: valid UTF-8, no NaN or infinities."""

    def refuse(token: str) -> Any:
        raise ValueError(f"{token} in a request body")

    text = data.decode("utf-8") if isinstance(data, bytes) else data
    return json.loads(text, parse_constant=refuse)


def assert_every_call_answered(history: Sequence[Message]) -> None:
    """Each assistant message with calls is followed by a tool message answering each."""
    for position, message in enumerate(history):
        if message.role == "assistant" and message.tool_calls:
            following = history[position + 1]
            assert following.role == "tool"
            assert [o.call_id for o in following.observations] == [c.id for c in message.tool_calls]
    for request_builder in _provider_bodies(history):
        strict_json(json.dumps(request_builder, ensure_ascii=False, allow_nan=False).encode())


def _provider_bodies(history: Sequence[Message]) -> list[Any]:
    client = httpx.AsyncClient()
    request = ModelRequest(messages=tuple(history))
    return [
        m.build(request, stream=True)[2]
        for m in (
            OpenAIModel("gpt-4.1-mini", client=client, api_key="k"),
            AnthropicModel("claude-sonnet-4-5", client=client, api_key="k"),
            GeminiModel("gemini-2.5-flash", client=client, api_key="k"),
        )
    ]


async def transcript(store: Any, key: SessionKey) -> list[Message]:
    entries = await store.load(key)
    assert entries is not None
    # What is on disk is strict JSON and valid UTF-8 all the way down.
    for entry in entries:
        strict_json(json.dumps(entry, ensure_ascii=False, allow_nan=False).encode())
    history = history_from_entries(entries)
    assert_every_call_answered(history)
    return history


def refused_with(observation: Observation, *fragments: str) -> None:
    assert observation.error is not None, observation
    assert observation.error.kind == "bad_arguments", observation.error
    assert observation.content.startswith("Error (bad_arguments): $"), observation.content
    for fragment in fragments:
        assert fragment in observation.content, observation.content
    assert "\n" not in observation.content


# --- a scripted model ------------------------------------------------------------------

BAD_ARGUMENTS: list[tuple[str, dict[str, Any] | str, str]] = [
    ("escaped-high", '{"path": "\\ud800"}', "$.path: lone surrogate \\ud800 is not valid Unicode"),
    ("escaped-low", '{"path": "\\udfff"}', "$.path: lone surrogate \\udfff"),
    ("literal-high", '{"path": "\ud800"}', "$.path: lone surrogate \\ud800"),
    ("reversed-pair", '{"path": "\\ude00\\ud83d"}', "$.path: lone surrogate \\ude00"),
    ("in-a-key", '{"path": "x", "extra": {"\\udbff": 1}}', LONE),
    ("deep", '{"path": "x", "extra": [1, [{"k": "ok\\udc00"}]]}', "$.extra[1][0].k: " + LONE),
    ("nan", '{"path": "x", "n": NaN}', "$.n: NaN " + NOT_A_NUMBER),
    ("infinity", '{"path": "x", "n": Infinity}', "$.n: Infinity " + NOT_A_NUMBER),
    ("minus-infinity", '{"path": "x", "n": -Infinity}', "$.n: -Infinity " + NOT_A_NUMBER),
    ("overflow", '{"path": "x", "n": 1e999}', "$.n: Infinity " + NOT_A_NUMBER),
    ("nan-in-list", '{"path": "x", "extra": [NaN]}', "$.extra[0]: NaN"),
    ("dict-surrogate", {"path": "\ud800"}, "$.path: lone surrogate \\ud800"),
    ("dict-nan", {"path": "x", "n": float("nan")}, "$.n: NaN"),
    ("dict-inf", {"path": "x", "extra": {"v": float("-inf")}}, "$.extra.v: -Infinity"),
]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [pytest.param(a, m, id=name) for name, a, m in BAD_ARGUMENTS],
)
async def test_model_reply_with_unrecordable_arguments(
    tmp_path: Path, arguments: dict[str, Any] | str, message: str
) -> None:
    marks = Marks(tmp_path)
    model = ScriptedModel(
        [
            ScriptedModel.reply(
                "calling \ud800",
                calls=[("mark", arguments), ("mark", {"path": "sibling"})],
            ),
            "done",
        ]
    )
    store = MemoryStore()
    session = Session(store, SessionKey("p", "s"))
    result = await Agent(model, marks.tools).run_turn(session, "go")
    assert result.reason == "final"
    assert marks.ran() == ["sibling"]
    history = await transcript(store, session.key)
    observations = history[2].observations
    refused_with(observations[0], message)
    assert observations[1].content == "marked sibling"
    # The model was told, in a request a provider accepts.
    assert_every_call_answered(model.requests[1].messages)


# --- the three adapters, fed the provider's own wire format ---------------------------


def sse(data: Any, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def sse_response(body: str) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)


class Provider:
    def __init__(self, *answers: httpx.Response) -> None:
        self.answers = list(answers)
        self.bodies: list[bytes] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(request.content)
        return self.answers.pop(0)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handler))


def openai_stream(arguments: str) -> httpx.Response:
    calls = [
        {"index": 0, "id": "c0", "function": {"name": "mark", "arguments": arguments}},
        {"index": 1, "id": "c1", "function": {"name": "mark", "arguments": '{"path": "sib'}},
    ]
    return sse_response(
        sse({"model": "gpt", "choices": [{"index": 0, "delta": {"tool_calls": calls}}]})
        + sse(
            {
                "choices": [
                    {
                        "index": 0,
                        "delta": {
                            "tool_calls": [{"index": 1, "function": {"arguments": 'ling"}'}}]
                        },
                        "finish_reason": "tool_calls",
                    }
                ]
            }
        )
        + sse("[DONE]")
    )


def openai_whole(arguments: str) -> httpx.Response:
    body = {
        "model": "gpt",
        "choices": [
            {
                "finish_reason": "tool_calls",
                "message": {
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c0",
                            "type": "function",
                            "function": {"name": "mark", "arguments": arguments},
                        },
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "mark", "arguments": '{"path": "sibling"}'},
                        },
                    ],
                },
            }
        ],
    }
    return httpx.Response(
        200, headers={"content-type": "application/json"}, content=json.dumps(body)
    )


def openai_final() -> httpx.Response:
    return sse_response(
        sse({"choices": [{"index": 0, "delta": {"content": "done"}, "finish_reason": "stop"}]})
        + sse("[DONE]")
    )


def anthropic_stream(partial_json: str) -> httpx.Response:
    events = [
        (
            "message_start",
            {"type": "message_start", "message": {"model": "claude", "usage": {"input_tokens": 3}}},
        ),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "tool_use", "id": "t0", "name": "mark", "input": {}},
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "input_json_delta", "partial_json": partial_json},
            },
        ),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 1,
                "content_block": {"type": "tool_use", "id": "t1", "name": "mark", "input": {}},
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 1,
                "delta": {"type": "input_json_delta", "partial_json": '{"path": "sibling"}'},
            },
        ),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "tool_use"},
                "usage": {"output_tokens": 5},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    return sse_response("".join(sse(data, event) for event, data in events))


def anthropic_whole(raw_input: str) -> httpx.Response:
    # Spliced in as raw JSON text: NaN and lone escapes exactly as sent.
    body = (
        '{"model": "claude", "stop_reason": "tool_use", "usage": {"input_tokens": 1}, "content": ['
        f'{{"type": "tool_use", "id": "t0", "name": "mark", "input": {raw_input}}},'
        '{"type": "tool_use", "id": "t1", "name": "mark", "input": {"path": "sibling"}}]}'
    )
    return httpx.Response(200, headers={"content-type": "application/json"}, content=body.encode())


def anthropic_final() -> httpx.Response:
    return httpx.Response(
        200,
        json={
            "model": "claude",
            "stop_reason": "end_turn",
            "content": [{"type": "text", "text": "done"}],
        },
    )


def gemini_stream(raw_args: str) -> httpx.Response:
    chunk = (
        '{"modelVersion": "gemini", "candidates": [{"finishReason": "STOP", "content": {"role": "model", "parts": ['
        f'{{"functionCall": {{"name": "mark", "args": {raw_args}}}}},'
        '{"functionCall": {"name": "mark", "args": {"path": "sibling"}}}]}}]}'
    )
    return sse_response(sse(chunk))


def gemini_final() -> httpx.Response:
    return sse_response(
        sse({"candidates": [{"finishReason": "STOP", "content": {"parts": [{"text": "done"}]}}]})
    )


AdapterCase = tuple[
    Callable[[httpx.AsyncClient], Any],
    Callable[[str], httpx.Response],
    Callable[[], httpx.Response],
]

ADAPTERS: dict[str, AdapterCase] = {
    "openai-sse": (
        lambda c: OpenAIModel("gpt", client=c, api_key="k", retry=NO_RETRY),
        openai_stream,
        openai_final,
    ),
    "openai-json": (
        lambda c: OpenAIModel("gpt", client=c, api_key="k", retry=NO_RETRY),
        openai_whole,
        openai_final,
    ),
    "anthropic-sse": (
        lambda c: AnthropicModel("claude", client=c, api_key="k", retry=NO_RETRY),
        anthropic_stream,
        anthropic_final,
    ),
    "anthropic-json": (
        lambda c: AnthropicModel("claude", client=c, api_key="k", retry=NO_RETRY),
        anthropic_whole,
        anthropic_final,
    ),
    "gemini-sse": (
        lambda c: GeminiModel("gemini", client=c, api_key="k", retry=NO_RETRY),
        gemini_stream,
        gemini_final,
    ),
}

# (what the provider sent as the call's arguments, in its own wire encoding; what we say)
WIRE_ARGUMENTS: dict[str, tuple[str, str]] = {
    "escaped-surrogate": ('{"path": "\\ud800"}', "$.path: lone surrogate \\ud800"),
    "low-surrogate": ('{"path": "a\\udfffb"}', "$.path: lone surrogate \\udfff"),
    "nan": ('{"path": "x", "n": NaN}', "$.n: NaN " + NOT_A_NUMBER),
    "infinity": ('{"path": "x", "n": Infinity}', "$.n: Infinity"),
    "overflow": ('{"path": "x", "n": 1e999}', "$.n: Infinity"),
}


@pytest.mark.parametrize("wire", list(WIRE_ARGUMENTS))
@pytest.mark.parametrize("adapter", list(ADAPTERS))
async def test_provider_reply_with_unrecordable_arguments(
    tmp_path: Path, adapter: str, wire: str
) -> None:
    make, calls_answer, final_answer = ADAPTERS[adapter]
    arguments, message = WIRE_ARGUMENTS[wire]
    # OpenAI and streamed Anthropic send the arguments as a JSON string (escaped once
    # more on the wire); Gemini and whole Anthropic responses as an object, spliced raw.
    provider = Provider(calls_answer(arguments), final_answer())
    marks = Marks(tmp_path)
    store = MemoryStore()
    session = Session(store, SessionKey("p", "s"))
    async with provider.client() as client:
        result = await Agent(make(client), marks.tools).run_turn(session, "go")
    assert result.reason == "final", result.error
    assert marks.ran() == ["sibling"]
    history = await transcript(store, session.key)
    refused_with(history[2].observations[0], message)
    assert history[2].observations[1].content == "marked sibling"
    # The follow-up request the provider got is strict JSON, each call answered.
    strict_json(provider.bodies[1])


@pytest.mark.parametrize("adapter", ["openai-sse", "anthropic-sse"])
async def test_provider_sends_a_literal_surrogate_in_streamed_arguments(
    tmp_path: Path, adapter: str
) -> None:
    """The chunk's JSON escapes the surrogate once: the fragment holds the code point."""
    make, calls_answer, final_answer = ADAPTERS[adapter]
    provider = Provider(calls_answer('{"path": "\ud800"}'), final_answer())
    marks = Marks(tmp_path)
    store = MemoryStore()
    session = Session(store, SessionKey("p", "s"))
    async with provider.client() as client:
        result = await Agent(make(client), marks.tools).run_turn(session, "go")
    assert result.reason == "final", result.error
    assert marks.ran() == ["sibling"]
    history = await transcript(store, session.key)
    refused_with(history[2].observations[0], "$.path: lone surrogate \\ud800")
    strict_json(provider.bodies[1])


@pytest.mark.parametrize(
    "usage",
    [
        {"prompt_tokens": "NaN", "completion_tokens": 1},
        {"prompt_tokens": 1, "completion_tokens": "Infinity"},
        {"prompt_tokens": "1e999", "completion_tokens": 1},
    ],
)
async def test_provider_usage_that_is_not_a_count(tmp_path: Path, usage: dict[str, Any]) -> None:
    raw = json.dumps(usage).replace('"NaN"', "NaN").replace('"Infinity"', "Infinity")
    raw = raw.replace('"1e999"', "1e999")
    body = sse(
        '{"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c0", '
        '"function": {"name": "mark", "arguments": "{\\"path\\": \\"x\\"}"}}]}, '
        f'"finish_reason": "tool_calls"}}], "usage": {raw}}}'
    ) + sse("[DONE]")
    provider = Provider(sse_response(body))
    marks = Marks(tmp_path)
    store = MemoryStore()
    session = Session(store, SessionKey("p", "s"))
    async with provider.client() as client:
        result = await Agent(make_openai(client), marks.tools).run_turn(session, "go")
    assert result.reason == "model_error"
    assert result.error is not None and "is not a token count" in result.error
    assert marks.ran() == []
    await transcript(store, session.key)


def make_openai(client: httpx.AsyncClient) -> OpenAIModel:
    return OpenAIModel("gpt", client=client, api_key="k", retry=NO_RETRY)


# --- the embedding API ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        pytest.param({"path": "\ud800"}, "$.path: lone surrogate \\ud800", id="surrogate"),
        pytest.param({"path": "x", "extra": ["\udfff"]}, "$.extra[0]: lone", id="nested"),
        pytest.param({"path": "x", "n": float("inf")}, "$.n: Infinity", id="infinity"),
        pytest.param({"path": "x", "extra": {"\ud800": 1}}, "(in the key)", id="key"),
        pytest.param('{"path": "\\ud800"}', "$.path: lone surrogate", id="json-text"),
    ],
)
async def test_call_tools_with_unrecordable_arguments(
    tmp_path: Path, arguments: dict[str, Any] | str, message: str
) -> None:
    marks = Marks(tmp_path)
    async with open_kernel(home=tmp_path / "home", tools=marks.tools, plugins=[]) as k:
        session = k.session("s")
        observations = await k.call_tools(
            session, [ToolCall("a", "mark", arguments), ToolCall("b", "mark", {"path": "sib"})]
        )
        refused_with(observations[0], message)
        assert marks.ran() == ["sib"]
        history = await transcript(k.store, session.key)
        assert list(history[1].observations) == observations
        # Still answering.
        again = await k.call_tools(session, [ToolCall("c", "mark", {"path": "after"})])
        assert again[0].content == "marked after"


async def test_kit_a_surrogate_pair_is_accepted(tmp_path: Path) -> None:
    marks = Marks(tmp_path)
    model = ScriptedModel(
        [
            ScriptedModel.reply(
                calls=[("mark", '{"path": "\\ud83d\\ude00"}'), ("mark", {"path": "é😀"})]
            ),
            "done",
        ]
    )
    store = MemoryStore()
    session = Session(store, SessionKey("p", "s"))
    assert (await Agent(model, marks.tools).run_turn(session, "go")).reason == "final"
    assert marks.ran() == ["é😀", "😀"]
    history = await transcript(store, session.key)
    assert [o.is_error for o in history[2].observations] == [False, False]


@pytest.mark.parametrize(
    "arguments",
    [
        '{"number": 1' + "0" * 400 + "}",  # an exact integer JSON allows, too big for a float
        '{"number": 1e999}',  # hidden inside arguments given as a JSON string
        {"number": 2 * 10**308},
        '{"number": 1.7976931348623159e308}',  # rounds up to infinity
    ],
    ids=["int-400-digits", "string-1e999", "int-past-float", "rounds-to-inf"],
)
async def test_a_number_that_overflows_a_float_parameter_does_not_run(
    tmp_path: Path, arena: Arena, arguments: object
) -> None:
    from test_frames import marker_tools

    markers = tmp_path / "markers"
    markers.mkdir()
    async with open_test_kernel(tmp_path / "home", tools=marker_tools(markers)) as k:
        session = k.session("victim")
        [obs] = await k.call_tools(session, [ToolCall("k", "mark", arguments)])  # type: ignore[arg-type]
    assert obs.is_error and "bad_arguments" in obs.content, obs.content
    assert list(markers.iterdir()) == []
    arena.assert_nothing_seen([obs.content])


# --- a record that cannot be written ----------------------------------------------------


class RefusingStore(MemoryStore):
    """Fails to append an assistant entry that carries tool calls."""

    async def append(self, key: SessionKey, entries: Sequence[Mapping[str, Any]]) -> None:
        for entry in entries:
            parts = entry.get("message", {}).get("parts", [])
            if entry.get("type") == "assistant" and any(p["type"] == "tool_call" for p in parts):
                raise StoreError("disk full")
        await super().append(key, entries)


async def test_store_refuses_the_calls_so_nothing_runs(tmp_path: Path) -> None:
    marks = Marks(tmp_path)
    model = ScriptedModel([ScriptedModel.reply(calls=[("mark", {"path": "a"})]), "done"])
    store = RefusingStore()
    session = Session(store, SessionKey("p", "s"))
    with pytest.raises(StoreError, match="none ran: disk full"):
        await Agent(model, marks.tools).run_turn(session, "go")
    assert marks.ran() == []
    await transcript(store, session.key)


async def test_store_refuses_call_tools_so_nothing_runs(tmp_path: Path) -> None:
    marks = Marks(tmp_path)
    async with open_kernel(
        home=tmp_path / "home", tools=marks.tools, plugins=[], store=RefusingStore()
    ) as k:
        session = k.session("s")
        with pytest.raises(StoreError, match="so none ran"):
            await k.call_tools(session, [ToolCall("a", "mark", {"path": "a"})])
        assert marks.ran() == []


async def test_arguments_that_are_not_json_so_nothing_runs(tmp_path: Path) -> None:
    marks = Marks(tmp_path)
    async with open_kernel(home=tmp_path / "home", tools=marks.tools, plugins=[]) as k:
        session = k.session("s")
        with pytest.raises(StoreError, match="not writable as JSON"):
            await k.call_tools(
                session,
                [
                    ToolCall("a", "mark", {"path": "a", "extra": {1, 2}}),
                    ToolCall("b", "mark", {"path": "b"}),
                ],
            )
        assert marks.ran() == []
        assert await k.store.load(session.key) is None


# --- a kernel that died between the record of the calls and their results ---------------


async def test_kernel_killed_between_calls_and_results(tmp_path: Path) -> None:
    marks = Marks(tmp_path)
    store = MemoryStore()
    session = Session(store, SessionKey("p", "s"))
    await session.append(Message("user", [Text("go")]))
    calls = Message(
        "assistant", [ToolCall("a", "mark", {"path": "a"}), ToolCall("b", "echo", {"text": "x"})]
    )
    await session.record_calls(calls)  # ... and the kernel is SIGKILLed here
    history = await transcript(store, session.key)
    stopped = history[2].observations
    assert [o.error.kind if o.error else None for o in stopped] == ["crashed", "crashed"]
    assert "the kernel stopped before this call finished" in stopped[0].content
    # The next turn sends the provider a history it accepts, and goes on.
    model = ScriptedModel(["recovered"])
    assert (await Agent(model, marks.tools).run_turn(session, "again")).reason == "final"
    assert_every_call_answered(model.requests[0].messages)
    assert marks.ran() == []


async def test_results_recorded_after_other_entries_still_answer_their_calls(
    tmp_path: Path,
) -> None:
    """A late tool entry is read with its calls, not left where a provider refuses it."""
    store = MemoryStore()
    session = Session(store, SessionKey("p", "s"))
    calls = Message("assistant", [ToolCall("a", "mark", {"path": "a"})])
    answers = await session.record_calls(calls)
    await session.set_title("meanwhile")
    await session.append(Message("user", [Text("another prompt")]))
    await session.record_results(calls, [Observation("a", "mark", 0, "marked a")], answers=answers)
    history = await transcript(store, session.key)
    assert [m.role for m in history] == ["assistant", "tool", "user"]
    assert history[1].observations[0].content == "marked a"


# --- results a tool gives back ---------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("half", "half \ufffd pair", id="string"),
        pytest.param("dict", '{"value": "a\ufffdb"}', id="dict"),
        pytest.param("raise", "Error (exception): bad \ufffd news", id="exception"),
    ],
)
async def test_tool_result_with_a_lone_surrogate_is_recorded(
    tmp_path: Path, text: str, expected: str
) -> None:
    marks = Marks(tmp_path)
    async with open_kernel(home=tmp_path / "home", tools=marks.tools, plugins=[]) as k:
        session = k.session("s")
        with trio.fail_after(10):
            observations = await k.call_tools(session, [ToolCall("a", "echo", {"text": text})])
        assert observations[0].content == expected
        history = await transcript(k.store, session.key)
        assert history[1].observations[0].content == expected


async def test_model_text_with_a_lone_surrogate_is_recorded(tmp_path: Path) -> None:
    store = MemoryStore()
    session = Session(store, SessionKey("p", "s"))
    model = ScriptedModel(["answer \udc00 here"])
    result = await Agent(model, []).run_turn(session, "prompt \ud800")
    assert (result.reason, result.text) == ("final", "answer \ufffd here")
    history = await transcript(store, session.key)
    assert [m.text for m in history] == ["prompt \ufffd", "answer \ufffd here"]
