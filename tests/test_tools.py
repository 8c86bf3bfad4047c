"""`@tool`, strict argument validation with paths, and the registry."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tool_types import Color, Item, Level, Order

from kernel.agent import Agent
from kernel.errors import UsageError
from kernel.messages import converter
from kernel.models import (
    ScriptedModel,
)
from kernel.session import Session
from kernel.store import MemoryStore, SessionKey
from kernel.tools import ArgumentError, Tool, ToolFailure, ToolRegistry, tool


@tool
def place(
    city: str,
    items: list[Item],
    count: int = 1,
    ratio: float = 1.0,
    urgent: bool = False,
    color: Color = Color.RED,
    level: Level = Level.LOW,
    mode: Literal["fast", "slow"] = "fast",
    note: str | None = None,
    order: Order | None = None,
    tags: dict[str, int] | None = None,
    either: int | str = 0,
    path: tuple[int, ...] = (),
    extra: Any = None,
) -> str:
    """Place an order."""
    return city


def error_of(t: Tool, arguments: Any) -> str:
    with pytest.raises(ArgumentError) as info:
        t.validate(arguments)
    return str(info.value)


# --- the decorator -----------------------------------------------------------------


def test_bare_decorator_makes_a_tool_with_default_options() -> None:
    def add(a: int, b: int) -> int:
        return a + b

    t = tool(add)
    assert isinstance(t, Tool)
    assert (t.name, t.fn, t.is_async) == ("add", add, False)
    assert (t.timeout, t.exclusive, t.max_output, t.invoke) == (None, False, None, None)


def test_decorator_with_options() -> None:
    @tool(name="math.add", timeout=2.5, exclusive=True, max_output=1000)
    def add(a: int, b: int) -> int:
        return a + b

    assert (add.name, add.timeout, add.exclusive, add.max_output) == ("math.add", 2.5, True, 1000)
    assert add.fn is not None and add.fn(1, 2) == 3


async def test_async_functions_are_detected_and_still_run() -> None:
    @tool
    async def fetch(url: str) -> str:
        return url.upper()

    assert fetch.is_async
    assert fetch.fn is not None
    assert await fetch.fn(**fetch.validate({"url": "x"})) == "X"


def test_sync_function_is_not_async() -> None:
    assert place.is_async is False


def _star_args(*names: str) -> None:
    pass


def _star_kwargs(**options: str) -> None:
    pass


def _no_hint(x, y: int) -> None:  # type: ignore[no-untyped-def]
    pass


def _set(x: set[int]) -> None:
    pass


def _fixed_tuple(x: tuple[int, str]) -> None:
    pass


def _int_keys(x: dict[int, str]) -> None:
    pass


def _bytes_literal(x: Literal[b"x"]) -> None:
    pass


def _positional_only(x: int, /) -> None:
    pass


def _undefined(x: Undefined) -> None:  # type: ignore[name-defined]  # noqa: F821
    pass


@attrs.frozen
class Node:
    children: list[Node]


def _recursive(x: Node) -> None:
    pass


class Opaque:
    pass


def _opaque(x: Opaque) -> None:
    pass


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (_star_args, "tool '_star_args': parameter 'names': *args and **kwargs are not supported"),
        (
            _star_kwargs,
            "tool '_star_kwargs': parameter 'options': *args and **kwargs are not supported",
        ),
        (_no_hint, "tool '_no_hint': parameter 'x' has no type hint"),
        (_set, "tool '_set': parameter 'x': unsupported type set[int]"),
        (_fixed_tuple, "parameter 'x': tuple[int, str]: only tuple[T, ...] is supported"),
        (_int_keys, "parameter 'x': dict[int, str]: object keys must be str"),
        (_bytes_literal, "parameter 'x': value b'x' is not a JSON string"),
        (_positional_only, "tool '_positional_only': parameter 'x' is positional-only"),
        (_undefined, "tool '_undefined': cannot read the signature: name 'Undefined'"),
        (_recursive, "parameter 'x': Node.children: Node refers to itself"),
        (_opaque, "tool '_opaque': parameter 'x': unsupported type Opaque"),
    ],
    ids=lambda v: getattr(v, "__name__", "message"),
)
def test_bad_definitions_raise_usage_error(fn: Any, message: str) -> None:
    with pytest.raises(UsageError) as info:
        tool(fn)
    assert message in str(info.value)


@pytest.mark.parametrize("name", ["1st", "has space", "a/b", "x" * 65, "", "ünï"])
def test_bad_names_raise_usage_error(name: str) -> None:
    with pytest.raises(UsageError, match="invalid tool name"):
        tool(name=name)(_set_free)


def _set_free(x: int) -> None:
    pass


@pytest.mark.parametrize("name", ["a", "_x", "fs.read", "web-fetch", "A1_b.c-d", "x" * 64])
def test_good_names_are_kept_as_given(name: str) -> None:
    assert tool(name=name)(_set_free).name == name


@pytest.mark.parametrize(
    "options",
    [
        {"timeout": 0},
        {"timeout": -1.0},
        {"timeout": float("inf")},
        {"timeout": float("nan")},
        {"max_output": 0},
    ],
)
def test_non_positive_limits_raise_usage_error(options: dict[str, Any]) -> None:
    with pytest.raises(
        UsageError, match=r"Tool\.(timeout|max_output) must be a positive (number|integer) or None"
    ):
        tool(**options)(_set_free)


def test_tool_failure_carries_kind_and_type() -> None:
    exc = ToolFailure("denied", "no network", type="NetworkDenied")
    assert (exc.kind, exc.message, exc.type, str(exc)) == (
        "denied",
        "no network",
        "NetworkDenied",
        "no network",
    )
    assert ToolFailure("timeout", "slow").type == "ToolFailure"


# --- validation --------------------------------------------------------------------


def test_validate_structures_into_declared_types_and_fills_defaults() -> None:
    kwargs = place.validate(
        {
            "city": "Oslo",
            "items": [{"name": "tea"}, {"name": "jam", "qty": 2}],
            "ratio": 3,
            "color": "green",
            "level": 2,
            "mode": "slow",
            "order": {"items": [{"name": "pie"}]},
            "tags": {"a": 1},
            "either": "x",
            "path": [1, 2],
            "extra": {"any": ["thing"]},
        }
    )
    assert kwargs == {
        "city": "Oslo",
        "items": [Item("tea", 1), Item("jam", 2)],
        "count": 1,
        "ratio": 3.0,
        "urgent": False,
        "color": Color.GREEN,
        "level": Level.HIGH,
        "mode": "slow",
        "note": None,
        "order": Order([Item("pie")]),
        "tags": {"a": 1},
        "either": "x",
        "path": (1, 2),
        "extra": {"any": ["thing"]},
    }
    assert type(kwargs["ratio"]) is float
    assert type(kwargs["level"]) is Level


def test_validate_json_gives_json_for_a_worker() -> None:
    assert place.validate_json({"city": "Oslo", "items": [{"name": "tea"}], "color": "green"}) == {
        "city": "Oslo",
        "items": [{"name": "tea", "qty": 1}],
        "count": 1,
        "ratio": 1.0,
        "urgent": False,
        "color": "green",
        "level": 1,
        "mode": "fast",
        "note": None,
        "order": None,
        "tags": None,
        "either": 0,
        "path": [],
        "extra": None,
    }


BASE: dict[str, Any] = {"city": "Oslo", "items": []}


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({**BASE, "count": "3"}, "$.count: expected int, got str"),
        ({**BASE, "count": True}, "$.count: expected int, got bool"),
        ({**BASE, "count": 3.5}, "$.count: expected int, got float"),
        ({**BASE, "count": None}, "$.count: expected int, got NoneType"),
        ({**BASE, "ratio": "1.5"}, "$.ratio: expected float, got str"),
        ({**BASE, "urgent": 1}, "$.urgent: expected bool, got int"),
        ({**BASE, "city": 7}, "$.city: expected str, got int"),
        ({**BASE, "items": "tea"}, "$.items: expected list, got str"),
        ({**BASE, "items": {"name": "tea"}}, "$.items: expected list, got dict"),
        ({**BASE, "items": ["tea"]}, "$.items[0]: expected dict, got str"),
        (
            {**BASE, "items": [{"name": "a"}, {"name": "b"}, {"name": 3}]},
            "$.items[2].name: expected str, got int",
        ),
        ({**BASE, "items": [{}]}, "$.items[0].name: required field missing"),
        ({**BASE, "items": [{"name": "a", "size": 1}]}, "$.items[0]: unexpected field(s): size"),
        ({**BASE, "color": "blue"}, "$.color: expected one of 'red', 'green', got 'blue'"),
        ({**BASE, "color": "RED"}, "$.color: expected one of 'red', 'green', got 'RED'"),
        ({**BASE, "level": True}, "$.level: expected one of 1, 2, got True"),
        ({**BASE, "level": "1"}, "$.level: expected one of 1, 2, got '1'"),
        ({**BASE, "mode": "medium"}, "$.mode: expected one of 'fast', 'slow', got 'medium'"),
        ({**BASE, "note": 3}, "$.note: expected str | None, got int"),
        ({**BASE, "order": "pie"}, "$.order: expected Order | None, got str"),
        (
            {**BASE, "order": {"items": [{"name": 1}]}},
            "$.order.items[0].name: expected str, got int",
        ),
        ({**BASE, "tags": {"a": "1"}}, "$.tags['a']: expected int, got str"),
        ({**BASE, "tags": ["a"]}, "$.tags: expected dict[str, int] | None, got list"),
        ({**BASE, "either": 1.5}, "$.either: expected int | str, got float"),
        ({**BASE, "path": [1, "2"]}, "$.path[1]: expected int, got str"),
        ({"items": []}, "$.city: required argument missing"),
        ({**BASE, "colour": "red"}, "$: unexpected argument(s): colour"),
        ({**BASE, "b": 1, "a": 2}, "$: unexpected argument(s): a, b"),
        ([], "$: expected dict, got list"),
        ("{}", "$: expected dict, got str"),
    ],
    ids=repr,
)
def test_invalid_arguments_name_their_path(arguments: Any, message: str) -> None:
    assert error_of(place, arguments) == message


def test_several_problems_are_joined() -> None:
    message = error_of(place, {"items": [{"name": 1}], "count": "2", "zip": 1})
    assert message.split("; ") == [
        "$.city: required argument missing",
        "$.items[0].name: expected str, got int",
        "$.count: expected int, got str",
        "$: unexpected argument(s): zip",
    ]


def test_optional_accepts_null_and_plain_types_do_not() -> None:
    assert place.validate({**BASE, "note": None, "order": None})["note"] is None
    assert error_of(place, {**BASE, "city": None}) == "$.city: expected str, got NoneType"


def test_literal_matching_is_strict_json() -> None:
    @tool
    def f(x: Literal[1, "1", True, 2.5]) -> None:  # type: ignore[valid-type]
        pass

    assert type(f.validate({"x": 1})["x"]) is int
    assert f.validate({"x": "1"}) == {"x": "1"}
    assert f.validate({"x": True})["x"] is True
    assert f.validate({"x": 2.5}) == {"x": 2.5}
    assert "got 1.0" in error_of(f, {"x": 1.0})
    assert "got False" in error_of(f, {"x": False})


def test_float_literal_accepts_an_integer_number() -> None:
    @tool
    def f(x: Literal[2.0]) -> None:  # type: ignore[valid-type]
        pass

    assert f.validate({"x": 2}) == {"x": 2.0}


def test_mutable_defaults_are_fresh_for_every_call() -> None:
    @tool
    def f(tags: list[str] = ["a"]) -> None:  # noqa: B006 - what the test is about
        pass

    first = f.validate({})
    first["tags"].append("b")
    assert f.validate({}) == {"tags": ["a"]}


@attrs.frozen
class Span:
    start: int = attrs.field(validator=attrs.validators.ge(0))


def test_attrs_validators_of_a_parameter_class_become_argument_errors() -> None:
    @tool
    def f(span: Span) -> None:
        pass

    assert f.validate({"span": {"start": 1}}) == {"span": Span(1)}
    assert error_of(f, {"span": {"start": -1}}).startswith("$.span: ")


# --- tools defined by a JSON Schema alone (e.g. run by a sandbox worker) -----------


REMOTE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "mode": {"type": "string", "enum": ["r", "w"], "default": "r"},
        "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "lines": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"n": {"type": "integer"}, "text": {"type": ["string", "null"]}},
                "required": ["n"],
                "additionalProperties": False,
            },
        },
        "meta": {"type": "object", "additionalProperties": {"type": "number"}},
    },
    "required": ["path"],
    "additionalProperties": False,
}


async def _never(arguments: dict[str, Any]) -> Any:
    raise AssertionError("not called")


remote = Tool(
    name="fs.read",
    description="Read a file.",
    parameters=REMOTE_SCHEMA,
    fn=None,
    is_async=True,
    invoke=_never,
)


def test_schema_only_tool_returns_json_with_defaults_and_without_absent_keys() -> None:
    assert remote.validate({"path": "a.txt"}) == {"path": "a.txt", "mode": "r"}
    arguments = {
        "path": "a.txt",
        "mode": "w",
        "limit": None,
        "lines": [{"n": 1}, {"n": 2, "text": None}],
        "meta": {"x": 1},
    }
    assert remote.validate(arguments) == arguments
    assert remote.validate_json(arguments) == arguments


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({}, "$.path: required argument missing"),
        ({"path": "a", "mode": "x"}, "$.mode: expected one of 'r', 'w', got 'x'"),
        ({"path": "a", "limit": "3"}, "$.limit: expected int | None, got str"),
        ({"path": "a", "lines": [{"n": "1"}]}, "$.lines[0].n: expected int, got str"),
        ({"path": "a", "lines": [{"n": 1, "m": 2}]}, "$.lines[0]: unexpected field(s): m"),
        ({"path": "a", "meta": {"x": "y"}}, "$.meta['x']: expected float, got str"),
        ({"path": "a", "other": 1}, "$: unexpected argument(s): other"),
    ],
    ids=repr,
)
def test_schema_only_tool_validates_like_a_typed_one(arguments: Any, message: str) -> None:
    assert error_of(remote, arguments) == message


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": "string"},
        {"type": "object", "properties": {"a-b": {"type": "string"}}},
        {"type": "object", "properties": {"a": {"type": "date"}}},
        {"type": "object", "properties": {"a": {"enum": [[1]]}}},
    ],
    ids=repr,
)
def test_schema_only_tool_with_a_schema_it_cannot_check_is_refused(
    parameters: dict[str, Any],
) -> None:
    with pytest.raises(UsageError):
        Tool(name="t", description="", parameters=parameters, fn=None, is_async=True)


# --- property: valid arguments validate and round-trip -----------------------------

json_text = st.text(max_size=10)
items = st.fixed_dictionaries({"name": json_text}, optional={"qty": st.integers(-1000, 1000)})
optional_arguments = {
    "count": st.integers(-(2**53), 2**53),
    "ratio": st.integers(-1000, 1000) | st.floats(allow_nan=False, allow_infinity=False),
    "urgent": st.booleans(),
    "color": st.sampled_from(["red", "green"]),
    "level": st.sampled_from([1, 2]),
    "mode": st.sampled_from(["fast", "slow"]),
    "note": st.none() | json_text,
    "order": st.none()
    | st.fixed_dictionaries({"items": st.lists(items, max_size=3)}, optional={"note": json_text}),
    "tags": st.none() | st.dictionaries(json_text, st.integers(-5, 5), max_size=3),
    "either": st.integers(-5, 5) | json_text,
}
place_arguments = st.fixed_dictionaries(
    {"city": json_text, "items": st.lists(items, max_size=3)}, optional=optional_arguments
)
PLACE_DEFAULTS = {
    "count": 1,
    "ratio": 1.0,
    "urgent": False,
    "color": "red",
    "level": 1,
    "mode": "fast",
    "note": None,
    "order": None,
    "tags": None,
    "either": 0,
    "path": [],
    "extra": None,
}


def _filled(arguments: dict[str, Any]) -> dict[str, Any]:
    """What the arguments mean once every default is filled in, nested ones included."""
    out = {**PLACE_DEFAULTS, **arguments}
    out["items"] = [{"qty": 1, **i} for i in out["items"]]
    if out["order"] is not None:
        out["order"] = {
            "note": None,
            "tags": [],
            **out["order"],
            "items": [{"qty": 1, **i} for i in out["order"]["items"]],
        }
    return out


@given(place_arguments)
def test_valid_arguments_round_trip(arguments: dict[str, Any]) -> None:
    kwargs = place.validate(arguments)
    assert converter.unstructure(kwargs) == _filled(arguments)
    assert place.validate_json(arguments) == _filled(arguments)


# JSON has one number type; a float, even 3.0, is still not an int here.
not_an_int = (
    st.text()
    | st.booleans()
    | st.none()
    | st.floats()
    | st.lists(st.integers(), max_size=2)
    | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
)


@given(place_arguments, not_an_int)
def test_a_non_integer_count_is_always_refused(arguments: dict[str, Any], bad: Any) -> None:
    assert error_of(place, {**arguments, "count": bad}).startswith("$.count: ")


# --- the registry ------------------------------------------------------------------


def _other(x: int) -> None:
    pass


def test_registry_keeps_registration_order() -> None:
    a, b, c = (tool(name=n)(_other) for n in ("b_tool", "a_tool", "c_tool"))
    registry = ToolRegistry([a, b])
    registry.add(c)
    assert registry.names() == ["b_tool", "a_tool", "c_tool"]
    assert list(registry) == [a, b, c]
    assert len(registry) == 3
    assert "a_tool" in registry and "zz" not in registry
    assert registry.get("c_tool") is c and registry.get("zz") is None


def test_registry_refuses_a_second_tool_with_the_same_name() -> None:
    registry = ToolRegistry([tool(name="dup")(_other)])
    with pytest.raises(UsageError, match="'dup'"):
        registry.add(tool(name="dup")(_set_free))
    with pytest.raises(UsageError, match="'dup'"):
        ToolRegistry([tool(name="dup")(_other), tool(name="dup")(_set_free)])
    assert len(registry) == 1


# --- module hygiene ----------------------------------------------------------------


def test_tools_imports_only_messages_errors_and_checks_of_ours() -> None:
    package = Path(__file__).parent.parent / "kernel" / "tools"
    ours = set()
    for source in package.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                continue  # a module of the package itself
            if isinstance(node, ast.ImportFrom) and (
                node.level or (node.module or "").startswith("kernel")
            ):
                ours.add(node.module)
            if isinstance(node, ast.Import):
                ours.update(a.name for a in node.names if a.name.startswith("kernel"))
    assert ours <= {"messages", "errors", "_checks"}  # each on floors 0 and 2 only


def test_importing_tools_does_not_load_trio_or_httpx() -> None:
    code = (
        "import sys, kernel.tools; print(sorted(m for m in ('trio', 'httpx') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_evolve_keeps_validation() -> None:
    # The sandbox derives worker-backed tools from typed ones this way.
    evolved = attrs.evolve(place, name="remote_place", invoke=_never, timeout=5)
    assert evolved.validate({"city": "Oslo", "items": [{"name": "tea"}]})["items"] == [Item("tea")]
    assert error_of(evolved, {"items": []}) == "$.city: required argument missing"


# --- a schema-only tool checks arguments as the converter would --------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(-2, 2) | st.sampled_from(["r", "x"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from("nmx"), inner),
    max_leaves=6,
)
place_from_schema = Tool(
    name="place", description="", parameters=place.parameters, fn=None, is_async=True
)


@given(place_arguments, st.sampled_from([*place.parameters["properties"], "nope"]), json_values)
def test_a_schema_only_tool_accepts_what_the_typed_one_does(
    arguments: dict[str, Any], key: str, value: Any
) -> None:
    # The schema's checks (kernel side) and the converter (worker side) must agree,
    # or a worker would get arguments it refuses, or a good call would be refused.
    arguments = {**arguments, key: value}
    try:
        expected: Any = place.validate_json(arguments)
    except ArgumentError:
        expected = ArgumentError
    try:
        got: Any = place_from_schema.validate(arguments)
    except ArgumentError:
        got = ArgumentError
    assert got == expected


@given(
    st.fixed_dictionaries(
        {"path": json_values},
        optional={"mode": json_values, "limit": json_values, "lines": json_values},
    )
)
def test_schema_checks_and_converter_agree_on_any_json(arguments: dict[str, Any]) -> None:
    from kernel.tools._remote import _class_from_schema
    from kernel.tools._strict import STRUCTURE_ERRORS
    from kernel.tools._strict import converter as strict

    cls = _class_from_schema(REMOTE_SCHEMA, "t")
    try:
        strict.structure(arguments, cls)
    except STRUCTURE_ERRORS:
        accepted = False
    else:
        accepted = True
    try:
        remote.validate(arguments)
    except ArgumentError:
        assert not accepted
    else:
        assert accepted


def test_schema_checks_send_the_object_as_is_when_nothing_is_filled_in() -> None:
    arguments = {"path": "a", "mode": "w", "lines": [{"n": 1}], "meta": {"x": 1.5}}
    assert remote.validate(arguments) is arguments
    filled = remote.validate({"path": "a"})
    assert filled == {"path": "a", "mode": "r"}
    # Numbers become what the schema says, as the converter makes them.
    assert remote.validate({"path": "a", "meta": {"x": 1}})["meta"] == {"x": 1.0}


@given(place_arguments, st.sampled_from([*place.parameters["properties"], "nope"]), json_values)
def test_the_fast_path_structures_as_cattrs_generated_code_does(
    arguments: dict[str, Any], key: str, value: Any
) -> None:
    # Tool.validate skips making an instance of the arguments class; the instance's
    # own (generated) structuring code is the reference, values and errors alike.
    from kernel.tools._strict import STRUCTURE_ERRORS, describe_argument_error
    from kernel.tools._strict import converter as strict

    arguments = {**arguments, key: value}
    cls: Any = place._arguments_class
    try:
        instance = strict.structure(arguments, cls)
        expected: Any = {f.name: getattr(instance, f.name) for f in attrs.fields(cls)}
    except STRUCTURE_ERRORS as exc:
        expected = describe_argument_error(exc)
    try:
        got: Any = place.validate(arguments)
    except ArgumentError as exc:
        got = str(exc)
    assert got == expected


async def test_a_tool_failure_of_an_unknown_kind_is_not_silently_rewritten() -> None:
    """Issue 14: ToolFailure("not_found", ...) used to arrive as kind ``exception``
    with no word why; the kinds are fixed, so it is refused where it is raised."""
    from kernel import ToolCall, ToolFailure, run_tool_calls, tool
    from kernel.errors import UsageError

    with pytest.raises(UsageError, match="ToolFailure kind 'not_found' is not one of invalid_call"):
        ToolFailure("not_found", "no such page")  # type: ignore[arg-type]

    @tool
    async def find(page: str) -> str:
        """Find a page."""
        raise ToolFailure("not_found", f"{page}: no such page")  # type: ignore[arg-type]

    @tool
    async def find_typed(page: str) -> str:
        """Find a page."""
        raise ToolFailure("exception", f"{page}: no such page", type="NotFound")

    [bad, good] = await run_tool_calls(
        [ToolCall("1", "find", {"page": "x"}), ToolCall("2", "find_typed", {"page": "x"})],
        [find, find_typed],
    )
    assert bad.error is not None and bad.error.kind == "exception"
    assert "ToolFailure kind 'not_found' is not one of" in bad.content
    assert good.error is not None and (good.error.kind, good.error.type) == (
        "exception",
        "NotFound",
    )


reply = ScriptedModel.reply


def session() -> Session:
    return Session(MemoryStore(), SessionKey("p", "s1"))


async def test_a_tool_failure_of_an_unknown_kind_is_an_exception_observation_saying_so() -> None:
    @tool
    async def find(name: str) -> str:
        """Find a thing."""
        from kernel.tools import ToolFailure

        raise ToolFailure("not_found", f"{name} is not here")  # type: ignore[arg-type]

    model = ScriptedModel([reply(calls=[("find", {"name": "x"})]), "done"])
    s = session()
    result = await Agent(model, [find]).run_turn(s, "q")
    assert result.reason == "final"
    (observation,) = [o for m in await s.messages() for o in m.observations]
    assert observation.error is not None and observation.error.kind == "exception"
    assert "'not_found' is not one of" in observation.content
