"""Records round-trip through JSON with the one converter; bad input names its path."""

from __future__ import annotations

import json
from typing import Any

import attrs
import cattrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernel.messages import (
    ERROR_KINDS,
    Message,
    Observation,
    Text,
    ToolCall,
    ToolError,
    converter,
    describe_structure_error,
)

json_scalars = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20)
json_values = st.recursive(
    json_scalars | st.floats(allow_nan=False, allow_infinity=False),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
ids = st.text(min_size=1, max_size=12)
tool_errors = st.builds(ToolError, kind=st.sampled_from(ERROR_KINDS), type=ids, message=st.text())
tool_calls = st.builds(
    ToolCall,
    id=ids,
    name=ids,
    arguments=st.dictionaries(st.text(max_size=8), json_values, max_size=4) | st.text(),
    index=st.none() | st.integers(0, 1000),
)


@st.composite
def observations(draw: st.DrawFn) -> Observation:
    error = draw(st.none() | tool_errors)
    return Observation(
        call_id=draw(ids),
        name=draw(ids),
        index=draw(st.integers(0, 1000)),
        content=draw(st.text()),
        is_error=error is not None,
        error=error,
        duration_s=draw(st.floats(0, 1e6)),
    )


texts = st.builds(Text, text=st.text())
messages = st.builds(
    Message,
    role=st.sampled_from(["system", "user", "assistant", "tool"]),
    parts=st.lists(texts | tool_calls | observations(), max_size=5),
)


def round_trip(value: Any, cls: type) -> Any:
    wire = json.dumps(converter.unstructure(value))
    return converter.structure(json.loads(wire), cls)


@given(tool_errors)
def test_tool_error_round_trip(value: ToolError) -> None:
    assert round_trip(value, ToolError) == value


@given(tool_calls)
def test_tool_call_round_trip(value: ToolCall) -> None:
    assert round_trip(value, ToolCall) == value


@given(observations())
def test_observation_round_trip(value: Observation) -> None:
    assert round_trip(value, Observation) == value


@given(texts)
def test_text_round_trip(value: Text) -> None:
    assert round_trip(value, Text) == value


@given(messages)
def test_message_round_trip(value: Message) -> None:
    assert round_trip(value, Message) == value


def test_parts_are_tagged_by_type() -> None:
    wire = converter.unstructure(Message("assistant", [Text("hi"), ToolCall("a", "b", {}, 0)]))
    assert [p["type"] for p in wire["parts"]] == ["text", "tool_call"]


@pytest.mark.parametrize(
    ("value", "cls", "expected"),
    [
        ({"role": "user", "parts": [{"type": "text", "text": 5}]}, Message, "$.parts[0].text"),
        ({"role": "user", "parts": [], "extra": 1}, Message, "extra fields found (extra)"),
        ({"role": "robot", "parts": []}, Message, "$.role"),
        ({"id": "a", "name": "b", "arguments": [1], "index": 0}, ToolCall, "$.arguments"),
        (
            {"call_id": "a", "name": "b", "index": True, "content": "x"},
            Observation,
            "$.index",
        ),
        ({"kind": "exploded", "type": "X", "message": "m"}, ToolError, "$.kind"),
    ],
)
def test_bad_input_names_the_path(value: dict[str, Any], cls: type, expected: str) -> None:
    with pytest.raises(cattrs.BaseValidationError) as info:
        converter.structure(value, cls)
    assert expected in describe_structure_error(info.value)


def test_observation_is_error_must_match_error() -> None:
    with pytest.raises(ValueError, match="is_error"):
        Observation("a", "b", 0, "x", is_error=True)
    with pytest.raises(ValueError, match="is_error"):
        Observation("a", "b", 0, "x", error=ToolError("timeout", "Timeout", "late"))


@given(ids, ids, st.integers(0, 1000), st.text(), st.floats(0, 1e6))
def test_observation_success_is_the_record_init_makes(
    call_id: str, name: str, index: int, content: str, duration_s: float
) -> None:
    """``Observation.success`` skips ``__init__`` (and its validator, which holds by
    construction): every field, a field added later included, is what ``__init__`` sets."""
    made = Observation.success(ToolCall(call_id, name), index, content, duration_s=duration_s)
    expected = Observation(call_id, name, index, content, duration_s=duration_s)
    assert type(made) is Observation
    for field in attrs.fields(Observation):
        assert getattr(made, field.name) == getattr(expected, field.name), field.name
    assert made == expected and hash(made) == hash(expected)
    assert round_trip(made, Observation) == made
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        made.content = "changed"  # type: ignore[misc]


def test_an_invalid_observation_is_still_refused_after_a_success() -> None:
    """The shortcut is the success path's alone: ``__init__`` still validates."""
    Observation.success(ToolCall("a", "b"), 0, "x")
    with pytest.raises(ValueError, match="is_error"):
        Observation("a", "b", 0, "x", is_error=True)


def test_a_copy_of_the_converter_keeps_the_union_hooks() -> None:
    """Each floor's converter is ``converter.copy()``; cattrs' copy drops hooks
    registered for union types unless the kernel's converter registers them again."""
    from kernel.messages import Message, ToolCall, converter

    copy = converter.copy()
    for conv in (converter, copy):
        assert (
            conv.structure({"id": "a", "name": "n", "arguments": "{}"}, ToolCall).arguments == "{}"
        )
        message = conv.structure(
            {"role": "user", "parts": [{"type": "text", "text": "x"}]}, Message
        )
        assert conv.unstructure(message) == converter.unstructure(message)
    with pytest.raises(Exception, match="While structuring ToolCall"):
        copy.structure({"id": "a", "name": "n", "arguments": 3}, ToolCall)
