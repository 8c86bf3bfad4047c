"""Run the tool calls of one turn concurrently, each failing alone, results in declared order.

``run_tool_calls`` is the heart of the kernel (DESIGN §4):

1. every call is checked before anything runs (ids, tool names, arguments,
   and arguments a transcript could not record: lone surrogates, NaN and
   infinities are ``bad_arguments``, so a call that ran always has a record);
2. results go into ``[None] * n`` slots written by declared index;
3. each call runs in its own task of one nursery, and any ``Exception`` it
   raises becomes an error observation in its own slot;
4. every call has a deadline, sync tools included (they run in threads);
5. concurrency is bounded, ``exclusive`` tools run alone, output is capped;
6. cancelling the batch leaves no task behind and a ``cancelled``
   observation in every unfinished slot; one call can be cancelled by id;
7. ``on_event`` sees calls start and finish in completion order, and
   ``ordered_observations`` releases them in declared order;
8. with tracing on (``kernel.tracing``), every call has an
   ``execute_tool {name}`` span, a child of the span current when the batch
   started, current while the tool runs, and ended with its observation
   (failed with ``error.type`` = the error's kind, and no argument: the
   error's message stays out); off, it costs nothing.

A call's arguments are validated once, in ``_check`` (``Tool.prepare``), and
the tool runs in one place, ``_Batch.run_untraced``, through its runner
(``kernel.tools.ToolRunner``: a function in this task or in a thread, or a
worker): whatever runs a tool, points 3 to 5 hold the same way.
"""

from __future__ import annotations

import contextlib
import json
import json.scanner
import math
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from contextvars import ContextVar
from typing import Any, NamedTuple, TypeAlias, cast

import attrs
import trio

from ._checks import positive
from .errors import UsageError
from .messages import (
    Attachment,
    Observation,
    ToolCall,
    ToolError,
    ToolOutput,
    converter,
    json_problem,
    replace_lone_surrogates,
)
from .tools import (
    ArgumentError,
    AsyncFunctionRunner,
    RunContext,
    SyncFunctionRunner,
    Tool,
    ToolFailure,
    ToolRegistry,
    ToolRunner,
    describe_exception,
)
from .tracing import Span as TraceSpan
from .tracing import enabled as tracing_enabled
from .tracing import start_span as start_trace_span

__all__ = [
    "BatchHandle",
    "CallCanceller",
    "CallEvent",
    "CallFinished",
    "CallLimits",
    "CallStarted",
    "EventCallback",
    "cancelling_calls",
    "only_cancelled",
    "ordered_observations",
    "run_tool_calls",
]

#: The runners' context of a batch without sync tools: nothing to lend, nothing to make.
_NO_THREADS = RunContext()

#: How many tool names an ``unknown_tool`` message lists before it says "and N more".
_MAX_LISTED_NAMES = 40


@attrs.frozen(kw_only=True)
class CallLimits:
    """Limits for one batch.

    Attributes:
        timeout: seconds each call may run, unless its tool sets its own ``timeout``.
        max_concurrency: how many calls run at once (``None``: all of them).
        max_output: bytes of content an observation keeps before it is cut with a
            visible marker, unless the tool sets its own ``max_output`` (``None``: no cap).
        max_threads: worker threads for sync tools in one batch.

    Raises:
        UsageError: a limit that is not a positive number (or integer, for counts).
    """

    timeout: float = attrs.field(default=120.0, validator=positive())
    max_concurrency: int | None = attrs.field(
        default=None, validator=positive(integer=True, optional=True)
    )
    max_output: int | None = attrs.field(
        default=100_000, validator=positive(integer=True, optional=True)
    )
    max_threads: int = attrs.field(default=32, validator=positive(integer=True))


@attrs.frozen
class CallStarted:
    """A call began running (after it got its concurrency slot)."""

    index: int
    call: ToolCall


