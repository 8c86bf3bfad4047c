"""What every ``tak`` command shares: the home, the workspace and the plugin host
it opens, the hints it prints (runnable as printed), and one-line failures of the
operating system's. Not a command: each command module imports from here.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import KernelError
from ..terminal import escape_terminal
from ._exit import os_error_line, single_leaf

if TYPE_CHECKING:
    from plugins import McpServers, PluginHost, PluginLoadError, SkipReport

    from ..home import Config, TakHome


def tak_command(*words: str) -> str:
    """``tak WORDS...`` runnable as printed (``.venv/bin/tak ...`` when ``tak`` is not on
    ``PATH``): every hint a command prints is made here (``plugins.tak_command``)."""
    from plugins import tak_command

    return tak_command(*words)


def home_option(home: str | None) -> tuple[str, ...]:
    """``--home HOME`` for a hint, unless the home is the default (``~/.tak``).

    ``home`` is ``--home`` as given (a hint is pasted where the command ran); a home
    from ``$TAK_HOME`` is named absolute, as another terminal may not have it set.
    """
    if home is not None:
        return ("--home", home)
    if os.environ.get("TAK_HOME"):
        from ..home import TakHome

        return ("--home", str(TakHome.locate(None).root))
    return ()


def ensure_home(home: str | None) -> TakHome:
    """The home (``--home``, ``$TAK_HOME``, ``~/.tak``), its directories created.

    Raises:
        UsageError: they cannot be (a read-only home, one below a file): one line
            naming the path and the system's reason.
    """
    from ..errors import UsageError
    from ..home import TakHome

    located = TakHome.locate(home)
    try:
        return located.ensure()
    except OSError as exc:
        raise UsageError(f"TAK_HOME {located.root} is not usable: {os_error_line(exc)}") from exc


@contextlib.contextmanager
def os_errors_as(prefix: str) -> Iterator[None]:
    """Raise an ``OSError`` from the block (alone in groups) as a ``KernelError`` whose
    one line starts with ``prefix`` (a workspace, the home): the path alone can be
    relative to a directory the message would not name."""
    try:
        yield
    except BaseException as exc:
        leaf = single_leaf(exc)
        if isinstance(leaf, OSError) and not isinstance(leaf, BrokenPipeError):
            raise KernelError(f"{prefix}: {os_error_line(leaf)}") from leaf
        raise


def workspace_or_exit(command: str, args: argparse.Namespace) -> Path | None:
    """``--workspace`` or the home's; ``None`` (after saying why) when it is not a directory.

    Raises:
        UsageError: the home's workspace cannot be created (``ensure_home``).
    """
    workspace: Path | None = getattr(args, "workspace", None)
    if workspace is not None and not workspace.is_dir():
        print(
            escape_terminal(f"{command}: --workspace {workspace}: not a directory"),
            file=sys.stderr,
        )
        return None
    if workspace is None:
        workspace = ensure_home(args.home).workspace
    return workspace.absolute()


@contextlib.asynccontextmanager
async def open_cli_host(
    home: str | None,
    workspace: Path,
    extra_plugins: Sequence[str] = (),
    *,
    report: SkipReport = "line",
) -> AsyncIterator[PluginHost]:
    """The plugin host ``tak`` commands use: built-ins, discovered plugins, ``--plugin``.

    Raises:
        KernelError: ``tak.toml`` is wrong or cannot be read, or the workspace cannot be
            prepared (one line naming the home or the workspace).
    """
    import trio

    from ..home import TakHome

    tak_home = TakHome.locate(home)
    with os_errors_as(f"TAK_HOME {tak_home.root}"):
        # file I/O: off the Trio thread
        config = await trio.to_thread.run_sync(tak_home.read_config)
    async with _open_host(tak_home, config, workspace, extra_plugins, report=report) as host:
        yield host


@contextlib.asynccontextmanager
async def open_cli_tools(
    home: str | None, workspace: Path, extra_plugins: Sequence[str] = ()
) -> AsyncIterator[tuple[PluginHost, McpServers | None]]:
    """``open_cli_host``, and the MCP servers of ``[mcp.servers]`` (``None`` when there
    are none: ``mcp`` is not imported), their tools joining the host's as ``NAME.tool``.

    Eager servers are started and listed here; a lazy one when ``list_tools_for``
    names one of its tools. Stdio servers run confined in ``workspace``, once
    approved (``tak mcp trust``).

    Raises:
        KernelError: as ``open_cli_host``.
    """
    import trio

    from ..home import TakHome

    tak_home = TakHome.locate(home)
    with os_errors_as(f"TAK_HOME {tak_home.root}"):
        config = await trio.to_thread.run_sync(tak_home.read_config)
    async with _open_host(tak_home, config, workspace, extra_plugins) as host:
        if not config.mcp.servers:
            yield host, None
            return
        from plugins import open_mcp_servers

        async with open_mcp_servers(
            config.mcp.servers,
            host.tools,
            log_dir=tak_home.data / "mcp",
            workspace=workspace,
            home=tak_home,
            allow_unsandboxed=config.sandbox.allow_unsandboxed,
        ) as servers:
            yield host, servers


@contextlib.asynccontextmanager
async def _open_host(
    tak_home: TakHome,
    config: Config,
    workspace: Path,
    extra_plugins: Sequence[str],
    *,
    report: SkipReport = "line",
) -> AsyncIterator[PluginHost]:
    from plugins import open_plugin_host

    async with contextlib.AsyncExitStack() as stack:
        # Only while it opens: an OSError of the caller's own is not the workspace's.
        with os_errors_as(f"workspace {workspace}"):
            host = await stack.enter_async_context(
                open_plugin_host(
                    workspace,
                    extra_plugins=extra_plugins,
                    config=config,
                    allow_unsandboxed=config.sandbox.allow_unsandboxed,
                    home=tak_home,
                    report=report,
                )
            )
        yield host


def trust_command(home: str | None, approve: str) -> str:
    """The command that approves a skipped plugin, as a person can paste it (quoted
    for the shell once; raw: ``--json`` prints it)."""
    return tak_command(*home_option(home), "plugins", "trust", approve)


def check_command(error: PluginLoadError) -> str:
    """The command that shows why a plugin failed to load (its worker's traceback)."""
    return tak_command("--debug", "plugins", "check", error.source.target.partition(":")[0])


def pasteable(command: str) -> str:
    """``command`` as a terminal shows it: shell-quoted already, and escaped.

    A command whose words hold characters a terminal acts on (a file named with
    an escape sequence or a newline) is shown escaped and said not to be pasteable:
    what pasting the escaped text runs is not what was meant.
    """
    shown = escape_terminal(command)
    if shown == command:
        return command
    return f"{shown}  (not pasteable: a name in it holds control characters; rename it)"
