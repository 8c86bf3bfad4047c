"""Attachments: media a tool returned, kept in the transcript and sent as each provider takes it.

The records (``kernel.messages.Attachment``, ``ToolOutput``,
``Observation.attachments``) round-trip, an older transcript still loads, bad
base64 is refused with its path, an oversized attachment becomes a line of
text. Each adapter's request body for a result with media is compared with
the JSON its provider documents; what a provider cannot take is named in the
result's text.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import attrs
import cattrs
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernel.executor import run_tool_calls
from kernel.messages import (
    MAX_ATTACHMENT_BYTES,
    Attachment,
    FieldRefused,
    Message,
    Observation,
    Text,
    ToolCall,
    ToolError,
    ToolOutput,
    converter,
    describe_structure_error,
    recordable,
)
from kernel.models import AnthropicModel, GeminiModel, ModelRequest, OpenAIModel
from kernel.models._wire import AttachmentPlan, refused_media
from kernel.session import Session, message_entry
from kernel.store import MemoryStore, SessionKey
from kernel.tools import tool
from kernel.wire import CallFinishedEvent, Event, decode_server_frame, encode
from tests.models.wire import NO_RETRY, FakeServer, json_response, schema_tool

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(40))
PNG64 = base64.b64encode(PNG).decode()
PDF = b"%PDF-1.7\n%%EOF\n"
PDF64 = base64.b64encode(PDF).decode()
WAV = b"RIFF\x24\x00\x00\x00WAVEfmt "
WAV64 = base64.b64encode(WAV).decode()

IMAGE = Attachment("image", "image/png", PNG64, name="chart.png")
DOCUMENT = Attachment("resource", "application/pdf", PDF64, uri="file:///work/report.pdf")
AUDIO = Attachment("audio", "audio/wav", WAV64)

CALL = ToolCall("toolu_01A", "chart.draw", {"title": "sales"}, 0)
KEY = SessionKey("p", "s")
TS = "2025-01-01T00:00:00.000Z"


def result(*attachments: Attachment, content: str = "Drew the chart.") -> Observation:
    return Observation(CALL.id, CALL.name, 0, content, attachments=attachments)


def conversation(observation: Observation) -> ModelRequest:
    return ModelRequest(
        (
            Message("user", [Text("Chart the sales.")]),
            Message("assistant", [CALL]),
            Message("tool", [observation]),
        ),
        tools=(schema_tool("chart.draw", "title"),),
        max_tokens=500,
    )


def round_trip(value: Any, cls: type) -> Any:
    return converter.structure(json.loads(json.dumps(converter.unstructure(value))), cls)


# -- the records -------------------------------------------------------------------------------


def test_an_observation_with_attachments_round_trips_through_json() -> None:
    message = Message("tool", [result(IMAGE, DOCUMENT, AUDIO)])
    assert round_trip(message, Message) == message
    back = round_trip(message, Message).observations[0].attachments
    assert [a.media_type for a in back] == ["image/png", "application/pdf", "audio/wav"]
    assert base64.b64decode(back[0].data) == PNG


attachments = st.builds(
    Attachment.of_bytes,
    kind=st.sampled_from(["image", "audio", "resource"]),
    media_type=st.sampled_from(["image/png", "audio/wav", "application/pdf", "text/plain; a=b"]),
    data=st.binary(max_size=64),
    uri=st.none() | st.text(max_size=12),
    name=st.none() | st.text(max_size=12),
)


@given(st.lists(attachments, max_size=4), st.text(max_size=20))
def test_any_attachments_round_trip(values: list[Attachment], content: str) -> None:
    observation = Observation("c", "n", 0, content, attachments=values)
    assert round_trip(observation, Observation) == observation
    assert [base64.b64decode(a.data) for a in observation.attachments] == [
        base64.b64decode(a.data) for a in values
    ]


def test_an_observation_without_attachments_is_written_as_before() -> None:
    """Older kernels (and clients) read it: no ``attachments`` key at all."""
    plain = converter.unstructure(Observation("c", "n", 0, "x"))
    assert "attachments" not in plain
    assert "attachments" in converter.unstructure(result(IMAGE))


def test_a_transcript_written_before_attachments_still_loads() -> None:
    old = {
        "role": "tool",
        "parts": [
            {
                "type": "observation",
                "call_id": "c1",
                "name": "fs.read",
                "index": 0,
                "content": "hello",
                "is_error": False,
                "error": None,
                "duration_s": 0.25,
            }
        ],
    }
    message = converter.structure(old, Message)
    assert message.observations[0].attachments == ()
    assert converter.unstructure(message) == old  # and is written back the same


async def test_attachments_survive_a_transcript_reload() -> None:
    store = MemoryStore()
    await Session(store, KEY).record_turn(Message("assistant", [CALL]), [result(IMAGE)])
    history = await Session(store, KEY).history()  # a new session: read from the store
    assert history[-1].observations[0].attachments == (IMAGE,)
    assert history[-1].observations[0] == result(IMAGE)


def test_observation_success_sets_attachments_like_init() -> None:
    made = Observation.success(CALL, 0, "x", duration_s=0.5, attachments=(IMAGE,))
    expected = Observation(CALL.id, CALL.name, 0, "x", duration_s=0.5, attachments=[IMAGE])
    for field in attrs.fields(Observation):
        assert getattr(made, field.name) == getattr(expected, field.name), field.name
    assert made == expected and hash(made) == hash(expected)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        ("iVBO Rw0K", "not base64"),  # a space
        ("aGk", "not base64"),  # missing padding
        ("aGk=\n", "not base64"),  # a newline after it
        ("_-8=", "not base64"),  # the URL-safe alphabet
    ],
)
def test_bad_base64_is_refused_with_its_path(data: str, reason: str) -> None:
    wire = converter.unstructure(Message("tool", [result(IMAGE)]))
    wire["parts"][0]["attachments"][0]["data"] = data
    with pytest.raises(cattrs.BaseValidationError) as info:
        converter.structure(wire, Message)
    described = describe_structure_error(info.value)
    assert described.startswith(f"$.parts[0].attachments[0].data: {reason}"), described
    with pytest.raises(FieldRefused, match=f"^data: {reason}"):
        Attachment("image", "image/png", data)


def test_a_bad_media_type_is_refused_with_its_path() -> None:
    wire = converter.unstructure(Message("tool", [result(IMAGE)]))
    wire["parts"][0]["attachments"][0]["media_type"] = "png"
    with pytest.raises(cattrs.BaseValidationError) as info:
        converter.structure(wire, Message)
    assert describe_structure_error(info.value) == (
        "$.parts[0].attachments[0].media_type: 'png' is not a media type such as 'image/png'"
    )
    Attachment("resource", "text/plain; charset=utf-8", "")  # parameters are fine


def test_a_repr_shows_the_size_not_the_data() -> None:
    big = Attachment.of_bytes("image", "image/png", bytes(300_000))
    assert len(repr(big)) < 200
    assert big.size == 300_000
    assert big.describe() == "image: image/png, 300000 bytes"
    assert DOCUMENT.describe() == "resource: file:///work/report.pdf, application/pdf, 15 bytes"


def test_an_oversized_attachment_becomes_a_line_of_text() -> None:
    big = Attachment.of_bytes("image", "image/png", bytes(MAX_ATTACHMENT_BYTES + 1))
    content, kept = ToolOutput("Took the screenshot.", [big, IMAGE]).for_observation()
    assert kept == (IMAGE,)
    assert content == (
        "Took the screenshot.\n"
        f"[image: image/png, {MAX_ATTACHMENT_BYTES + 1} bytes, not kept: over the "
        f"{MAX_ATTACHMENT_BYTES} bytes an attachment may have]"
    )
    # Together past the cap of one result: the first ones are kept.
    content, kept = ToolOutput("", [IMAGE, IMAGE, IMAGE]).for_observation(max_total=2 * IMAGE.size)
    assert kept == (IMAGE, IMAGE)
    assert "not kept: over the 96 bytes the attachments of one result may have together" in content
    assert ToolOutput("x", [IMAGE]).for_observation() == ("x", (IMAGE,))


def test_a_uri_with_a_lone_surrogate_is_made_recordable() -> None:
    odd = Attachment("resource", "application/pdf", PDF64, uri="file:///a\ud800.pdf")
    recorded = recordable(Message("tool", [result(odd)]))
    assert recorded.observations[0].attachments[0].uri == "file:///a\ufffd.pdf"
    json.dumps(converter.unstructure(recorded)).encode("utf-8")
    same = Message("tool", [result(IMAGE)])
    assert recordable(same) is same


def test_a_websocket_frame_carries_the_attachments() -> None:
    event = Event.of("r1", CallFinishedEvent(index=0, observation=result(IMAGE)))
    frame = decode_server_frame(encode(event))
    assert isinstance(frame, Event)
    assert frame.payload() == CallFinishedEvent(index=0, observation=result(IMAGE))
    plain = Event.of("r1", CallFinishedEvent(index=0, observation=Observation("c", "n", 0, "x")))
    assert "attachments" not in encode(plain)


def test_a_message_entry_keeps_attachments_and_omits_none() -> None:
    entry = message_entry(Message("tool", [result(IMAGE)]), timestamp=TS, uuid="u1")
    assert entry["message"]["parts"][0]["attachments"][0]["data"] == PNG64
    plain = message_entry(Message("tool", [Observation("c", "n", 0, "x")]), timestamp=TS)
    assert "attachments" not in plain["message"]["parts"][0]


# -- the executor ------------------------------------------------------------------------------


async def test_a_tool_returning_tool_output_gets_an_observation_with_attachments() -> None:
    big = Attachment.of_bytes("image", "image/png", bytes(MAX_ATTACHMENT_BYTES + 1))

    @tool
    async def screenshot(page: str) -> ToolOutput:
        """Take a screenshot."""
        return ToolOutput(f"Screenshot of {page}.", [IMAGE, big])

    calls = [ToolCall("c1", "screenshot", {"page": "home"})]
    [observation] = await run_tool_calls(calls, [screenshot])
    assert not observation.is_error
    assert observation.attachments == (IMAGE,)
    assert observation.content.startswith("Screenshot of home.\n[image: image/png, ")
    assert "not kept" in observation.content


# -- Anthropic ---------------------------------------------------------------------------------

ANTHROPIC_ANSWER = {
    "id": "msg_01",
    "type": "message",
    "role": "assistant",
    "model": "claude-sonnet-4-5",
    "content": [{"type": "text", "text": "Sales rose."}],
    "stop_reason": "end_turn",
    "usage": {"input_tokens": 900, "output_tokens": 4},
}


async def sent_body(make: Any, answer: Any, request: ModelRequest) -> Any:
    server = FakeServer(json_response(200, answer))
    async with server.client() as client:
        await make(client).complete(request)
    return server.body()


def anthropic(client: httpx.AsyncClient) -> AnthropicModel:
    return AnthropicModel("claude-sonnet-4-5", client=client, api_key="k", retry=NO_RETRY)


async def test_anthropic_sends_images_and_pdfs_as_blocks_of_the_tool_result() -> None:
    body = await sent_body(
        anthropic, ANTHROPIC_ANSWER, conversation(result(IMAGE, DOCUMENT, AUDIO))
    )
    assert body["messages"][2] == {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "toolu_01A",
                "content": [
                    {
                        "type": "text",
                        "text": "Drew the chart.\n[audio: audio/wav, 16 bytes, not sent: "
                        "anthropic does not take audio/wav in tool results]",
                    },
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": PNG64},
                    },
                    {
                        "type": "document",
                        "source": {
                            "type": "base64",
                            "media_type": "application/pdf",
                            "data": PDF64,
                        },
                        "title": "file:///work/report.pdf",
                    },
                ],
            }
        ],
    }


async def test_anthropic_result_of_media_alone_has_no_empty_text_block() -> None:
    body = await sent_body(anthropic, ANTHROPIC_ANSWER, conversation(result(IMAGE, content="")))
    [block] = body["messages"][2]["content"]
    assert [b["type"] for b in block["content"]] == ["image"]


async def test_anthropic_names_an_image_over_its_limit_instead_of_sending_it() -> None:
    """The API refuses an image whose base64 is over 5 MiB: the request would fail every turn."""
    jpeg = b"\xff\xd8\xff\xe0" + bytes(4 * 1024 * 1024 - 4)  # 5.3 MiB of base64
    big = Attachment.of_bytes("image", "image/jpeg", jpeg)
    body = await sent_body(anthropic, ANTHROPIC_ANSWER, conversation(result(big)))
    assert body["messages"][2]["content"][0]["content"] == (
        "Drew the chart.\n[image: image/jpeg, 4194304 bytes, not sent: "
        "over the 5 MiB of base64 anthropic takes for an image]"
    )


async def test_an_image_goes_with_the_type_its_bytes_show() -> None:
    """Servers often call a JPEG image/png; providers refuse the mismatch (every turn)."""
    jpeg64 = base64.b64encode(b"\xff\xd8\xff\xe0\x00\x10JFIF").decode()
    mislabelled = Attachment("image", "image/png", jpeg64)
    garbage = Attachment.of_bytes("image", "image/png", b"<html>not found</html>")
    observation = result(mislabelled, garbage)
    body = await sent_body(anthropic, ANTHROPIC_ANSWER, conversation(observation))
    assert body["messages"][2]["content"][0]["content"] == [
        {
            "type": "text",
            "text": "Drew the chart.\n[image: image/png, 22 bytes, not sent: its bytes are not "
            "image/png]",
        },
        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": jpeg64}},
    ]
    body = await sent_body(openai, OPENAI_ANSWER, conversation(observation))
    assert body["messages"][3]["content"][1]["image_url"]["url"].startswith("data:image/jpeg;")
    body = await sent_body(
        gemini("gemini-3-flash-preview"), GEMINI_ANSWER, conversation(observation)
    )
    [part] = body["contents"][2]["parts"][0]["functionResponse"]["parts"]
    assert part["inlineData"]["mimeType"] == "image/jpeg"


async def test_anthropic_without_attachments_sends_the_same_string_content() -> None:
    body = await sent_body(anthropic, ANTHROPIC_ANSWER, conversation(result()))
    assert body["messages"][2]["content"][0]["content"] == "Drew the chart."


# -- OpenAI ------------------------------------------------------------------------------------

OPENAI_ANSWER = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "model": "gpt-4.1-mini",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Sales rose."},
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 900, "completion_tokens": 4, "total_tokens": 904},
}


def openai(client: httpx.AsyncClient) -> OpenAIModel:
    return OpenAIModel("gpt-4.1-mini", client=client, api_key="k", retry=NO_RETRY)


async def test_openai_sends_images_in_a_user_message_after_the_tool_messages() -> None:
    """A tool message takes text parts only (Chat Completions): its images follow it."""
    second = Observation("call_2", "chart.draw", 1, "Drew it again.", attachments=(IMAGE,))
    calls = Message("assistant", [CALL, ToolCall("call_2", "chart.draw", {"title": "x"}, 1)])
    request = ModelRequest(
        (
            Message("user", [Text("Chart the sales.")]),
            calls,
            Message("tool", [result(IMAGE, AUDIO), second]),
        ),
        tools=(schema_tool("chart.draw", "title"),),
    )
    body = await sent_body(openai, OPENAI_ANSWER, request)
    assert body["messages"][2:] == [
        {
            "role": "tool",
            "tool_call_id": "toolu_01A",
            "content": "Drew the chart.\n"
            "[audio: audio/wav, 16 bytes, not sent: openai does not take audio/wav in tool "
            "results]\n"
            "[image: chart.png, image/png, 48 bytes: image 1 of the user message after the "
            "tool results]",
        },
        {
            "role": "tool",
            "tool_call_id": "call_2",
            "content": "Drew it again.\n"
            "[image: chart.png, image/png, 48 bytes: image 2 of the user message after the "
            "tool results]",
        },
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Image 1, from chart.draw (call toolu_01A):"},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG64}"}},
                {"type": "text", "text": "Image 2, from chart.draw (call call_2):"},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG64}"}},
            ],
        },
    ]


async def test_openai_names_a_pdf_it_cannot_send() -> None:
    body = await sent_body(openai, OPENAI_ANSWER, conversation(result(DOCUMENT)))
    assert body["messages"][2:] == [
        {
            "role": "tool",
            "tool_call_id": "toolu_01A",
            "content": "Drew the chart.\n[resource: file:///work/report.pdf, application/pdf, "
            "15 bytes, not sent: openai does not take application/pdf in tool results]",
        }
    ]


# -- Gemini ------------------------------------------------------------------------------------

GEMINI_ANSWER = {
    "candidates": [
        {"content": {"role": "model", "parts": [{"text": "Sales rose."}]}, "finishReason": "STOP"}
    ],
    "usageMetadata": {"promptTokenCount": 900, "candidatesTokenCount": 4},
}


def gemini(name: str) -> Any:
    def make(client: httpx.AsyncClient) -> GeminiModel:
        return GeminiModel(name, client=client, api_key="k", retry=NO_RETRY)

    return make


async def test_gemini_3_sends_media_inside_the_function_response() -> None:
    """Multimodal function responses: ``functionResponse.parts[].inlineData``."""
    body = await sent_body(
        gemini("gemini-3-flash-preview"),
        GEMINI_ANSWER,
        conversation(result(IMAGE, DOCUMENT, AUDIO)),
    )
    assert body["contents"][2] == {
        "role": "user",
        "parts": [
            {
                "functionResponse": {
                    "name": "chart.draw",
                    "id": "toolu_01A",
                    "response": {
                        "result": "Drew the chart.\n[audio: audio/wav, 16 bytes, not sent: "
                        "gemini does not take audio/wav in tool results]"
                    },
                    "parts": [
                        {"inlineData": {"mimeType": "image/png", "data": PNG64}},
                        {"inlineData": {"mimeType": "application/pdf", "data": PDF64}},
                    ],
                }
            }
        ],
    }


async def test_gemini_2_sends_media_after_the_function_responses() -> None:
    """Gemini 2.x refuses media inside a functionResponse; inline parts after it are taken."""
    body = await sent_body(
        gemini("gemini-2.5-flash"), GEMINI_ANSWER, conversation(result(IMAGE, AUDIO))
    )
    assert body["contents"][2] == {
        "role": "user",
        "parts": [
            {
                "functionResponse": {
                    "name": "chart.draw",
                    "id": "toolu_01A",
                    "response": {
                        "result": "Drew the chart.\n"
                        "[image: chart.png, image/png, 48 bytes: sent after the function responses]\n"
                        "[audio: audio/wav, 16 bytes: sent after the function responses]"
                    },
                }
            },
            {"text": "image: chart.png, image/png, 48 bytes, from chart.draw (call toolu_01A):"},
            {"inlineData": {"mimeType": "image/png", "data": PNG64}},
            {"text": "audio: audio/wav, 16 bytes, from chart.draw (call toolu_01A):"},
            {"inlineData": {"mimeType": "audio/wav", "data": WAV64}},
        ],
    }


async def test_gemini_error_results_carry_their_text_under_error() -> None:
    failed = Observation.failure(CALL, 0, ToolError("timeout", "T", "late"))
    body = await sent_body(gemini("gemini-3-pro-preview"), GEMINI_ANSWER, conversation(failed))
    assert body["contents"][2]["parts"][0]["functionResponse"]["response"] == {
        "error": "Error (timeout): late"
    }


# -- the budget of one request -----------------------------------------------------------------


def test_the_newest_attachments_are_sent_and_older_ones_named() -> None:
    old = Observation("c0", "shot", 0, "old", attachments=(IMAGE,))
    new = Observation("c1", "shot", 0, "new", attachments=(IMAGE, IMAGE))
    messages = [Message("tool", [old]), Message("user", [Text("again")]), Message("tool", [new])]
    plan = AttachmentPlan(
        messages, refusal=refused_media("x", {"image/png"}), budget=2 * len(PNG64)
    )
    assert plan.split(new) == ("new", [IMAGE, IMAGE])
    text, sent = plan.split(old)
    assert sent == []
    assert text.startswith(
        "old\n[image: chart.png, image/png, 48 bytes, not sent: newer attachments took the "
        "room one request has for them ("
    )
    counted = AttachmentPlan(
        messages, refusal=refused_media("x", {"image/png"}), budget=1 << 20, max_count=2
    )
    assert counted.split(old)[1] == [] and "2 attachments" in counted.split(old)[0]