@attrs.frozen
class CallFinished:
    """A call has its observation; emitted once per call, in completion order."""

    index: int
    observation: Observation


CallEvent: TypeAlias = CallStarted | CallFinished
EventCallback: TypeAlias = Callable[[CallEvent], None]


class BatchHandle:
    """Cancels single calls of a running batch by id.

    Pass it as ``run_tool_calls(..., handle=h)``; ``h.cancel(call_id)`` from any
    task cancels that call alone (it gets a ``cancelled`` observation, the batch
    goes on). A cancel that arrives before the call starts stops it from starting.
    A handle serves one batch.
    """

    def __init__(self) -> None:
        self._bound = False
        # id -> the scope of the call while it waits or runs (None before and after)
        self._scopes: dict[str, trio.CancelScope | None] = {}
        self._requested: set[str] = set()
        self._done: set[str] = set()

    def cancel(self, call_id: str) -> bool:
        """Cancel the call with this id; ``False`` if no such call is still unfinished."""
        if call_id in self._done or (self._bound and call_id not in self._scopes):
            return False
        self._requested.add(call_id)
        scope = self._scopes.get(call_id)
        if scope is not None:
            scope.cancel()
        return True

    def _bind(self, ids: Iterable[str]) -> None:
        if self._bound:
            raise UsageError("a BatchHandle serves one batch; create a new one for each call")
        self._bound = True
        self._scopes = dict.fromkeys(ids)
        # ids asked for that are not in this batch are forgotten
        self._requested &= self._scopes.keys()


class CallCanceller:
    """Cancels single calls, by id, of the batches run in ``cancelling_calls(self)``.

    For a caller that does not run the batches itself: a WebSocket request's
    turn runs one batch per model step, and ``cancel(call_id)`` reaches the
    batch running now. The batches of a call's own work (a ``delegate`` tool's
    sub-agent) are not reached: their call ids are their own.
    """

    def __init__(self) -> None:
        self._batch: BatchHandle | None = None

    def cancel(self, call_id: str) -> bool:
        """Cancel that call; ``False`` if the running batch has no such unfinished call."""
        return self._batch is not None and self._batch.cancel(call_id)

    @contextlib.contextmanager
    def _running(self, handle: BatchHandle | None) -> Iterator[BatchHandle]:
        self._batch = handle or BatchHandle()
        token = _canceller.set(None)  # tasks the batch starts copy this: not theirs
        try:
            yield self._batch
        finally:
            _canceller.reset(token)
            self._batch = None


_canceller: ContextVar[CallCanceller | None] = ContextVar("tak_call_canceller", default=None)


@contextlib.contextmanager
def cancelling_calls(canceller: CallCanceller) -> Iterator[None]:
    """Batches run in this block, and in tasks started from it, answer ``canceller.cancel``."""
    token = _canceller.set(canceller)
    try:
        yield
    finally:
        _canceller.reset(token)


class _Planned(NamedTuple):
    """A call that passed the checks: what to run, with what."""

    slot: int
    call: ToolCall
    tool: Tool
    runner: ToolRunner
    # Validated once, into what the runner takes (Tool.prepare).
    arguments: dict[str, Any]


# A NamedTuple's own __new__ is a Python function around this: one per call, at twice the cost.
_new_planned = tuple.__new__


def _tool_lookup(tools: Sequence[Tool] | ToolRegistry) -> ToolRegistry:
    if isinstance(tools, ToolRegistry):
        return tools
    return ToolRegistry(tools)


class _Plan(NamedTuple):
    """What ``_check`` found: each call's slot (filled for a refused call), what runs."""

    slots: list[Observation | None]
    planned: list[_Planned]
    # How many calls run in threads (they get a limiter), whether any runs alone,
    # whether any has a timeout of its own (else all share the batch's).
    n_sync: int
    any_exclusive: bool
    any_own_timeout: bool


