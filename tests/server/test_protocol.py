"""kernel.wire's frames: to JSON text and back, typed payloads, and what a bad frame is told."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernel import Observation, ProtocolError, ToolCall, UsageError, converter
from kernel.models import Usage
from kernel.wire import (
    EVENT_KINDS,
    CallFinishedEvent,
    CallStartedEvent,
    CallTools,
    Cancel,
    CancelResult,
    ErrorFrame,
    ErrorInfo,
    Event,
    EventData,
    FrameError,
    Hello,
    History,
    ModelDeltaEvent,
    OtherEvent,
    Reply,
    Run,
    RunResult,
    ServerLimits,
    Sessions,
    Tools,
    TurnFinishedEvent,
    decode_request,
    decode_server_frame,
    encode,
)

ids = st.text(min_size=1, max_size=20)
texts = st.text(max_size=30)
requests = st.one_of(
    st.builds(Hello, id=ids, token=st.none() | texts, client=st.none() | texts),
    st.builds(
        CallTools,
        id=ids,
        session=texts,
        calls=st.lists(
            st.builds(
                ToolCall,
                id=texts,
                name=texts,
                arguments=st.dictionaries(texts, st.integers() | texts) | texts,
                index=st.none() | st.integers(0, 9),
            ),
            max_size=3,
        ).map(tuple),
        project=texts,
    ),
    st.builds(Run, id=ids, session=texts, prompt=texts, model=st.none() | texts, project=texts),
    st.builds(Cancel, id=ids, target=texts),
    st.builds(Sessions, id=ids, project=texts),
    st.builds(History, id=ids, session=texts, after=st.none() | texts, project=texts),
    st.builds(Tools, id=ids),
)


@given(requests)
def test_requests_round_trip(request: object) -> None:
    text = encode(request)  # type: ignore[arg-type]
    assert text.isascii()
    assert json.loads(text)["v"] == 1
    assert decode_request(text) == request


@given(
    st.one_of(
        st.builds(
            Reply,
            re=ids,
            status=st.sampled_from(["ok", "error", "cancelled"]),
            result=st.none() | st.dictionaries(texts, st.integers()),
            error=st.none() | st.builds(ErrorInfo, code=texts, message=texts),
            seq=st.integers(1, 99),
        ),
        st.builds(
            Event, re=ids, kind=texts, data=st.dictionaries(texts, texts), seq=st.integers(1, 99)
        ),
        st.builds(
            ErrorFrame,
            error=st.builds(ErrorInfo, code=texts, message=texts),
            re=st.none() | ids,
            seq=st.integers(1, 99),
        ),
    )
)
def test_server_frames_round_trip(frame: Reply | Event | ErrorFrame) -> None:
    decoded = decode_server_frame(encode(frame))
    if isinstance(frame, Event):
        # header keys in data are dropped: a payload cannot forge re, seq or kind
        clean = {k: v for k, v in frame.data.items() if k not in ("v", "type", "re", "seq", "kind")}
        assert decoded == Event(re=frame.re, kind=frame.kind, data=clean, seq=frame.seq)
    else:
        assert decoded == frame


def test_frames_are_compact_with_v_and_type_first() -> None:
    assert encode(Tools(id="t")) == '{"v":1,"type":"tools","id":"t"}'
    assert (
        encode(Reply(re="t", status="cancelled", seq=4))
        == '{"v":1,"type":"reply","re":"t","status":"cancelled","seq":4}'
    )
    # what strict JSON cannot carry is replaced, as JSON.stringify does
    assert encode(Event(re="r", kind="model_delta", data={"text": "\ud800é"}, seq=2)) == (
        '{"v":1,"type":"event","re":"r","seq":2,"kind":"model_delta","text":"\\ufffd\\u00e9"}'
    )
    assert encode(Reply(re="t", status="ok", result={"x": float("nan"), "y": [-math.inf]})) == (
        '{"v":1,"type":"reply","re":"t","status":"ok","seq":0,"result":{"x":null,"y":[null]}}'
    )


@pytest.mark.parametrize(
    ("text", "code", "re"),
    [
        ("", "bad_json", None),
        ('"hello"', "bad_message", None),
        ('{"v": 1, "type": "tools"}', "bad_message", None),
        ('{"v": 1, "type": "tools", "id": "' + "x" * 129 + '"}', "bad_message", None),
        ('{"v": 1.0, "type": "tools", "id": "a"}', "bad_message", "a"),
        ('{"v": 1, "type": ["run"], "id": "a"}', "bad_message", "a"),
        ('{"v": 1, "type": "run", "id": "a", "session": "s", "prompt": 5}', "bad_message", "a"),
        ('{"v": 1, "type": "Run", "id": "a"}', "unknown_type", "a"),
    ],
)
def test_decode_request_refusals(text: str, code: str, re: str | None) -> None:
    with pytest.raises(FrameError) as refused:
        decode_request(text)
    assert (refused.value.code, refused.value.re) == (code, re)
    assert isinstance(refused.value, ProtocolError)


def test_decode_server_frame_refuses_what_is_not_one() -> None:
    for text in ("nope", '{"type": "event"}', '{"v": 1, "type": "hello", "id": "x"}', b"{}"):
        with pytest.raises(ProtocolError):
            decode_server_frame(text)


def test_server_limits_are_checked() -> None:
    with pytest.raises(UsageError, match=r"ServerLimits\.max_inflight must be a positive integer"):
        ServerLimits(max_inflight=0)
    with pytest.raises(UsageError, match="hard_frame_limit must be at least"):
        ServerLimits(max_frame_bytes=100, hard_frame_limit=50)
    assert ServerLimits(max_frame_bytes=100).frame_buffer_limit == 200


def test_public_surface() -> None:
    import importlib.util

    import kernel.repl
    import kernel.wire

    assert set(kernel.repl.__all__) == {"Repl", "history_path", "main", "run_repl", "url_problem"}
    # The one path: kernel.wire (the re-exports kernel.protocol and kernel.server went).
    assert importlib.util.find_spec("kernel.protocol") is None
    assert importlib.util.find_spec("kernel.server") is None
    for name in kernel.wire.__all__:
        assert hasattr(kernel.wire, name)
    assert set(kernel.wire.EVENT_CLASSES) == set(EVENT_KINDS)


USAGE = Usage(input_tokens=3, output_tokens=4)
CALL = ToolCall(id="a", name="add", arguments={"a": 1}, index=0)
OBSERVATION = Observation(call_id="a", name="add", index=0, content="1", duration_s=0.5)


@pytest.mark.parametrize(
    ("payload", "data"),
    [
        (ModelDeltaEvent(step=1, text="Hi"), {"step": 1, "text": "Hi"}),
        (
            CallStartedEvent(index=0, call=CALL),
            {"index": 0, "call": {"id": "a", "name": "add", "arguments": {"a": 1}, "index": 0}},
        ),
        (
            CallFinishedEvent(index=0, observation=OBSERVATION),
            {"index": 0, "observation": converter.unstructure(OBSERVATION)},
        ),
        (
            TurnFinishedEvent(reason="final", text="t", steps=1, usage=USAGE),
            {"reason": "final", "text": "t", "steps": 1, "usage": converter.unstructure(USAGE)},
        ),
        (
            TurnFinishedEvent(reason="model_error", text="", steps=2, usage=USAGE, error="503"),
            {
                "reason": "model_error",
                "text": "",
                "steps": 2,
                "usage": converter.unstructure(USAGE),
                "error": "503",
            },
        ),
        (OtherEvent(kind="from_the_future", data={"x": 1}), {"x": 1}),
    ],
)
def test_event_payloads_are_records_with_the_wire_format_unchanged(
    payload: EventData, data: dict[str, Any]
) -> None:
    event = Event.of("r", payload)
    assert (event.kind, event.data) == (payload.kind, data)
    decoded = decode_server_frame(encode(event))
    assert isinstance(decoded, Event)
    assert decoded.payload() == payload


def test_a_known_event_kind_with_bad_fields_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match=r"bad model_delta event: \$\.step"):
        Event(re="r", kind="model_delta", data={"text": "x"}).payload()


def test_results_are_records() -> None:
    reply = Reply.ok("r", RunResult(session="s", reason="final", text="t", steps=1, usage=USAGE))
    assert reply.result is not None and "error" not in reply.result
    assert reply.result_as(RunResult).usage == USAGE
    assert Reply.ok("c", CancelResult(found=True)).result == {"found": True}
    with pytest.raises(ProtocolError, match="has no result"):
        Reply(re="r", status="cancelled").result_as(RunResult)
