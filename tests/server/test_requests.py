"""Requests and their frames: events, exactly one reply, cancel, and every error code."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from kernel import Kernel, StoreError
from kernel.wire import ERROR_CODES, ServerLimits

from .wsclient import Client, connect, running_server

SLEEP_30 = '/call sleep {"seconds": 30}'


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["kind"] for e in events]


async def no_frame_for(client: Client, seconds: float) -> None:
    with trio.move_on_after(seconds):
        frame = await client.recv()
        raise AssertionError(f"unexpected frame {frame}")


async def test_call_tools_streams_events_then_one_reply_in_declared_order(url: str) -> None:
    async with connect(url) as client:
        events, reply = await client.request(
            {
                "type": "call_tools",
                "id": "c1",
                "session": "s",
                "calls": [
                    {"id": "slow", "name": "sleep", "arguments": {"seconds": 0.3}},
                    {"id": "boom", "name": "divide", "arguments": {"a": 1, "b": 0}},
                    {"id": "bad", "name": "add", "arguments": '{"a": "two"}'},
                ],
            }
        )
    finished = [e["observation"]["call_id"] for e in events if e["kind"] == "call_finished"]
    assert finished[-1] == "slow", "events come in completion order"
    assert sorted(finished) == ["bad", "boom", "slow"]
    assert kinds(events).count("call_started") == 2, "a call refused before running never starts"
    assert reply["status"] == "ok"
    observations = reply["result"]["observations"]
    assert [o["call_id"] for o in observations] == ["slow", "boom", "bad"]
    assert [o["error"] and o["error"]["kind"] for o in observations] == [
        None,
        "exception",
        "bad_arguments",
    ]
    assert observations[0]["content"] == "slept 0.3 s"


async def test_run_streams_events_then_exactly_one_reply_and_nothing_after(url: str) -> None:
    async with connect(url) as client:
        await client.send({"v": 1, "type": "hello", "id": "h"})
        hello = await client.recv()
        prompt = '/call add {"a": 2, "b": 40}\n/call echo {"text": "hi"}'
        events, reply = await client.request(
            {"type": "run", "id": "r1", "session": "s", "prompt": prompt}
        )
        frames = [*events, reply]
        assert [f["seq"] for f in frames] == list(
            range(hello["seq"] + 1, hello["seq"] + 1 + len(frames))
        )
        assert all(f["re"] == "r1" for f in frames)
        assert kinds(events)[0] == "model_delta"
        assert kinds(events)[-1] == "turn_finished"
        assert kinds(events).count("call_finished") == 2
        assert events[-1]["reason"] == "final"
        text = "".join(e["text"] for e in events if e["kind"] == "model_delta" and e["step"] == 2)
        assert text == events[-1]["text"] == reply["result"]["text"]
        assert reply["status"] == "ok"
        assert reply["result"]["reason"] == "final"
        assert reply["result"]["steps"] == 2
        # The reply was the last word on r1: the next frame is about the next request.
        await no_frame_for(client, 0.2)
        _, tools = await client.request({"type": "tools", "id": "t"})
        assert tools["seq"] == reply["seq"] + 1


async def test_cancel_of_a_running_run_replies_cancelled_and_keeps_the_transcript_valid(
    url: str,
) -> None:
    async with connect(url) as client:
        await client.send(
            {
                "v": 1,
                "type": "run",
                "id": "r",
                "session": "c",
                "prompt": f'{SLEEP_30}\n/call add {{"a": 1, "b": 2}}',
            }
        )
        # wait until add is done and sleep is running
        while (await client.recv()).get("kind") != "call_finished":
            pass
        _, cancel = await client.request({"type": "cancel", "id": "x", "target": "r"})
        assert cancel == {
            "v": 1,
            "type": "reply",
            "re": "x",
            "status": "ok",
            "seq": cancel["seq"],
            "result": {"found": True},
        }
        events, reply = await client.until_reply("r")
        assert reply["status"] == "cancelled"
        assert "result" not in reply
        assert kinds(events)[-1] == "turn_finished"
        assert events[-1]["reason"] == "cancelled"
        sleep = [e for e in events if e["kind"] == "call_finished"]
        assert sleep[-1]["observation"]["error"]["kind"] == "cancelled"

        _, again = await client.request({"type": "cancel", "id": "y", "target": "r"})
        assert again["result"] == {"found": False}
        _, history = await client.request({"type": "history", "id": "h", "session": "c"})
    entries = history["result"]["entries"]
    calls = [p["id"] for e in entries for p in e["message"]["parts"] if p["type"] == "tool_call"]
    results = [
        p["call_id"] for e in entries for p in e["message"]["parts"] if p["type"] == "observation"
    ]
    assert len(calls) == 2
    assert sorted(calls) == sorted(results), "every tool call has its result"


async def test_cancel_of_a_call_tools_batch(url: str) -> None:
    async with connect(url) as client:
        await client.send(
            {
                "v": 1,
                "type": "call_tools",
                "id": "c",
                "session": "s",
                "calls": [{"id": "a", "name": "sleep", "arguments": {"seconds": 30}}],
            }
        )
        assert (await client.recv())["kind"] == "call_started"
        _, cancel = await client.request({"type": "cancel", "id": "x", "target": "c"})
        assert cancel["result"] == {"found": True}
        events, reply = await client.until_reply("c")
        assert reply["status"] == "cancelled"
        assert events[-1]["observation"]["error"]["kind"] == "cancelled"


async def test_sessions_history_and_tools(url: str) -> None:
    async with connect(url) as client:
        await client.request({"type": "run", "id": "1", "session": "one", "prompt": "hello"})
        await client.request(
            {"type": "run", "id": "2", "session": "two", "prompt": "hi", "project": "p"}
        )
        _, sessions = await client.request({"type": "sessions", "id": "3"})
        assert [s["session_id"] for s in sessions["result"]["sessions"]] == ["one"]
        _, sessions = await client.request({"type": "sessions", "id": "4", "project": "p"})
        assert [s["session_id"] for s in sessions["result"]["sessions"]] == ["two"]
        assert sessions["result"]["sessions"][0]["data"]["entry_count"] == 2

        _, history = await client.request({"type": "history", "id": "5", "session": "one"})
        entries = history["result"]["entries"]
        assert [e["type"] for e in entries] == ["user", "assistant"]
        _, after = await client.request(
            {"type": "history", "id": "6", "session": "one", "after": entries[0]["uuid"]}
        )
        assert after["result"]["entries"] == entries[1:]
        _, empty = await client.request({"type": "history", "id": "7", "session": "never"})
        assert empty["result"] == {"entries": []}

        _, tools = await client.request({"type": "tools", "id": "8"})
        add = next(t for t in tools["result"]["tools"] if t["name"] == "add")
        assert add["parameters"]["required"] == ["a", "b"]
        assert add["description"].startswith("Add two integers")


# --- errors ---------------------------------------------------------------------------

FRAME_ERRORS = [
    ("not json", None, "bad_json", "not JSON"),
    (b"\x00binary", None, "bad_json", "binary frame"),
    ("[1, 2]", None, "bad_message", "$: expected an object"),
    ('{"type": "tools", "id": "a"}', "a", "bad_message", "$.v: expected 1, got missing"),
    ('{"v": 2, "type": "tools", "id": "a"}', "a", "bad_message", "$.v: expected 1, got 2"),
    ('{"v": 1, "id": "a"}', "a", "bad_message", "$.type"),
    ('{"v": 1, "type": "teleport", "id": "a"}', "a", "unknown_type", "unknown request type"),
    ('{"v": 1, "type": "tools", "id": ""}', None, "bad_message", "$.id: expected 1 to 128"),
    ('{"v": 1, "type": "tools", "id": 7}', None, "bad_message", "$.id: invalid value"),
    (
        '{"v": 1, "type": "run", "id": "a", "session": "s"}',
        "a",
        "bad_message",
        "$.prompt: required field missing",
    ),
    (
        '{"v": 1, "type": "tools", "id": "a", "extra": 1}',
        "a",
        "bad_message",
        "extra fields found (extra)",
    ),
    (
        '{"v": 1, "type": "call_tools", "id": "a", "session": "s", "calls": [{"id": "c", "name": "add"}, {"id": "d"}]}',
        "a",
        "bad_message",
        "$.calls[1].name: required field missing",
    ),
    ("[" * 100_000, None, "bad_json", "not JSON"),
]


@pytest.mark.parametrize(("frame", "re", "code", "message"), FRAME_ERRORS)
async def test_a_refused_frame_gets_an_error_and_the_connection_survives(
    url: str, frame: str | bytes, re: str | None, code: str, message: str
) -> None:
    async with connect(url) as client:
        await client.send(frame)
        error = await client.recv()
        assert error["type"] == "error"
        assert error.get("re") == re
        assert error["error"]["code"] == code
        assert message in error["error"]["message"]
        _, reply = await client.request({"type": "tools", "id": "after"})
        assert reply["status"] == "ok"


async def test_bad_message_details_list_each_path(url: str) -> None:
    async with connect(url) as client:
        await client.send({"v": 1, "type": "run", "id": "a", "session": 3})
        error = await client.recv()
    assert error["error"]["details"]["errors"] == [
        "$.session: invalid value for type, expected str",
        "$.prompt: required field missing",
    ]


async def test_an_oversized_frame_gets_too_large_and_the_connection_survives(
    kernel: Kernel,
) -> None:
    async with running_server(kernel, limits=ServerLimits(max_frame_bytes=1000)) as url:
        async with connect(url) as client:
            # 600 characters but 1200 bytes: the limit is in bytes
            prompt = "é" * 600
            frame = {"v": 1, "type": "run", "id": "a", "session": "s", "prompt": prompt}
            await client.send(json.dumps(frame, ensure_ascii=False))
            error = await client.recv()
            assert error["error"]["code"] == "too_large"
            assert "1000 bytes" in error["error"]["message"]
            _, reply = await client.request({"type": "tools", "id": "t"})
            assert reply["status"] == "ok"


async def test_a_frame_past_the_hard_limit_closes_the_connection_with_1009(
    kernel: Kernel,
) -> None:
    """trio-websocket stops buffering a frame past max_message_size and closes: documented."""
    from trio_websocket import ConnectionClosed

    async with running_server(kernel, limits=ServerLimits(max_frame_bytes=1000)) as url:
        async with connect(url) as client:
            await client.send("x" * 2001)
            with pytest.raises(ConnectionClosed) as closed:
                await client.recv()
            assert closed.value.reason is not None
            assert closed.value.reason.code == 1009
        async with connect(url) as client:
            _, reply = await client.request({"type": "tools", "id": "t"})
            assert reply["status"] == "ok"


async def test_a_duplicate_id_is_refused_while_the_first_runs(url: str) -> None:
    async with connect(url) as client:
        await client.send({"v": 1, "type": "run", "id": "r", "session": "s", "prompt": SLEEP_30})
        while (await client.recv()).get("kind") != "call_started":
            pass
        await client.send({"v": 1, "type": "tools", "id": "r"})
        error = await client.recv()
        assert (error["type"], error["re"], error["error"]["code"]) == (
            "error",
            "r",
            "duplicate_id",
        )
        await client.send({"v": 1, "type": "cancel", "id": "r", "target": "r"})
        assert (await client.recv())["error"]["code"] == "duplicate_id"
        _, cancel = await client.request({"type": "cancel", "id": "x", "target": "r"})
        assert cancel["result"] == {"found": True}
        _, reply = await client.until_reply("r")
        assert reply["status"] == "cancelled"
        # once replied, the id is free again
        _, tools = await client.request({"type": "tools", "id": "r"})
        assert tools["status"] == "ok"


async def test_too_many_inflight_requests_are_refused_but_cancel_still_works(
    kernel: Kernel,
) -> None:
    async with running_server(kernel, limits=ServerLimits(max_inflight=2)) as url:
        async with connect(url) as client:
            for i in (1, 2):
                await client.send(
                    {
                        "v": 1,
                        "type": "call_tools",
                        "id": f"s{i}",
                        "session": "s",
                        "calls": [{"id": "a", "name": "sleep", "arguments": {"seconds": 30}}],
                    }
                )
                assert (await client.recv())["kind"] == "call_started"
            await client.send({"v": 1, "type": "tools", "id": "t"})
            error = await client.recv()
            assert (error["re"], error["error"]["code"]) == ("t", "too_many_inflight")
            _, cancel = await client.request({"type": "cancel", "id": "c", "target": "s1"})
            assert cancel["result"] == {"found": True}
            _, reply = await client.until_reply("s1")
            assert reply["status"] == "cancelled"
            _, tools = await client.request({"type": "tools", "id": "t"})
            assert tools["status"] == "ok"


async def test_requests_the_kernel_refuses_reply_invalid_request(url: str) -> None:
    async with connect(url) as client:
        _, bad_id = await client.request(
            {"type": "run", "id": "1", "session": "../etc", "prompt": "x"}
        )
        _, model = await client.request(
            {"type": "run", "id": "2", "session": "s", "prompt": "x", "model": "nope:model"}
        )
        _, after = await client.request(
            {"type": "history", "id": "3", "session": "s", "after": "nope"}
        )
    for reply in (bad_id, model, after):
        assert reply["status"] == "error"
        assert reply["error"]["code"] == "invalid_request"
    assert "$.model" in model["error"]["message"]
    assert "$.after" in after["error"]["message"]


async def test_a_run_may_name_another_model(url: str) -> None:
    async with connect(url) as client:
        _, reply = await client.request(
            {
                "type": "run",
                "id": "1",
                "session": "m",
                "prompt": "echo me",
                "model": "scripted:echo",
            }
        )
    assert reply["status"] == "ok", reply
    assert "echo me" in reply["result"]["text"]


async def test_a_kernel_error_replies_kernel_error(
    kernel: Kernel, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken_store(project: str) -> None:
        raise StoreError("disk on fire")

    monkeypatch.setattr(kernel.store, "list_session_summaries", broken_store)
    async with connect(url) as client:
        _, reply = await client.request({"type": "sessions", "id": "s"})
        assert reply["error"] == {"code": "kernel_error", "message": "StoreError: disk on fire"}
        _, tools = await client.request({"type": "tools", "id": "t"})
        assert tools["status"] == "ok"


def test_every_error_code_is_tested_here_or_in_test_auth() -> None:
    tested = {code for _, _, code, _ in FRAME_ERRORS} | {
        "too_large",
        "duplicate_id",
        "too_many_inflight",
        "invalid_request",
        "kernel_error",
        "unauthorized",  # test_auth
        "internal",  # test_robustness
        "too_many_connections",  # tests/security/test_server_preauth.py
    }
    assert tested == set(ERROR_CODES)


async def test_a_hello_cannot_reuse_a_running_requests_id(url: str) -> None:
    async with connect(url) as client:
        await client.send(
            {
                "v": 1,
                "type": "call_tools",
                "id": "X",
                "session": "s",
                "calls": [{"id": "a", "name": "sleep", "arguments": {"seconds": 0.3}}],
            }
        )
        assert (await client.recv())["kind"] == "call_started"
        await client.send({"v": 1, "type": "hello", "id": "X"})
        refused = await client.recv()
        assert refused["type"] == "error" and refused["error"]["code"] == "duplicate_id"
        _, reply = await client.until_reply("X")
        assert reply["type"] == "reply" and reply["status"] == "ok"


async def test_deeply_nested_input_is_a_bad_message_and_the_connection_stays(url: str) -> None:
    deep: Any = "x"
    for _ in range(500):
        deep = [deep]
    async with connect(url) as client:
        _, refused = await client.request(
            {
                "type": "call_tools",
                "id": "deep",
                "session": "s",
                "calls": [{"id": "a", "name": "echo", "arguments": {"text": deep}}],
            }
        )
        assert refused["type"] == "error" and refused["error"]["code"] == "bad_message"
        assert "nested deeper than 64" in refused["error"]["message"]
        _, fine = await client.request({"type": "tools", "id": "after"})
        assert fine["status"] == "ok"