def _check(calls: Sequence[ToolCall], registry: ToolRegistry) -> _Plan:
    """Point 1: find every bad call before anything runs."""
    slots: list[Observation | None] = [None] * len(calls)
    planned: list[_Planned] = []
    n_sync = 0
    any_exclusive = any_own_timeout = False
    # Ids need counting only when two calls share one, which a set tells at once.
    ids_unique = len({call.id for call in calls}) == len(calls)
    id_count: dict[str, int] | None = None

    for index, call in enumerate(calls):
        tool = registry.get(call.name)
        if (
            tool is None
            or not ids_unique
            or not call.id
            or not call.id.strip()
            or (call.index is not None and call.index != index)
        ):
            if id_count is None:
                id_count = {}
                for c in calls:
                    id_count[c.id] = id_count.get(c.id, 0) + 1
            error = _call_error(index, call, id_count, registry)
            if error is not None:
                slots[index] = Observation.failure(call, index, error)
                continue
        assert tool is not None  # _call_error checked it
        try:
            # Structured into a function's parameters, or for a worker (any runner but
            # a function's) checked against the schema and sent on as the JSON it is.
            arguments = tool.prepare(_parse_arguments(call.arguments))
        except ArgumentError as exc:
            slots[index] = Observation.failure(
                call, index, ToolError("bad_arguments", "ArgumentError", str(exc))
            )
            continue
        runner = tool.active_runner
        planned.append(_new_planned(_Planned, (index, call, tool, runner, arguments)))
        if isinstance(runner, SyncFunctionRunner):
            n_sync += 1
        if tool.exclusive:
            any_exclusive = True
        if tool.timeout is not None:
            any_own_timeout = True
    return _Plan(slots, planned, n_sync, any_exclusive, any_own_timeout)


def _call_error(
    index: int, call: ToolCall, id_count: Mapping[str, int], registry: ToolRegistry
) -> ToolError | None:
    if not call.id or not call.id.strip():
        return ToolError("invalid_call", "EmptyId", "the call has an empty id")
    if id_count[call.id] > 1:
        return ToolError(
            "invalid_call",
            "DuplicateId",
            f"{id_count[call.id]} calls in this batch share the id {call.id!r}; ids must be unique",
        )
    if call.index is not None and call.index != index:
        return ToolError(
            "invalid_call",
            "IndexMismatch",
            f"the call declares index {call.index} but stands at position {index}",
        )
    if registry.get(call.name) is None:
        names = registry.names()
        listed = ", ".join(names[:_MAX_LISTED_NAMES]) or "(none)"
        if len(names) > _MAX_LISTED_NAMES:
            listed += f", and {len(names) - _MAX_LISTED_NAMES} more"
        return ToolError(
            "unknown_tool", "UnknownTool", f"no tool named {call.name!r}; available: {listed}"
        )
    return None


class _NotAJSONNumber(ValueError):
    """NaN or an infinity in arguments: JSON has none, and a transcript cannot hold one."""


def _refuse_constant(name: str) -> Any:
    raise _NotAJSONNumber(name)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999
        raise _NotAJSONNumber(text)
    return value


# parse_float runs only for numbers with a fraction or an exponent, parse_constant only
# for NaN and the infinities: arguments without them decode at full speed.
_ARGUMENTS_DECODER = json.JSONDecoder(parse_float=_finite_float, parse_constant=_refuse_constant)
# The scanner decode() runs, called without the two whitespace matches around it. (The
# stub wants a scanner for context; the decoder has every attribute it reads.)
_scan_arguments = json.scanner.make_scanner(_ARGUMENTS_DECODER)  # type: ignore[arg-type]


def _decode(arguments: str) -> Any:
    """``_ARGUMENTS_DECODER.decode(arguments)``, at a third of its cost when the text is
    one JSON value with nothing around it, as models send arguments.

    Raises:
        ValueError, RecursionError: what ``decode`` raises, the same: text that does
            not start with a value, or has more after it, is decoded by ``decode``
            itself, and any other error comes from the scanner it runs.
    """
    try:
        value, end = _scan_arguments(arguments, 0)
    except StopIteration:  # no value at 0 (whitespace first?): decode says what it is
        return _ARGUMENTS_DECODER.decode(arguments)
    if end != len(arguments):  # whitespace or more data after it
        return _ARGUMENTS_DECODER.decode(arguments)
    return value


