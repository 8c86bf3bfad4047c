"""run_tool_calls: isolation, declared order, deadlines, limits, cancellation, events."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
import trio
import trio.lowlevel
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel import (
    BatchHandle,
    CallFinished,
    CallLimits,
    CallStarted,
    Observation,
    ToolCall,
    ToolFailure,
    ordered_observations,
    run_tool_calls,
    tool,
)
from kernel.errors import UsageError
from kernel.executor import CallEvent
from kernel.tools import AsyncFunctionRunner, RunContext, Tool


@tool
async def echo(text: str) -> str:
    """Echo text."""
    return text


@tool
async def nap(seconds: float, label: str = "") -> str:
    """Sleep then answer."""
    await trio.sleep(seconds)
    return label or f"slept {seconds}"


@tool
def sync_add(a: int, b: int) -> int:
    """Add in a thread."""
    return a + b


@tool
async def boom(message: str) -> str:
    """Raise."""
    raise RuntimeError(message)


@tool
async def group_boom() -> str:
    """Raise an ExceptionGroup out of the tool's own nursery."""

    async def fail(msg: str) -> None:
        raise ValueError(msg)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(fail, "first")
        nursery.start_soon(fail, "second")
    return "unreachable"


@tool
async def unserializable() -> object:
    """Return something JSON cannot hold."""
    return {1, 2, 3}


@tool
async def denied() -> str:
    """Choose its own error kind."""
    raise ToolFailure("denied", "writing outside the workspace was refused")


@tool
async def dict_result() -> dict[str, Any]:
    """Return structured data."""
    return {"a": [1, 2], "b": None}


@tool(max_output=20)
async def chatty() -> str:
    """Say too much."""
    return "x" * 100


@tool(timeout=2)
async def short_fuse() -> str:
    """Its own deadline is shorter than the batch's."""
    await trio.sleep(10)
    return "never"


TOOLS = [echo, nap, sync_add, boom, group_boom, unserializable, denied, dict_result, chatty]


def call(
    i: int, name: str, arguments: dict[str, Any] | str, call_id: str | None = None
) -> ToolCall:
    return ToolCall(call_id if call_id is not None else f"c{i}", name, arguments, i)


