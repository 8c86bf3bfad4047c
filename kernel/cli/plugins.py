"""``tak plugins ls | trust | untrust | new | check`` (what every command shares is in
``kernel.cli._common``)."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import KernelError
from ..terminal import escape_terminal
from ._common import (
    check_command,
    ensure_home,
    open_cli_host,
    pasteable,
    tak_command,
    trust_command,
    workspace_or_exit,
)
from ._exit import BAD_INPUT, one_line_errors, report

if TYPE_CHECKING:
    from plugins import (
        LoadedPlugin,
        PluginLoadError,
        PluginSource,
        SkipReport,
    )


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


__all__ = ["add_commands", "cmd_check", "cmd_ls", "cmd_new", "cmd_trust", "cmd_untrust"]