def _parse_arguments(arguments: dict[str, Any] | str) -> dict[str, Any]:
    """Models send arguments as JSON text; never trust it.

    Whatever a transcript could not record (a lone surrogate, NaN, an infinity)
    is refused here, with its path, for both forms.
    """
    if isinstance(arguments, dict):
        if arguments:  # {} holds nothing to refuse: the common call without arguments
            _refuse_unrecordable(arguments)
        return arguments
    if not isinstance(arguments, str):
        raise ArgumentError(f"$: arguments must be a JSON object, got {_json_type_name(arguments)}")
    if not arguments.strip():
        # Some models send "" for a call without arguments.
        return {}
    try:
        value = _decode(arguments)
    except _NotAJSONNumber as exc:
        raise ArgumentError(_where_not_a_number(arguments, str(exc))) from None
    except ValueError as exc:  # JSONDecodeError, or an integer too long to convert
        raise ArgumentError(f"$: arguments are not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise ArgumentError("$: arguments are nested too deeply") from exc
    if not isinstance(value, dict):
        raise ArgumentError(f"$: arguments must be a JSON object, got {_json_type_name(value)}")
    if not arguments.isascii() or "\\u" in arguments:
        # Only a non-ASCII character or an escape can decode to a surrogate.
        _refuse_unrecordable(value)
    return value


def _where_not_a_number(arguments: str, token: str) -> str:
    """Decode again, accepting NaN and infinities, to say where the first one is."""
    try:
        problem = json_problem(json.loads(arguments))
    except (ValueError, RecursionError):  # broken further on: name the token alone
        problem = None
    return problem or f"$: {token} is not a JSON number"


def _refuse_unrecordable(value: Any) -> None:
    try:
        problem = json_problem(value)
    except RecursionError as exc:
        raise ArgumentError("$: arguments are nested too deeply") from exc
    if problem is not None:
        raise ArgumentError(problem)


def _json_type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array"}.get(
        type(value), type(value).__name__
    )


def render_result(result: Any) -> str:
    """The text the model sees: a ``str`` as is, anything else as JSON (a
    ``ToolOutput`` is not rendered: the executor makes its observation from it).

    Raises:
        TypeError, ValueError: the result cannot be turned into JSON.
    """
    if isinstance(result, str):
        return result
    if isinstance(result, bytes):
        return result.decode("utf-8", errors="replace")
    return json.dumps(
        converter.unstructure(result), ensure_ascii=False, allow_nan=False, sort_keys=False
    )


def truncate_output(content: str, max_bytes: int | None) -> str:
    """Cut ``content`` to ``max_bytes`` of UTF-8, with a marker saying how much was dropped."""
    if max_bytes is None or len(content) * 4 <= max_bytes:
        # UTF-8 takes at most 4 bytes a character: no need to encode to know it fits.
        return content
    encoded = content.encode("utf-8", errors="surrogatepass")
    if len(encoded) <= max_bytes:
        return content
    kept = encoded[:max_bytes].decode("utf-8", errors="ignore")
    kept_bytes = len(kept.encode("utf-8", errors="surrogatepass"))
    return (
        f"{kept}\n[output truncated: showed {kept_bytes} of {len(encoded)} bytes; "
        f"limit {max_bytes} bytes]"
    )


def _groups(planned: Sequence[_Planned]) -> list[list[_Planned]]:
    """Split into runs that may overlap; an exclusive call is a run of its own."""
    groups: list[list[_Planned]] = []
    current: list[_Planned] = []
    for p in planned:
        if p.tool.exclusive:
            if current:
                groups.append(current)
                current = []
            groups.append([p])
        else:
            current.append(p)
    if current:
        groups.append(current)
    return groups