@pytest.fixture(params=["shared-deadline", "handle", "limited"])
def mode(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The executor's scheduling paths: calls sharing a group deadline scope, calls with
    their own scopes (a handle was given), and calls behind a concurrency limit."""
    if request.param == "handle":
        return {"handle": BatchHandle()}
    if request.param == "limited":
        return {"max_concurrency": 1000}
    return {}


def run_kwargs(mode: dict[str, Any], **limits: Any) -> dict[str, Any]:
    kwargs = {k: v for k, v in mode.items() if k == "handle"}
    if "max_concurrency" in mode:
        limits.setdefault("max_concurrency", mode["max_concurrency"])
    kwargs["limits"] = CallLimits(**limits)
    return kwargs


def kinds(observations: list[Observation]) -> list[str | None]:
    return [o.error.kind if o.error else None for o in observations]


async def test_fault_matrix_good_calls_are_untouched(
    thread_clock: trio.abc.Clock, mode: dict[str, Any]
) -> None:
    bad: list[tuple[str, dict[str, Any] | str, str, str | None]] = [
        # (tool, arguments, expected kind, forced id)
        ("echo", {"text": "x"}, "invalid_call", ""),
        ("nowhere", {}, "unknown_tool", None),
        ("echo", '{"text": ', "bad_arguments", None),
        ("echo", "[1, 2]", "bad_arguments", None),
        ("echo", {"text": 5}, "bad_arguments", None),
        ("echo", {"text": "x", "extra": 1}, "bad_arguments", None),
        ("boom", {"message": "kaput"}, "exception", None),
        ("group_boom", {}, "exception", None),
        ("nap", {"seconds": 500}, "timeout", None),
        ("unserializable", {}, "exception", None),
        ("denied", {}, "denied", None),
    ]
    calls: list[ToolCall] = []
    expected: list[tuple[str | None, str | None]] = []  # (kind, exact good content)
    for n, (name, arguments, kind, forced_id) in enumerate(bad):
        i = len(calls)
        calls.append(call(i, "echo", {"text": f"good-{n}"}))
        expected.append((None, f"good-{n}"))
        i = len(calls)
        calls.append(call(i, name, arguments, forced_id))
        expected.append((kind, None))
    i = len(calls)
    calls.append(call(i, "sync_add", '{"a": 40, "b": 2}'))
    expected.append((None, "42"))

    observations = await run_tool_calls(calls, TOOLS, **run_kwargs(mode, timeout=30))

    assert [o.index for o in observations] == list(range(len(calls)))
    assert [o.call_id for o in observations] == [c.id for c in calls]
    for o, (kind, content) in zip(observations, expected, strict=True):
        if kind is None:
            assert o.error is None and not o.is_error
            assert o.content == content
        else:
            assert o.error is not None and o.is_error, o
            assert o.error.kind == kind, o
            assert o.content.startswith(f"Error ({kind}): ")


async def test_error_messages_say_what_was_wrong(
    thread_clock: trio.abc.Clock, mode: dict[str, Any]
) -> None:
    calls = [
        call(0, "nowhere", {}),
        call(1, "echo", '{"text": '),
        call(2, "echo", {"text": 5}),
        call(3, "boom", {"message": "kaput"}),
        call(4, "group_boom", {}),
        call(5, "nap", {"seconds": 99}),
        call(6, "unserializable", {}),
    ]
    obs = await run_tool_calls(calls, TOOLS, **run_kwargs(mode, timeout=3))
    errors = [o.error for o in obs]
    assert all(e is not None for e in errors)
    assert "nowhere" in errors[0].message and "echo, nap, sync_add" in errors[0].message  # type: ignore[union-attr]
    assert "not valid JSON" in errors[1].message  # type: ignore[union-attr]
    assert "$.text" in errors[2].message  # type: ignore[union-attr]
    assert (errors[3].type, errors[3].message) == ("RuntimeError", "kaput")  # type: ignore[union-attr]
    assert errors[4].type == "ExceptionGroup"  # type: ignore[union-attr]
    assert "first" in errors[4].message and "second" in errors[4].message  # type: ignore[union-attr]
    assert errors[5].message == "nap did not finish within 3 s"  # type: ignore[union-attr]
    assert obs[5].duration_s == pytest.approx(3)
    assert "set" in errors[6].message  # type: ignore[union-attr]


async def test_duplicate_ids_all_get_invalid_call() -> None:
    calls = [
        call(0, "echo", {"text": "a"}, "same"),
        call(1, "echo", {"text": "b"}, "other"),
        call(2, "echo", {"text": "c"}, "same"),
    ]
    obs = await run_tool_calls(calls, TOOLS)
    assert kinds(obs) == ["invalid_call", None, "invalid_call"]
    assert "'same'" in obs[0].content
    assert obs[1].content == "b"


async def test_declared_index_must_match_position() -> None:
    calls = [ToolCall("a", "echo", {"text": "a"}, 1), ToolCall("b", "echo", {"text": "b"})]
    obs = await run_tool_calls(calls, TOOLS)
    assert kinds(obs) == ["invalid_call", None]
    assert obs[1].index == 1 and obs[1].content == "b"


async def test_empty_argument_string_means_no_arguments() -> None:
    obs = await run_tool_calls([call(0, "dict_result", "")], TOOLS)
    assert obs[0].content == '{"a": [1, 2], "b": null}'


async def test_output_is_truncated_with_a_visible_marker() -> None:
    obs = await run_tool_calls(
        [call(0, "chatty", {}), call(1, "echo", {"text": "y" * 50})],
        TOOLS,
        limits=CallLimits(max_output=30),
    )
    assert obs[0].content.startswith("x" * 20 + "\n[output truncated: showed 20 of 100 bytes")
    assert obs[1].content.startswith("y" * 30 + "\n[output truncated: showed 30 of 50 bytes")
    assert not obs[0].is_error


async def test_truncation_never_splits_a_character() -> None:
    obs = await run_tool_calls(
        [call(0, "echo", {"text": "é" * 10})], TOOLS, limits=CallLimits(max_output=5)
    )
    assert obs[0].content.startswith("éé\n[output truncated: showed 4 of 20 bytes")


async def test_tool_timeout_overrides_the_batch(
    autojump_clock: trio.abc.Clock, mode: dict[str, Any]
) -> None:
    obs = await run_tool_calls(
        [call(0, "short_fuse", {}), call(1, "nap", {"seconds": 5})],
        [short_fuse, nap],
        **run_kwargs(mode, timeout=100),
    )
    assert kinds(obs) == ["timeout", None]
    assert obs[0].duration_s == pytest.approx(2)


async def test_sync_tool_that_blocks_still_times_out(
    thread_clock: trio.abc.Clock, mode: dict[str, Any]
) -> None:
    release = threading.Event()

    @tool
    def stuck() -> str:
        """Block the thread until released."""
        release.wait(10)
        return "late"

    try:
        start = trio.current_time()
        obs = await run_tool_calls(
            [call(0, "stuck", {}), call(1, "sync_add", {"a": 1, "b": 1})],
            [stuck, sync_add],
            **run_kwargs(mode, timeout=5),
        )
        assert trio.current_time() - start == pytest.approx(5)
        assert kinds(obs) == ["timeout", None]
        assert obs[1].content == "2"
    finally:
        release.set()


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
async def test_keyboard_interrupt_and_system_exit_propagate(
    exc_type: type[BaseException], mode: dict[str, Any]
) -> None:
    @tool
    async def interrupt() -> str:
        """Raise a BaseException."""
        await trio.lowlevel.checkpoint()
        raise exc_type()

    finished: list[CallEvent] = []
    with pytest.raises(exc_type):
        await run_tool_calls(
            [call(0, "nap", {"seconds": 100}), call(1, "interrupt", {})],
            [nap, interrupt],
            on_event=finished.append,
            **run_kwargs(mode),
        )
    # the sibling was cancelled and still got its observation
    done = {e.index: e.observation for e in finished if isinstance(e, CallFinished)}
    assert done[0].error is not None and done[0].error.kind == "cancelled"


async def test_keyboard_interrupt_from_a_sync_tool_propagates() -> None:
    @tool
    def interrupt_sync() -> str:
        """Raise KeyboardInterrupt in a worker thread."""
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        await run_tool_calls([call(0, "interrupt_sync", {})], [interrupt_sync])


def _running_tool_tasks() -> list[trio.lowlevel.Task]:
    found: list[trio.lowlevel.Task] = []

    def walk(task: trio.lowlevel.Task) -> Iterator[trio.lowlevel.Task]:
        yield task
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                yield from walk(child)

    for task in walk(trio.lowlevel.current_root_task()):  # type: ignore[arg-type]
        if task.name.startswith("tool:"):
            found.append(task)
    return found


async def test_batch_cancellation_leaves_no_task_and_no_slot_empty(
    autojump_clock: trio.abc.Clock, mode: dict[str, Any]
) -> None:
    events: list[CallEvent] = []
    calls = [
        call(0, "nap", {"seconds": 1}),
        call(1, "nap", {"seconds": 50}),
        call(2, "echo", {"text": 5}),  # bad arguments: finished before anything runs
        call(3, "nap", {"seconds": 70}),
    ]
    seen_inside: list[int] = []
    caught: list[type[BaseException]] = []

    async def watch() -> None:
        await trio.sleep(10)
        seen_inside.append(len(_running_tool_tasks()))

    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            scope.deadline = trio.current_time() + 20
            try:
                await run_tool_calls(calls, TOOLS, on_event=events.append, **run_kwargs(mode))
            except BaseException as exc:
                caught.append(type(exc))
                # counted before the enclosing nursery closes: a task the executor
                # left behind (or started elsewhere) would still be visible here
                seen_inside.append(len(_running_tool_tasks()))
                raise
    assert scope.cancelled_caught
    # the caller sees trio.Cancelled itself, not a group of the children's
    assert caught == [trio.Cancelled]
    assert seen_inside == [2, 0]
    finished = {e.index: e.observation for e in events if isinstance(e, CallFinished)}
    assert sorted(finished) == [0, 1, 2, 3]
    assert kinds([finished[i] for i in range(4)]) == [
        None,
        "cancelled",
        "bad_arguments",
        "cancelled",
    ]
    started = [e.index for e in events if isinstance(e, CallStarted)]
    assert sorted(started) == [0, 1, 3]


async def test_cancelled_inside_a_shielded_scope_can_persist_the_turn(
    autojump_clock: trio.abc.Clock,
) -> None:
    """What the agent loop does: on cancel, persist the complete turn under a shield."""
    persisted: list[list[str | None]] = []
    events: list[CallEvent] = []
    with trio.move_on_after(5):
        try:
            await run_tool_calls(
                [call(0, "nap", {"seconds": 1}), call(1, "nap", {"seconds": 9})],
                TOOLS,
                on_event=events.append,
            )
        except trio.Cancelled:
            with trio.CancelScope(shield=True):
                await trio.sleep(1)  # a store write
                obs = {e.index: e.observation for e in events if isinstance(e, CallFinished)}
                persisted.append(kinds([obs[0], obs[1]]))
            raise
    assert persisted == [[None, "cancelled"]]


async def test_cancel_one_call_by_id(autojump_clock: trio.abc.Clock) -> None:
    handle = BatchHandle()
    calls = [
        call(0, "nap", {"seconds": 3, "label": "a"}),
        call(1, "nap", {"seconds": 100, "label": "b"}),
        call(2, "nap", {"seconds": 5, "label": "c"}),
    ]
    result: list[Observation] = []

    async def run() -> None:
        result.extend(await run_tool_calls(calls, TOOLS, handle=handle))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await trio.sleep(1)
        assert handle.cancel("c1") is True
        assert handle.cancel("nope") is False
    assert kinds(result) == [None, "cancelled", None]
    assert [o.content for o in (result[0], result[2])] == ["a", "c"]
    assert result[1].duration_s == pytest.approx(1)
    assert handle.cancel("c1") is False  # already finished


async def test_cancel_by_id_before_the_call_starts(autojump_clock: trio.abc.Clock) -> None:
    handle = BatchHandle()
    handle.cancel("c1")
    obs = await run_tool_calls(
        [call(0, "nap", {"seconds": 1}), call(1, "nap", {"seconds": 1})],
        TOOLS,
        handle=handle,
    )
    assert kinds(obs) == [None, "cancelled"]
    with pytest.raises(UsageError):
        await run_tool_calls([], TOOLS, handle=handle)


async def test_concurrency_limit_is_reached_and_never_exceeded(
    autojump_clock: trio.abc.Clock,
) -> None:
    in_flight = 0
    highest = 0

    @tool
    async def tracked(i: int) -> int:
        """Count concurrent calls."""
        nonlocal in_flight, highest
        in_flight += 1
        highest = max(highest, in_flight)
        await trio.sleep(1 + (i % 3))
        in_flight -= 1
        return i

    calls = [call(i, "tracked", {"i": i}) for i in range(40)]
    obs = await run_tool_calls(calls, [tracked], limits=CallLimits(max_concurrency=7))
    assert highest == 7
    assert [o.content for o in obs] == [str(i) for i in range(40)]


async def test_deadline_counts_from_start_not_from_queueing(
    autojump_clock: trio.abc.Clock,
) -> None:
    calls = [call(i, "nap", {"seconds": 4}) for i in range(4)]
    obs = await run_tool_calls(calls, TOOLS, limits=CallLimits(timeout=5, max_concurrency=1))
    assert kinds(obs) == [None] * 4


async def test_exclusive_tool_is_a_barrier(autojump_clock: trio.abc.Clock) -> None:
    spans: dict[str, tuple[float, float]] = {}

    async def record(label: str, seconds: float) -> str:
        start = trio.current_time()
        await trio.sleep(seconds)
        spans[label] = (start, trio.current_time())
        return label

    @tool
    async def work(label: str, seconds: float) -> str:
        """Parallel work."""
        return await record(label, seconds)

    @tool(exclusive=True)
    async def alone(label: str, seconds: float) -> str:
        """Runs by itself."""
        return await record(label, seconds)

    calls = [
        call(0, "work", {"label": "a", "seconds": 3}),
        call(1, "work", {"label": "b", "seconds": 1}),
        call(2, "alone", {"label": "X", "seconds": 2}),
        call(3, "work", {"label": "c", "seconds": 1}),
        call(4, "work", {"label": "d", "seconds": 2}),
        call(5, "alone", {"label": "Y", "seconds": 1}),
    ]
    obs = await run_tool_calls(calls, [work, alone])
    assert [o.content for o in obs] == ["a", "b", "X", "c", "d", "Y"]
    assert spans["a"][0] == spans["b"][0]  # a and b overlap
    assert max(spans["a"][1], spans["b"][1]) <= spans["X"][0]
    assert spans["X"][1] <= min(spans["c"][0], spans["d"][0])
    assert spans["c"][0] == spans["d"][0]
    assert max(spans["c"][1], spans["d"][1]) <= spans["Y"][0]


async def test_events_in_completion_order_once_each(
    autojump_clock: trio.abc.Clock, mode: dict[str, Any]
) -> None:
    events: list[CallEvent] = []
    calls = [
        call(0, "nap", {"seconds": 3}),
        call(1, "nap", {"seconds": 1}),
        call(2, "nowhere", {}),
        call(3, "nap", {"seconds": 2}),
    ]
    await run_tool_calls(calls, TOOLS, on_event=events.append, **run_kwargs(mode))
    finished = [e.index for e in events if isinstance(e, CallFinished)]
    assert finished == [2, 1, 3, 0]
    started = [e.index for e in events if isinstance(e, CallStarted)]
    assert sorted(started) == [0, 1, 3]
    # each call's start precedes its finish
    position = {(type(e).__name__, e.index): n for n, e in enumerate(events)}
    for i in (0, 1, 3):
        assert position[("CallStarted", i)] < position[("CallFinished", i)]


async def test_ordered_stream_releases_each_as_soon_as_earlier_ones_are_done(
    autojump_clock: trio.abc.Clock,
) -> None:
    calls = [
        call(0, "nap", {"seconds": 1}),
        call(1, "nap", {"seconds": 5}),
        call(2, "nap", {"seconds": 2}),
        call(3, "nap", {"seconds": 7}),
    ]
    released: list[tuple[int, float]] = []
    start = trio.current_time()
    async with ordered_observations(calls, TOOLS) as stream:
        async for observation in stream:
            released.append((observation.index, trio.current_time() - start))
    assert released == [(0, 1), (1, 5), (2, 5), (3, 7)]


async def test_leaving_the_ordered_stream_early_cancels_the_rest(
    autojump_clock: trio.abc.Clock,
) -> None:
    calls = [call(0, "nap", {"seconds": 1}), call(1, "nap", {"seconds": 1000})]
    start = trio.current_time()
    async with ordered_observations(calls, TOOLS) as stream:
        async for observation in stream:
            assert observation.index == 0
            break
    # leaving did not wait for the 1000 s call: it was cancelled
    assert trio.current_time() - start == pytest.approx(1)


async def test_ten_thousand_calls_in_one_batch() -> None:
    calls = [call(i, "echo", {"text": str(i)}) for i in range(10_000)]
    obs = await run_tool_calls(calls, TOOLS)
    assert [o.content for o in obs] == [str(i) for i in range(10_000)]


async def test_tools_may_be_given_as_a_registry_or_a_sequence() -> None:
    from kernel import ToolRegistry

    for tools in (ToolRegistry([echo]), [echo], (echo,)):
        obs = await run_tool_calls([call(0, "echo", {"text": "hi"})], tools)
        assert obs[0].content == "hi"


def test_call_limits_reject_nonsense() -> None:
    with pytest.raises(UsageError, match="timeout"):
        CallLimits(timeout=0)
    with pytest.raises(UsageError, match="max_concurrency"):
        CallLimits(max_concurrency=-1)


@attrs.frozen
class Point:
    x: int
    y: int


async def test_structured_results_are_json() -> None:
    @tool
    async def point() -> Point:
        """An attrs result."""
        return Point(1, 2)

    obs = await run_tool_calls([call(0, "point", {})], [point])
    assert obs[0].content == '{"x": 1, "y": 2}'


@settings(max_examples=60, deadline=None)
@given(
    delays=st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=30),
    failing=st.sets(st.integers(min_value=0, max_value=29)),
)
def test_any_completion_order_gives_declared_order(delays: list[int], failing: set[int]) -> None:
    @tool
    async def step(i: int, ms: int, fail: bool) -> int:
        """Sleep ms milliseconds, maybe fail."""
        await trio.sleep(ms / 1000)
        if fail:
            raise ValueError(f"step {i} failed")
        return i

    calls = [
        call(i, "step", {"i": i, "ms": ms, "fail": i in failing}) for i, ms in enumerate(delays)
    ]
    completion: list[int] = []

    def on_event(event: CallEvent) -> None:
        if isinstance(event, CallFinished):
            completion.append(event.index)

    obs = trio.run(
        lambda: run_tool_calls(calls, [step], on_event=on_event),
        clock=trio.testing.MockClock(autojump_threshold=0),
    )
    assert [o.index for o in obs] == list(range(len(delays)))
    for i, o in enumerate(obs):
        if i in failing:
            assert o.error is not None and o.content == f"Error (exception): step {i} failed"
        else:
            assert o.content == str(i)
    # completion order follows the delays (ties broken arbitrarily)
    assert [delays[i] for i in completion] == sorted(delays)


async def test_a_batch_of_one_is_cancelled_with_the_callers_own_cancelled(
    autojump_clock: trio.abc.Clock,
) -> None:
    events: list[CallEvent] = []
    with trio.move_on_after(3) as scope:
        try:
            await run_tool_calls([call(0, "nap", {"seconds": 10})], TOOLS, on_event=events.append)
        except trio.Cancelled as exc:
            assert exc.source == "deadline"
            raise
    assert scope.cancelled_caught
    finished = [e.observation for e in events if isinstance(e, CallFinished)]
    assert kinds(finished) == ["cancelled"]
    assert finished[0].duration_s == pytest.approx(3)


async def test_a_batch_of_one_times_out(autojump_clock: trio.abc.Clock) -> None:
    obs = await run_tool_calls(
        [call(0, "nap", {"seconds": 10})], TOOLS, limits=CallLimits(timeout=4)
    )
    assert kinds(obs) == ["timeout"]
    assert obs[0].duration_s == pytest.approx(4)


async def test_a_cleanup_that_fails_while_timing_out_is_that_calls_observation(
    autojump_clock: trio.abc.Clock, mode: dict[str, Any]
) -> None:
    @tool
    async def messy() -> str:
        """Its own nursery's cleanup raises when the deadline cancels it."""

        async def child() -> None:
            try:
                await trio.sleep_forever()
            finally:
                raise OSError("could not close the connection")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(child)
            await trio.sleep_forever()  # so the group holds Cancelled and the OSError
        return "unreachable"

    obs = await run_tool_calls(
        [call(0, "messy", {}), call(1, "nap", {"seconds": 1}), call(2, "messy", {})],
        [messy, nap],
        **run_kwargs(mode, timeout=5),
    )
    assert kinds(obs) == ["exception", None, "exception"]
    assert "failed while being cancelled" in obs[0].content
    assert "could not close the connection" in obs[0].content
    assert obs[1].content == "slept 1.0"


@pytest.mark.parametrize("arguments", [None, 42, [1, 2]])
async def test_arguments_of_the_wrong_type_are_bad_arguments(arguments: Any) -> None:
    bad = ToolCall.__new__(ToolCall)
    object.__setattr__(bad, "id", "x")
    object.__setattr__(bad, "name", "echo")
    object.__setattr__(bad, "arguments", arguments)
    object.__setattr__(bad, "index", 0)
    obs = await run_tool_calls([bad, call(1, "echo", {"text": "fine"})], TOOLS)
    assert kinds(obs) == ["bad_arguments", None]
    assert "arguments must be a JSON object" in obs[0].content


@pytest.mark.parametrize(
    "limits",
    [
        {"timeout": None},
        {"timeout": True},
        {"max_threads": None},
        {"max_concurrency": 2.5},
        {"max_output": 0},
    ],
)
def test_call_limits_name_the_bad_field(limits: dict[str, Any]) -> None:
    with pytest.raises(UsageError, match=f"CallLimits.{next(iter(limits))}"):
        CallLimits(**limits)


# --- the runner seam: one place where a tool runs -----------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "mode": {"enum": ["r", "w"], "default": "r"},
        "size": {"type": "number"},
    },
    "required": ["path"],
    "additionalProperties": False,
}


