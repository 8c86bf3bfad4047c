"""The JSON Schema `@tool` derives from type hints and docstrings, and the provider exports.

The exports are the model adapters' own functions (kernel.models), fed the registry's
neutral ``ToolDefinition`` records; tests/models/test_tool_formats.py checks that they
are what goes on the wire.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, Optional

import pytest
from tool_types import Color, Item, Level, Order

from kernel.models import anthropic_tools, gemini_tools, openai_tools
from kernel.tools import Tool, ToolRegistry, tool

ITEM_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "qty": {"type": "integer", "default": 1}},
    "required": ["name"],
    "additionalProperties": False,
}


def tool_with(hint: Any, default: Any = None, *, has_default: bool = False) -> Tool:
    """A one-parameter tool `x: hint` (with `= default` when has_default)."""

    def fn(x: Any = default) -> None:
        pass

    if not has_default:
        fn.__defaults__ = None
    fn.__annotations__ = {"x": hint, "return": None}
    return tool(fn)


def schema_of(hint: Any) -> dict[str, Any]:
    return dict(tool_with(hint).parameters["properties"]["x"])


@pytest.mark.parametrize(
    ("hint", "expected"),
    [
        (str, {"type": "string"}),
        (int, {"type": "integer"}),
        (float, {"type": "number"}),
        (bool, {"type": "boolean"}),
        (None, {"type": "null"}),
        (Any, {}),
        (Literal["a", "b"], {"type": "string", "enum": ["a", "b"]}),
        (Literal[1, 2], {"type": "integer", "enum": [1, 2]}),
        (Literal[True], {"type": "boolean", "enum": [True]}),
        (Literal[0.5], {"type": "number", "enum": [0.5]}),
        (
            Literal["a", 1],
            {"anyOf": [{"type": "string", "enum": ["a"]}, {"type": "integer", "enum": [1]}]},
        ),
        (
            Literal["a", None],
            {"anyOf": [{"type": "string", "enum": ["a"]}, {"type": "null"}]},
        ),
        (Color, {"type": "string", "enum": ["red", "green"]}),
        (Level, {"type": "integer", "enum": [1, 2]}),
        (list[int], {"type": "array", "items": {"type": "integer"}}),
        (Sequence[str], {"type": "array", "items": {"type": "string"}}),
        (tuple[bool, ...], {"type": "array", "items": {"type": "boolean"}}),
        (list, {"type": "array", "items": {}}),
        (dict[str, int], {"type": "object", "additionalProperties": {"type": "integer"}}),
        (Mapping[str, str], {"type": "object", "additionalProperties": {"type": "string"}}),
        (dict, {"type": "object", "additionalProperties": {}}),
        (int | None, {"anyOf": [{"type": "integer"}, {"type": "null"}]}),
        (Optional[str], {"anyOf": [{"type": "string"}, {"type": "null"}]}),  # noqa: UP045
        (int | str, {"anyOf": [{"type": "integer"}, {"type": "string"}]}),
        (
            list[Item] | None,
            {"anyOf": [{"type": "array", "items": ITEM_SCHEMA}, {"type": "null"}]},
        ),
        (Item, ITEM_SCHEMA),
        (
            Order,
            {
                "type": "object",
                "properties": {
                    "items": {"type": "array", "items": ITEM_SCHEMA},
                    "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
                    "tags": {"type": "array", "items": {"type": "string"}, "default": []},
                },
                "required": ["items"],
                "additionalProperties": False,
            },
        ),
        (Annotated[int, "how many"], {"type": "integer", "description": "how many"}),
        (
            list[Annotated[str, "a tag"]],
            {"type": "array", "items": {"type": "string", "description": "a tag"}},
        ),
    ],
    ids=repr,
)
def test_schema_for_each_supported_hint(hint: Any, expected: dict[str, Any]) -> None:
    assert schema_of(hint) == expected


def test_parameters_object_lists_required_and_forbids_extra_keys() -> None:
    @tool
    def weather(city: str, days: int = 3, units: Literal["c", "f"] = "c") -> str:
        return ""

    assert weather.parameters == {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer", "default": 3},
            "units": {"type": "string", "enum": ["c", "f"], "default": "c"},
        },
        "required": ["city"],
        "additionalProperties": False,
    }


def test_a_tool_without_parameters_has_an_empty_object_schema() -> None:
    @tool
    def now() -> str:
        return ""

    assert now.parameters == {
        "type": "object",
        "properties": {},
        "required": [],
        "additionalProperties": False,
    }


@pytest.mark.parametrize(
    ("hint", "default", "expected"),
    [
        (int, 3, {"type": "integer", "default": 3}),
        (int | None, None, {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None}),
        (Color, Color.GREEN, {"type": "string", "enum": ["red", "green"], "default": "green"}),
        (Item, Item("x"), {**ITEM_SCHEMA, "default": {"name": "x", "qty": 1}}),
        (
            tuple[int, ...],
            (1, 2),
            {"type": "array", "items": {"type": "integer"}, "default": [1, 2]},
        ),
        # Not JSON: left out of the schema, but the parameter is still optional.
        (Any, object(), {}),
        (float, float("nan"), {"type": "number"}),
    ],
    # Named, not repr'd: object()'s repr holds its address, which differs in every
    # process, and pytest-xdist refuses ids that differ between its workers.
    ids=["int", "optional_int", "enum", "attrs", "tuple", "not_json", "nan"],
)
def test_defaults_make_a_parameter_optional_and_show_when_json(
    hint: Any, default: Any, expected: dict[str, Any]
) -> None:
    t = tool_with(hint, default, has_default=True)
    assert t.parameters["required"] == []
    assert t.parameters["properties"]["x"] == expected


def test_future_annotations_are_resolved() -> None:
    # This module uses `from __future__ import annotations`: every hint is a string.
    @tool
    def place(order: Order, color: Color = Color.RED) -> None:
        pass

    assert place.parameters["properties"]["order"]["properties"]["items"]["items"] == ITEM_SCHEMA
    assert place.parameters["properties"]["color"]["enum"] == ["red", "green"]


# --- docstrings --------------------------------------------------------------------


def test_description_is_the_docstring_without_args_returns_raises() -> None:
    @tool
    def search(query: str, limit: int = 10) -> list[str]:
        """Search the notes.

        Matches whole words, case-insensitively.

        Args:
            query: the words to find;
                several words must all match.
            limit (int): at most this many results.

        Returns:
            The matching note titles.

        Raises:
            ValueError: when the query is empty.

        Example:
            search("trio nursery")
        """
        return []

    assert search.description == (
        "Search the notes.\n\nMatches whole words, case-insensitively.\n\n"
        'Example:\n    search("trio nursery")'
    )
    assert search.parameters["properties"]["query"] == {
        "type": "string",
        "description": "the words to find; several words must all match.",
    }
    assert search.parameters["properties"]["limit"] == {
        "type": "integer",
        "description": "at most this many results.",
        "default": 10,
    }


def test_annotated_description_wins_over_the_docstring() -> None:
    @tool
    def f(x: Annotated[int, "from the hint"]) -> None:
        """Do it.

        Args:
            x: from the docstring.
        """

    assert f.parameters["properties"]["x"]["description"] == "from the hint"


def test_no_docstring_gives_an_empty_description() -> None:
    @tool
    def f(x: int) -> None:
        pass

    assert f.description == ""
    assert f.parameters["properties"]["x"] == {"type": "integer"}


# --- provider exports --------------------------------------------------------------


@tool
def get_weather(city: Annotated[str, "City name"], days: int = 1) -> str:
    """Forecast for a city."""
    return ""


@tool
def pick(
    mode: Literal["fast", "slow"] | None = None,
    level: Literal[1, 2] = 1,
    item: Item | None = None,
    either: int | str = 0,
) -> None:
    """Pick one."""


@tool
def now() -> str:
    """The time."""
    return ""


@tool
def label(tags: dict[str, str]) -> None:
    """Label things."""


def test_openai_tools() -> None:
    assert openai_tools(ToolRegistry([get_weather, now]).definitions()) == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Forecast for a city.",
                "parameters": get_weather.parameters,
            },
        },
        {
            "type": "function",
            "function": {"name": "now", "description": "The time.", "parameters": now.parameters},
        },
    ]


def test_anthropic_tools() -> None:
    assert anthropic_tools(ToolRegistry([get_weather]).definitions()) == [
        {
            "name": "get_weather",
            "description": "Forecast for a city.",
            "input_schema": get_weather.parameters,
        }
    ]


def test_exports_are_copies() -> None:
    specs = anthropic_tools(ToolRegistry([get_weather]).definitions())
    specs[0]["input_schema"]["properties"].clear()
    assert get_weather.parameters["properties"]


def test_gemini_tools_use_the_openapi_subset() -> None:
    assert gemini_tools(ToolRegistry([get_weather, pick, now]).definitions()) == [
        {
            "functionDeclarations": [
                {
                    "name": "get_weather",
                    "description": "Forecast for a city.",
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string", "description": "City name"},
                            "days": {"type": "integer"},
                        },
                        "required": ["city"],
                    },
                },
                {
                    "name": "pick",
                    "description": "Pick one.",
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "mode": {"type": "string", "enum": ["fast", "slow"], "nullable": True},
                            "level": {"type": "integer", "description": "One of 1, 2."},
                            "item": {
                                "type": "object",
                                "properties": {
                                    "name": {"type": "string"},
                                    "qty": {"type": "integer"},
                                },
                                "required": ["name"],
                                "nullable": True,
                            },
                            "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
                        },
                        "required": [],
                    },
                },
                # Gemini refuses an object without properties: no parameters at all.
                {"name": "now", "description": "The time."},
            ]
        }
    ]


def test_gemini_falls_back_to_json_schema_for_maps() -> None:
    [declarations] = gemini_tools(ToolRegistry([label]).definitions())
    assert declarations == {
        "functionDeclarations": [
            {
                "name": "label",
                "description": "Label things.",
                "parametersJsonSchema": label.parameters,
            }
        ]
    }


def test_gemini_keeps_descriptions_of_non_string_enums() -> None:
    @tool
    def f(x: Annotated[Literal[1, 2], "the level"]) -> None:
        pass

    [declarations] = gemini_tools(ToolRegistry([f]).definitions())
    schema = declarations["functionDeclarations"][0]["parameters"]["properties"]["x"]
    assert schema == {"type": "integer", "description": "the level (one of 1, 2)"}


def test_empty_registry_exports_no_tools() -> None:
    for export in (openai_tools, anthropic_tools, gemini_tools):
        assert export(ToolRegistry().definitions()) == []


def test_gemini_parameters_never_carry_what_gemini_rejects() -> None:
    [declarations] = gemini_tools(ToolRegistry([get_weather, pick, now]).definitions())
    text = json.dumps(declarations)
    for rejected in ('"additionalProperties"', '"default"', '"null"'):
        assert rejected not in text
