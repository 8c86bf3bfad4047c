"""``tak plugins ls | trust | untrust | new | check``, and what every ``tak`` command
shares to reach the home, the workspace and the plugin host, and to fail in one line.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import KernelError
from ..terminal import escape_terminal
from ._exit import BAD_INPUT, one_line_errors, os_error_line, report, single_leaf

if TYPE_CHECKING:
    from plugins import (
        LoadedPlugin,
        McpServers,
        PluginHost,
        PluginLoadError,
        PluginSource,
        SkipReport,
    )

    from ..home import Config, TakHome


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    group = sub.add_parser("plugins", help="list, create and check plugins")
    commands = group.add_subparsers(dest="plugins_command", metavar="COMMAND", required=True)

    p = commands.add_parser("ls", help="the plugins tak loads, and those it skipped")
    p.add_argument("--workspace", type=Path, help="workspace (default: <home>/workspace)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_ls)

    for command, func, text in (
        ("trust", "cmd_trust", "approve a discovered plugin as it is now (hash, permissions)"),
        ("untrust", "cmd_untrust", "withdraw the approval of a plugin"),
    ):
        p = commands.add_parser(command, help=text)
        p.add_argument(
            "name",
            help="the plugin as `tak plugins ls` names it: an entry point's name, or the "
            "path of a .tak/plugins file (its stem with --workspace)",
        )
        p.add_argument("--workspace", type=Path, help="workspace (default: <home>/workspace)")
        p.set_defaults(func=globals()[func])

    p = commands.add_parser("new", help="scaffold a plugin package in ./NAME")
    p.add_argument("name", help="the plugin's name")
    p.add_argument("--dir", type=Path, help="where to create it (default: ./NAME)")
    p.set_defaults(func=cmd_new)

    p = commands.add_parser("check", help="import a plugin in a sandbox worker and show its tools")
    p.add_argument("path", help="a .py file, a package directory, a project with a "
                   "pyproject.toml, or a module name")  # fmt: skip
    p.set_defaults(func=cmd_check)


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
        print(_plain(f"{command}: --workspace {workspace}: not a directory"), file=sys.stderr)
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
                    config=config.to_toml(),
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


def _plain(text: str) -> str:
    return escape_terminal(text)


def _plugin_json(plugin: LoadedPlugin) -> dict[str, Any]:
    return {
        "name": plugin.name,
        "version": plugin.version,
        "description": plugin.description,
        "source": plugin.source.label,
        "tools": dict(plugin.tools),
        "permissions": plugin.permissions.describe(),
        "isolation": plugin.isolation,
    }


def _error_json(error: PluginLoadError, home: str | None) -> dict[str, Any]:
    out = {"source": error.source.label, "target": error.source.target, "reason": error.reason}
    if error.approve is not None:
        out["trust_command"] = trust_command(home, error.approve)
    else:
        out["check_command"] = check_command(error)
    return out


def _print_plugin(plugin: LoadedPlugin) -> None:
    # Every text here but isolation is the plugin's own: escaped (kernel.terminal).
    print(_plain(f"{plugin.name} {plugin.version}  ({plugin.source.label})"))
    if plugin.description:
        print(f"  {_plain(plugin.description)}")
    print(f"  isolation:   {_plain(plugin.isolation)}")
    print(f"  permissions: {_plain(plugin.permissions.describe())}")
    shown = [name if name == own else f"{name} (its {own})" for name, own in plugin.tools.items()]
    print(f"  tools:       {_plain(', '.join(shown))}")


def _print_error(error: PluginLoadError, home: str | None) -> None:
    print(_plain(f"skipped: {error.source.label} [{error.source.target}]"))
    print(f"  {_plain(error.reason)}")
    if error.approve is not None:
        print(f"  to trust it: {pasteable(trust_command(home, error.approve))}")
    else:
        print(f"  details:     {pasteable(check_command(error))}")


@one_line_errors("tak plugins ls")
def cmd_ls(args: argparse.Namespace) -> int:
    import trio

    workspace = workspace_or_exit("tak plugins ls", args)
    if workspace is None:
        return 2

    async def main() -> tuple[list[LoadedPlugin], list[PluginLoadError]]:
        # Silent: the skipped plugins are listed below, with their hints.
        async with open_cli_host(args.home, workspace, args.plugin, report="silent") as host:
            return host.plugins, host.errors

    try:
        loaded, errors = trio.run(main)
    except KernelError as exc:
        return report("tak plugins ls", exc)
    if args.json:
        out = {
            "plugins": [_plugin_json(p) for p in loaded],
            "errors": [_error_json(e, args.home) for e in errors],
        }
        print(json.dumps(out, indent=2))
        return 0
    for plugin in loaded:
        _print_plugin(plugin)
    for error in errors:
        _print_error(error, args.home)
    if not loaded and not errors:
        print("no plugins")
    return 0


def _named_source(name: str, workspace: Path) -> PluginSource:
    """The discovered plugin ``tak plugins trust NAME`` means.

    A path to a ``.py`` file is that file (wherever it is: a workspace plugin is
    approved by its real path); else an entry point's name, or the stem or label
    of a file in ``<workspace>/.tak/plugins``.

    Raises:
        UsageError: nothing, or more than one plugin, goes by that name.
    """
    from plugins import PluginSource, discover_plugins

    from ..errors import UsageError

    if name.endswith(".py") or os.sep in name:
        path = os.path.abspath(name)
        if not os.path.isfile(path):
            raise UsageError(f"{name}: no such plugin file")
        stem = os.path.splitext(os.path.basename(path))[0]
        return PluginSource("workspace", path, name, name=stem)
    found = [s for s in discover_plugins(workspace) if name in (s.name, s.label)]
    if not found:
        raise UsageError(
            f"no discovered plugin is named {name!r} (`tak plugins ls` shows their names)"
        )
    if len(found) > 1:
        raise UsageError(
            f"{name!r} names several plugins ({', '.join(s.label for s in found)}); "
            "give the path of the file"
        )
    return found[0]


@one_line_errors("tak plugins trust")
def cmd_trust(args: argparse.Namespace) -> int:
    import trio

    from plugins import trust_plugin

    workspace = workspace_or_exit("tak plugins trust", args)
    if workspace is None:
        return 2
    try:
        home = ensure_home(args.home)
        source = _named_source(args.name, workspace)
        approval, loaded = trio.run(
            functools.partial(trust_plugin, source, home=home, workspace=workspace)
        )
    except (KernelError, OSError) as exc:
        return report("tak plugins trust", exc)
    print(_plain(f"trusted: {loaded.name} {loaded.version}  ({source.label})"))
    print(f"  sha256:      {approval.sha256}")
    print(f"  permissions: {_plain(approval.permissions.describe())}")
    # What the approval grants: these names, in the plugin's own namespace.
    granted = [name if name == own else f"{name} (its {own})" for name, own in loaded.tools.items()]
    print(f"  tools:       {_plain(', '.join(granted))}")
    print(f"  recorded in: {_plain(str(home.config / 'trusted-plugins.json'))}")
    return 0


@one_line_errors("tak plugins untrust")
def cmd_untrust(args: argparse.Namespace) -> int:
    from plugins import TRUST_FILE, TrustStore, source_key

    from ..home import TakHome

    workspace = workspace_or_exit("tak plugins untrust", args)
    if workspace is None:
        return 2
    store = TrustStore(TakHome.locate(args.home).config / TRUST_FILE)
    try:
        try:
            key = source_key(_named_source(args.name, workspace))
        except KernelError:
            # A plugin no longer discovered: its recorded name still withdraws it.
            named = [k for k, p in store.load().items() if p.name == args.name]
            if len(named) != 1:
                raise
            key = named[0]
        removed = store.revoke(key)
    except (KernelError, OSError) as exc:
        return report("tak plugins untrust", exc)
    if removed is None:
        # a name that names no approval: bad input, as `tak mcp untrust` (docs/cli.md)
        print(f"tak plugins untrust: {_plain(args.name)} was not trusted", file=sys.stderr)
        return BAD_INPUT
    print(_plain(f"untrusted: {removed.name} ({args.name})"))
    return 0


@one_line_errors("tak plugins new")
def cmd_new(args: argparse.Namespace) -> int:
    from plugins import package_name, python_command, scaffold_plugin

    directory: Path = args.dir if args.dir is not None else Path(args.name)
    try:
        files = scaffold_plugin(args.name, directory)
    except KernelError as exc:
        return report("tak plugins new", exc)
    for path in files:
        print(f"created {path}")
    package = package_name(args.name)
    # With this interpreter: a `pip` or `pytest` on PATH may be another environment's.
    steps = (
        python_command("-m", "pip", "install", "-e", str(directory)),
        tak_command("plugins", "trust", args.name),
        tak_command("plugins", "ls"),
        tak_command("call", "greet", '{"name": "Ada"}'),
        python_command("-m", "pytest", str(directory)),
    )
    print("\nnext:\n" + "".join(f"  {step}\n" for step in steps), end="")
    print(f"then add tools in {directory / package / '__init__.py'}")
    return 0


def _project_source(project: Path) -> PluginSource:
    """The entry point a project's pyproject.toml declares, importable from the project.

    Raises:
        UsageError: no ``tak.plugins`` entry point, or more than one.
    """
    import tomllib

    from plugins import ENTRY_POINT_GROUP, PluginSource

    from ..errors import UsageError

    with open(project / "pyproject.toml", "rb") as f:
        data = tomllib.load(f)
    points = data.get("project", {}).get("entry-points", {}).get(ENTRY_POINT_GROUP, {})
    if len(points) != 1:
        raise UsageError(
            f'{project}/pyproject.toml: expected one [project.entry-points."{ENTRY_POINT_GROUP}"] '
            f"entry, found {len(points)}"
        )
    [(name, value)] = points.items()
    root = project / "src" if (project / "src").is_dir() else project
    return PluginSource("path", str(value).replace(" ", ""), f"{project} ({name})", (str(root),))


@one_line_errors("tak plugins check")
def cmd_check(args: argparse.Namespace) -> int:
    import tempfile
    import tomllib

    import trio

    from plugins import PluginSource, open_plugin_host, source_for

    from ..errors import UsageError

    path = Path(args.path)
    try:
        if (path / "pyproject.toml").is_file():
            source: PluginSource = _project_source(path.absolute())
        else:
            source = source_for(args.path)
            if source.kind == "path" and not os.path.exists(source.target):
                raise UsageError(f"{args.path}: no such file or directory")
    except tomllib.TOMLDecodeError as exc:
        return report("tak plugins check", UsageError(f"{path / 'pyproject.toml'}: {exc}"))
    except (KernelError, OSError) as exc:
        return report("tak plugins check", exc)
    if source.kind == "builtin":
        source = PluginSource("module", source.target, source.target)  # check it in a worker too

    async def main() -> tuple[list[LoadedPlugin], list[PluginLoadError], list[dict[str, Any]]]:
        with tempfile.TemporaryDirectory(prefix="tak-check-") as scratch:
            # The reason is one line; the worker's own output (a failed import's
            # traceback) is shown only with `tak --debug`.
            shown: SkipReport = "output" if getattr(args, "debug", False) else "silent"
            async with open_plugin_host(scratch, plugins=[source], report=shown) as host:
                specs = [
                    {
                        "name": t.name,
                        "description": t.description,
                        "parameters": t.parameters,
                        "timeout": t.timeout,
                        "exclusive": t.exclusive,
                        "max_output": t.max_output,
                    }
                    for t in host.tools
                ]
                return host.plugins, host.errors, specs

    try:
        loaded, errors, specs = trio.run(main)
    except KernelError as exc:
        return report("tak plugins check", exc)
    for error in errors:
        print(f"tak plugins check: {_plain(error.reason)}", file=sys.stderr)
        return 1
    _print_plugin(loaded[0])
    print(json.dumps(specs, indent=2))
    return 0