@attrs.define
class RecordingRunner:
    """A runner of our own (a mock transport, in httpx's terms): records what it got."""

    received: list[tuple[dict[str, Any], RunContext]] = attrs.Factory(list)

    async def run(self, arguments: dict[str, Any], ctx: RunContext) -> Any:
        self.received.append((arguments, ctx))
        if arguments["path"] == "fail":
            raise ToolFailure("denied", "not there")
        return {"read": arguments["path"]}


async def test_a_custom_runner_gets_the_validated_json_once() -> None:
    runner = RecordingRunner()
    t = Tool(
        name="fs.read", description="", parameters=SCHEMA, fn=None, is_async=True, runner=runner
    )
    assert t.active_runner is runner
    obs = await run_tool_calls(
        [
            call(0, "fs.read", '{"path": "a", "size": 2}'),
            call(1, "fs.read", {"path": "fail"}),
            call(2, "fs.read", {"path": 3}),
        ],
        [t],
    )
    assert [o.content for o in obs[:2]] == ['{"read": "a"}', "Error (denied): not there"]
    assert kinds(obs) == [None, "denied", "bad_arguments"]
    assert obs[2].error is not None and obs[2].error.message == "$.path: expected str, got int"
    # Parsed, checked, defaults filled in, numbers as the schema says; never structured.
    # (In whatever order the calls started.)
    assert sorted((arguments for arguments, _ in runner.received), key=str) == [
        {"path": "a", "size": 2.0, "mode": "r"},
        {"path": "fail", "mode": "r"},
    ]


