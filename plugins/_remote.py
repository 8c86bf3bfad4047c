"""A plugin's permissions as a sandbox ``Policy``, and a worker's tools as ``Tool`` objects.

The sandbox knows neither ``Permissions`` nor ``Tool`` (it is the floor below):
the host maps the one onto ``Policy`` here (``policy_for``), and builds each
remote tool once, from the ``ToolSpec`` its worker's greeting (or the plugin
imported in the kernel) gave (``remote_tool``). Its ``invoke`` passes the
caller's session key to ``Worker.invoke`` and turns a ``WorkerCallError`` into
the ``ToolFailure`` the executor reports.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from kernel.errors import UsageError
from kernel.messages import ERROR_KINDS, ErrorKind
from kernel.plugin import Permissions, context
from kernel.tools import Tool, ToolFailure
from sandbox import Policy, ToolSpec, Worker, WorkerCallError


def policy_for(permissions: Permissions) -> Policy:
    """The sandbox ``Policy`` of a worker running a plugin with ``permissions``."""
    network: Any = permissions.network  # Policy's tuple converter hides its type from mypy
    return Policy(
        workspace=permissions.workspace, network=network, subprocess=permissions.subprocess
    )


def _session_of_caller() -> str | None:
    """The session key of the ``kernel.context()`` the call runs in, if any."""
    try:
        return context().session
    except UsageError:
        return None


def _failure(exc: WorkerCallError) -> ToolFailure:
    # The worker runs untrusted code: a kind the kernel does not know is an exception.
    kind: ErrorKind = exc.kind if exc.kind in ERROR_KINDS else "exception"
    return ToolFailure(kind, exc.message, type=exc.type)


def remote_tool(
    spec: ToolSpec, worker: Worker, after: Callable[[], Awaitable[None]] | None = None
) -> Tool:
    """The tool ``spec`` describes, run in ``worker``, under the plugin's name for it.

    ``after`` runs when each call has returned or failed (the disk budget check of a
    plugin that writes the workspace); a failure it raises replaces the call's result.

    Raises:
        UsageError: the spec is not a valid tool (its name, limits or schema).
    """
    name = spec.name

    async def invoke(arguments: dict[str, Any]) -> Any:
        try:
            value = await worker.invoke(name, arguments, session=_session_of_caller())
        except WorkerCallError as exc:
            if after is not None:
                await after()  # a failed call may have written too: over budget wins
            raise _failure(exc) from None
        if after is not None:
            await after()
        return value

    return Tool(
        name=name,
        description=spec.description,
        parameters=spec.parameters,
        fn=None,
        is_async=True,
        timeout=spec.timeout,
        exclusive=spec.exclusive,
        max_output=spec.max_output,
        invoke=invoke,
    )


def remote_tools(worker: Worker) -> list[Tool]:
    """The tools of a started worker (``WorkerPool.start``), ready for the executor.

    Raises:
        UsageError: a spec from its greeting is not a valid tool.
    """
    return [remote_tool(spec, worker) for spec in worker.specs]
