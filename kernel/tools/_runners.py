"""How a tool runs: the one seam between the executor and whatever does the work.

A runner has one method, ``async def run(arguments, ctx)``, in the manner of
httpx's transports: the executor validates a call's arguments, then awaits
``tool.active_runner.run(arguments, ctx)`` in exactly one place, inside the
call's deadline and its error handling. Three runners come with the kernel:

- ``AsyncFunctionRunner``: an ``async def`` tool, awaited in the call's task;
- ``SyncFunctionRunner``: a plain ``def`` tool, in a worker thread (so the
  call's deadline holds for it too);
- ``RemoteRunner``: a tool served elsewhere (a sandbox worker), reached by an
  ``invoke(arguments)`` coroutine function.

A function runner gets the keyword arguments of its function, structured
once by the tool's converter; any other runner (remote or your own) gets the
validated JSON object, defaults filled in, to send on as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import attrs

if TYPE_CHECKING:
    import trio


@attrs.frozen
class RunContext:
    """What the executor lends the runners of one batch.

    Attributes:
        thread_limiter: bounds the worker threads of sync tools in the batch
            (``None``: Trio's default limiter).
    """

    thread_limiter: trio.CapacityLimiter | None = None


class ToolRunner(Protocol):
    """Runs one call of a tool with arguments already validated.

    ``run`` returns the result (rendered for the model by the executor) or
    raises: ``ToolFailure`` to choose the observation's error kind, any other
    ``Exception`` for an ``exception`` observation. It must let
    ``trio.Cancelled`` through: the executor's cancel scope is the deadline.
    """

    async def run(self, arguments: dict[str, Any], ctx: RunContext) -> Any: ...


@attrs.frozen
class AsyncFunctionRunner:
    """Awaits an ``async def`` tool function in the call's own task.

    The executor awaits ``fn(**arguments)`` itself for this class (what ``run``
    does, one coroutine less per call); a subclass is called through ``run``.
    """

    fn: Callable[..., Awaitable[Any]]

    async def run(self, arguments: dict[str, Any], ctx: RunContext) -> Any:
        return await self.fn(**arguments)


@attrs.frozen
class SyncFunctionRunner:
    """Runs a plain function in a worker thread, abandoned (not waited for) on cancel.

    A thread cannot be interrupted: on a deadline the call ends at once and
    the thread finishes in the background, its result dropped.
    """

    fn: Callable[..., Any]

    async def run(self, arguments: dict[str, Any], ctx: RunContext) -> Any:
        # Here, not at the top: importing kernel.tools must not load Trio (workers,
        # `import kernel`); by the time a call runs, the executor has loaded it.
        import trio

        return await trio.to_thread.run_sync(
            functools.partial(self.fn, **arguments),
            abandon_on_cancel=True,
            limiter=ctx.thread_limiter,
        )


@attrs.frozen
class RemoteRunner:
    """Forwards the validated JSON arguments to ``invoke`` (a worker's call), as they are."""

    invoke: Callable[[dict[str, Any]], Awaitable[Any]]

    async def run(self, arguments: dict[str, Any], ctx: RunContext) -> Any:
        return await self.invoke(arguments)


@attrs.frozen
class _NothingToRun:
    """A tool made from a schema alone, with neither a function nor a way to reach one."""

    name: str

    async def run(self, arguments: dict[str, Any], ctx: RunContext) -> Any:
        raise RuntimeError(f"tool {self.name!r} has no function, invoke or runner to run it")