async def test_a_remote_tool_is_sent_the_callers_json_object_as_is() -> None:
    received: list[dict[str, Any]] = []

    async def invoke(arguments: dict[str, Any]) -> Any:
        received.append(arguments)
        return "ok"

    remote = Tool(
        name="fs.read", description="", parameters=SCHEMA, fn=None, is_async=True, invoke=invoke
    )
    arguments = {"path": "a", "mode": "w", "size": 1.5}
    [obs] = await run_tool_calls([call(0, "fs.read", arguments)], [remote])
    assert obs.content == "ok"
    assert received[0] is arguments  # nothing to fill in: not even copied


async def test_sync_tools_run_in_threads_bounded_by_the_batch(
    thread_clock: trio.abc.Clock,
) -> None:
    seen: set[int] = set()

    @tool
    def where() -> int:
        """Which thread."""
        seen.add(threading.get_ident())
        return 1

    obs = await run_tool_calls([call(i, "where", {}) for i in range(4)], [where])
    assert kinds(obs) == [None] * 4
    assert threading.get_ident() not in seen


async def test_a_runner_that_extends_the_async_function_runner_is_called_through_run() -> None:
    """An ``async def`` tool's runner is awaited inline (what its ``run`` does); a
    subclass that changes ``run`` is still called through it."""

    @attrs.frozen
    class Wrapping(AsyncFunctionRunner):
        async def run(self, arguments: dict[str, Any], ctx: RunContext) -> Any:
            return f"wrapped {await self.fn(**arguments)}"

    wrapped = Tool(
        name="echo",
        description="",
        parameters=echo.parameters,
        fn=echo.fn,
        is_async=True,
        runner=Wrapping(echo.fn),  # type: ignore[arg-type]
    )
    for tools, expected in (([echo], "hi"), ([wrapped], "wrapped hi")):
        obs = await run_tool_calls([call(0, "echo", {"text": "hi"})], tools)
        assert [o.content for o in obs] == [expected]