class _Batch:
    """State of one ``run_tool_calls`` invocation."""

    def __init__(
        self,
        calls: Sequence[ToolCall],
        slots: list[Observation | None],
        limits: CallLimits,
        on_event: EventCallback | None,
        handle: BatchHandle | None,
        n_sync: int,
        any_own_timeout: bool,
    ) -> None:
        self.calls = calls
        self.slots = slots
        self.limits = limits
        self.on_event = on_event
        # None when the caller gave none: then nothing can cancel one call by id.
        self.handle = handle
        self.limiter = (
            trio.CapacityLimiter(limits.max_concurrency) if limits.max_concurrency else None
        )
        self.context = (
            RunContext(thread_limiter=trio.CapacityLimiter(min(n_sync, limits.max_threads)))
            if n_sync
            else _NO_THREADS
        )
        self.started_at: dict[int, float] = {}
        # trio.current_time() without the two calls around it: read once per call.
        self.now = trio.lowlevel.current_clock().current_time
        # Only a handle can cancel one call, and only a concurrency limit makes calls
        # of a group start at different times: otherwise calls share deadline scopes.
        self.own_scopes = handle is not None or self.limiter is not None
        self.any_own_timeout = any_own_timeout
        # Traced: each call's span by slot, from its start until its observation.
        self.spans: dict[int, TraceSpan] | None = None
        self.run_call: Callable[[_Planned], Awaitable[None]] = self.run_untraced
        if tracing_enabled():
            self.spans = {}
            self.run_call = self.run_traced

    def finish(self, index: int, observation: Observation) -> None:
        self.slots[index] = observation
        if self.handle is not None:
            self.handle._done.add(self.calls[index].id)
        if self.spans is not None:
            self.end_span(index, observation)
        if self.on_event is not None:
            self.on_event(CallFinished(index, observation))

    async def run_traced(self, p: _Planned) -> None:
        """``run_untraced`` in the call's span (ended by ``finish``, when the result is
        known: a call that timed out gets it after its task was cancelled)."""
        assert self.spans is not None
        span = self.spans[p.slot] = self.start_span(p.call)
        with span.current():
            await self.run_untraced(p)

    def start_span(self, call: ToolCall) -> TraceSpan:
        return start_trace_span(
            f"execute_tool {call.name}",
            {
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": call.name,
                "gen_ai.tool.call.id": call.id,
                "gen_ai.tool.type": "function",
            },
        )

    def end_span(self, index: int, observation: Observation) -> None:
        assert self.spans is not None
        # A call refused or cancelled before it started has a span of no length.
        span = self.spans.pop(index, None) or self.start_span(self.calls[index])
        error = observation.error
        if error is not None:
            # The class, never the message: it can quote the call's arguments.
            span.set_error(error.kind, error.type)
            span.set_attribute("tak.tool.error_type", error.type)
        span.end()

    def timeout_of(self, tool: Tool) -> float:
        return tool.timeout if tool.timeout is not None else self.limits.timeout

    async def run_group(self, group: list[_Planned]) -> None:
        """Run calls that may overlap; return when every one has its observation."""
        if len(group) == 1:
            # Nothing to overlap with: run it in this task, without a nursery.
            await self.run_in_own_scope(group[0])
            return
        if self.own_scopes:
            async with trio.open_nursery() as nursery:
                for p in group:
                    nursery.start_soon(
                        self.run_in_own_scope, p, name=f"tool:{p.call.name}#{p.slot}"
                    )
            return
        if not self.any_own_timeout:
            await self.run_sharing_deadline(self.limits.timeout, group)
            return
        by_timeout: dict[float, list[_Planned]] = {}
        for p in group:
            by_timeout.setdefault(self.timeout_of(p.tool), []).append(p)
        if len(by_timeout) == 1:
            [(timeout, calls)] = by_timeout.items()
            await self.run_sharing_deadline(timeout, calls)
            return
        async with trio.open_nursery() as nursery:
            for timeout, calls in by_timeout.items():
                nursery.start_soon(self.run_sharing_deadline, timeout, calls)

    async def run_sharing_deadline(self, seconds: float, group: list[_Planned]) -> None:
        """Calls that start together with one timeout share one deadline scope.

        A cancel scope per call costs more than the task itself; without a
        concurrency limit or a handle, calls of a group start in the same
        scheduler pass, so one scope (the nursery's own) gives each the same
        deadline.
        """
        run_call = self.run_call
        async with trio.open_nursery() as nursery:
            for p in group:
                nursery.start_soon(run_call, p, name=f"tool:{p.call.name}#{p.slot}")
            # The tasks first run after this (the parent has not checkpointed yet).
            started_at = self.now()
            nursery.cancel_scope.deadline = started_at + seconds
            for p in group:
                self.started_at[p.slot] = started_at
        if nursery.cancel_scope.cancelled_caught:
            for p in group:
                if self.slots[p.slot] is None:
                    self.finish(p.slot, self._timed_out(p, seconds, started_at))

    async def run_in_own_scope(self, p: _Planned) -> None:
        """One call with its own cancel scope: cancellable by id, deadline from its own start."""
        handle = self.handle
        call_id = p.call.id
        if self.limiter is not None:
            # Waiting for a slot can be cancelled by id too.
            with trio.CancelScope() as wait_scope:
                if handle is not None:
                    handle._scopes[call_id] = wait_scope
                    if call_id in handle._requested:
                        wait_scope.cancel()
                await self.limiter.acquire_on_behalf_of(call_id)
            if wait_scope.cancelled_caught:
                self._finish_cancelled_by_request(p, 0.0)
                return
        timeout = self.timeout_of(p.tool)
        try:
            # The deadline counts from the start, not from the wait for a slot.
            started_at = self.started_at[p.slot] = self.now()
            with trio.CancelScope(deadline=started_at + timeout) as scope:
                if handle is not None:
                    handle._scopes[call_id] = scope
                    if call_id in handle._requested:
                        scope.cancel()
                await self.run_call(p)
        finally:
            if self.limiter is not None:
                self.limiter.release_on_behalf_of(call_id)
        if self.slots[p.slot] is None:
            # Our own scope caught the cancellation: a cancel by id, or the deadline.
            if handle is not None and call_id in handle._requested:
                self._finish_cancelled_by_request(p, self.now() - started_at)
            else:
                self.finish(p.slot, self._timed_out(p, timeout, started_at))

    async def run_untraced(self, p: _Planned) -> None:
        """Run the tool and fill its slot; any ``Exception`` becomes the observation.

        Cancellation propagates and leaves the slot empty, for whoever owns the
        scope that was cancelled to fill.
        """
        slot, call, _, runner, arguments = p
        started_at = self.started_at[slot]
        if self.on_event is not None:
            self.on_event(CallStarted(slot, call))
        try:
            # The one place a tool runs, whatever runs it (kernel.tools._runners).
            if type(runner) is AsyncFunctionRunner:
                # What its run() does, without a coroutine around it: the common case.
                result = await runner.fn(**arguments)
            else:
                result = await runner.run(arguments, self.context)
        except BaseException as exc:
            error = _error_of(exc)
            if error is None:
                raise
            observation = self._failure(p, error, started_at)
        else:
            observation = self._success(p, result, started_at)
        self.finish(slot, observation)

    def _timed_out(self, p: _Planned, timeout: float, started_at: float) -> Observation:
        error = ToolError(
            "timeout", "Timeout", f"{p.tool.name} did not finish within {timeout:g} s"
        )
        return self._failure(p, error, started_at)

    def _finish_cancelled_by_request(self, p: _Planned, elapsed: float) -> None:
        error = ToolError("cancelled", "Cancelled", "the call was cancelled by request")
        self.finish(p.slot, Observation.failure(p.call, p.slot, error, duration_s=elapsed))

    def _failure(self, p: _Planned, error: ToolError, started_at: float) -> Observation:
        elapsed = self.now() - started_at
        return Observation.failure(p.call, p.slot, error, duration_s=elapsed)

    def _success(self, p: _Planned, result: Any, started_at: float) -> Observation:
        elapsed = self.now() - started_at
        tool = p.tool
        attachments: tuple[Attachment, ...] = ()
        if type(result) is str:
            content = result  # as render_result gives it, one call sooner: the common case
        elif isinstance(result, ToolOutput):
            # Text and media: an attachment past its caps becomes a line of the text.
            content, attachments = result.for_observation()
        else:
            try:
                content = render_result(result)
            except (TypeError, ValueError, RecursionError) as exc:
                error = ToolError(
                    "exception",
                    type(exc).__name__,
                    f"{tool.name} returned a {type(result).__name__} that cannot be "
                    f"serialized to JSON: {exc}",
                )
                return Observation.failure(p.call, p.slot, error, duration_s=elapsed)
        # The guards of the two calls below, inline: the common content needs neither.
        if not content.isascii():
            # A tool (or a worker) may return half of a UTF-16 pair: make it recordable.
            content = replace_lone_surrogates(content)
        max_output = tool.max_output if tool.max_output is not None else self.limits.max_output
        if max_output is not None and len(content) * 4 > max_output:
            content = truncate_output(content, max_output)
        # Valid by construction (no error): made without running the validator.
        return Observation.success(
            p.call, p.slot, content, duration_s=elapsed, attachments=attachments
        )

    def cancel_unfinished(self) -> None:
        now = self.now()
        error = ToolError(
            "cancelled", "Cancelled", "the turn was cancelled before this call finished"
        )
        for index, slot in enumerate(self.slots):
            if slot is None:
                started_at = self.started_at.get(index, now)
                self.finish(
                    index,
                    Observation.failure(
                        self.calls[index], index, error, duration_s=now - started_at
                    ),
                )


