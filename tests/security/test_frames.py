"""Class 8, WebSocket side: a frame the kernel could not record must not run anything.

A lone surrogate (``"\\ud800"``) or a non-finite number (``NaN``, ``Infinity``,
``1e999``) anywhere in a request would run the tool, then fail to go into the
transcript: an action without a trace. Each attempt sends one such frame; it
is refused where it is decoded (``bad_message`` naming the path), the marker
tool never ran, the session's transcript is unchanged, and the connection
still answers.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kit import Arena

from kernel import Tool, tool
from tests.server.wsclient import Client, connect, open_test_kernel, running_server


@pytest.fixture
def markers(tmp_path: Path) -> Path:
    path = tmp_path / "markers"
    path.mkdir()
    return path


@pytest.fixture
async def url(tmp_path: Path, markers: Path) -> AsyncIterator[str]:
    async with open_test_kernel(tmp_path / "home", tools=marker_tools(markers)) as k:
        async with running_server(k) as u:
            yield u


def ran(markers: Path) -> list[str]:
    """What the marker tool wrote: one entry per call that ran."""
    return [p.read_text() for p in sorted(markers.iterdir())]


def marker_tools(markers: Path) -> list[Tool]:
    @tool
    def mark(note: str = "", data: dict[str, Any] | None = None, number: float = 0.0) -> str:
        """Leave a marker file: proof that the call ran.

        Args:
            note: any text.
            data: any object.
            number: any number.
        """
        (markers / f"ran-{len(list(markers.iterdir()))}").write_text(repr((note, data, number)))
        return "marked"

    @tool
    def half_pair() -> str:
        """Return text holding a lone surrogate, as a buggy tool or plugin might."""
        return "before \ud800 after"

    return [mark, half_pair]


def call_frame(arguments: str) -> str:
    """A call_tools frame whose one call has these arguments (raw JSON text)."""
    return (
        '{"v":1,"type":"call_tools","id":"c1","session":"victim",'
        f'"calls":[{{"id":"k","name":"mark","arguments":{arguments}}}]}}'
    )


BAD_FRAMES = {
    "surrogate in an argument": (
        call_frame('{"note":"\\ud800"}'),
        "$.calls[0].arguments.note: lone surrogate \\ud800 is not valid Unicode",
    ),
    "low surrogate alone": (
        call_frame('{"note":"ok \\udfff"}'),
        "$.calls[0].arguments.note: lone surrogate \\udfff",
    ),
    "pair reversed": (
        call_frame('{"note":"\\ude00\\ud83d"}'),
        "$.calls[0].arguments.note: lone surrogate",
    ),
    "surrogate deep inside": (
        call_frame('{"data":{"list":[1,{"x":["fine","\\udbff"]}]}}'),
        "$.calls[0].arguments.data.list[1].x[1]: lone surrogate \\udbff",
    ),
    "surrogate in a key": (
        call_frame('{"data":{"\\ud800":1}}'),
        '$.calls[0].arguments.data["\\ud800"]: lone surrogate \\ud800',
    ),
    "surrogate in the run prompt": (
        '{"v":1,"type":"run","id":"c1","session":"victim",'
        '"prompt":"/call mark {\\"note\\": \\"x\\"}\\n\\ud800"}',
        "$.prompt: lone surrogate \\ud800",
    ),
    "surrogate in the session name": (
        '{"v":1,"type":"call_tools","id":"c1","session":"victim\\ud800",'
        '"calls":[{"id":"k","name":"mark","arguments":{}}]}',
        "$.session: lone surrogate \\ud800",
    ),
    "surrogate in the call id": (
        '{"v":1,"type":"call_tools","id":"c1","session":"victim",'
        '"calls":[{"id":"k\\ud800","name":"mark","arguments":{}}]}',
        "$.calls[0].id: lone surrogate \\ud800",
    ),
    "NaN": (call_frame('{"number":NaN}'), "$.calls[0].arguments.number: NaN is not"),
    "Infinity": (call_frame('{"number":Infinity}'), "$.calls[0].arguments.number: Infinity"),
    "-Infinity": (call_frame('{"number":-Infinity}'), "$.calls[0].arguments.number: -Infinity"),
    "1e999 decodes to inf": (
        call_frame('{"number":1e999}'),
        "$.calls[0].arguments.number: Infinity",
    ),
    "400 digits decode to inf": (
        call_frame('{"number":' + "9" * 400 + ".5}"),
        "$.calls[0].arguments.number: Infinity",
    ),
    "NaN in a field no request has": (
        '{"v":1,"type":"call_tools","id":"c1","session":"victim","temperature":NaN,'
        '"calls":[{"id":"k","name":"mark","arguments":{}}]}',
        "$.temperature: NaN is not",
    ),
}


async def history(client: Client, session: str = "victim") -> list[dict[str, Any]]:
    _, reply = await client.request({"type": "history", "id": "h", "session": session})
    assert reply["status"] == "ok", reply
    entries: list[dict[str, Any]] = reply["result"]["entries"]
    return entries


@pytest.mark.parametrize(("frame", "expected"), BAD_FRAMES.values(), ids=BAD_FRAMES.keys())
async def test_an_unrecordable_frame_is_refused_before_anything_runs(
    url: str, markers: Path, arena: Arena, frame: str, expected: str
) -> None:
    async with connect(url) as client:
        await client.send(frame)
        error = await client.recv()
        assert error["type"] == "error", error
        assert error["error"]["code"] == "bad_message"
        assert error["error"]["message"].startswith(expected), error["error"]["message"]
        assert "\n" not in error["error"]["message"]
        if "call id" not in expected and "$.id" not in expected:
            assert error["re"] == "c1"
        # the connection survives; nothing ran and nothing was recorded
        assert await history(client) == []
        _, tools = await client.request({"type": "tools", "id": "t"})
        assert tools["status"] == "ok"
    assert ran(markers) == []
    arena.assert_nothing_seen([json.dumps(error)])


async def test_arguments_as_a_json_string_hiding_a_surrogate_do_not_run(
    url: str, markers: Path, arena: Arena
) -> None:
    """Arguments may be a JSON string: the escape is then decoded later, by the kernel."""
    inner = json.dumps({"note": "\\ud800", "number": "NaN"}).replace("\\\\", "\\")
    frame = call_frame(json.dumps(inner))
    async with connect(url) as client:
        await client.send(frame)
        while True:
            answer = await client.recv()
            if answer["type"] != "event":
                break
        if answer["type"] == "reply" and answer["status"] == "ok":
            [observation] = answer["result"]["observations"]
            assert observation["is_error"], observation
        # whatever was recorded is valid UTF-8 JSON (the store held it)
        for entry in await history(client):
            json.dumps(entry, allow_nan=False).encode("utf-8")
    assert ran(markers) == []
    arena.assert_nothing_seen()


async def test_kit_a_valid_surrogate_pair_is_a_character_and_runs(url: str, markers: Path) -> None:
    """Not an attempt: the escape pair of an emoji is one real character, accepted."""
    async with connect(url) as client:
        await client.send(call_frame('{"note":"\\ud83d\\ude00", "number": 1e300}'))
        _, reply = await client.until_reply("c1")
        assert reply["status"] == "ok", reply
        assert reply["result"]["observations"][0]["content"] == "marked"
        entries = await history(client)
    assert ran(markers) == ["('😀', None, 1e+300)"]
    assert len(entries) == 2
    assert entries[0]["message"]["parts"][0]["arguments"]["note"] == "😀"


async def test_a_tool_output_with_a_lone_surrogate_does_not_break_the_connection(
    url: str, arena: Arena
) -> None:
    """Outgoing: every frame is strict JSON in valid Unicode, whatever a tool returned."""
    texts: list[str] = []
    async with connect(url) as client:
        await client.send(
            '{"v":1,"type":"call_tools","id":"c1","session":"victim",'
            '"calls":[{"id":"k","name":"half_pair","arguments":{}}]}'
        )
        while True:
            text = await client.ws.get_message()
            assert isinstance(text, str)
            texts.append(text)
            if '"type":"reply"' in text:
                break
        for text in texts:
            frame = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} sent"))
            json.dumps(frame, ensure_ascii=False).encode("utf-8")  # no lone surrogate
        reply = json.loads(texts[-1])
        assert reply["status"] == "ok", reply
        assert reply["result"]["observations"][0]["content"] == "before \ufffd after"
        # and it was recorded
        entries = await history(client)
        assert entries[-1]["message"]["parts"][0]["content"] == "before \ufffd after"
        _, tools = await client.request({"type": "tools", "id": "t"})
        assert tools["status"] == "ok"
    arena.assert_nothing_seen(texts)