ARGUMENT_TEXTS = [
    '{"a": 1}', '{"a": [1, 2.5, "x"]}', "{}", '{"a": NaN}', '{"a": 1e999}', "[1]", '"s"', "3",
    '{"a": ', '{"a" 1}', '{"\\ud800": 1}', "nul",
]  # fmt: skip


def _decoded(decode: Any, text: str) -> tuple[str, Any]:
    try:
        return "value", decode(text)
    except (ValueError, RecursionError) as exc:
        return type(exc).__name__, str(exc)


@settings(max_examples=400)
@given(
    st.one_of(
        st.text(max_size=30),
        st.builds(
            lambda pad, value, tail: pad + value + tail,
            st.sampled_from(["", " ", "\n\t"]),
            st.sampled_from(ARGUMENT_TEXTS),
            st.sampled_from(["", " ", "\n", "x", "{}", ", 1"]),
        ),
    )
)
def test_arguments_text_decodes_as_the_json_decoder_does(text: str) -> None:
    """The executor scans one JSON value without ``decode``'s whitespace matches around
    it (guarantee 1's cost); any text, padded or broken, decodes to the same value or
    fails with the same error and message as ``decode`` itself."""
    from kernel.executor import _ARGUMENTS_DECODER, _decode

    assert _decoded(_decode, text) == _decoded(_ARGUMENTS_DECODER.decode, text)