def _error_of(exc: BaseException) -> ToolError | None:
    """What a tool raised, as its observation's error; ``None``: not the call's to report.

    ``Cancelled``, ``KeyboardInterrupt`` and ``SystemExit`` are not (the caller
    re-raises them).
    """
    if isinstance(exc, ToolFailure):
        return ToolError(exc.kind, exc.type, exc.message)
    if isinstance(exc, Exception):
        return ToolError("exception", type(exc).__name__, describe_exception(exc))
    if isinstance(exc, BaseExceptionGroup):
        # The tool's own nursery was cancelled (deadline, cancel by id, or the
        # batch) and some cleanup also failed. The failure is this call's, not
        # the batch's: report it. A cancellation from outside is still pending
        # and fires at the next checkpoint, so nothing is swallowed for good.
        _, failures = exc.split(trio.Cancelled)
        if failures is None or not all(isinstance(e, Exception) for e in _leaves(failures)):
            return None
        return ToolError(
            "exception",
            type(failures).__name__,
            f"failed while being cancelled: {describe_exception(failures)}",
        )
    return None


async def run_tool_calls(
    calls: Sequence[ToolCall],
    tools: Sequence[Tool] | ToolRegistry,
    *,
    limits: CallLimits = CallLimits(),
    on_event: EventCallback | None = None,
    handle: BatchHandle | None = None,
) -> list[Observation]:
    """Run ``calls`` concurrently and return one observation per call, in declared order.

    A failing call (bad id, unknown tool, bad arguments, exception, timeout)
    gets an error observation in its own slot; the others are not disturbed.

    Args:
        calls: the calls of one turn, in the order the model declared them.
        tools: the available tools, as a sequence or a ``ToolRegistry``.
        limits: deadline, concurrency and output limits for the batch.
        on_event: called synchronously (it must not block) with ``CallStarted``
            and ``CallFinished`` events in completion order. On cancellation
            every unfinished call's ``cancelled`` observation is delivered here
            before ``trio.Cancelled`` propagates.
        handle: a ``BatchHandle`` to cancel single calls by id (inside
            ``cancelling_calls``, the ``CallCanceller``'s, when not given).

    Raises:
        trio.Cancelled: the batch was cancelled from outside (every slot still
            got an observation through ``on_event``).
        KeyboardInterrupt, SystemExit: raised by a tool; never swallowed.
    """
    canceller = _canceller.get()
    if canceller is not None:
        with canceller._running(handle) as handle:
            return await run_tool_calls(
                calls, tools, limits=limits, on_event=on_event, handle=handle
            )
    registry = _tool_lookup(tools)
    slots, planned, n_sync, any_exclusive, any_own_timeout = _check(calls, registry)
    if handle is not None:
        handle._bind([p.call.id for p in planned])
    batch = _Batch(calls, slots, limits, on_event, handle, n_sync, any_own_timeout)
    if len(planned) < len(calls):
        for index, slot in enumerate(slots):
            if slot is not None:
                batch.finish(index, slot)

    try:
        for group in _groups(planned) if any_exclusive else [planned]:
            if group:
                await batch.run_group(group)
    except BaseException as exc:
        batch.cancel_unfinished()
        _reraise_unwrapped(exc)
        if isinstance(exc, BaseExceptionGroup) and only_cancelled(exc):
            # The children's Cancelled came from a scope around us, which is still
            # cancelled: this checkpoint raises the caller's own Cancelled, bare,
            # instead of a group of the children's.
            await trio.lowlevel.checkpoint()
        raise

    assert all(slot is not None for slot in slots), "every slot is written before the end"
    return cast(list[Observation], slots)


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


