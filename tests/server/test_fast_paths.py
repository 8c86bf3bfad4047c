"""The server's fast paths give the bytes and answers of the plain ones.

``encode_numbered`` (the server numbers each frame without copying it), the
decoder's shortcuts (no flagging decoder without NaN/Infinity in the text, no
nesting walk with few brackets) and the writer that sends queued frames in
one write: each is checked against what the straightforward code gives.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernel import Kernel, Observation, ToolCall
from kernel.wire import FrameError, _connection, decode_request, encode
from kernel.wire._codec import (
    _LONE_SURROGATE_ESCAPE,
    MAX_NESTING,
    _recordable,
    encode_numbered,
)
from kernel.wire._frames import (
    ErrorFrame,
    ErrorInfo,
    Event,
    Reply,
    Request,
    ServerFrame,
    wire_converter,
)
from kernel.wire._payloads import CallFinishedEvent, CallStartedEvent, CallToolsResult

from .wsclient import connect, running_server


def reference_encode(frame: Request | ServerFrame) -> str:
    """``encode`` as it was before the fast path: the union's hook, then reordered
    (``_recordable`` and the regular expression are unchanged)."""
    union: Any = ServerFrame if isinstance(frame, Reply | Event | ErrorFrame) else Request
    body: dict[str, Any] = wire_converter.unstructure(frame, union)
    value = {"v": body.pop("v"), "type": body.pop("type"), **body}
    try:
        text: str | None = json.dumps(value, separators=(",", ":"), allow_nan=False)
    except ValueError:
        text = None
    if text is None or _LONE_SURROGATE_ESCAPE.search(text):
        text = json.dumps(_recordable(value), separators=(",", ":"), allow_nan=False)
    return text


# Lone surrogates, escapes that look like them, non-ASCII, NaN and infinities.
texts = st.text(max_size=8) | st.sampled_from(["\ud800", "a\udfffb", "\\ud800", "é😀", "\\\\uD800"])
values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)
observations = st.builds(
    Observation,
    call_id=texts,
    name=texts,
    index=st.integers(0, 9),
    content=texts,
    duration_s=st.floats(0, 10),
)
server_frames = st.one_of(
    st.builds(
        Reply,
        re=texts,
        status=st.sampled_from(["ok", "error", "cancelled"]),
        result=st.none() | st.dictionaries(texts, values, max_size=3),
        error=st.none() | st.builds(ErrorInfo, code=texts, message=texts),
    ),
    st.builds(Event, re=texts, kind=texts, data=st.dictionaries(texts, values, max_size=4)),
    st.builds(
        lambda re, obs: Event.of(re, CallFinishedEvent(index=obs.index, observation=obs)),
        texts,
        observations,
    ),
    st.builds(
        lambda re, obs: Reply.ok(re, CallToolsResult(observations=(obs,))), texts, observations
    ),
    st.builds(
        ErrorFrame,
        error=st.builds(ErrorInfo, code=texts, message=texts),
        re=st.none() | texts,
    ),
)


@given(server_frames, st.integers(1, 10**9))
def test_numbered_frames_are_byte_identical_to_encoding_a_numbered_copy(
    frame: ServerFrame, seq: int
) -> None:
    text = encode_numbered(frame, seq)
    assert text == reference_encode(attrs.evolve(frame, seq=seq))
    assert text == encode(attrs.evolve(frame, seq=seq))
    assert text.isascii()


def test_a_call_started_event_as_the_docs_show_it() -> None:
    call = ToolCall("c1", "echo", {"text": "hi"})
    frame = Event.of("r1", CallStartedEvent(index=0, call=call))
    assert encode_numbered(frame, 7) == (
        '{"v":1,"type":"event","re":"r1","seq":7,"kind":"call_started","index":0,'
        '"call":{"id":"c1","name":"echo","arguments":{"text":"hi"},"index":null}}'
    )


def _request(**fields: Any) -> str:
    return json.dumps({"v": 1, "type": "call_tools", "id": "r1", "session": "s", **fields})


def test_constants_are_refused_with_or_without_the_word_in_a_string() -> None:
    calls = [{"id": "c", "name": "echo", "arguments": {"text": "NaN and -Infinity"}}]
    assert decode_request(_request(calls=calls)).calls[0].arguments == {"text": "NaN and -Infinity"}
    for constant in ("NaN", "Infinity", "-Infinity"):
        text = _request(calls=[]).replace('"calls": []', f'"calls": [], "x": {constant}')
        with pytest.raises(FrameError) as caught:
            decode_request(text)
        assert caught.value.code == "bad_message"


def test_brackets_in_strings_do_not_make_a_frame_deep_and_deep_frames_are_refused() -> None:
    shallow = "[{" * MAX_NESTING
    calls = [{"id": "c", "name": "echo", "arguments": {"text": shallow}}]
    assert decode_request(_request(calls=calls)).calls[0].arguments == {"text": shallow}
    deep: Any = "x"
    for _ in range(MAX_NESTING):
        deep = [deep]
    with pytest.raises(FrameError) as caught:
        decode_request(_request(calls=[{"id": "c", "name": "echo", "arguments": {"a": deep}}]))
    assert caught.value.code == "bad_message" and "nested deeper" in caught.value.message


async def test_frames_queued_together_still_arrive_one_per_message_in_order(
    kernel: Kernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes: list[int] = []
    send_messages = _connection.send_messages

    async def counted(ws: Any, texts: list[str]) -> None:
        writes.append(len(texts))
        await send_messages(ws, texts)

    monkeypatch.setattr(_connection, "send_messages", counted)
    # 40 calls in one batch: their events are queued faster than they are sent, so
    # the writer sends several per write; the client must still see each as its own
    # message, numbered one after the other, the reply last.
    calls = [{"id": f"c{i}", "name": "echo", "arguments": {"text": str(i)}} for i in range(40)]
    async with running_server(kernel) as url, connect(url) as client:
        for round_ in range(3):
            rid = f"r{round_}"
            events, reply = await client.request(
                {"type": "call_tools", "id": rid, "session": "s", "calls": calls}
            )
            kinds = [e["kind"] for e in events]
            assert kinds.count("call_started") == 40 and kinds.count("call_finished") == 40
            seqs = [e["seq"] for e in events] + [reply["seq"]]
            assert seqs == list(range(seqs[0], seqs[0] + 81))
            assert reply["status"] == "ok"
            assert [o["content"] for o in reply["result"]["observations"]] == [
                str(i) for i in range(40)
            ]
    assert max(writes) > 1  # the writer did send several frames at once
    assert sum(writes) >= 3 * 81