def only_cancelled(exc: BaseException) -> bool:
    """Whether ``exc`` is ``trio.Cancelled``, or a group (of groups) of nothing else."""
    return all(isinstance(e, trio.Cancelled) for e in _leaves(exc))


def _reraise_unwrapped(exc: BaseException) -> None:
    """KeyboardInterrupt or SystemExit from a tool propagates as itself, not inside a group."""
    if not isinstance(exc, BaseExceptionGroup):
        return
    for leaf in _leaves(exc):
        if isinstance(leaf, KeyboardInterrupt | SystemExit):
            raise leaf


@contextlib.asynccontextmanager
async def ordered_observations(
    calls: Sequence[ToolCall],
    tools: Sequence[Tool] | ToolRegistry,
    *,
    limits: CallLimits = CallLimits(),
    on_event: EventCallback | None = None,
    handle: BatchHandle | None = None,
) -> AsyncIterator[trio.MemoryReceiveChannel[Observation]]:
    """Run a batch and receive its observations in declared order as they become ready.

    Observation ``i`` is released as soon as it and every observation before it
    are done::

        async with ordered_observations(calls, tools) as stream:
            async for observation in stream:
                ...

    The batch runs in a nursery owned by this context manager; leaving the block
    early cancels it.
    """
    send, receive = trio.open_memory_channel[Observation](math.inf)
    pending: dict[int, Observation] = {}
    next_index = 0

    def release(event: CallEvent) -> None:
        nonlocal next_index
        if on_event is not None:
            on_event(event)
        if isinstance(event, CallFinished):
            pending[event.index] = event.observation
            while next_index in pending:
                observation = pending.pop(next_index)
                next_index += 1
                # A consumer that left early closed the stream; the batch is being
                # cancelled, and that must not turn into another error.
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    send.send_nowait(observation)

    async def run() -> None:
        async with send:
            await run_tool_calls(calls, tools, limits=limits, on_event=release, handle=handle)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        async with receive:
            yield receive
        nursery.cancel_scope.cancel()
