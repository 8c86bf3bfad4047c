"""Third wave, classes 3 and 4, attacked again: the holes a second engineer found in
the owned namespaces and in "what runs is what was approved".

Class 3: a name is owned on the wire too. OpenAI and Anthropic see ``m3.echo`` as
``m3__echo`` (``kernel.models._wire``), so a plugin's bare ``m3__echo`` is the MCP
server's tool as the model calls it; and ``M3`` is ``m3`` to a person reading an
approval.

Class 4: the worker compiles the bytes that were approved, or nothing.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from kit import Arena
from test_wave3_trust import (
    IMPL,
    IMPL_PWNED,
    PACKAGE_INIT,
    approve_as_before,
    call_hello,
    capturer,
    entry_point,
    home_of,
    mcp_server,
    plant,
    site_package,
)

from kernel import open_kernel
from kernel.errors import KernelError, SandboxError, UsageError
from kernel.executor import run_tool_calls
from kernel.home import TakHome
from kernel.messages import ToolCall
from kernel.models._wire import ToolNameMap
from kernel.plugin import use_context
from plugins import discover_plugins, open_plugin_host
from plugins._host import trust_plugin

pytestmark = pytest.mark.usefixtures("confined")


# -- class 3: names owned on the wire ----------------------------------------------------


@pytest.mark.parametrize("name", ["m3__echo", "m3__x"])
async def test_a_bare_name_that_is_an_mcp_servers_on_the_wire_is_refused(
    arena: Arena, name: str
) -> None:
    # ``m3__echo`` is what the model calls for ``m3.echo``: registered beside it, every
    # request is refused (two tools, one wire name); registered alone, it answers it.
    home = home_of(arena)
    path = plant(arena, "evil", capturer("evil", name))
    approve_as_before(home, path, "evil")
    [source] = [s for s in discover_plugins(arena.workspace) if s.name == "evil"]
    async with open_kernel(
        home=home.root,
        workspace=arena.workspace,
        plugins=[source],
        mcp_servers={"m3": mcp_server(start="eager")},
    ) as k:
        names = k.tools.names()
        assert name not in names
        assert not [
            n for n in names if n.replace(".", "__").startswith("m3__") and not n.startswith("m3.")
        ]
        ToolNameMap(names)  # the request can be sent
        [obs] = await k.call_tools(k.session("s"), [ToolCall("1", "m3.echo", {"text": "hi"})])
        assert obs.content == "hi"
    arena.assert_nothing_seen()


async def test_a_plugins_tool_that_folds_onto_another_plugins_on_the_wire_is_refused(
    arena: Arena,
) -> None:
    # Plugin ``a_`` names ``a_.b`` (``a___b`` on the wire); plugin ``a`` names ``a._b``
    # (``a___b`` too): whichever loads second would make every request fail, or take
    # the calls the model meant for the other.
    home = home_of(arena)
    first = plant(arena, "one", capturer("a", "a._b"))
    second = plant(arena, "two", capturer("a_", "a_.b"))
    approve_as_before(home, first, "a")
    approve_as_before(home, second, "a_")
    async with open_plugin_host(arena.workspace, home=home, report="silent") as host:
        ToolNameMap(host.tools.names())
    arena.assert_nothing_seen()


async def test_a_plugin_named_like_an_mcp_server_but_for_case_is_a_start_error(
    arena: Arena,
) -> None:
    # ``M3.echo`` beside ``m3.echo``: an approval that says it grants ``M3.echo`` reads
    # as the MCP server's tool.
    home = home_of(arena)
    plugin_name = "M3"
    path = plant(arena, "evil", capturer(plugin_name, f"{plugin_name}.echo"))
    approve_as_before(home, path, plugin_name)
    [source] = [s for s in discover_plugins(arena.workspace) if s.name == "evil"]
    with pytest.raises(KernelError) as caught:
        async with open_kernel(
            home=home.root,
            workspace=arena.workspace,
            plugins=[source],
            mcp_servers={"m3": mcp_server(start="lazy")},
        ):
            pass
    message = str(caught.value)
    assert "MCP server m3" in message, message
    arena.assert_nothing_seen([message])


@pytest.mark.parametrize("plugin_name", ["m3_", "m3__x"])
async def test_a_plugin_name_whose_wire_form_reaches_into_another_namespace_is_refused(
    arena: Arena, plugin_name: str
) -> None:
    # ``m3_.echo`` is ``m3___echo`` on the wire, ``m3._echo`` too; ``m3__x.echo`` is
    # ``m3__x__echo``, which reads as m3's ``x__echo``.
    home = home_of(arena)
    path = plant(arena, "evil", capturer(plugin_name, f"{plugin_name}.echo"))
    approve_as_before(home, path, plugin_name)
    [source] = [s for s in discover_plugins(arena.workspace) if s.name == "evil"]
    async with open_plugin_host(
        arena.workspace, plugins=[source], home=home, report="silent"
    ) as host:
        assert not [n for n in host.tools.names() if n.startswith("m3")]
        [error] = [e for e in host.errors if e.source.name == "evil"]
        assert "is not a plugin name" in error.reason
    arena.assert_nothing_seen()


# -- class 4: the bytes compiled are the bytes approved ------------------------------------

WRITER_INIT = PACKAGE_INIT.replace(
    'description="Harmless.")', 'description="Harmless.", permissions={"workspace": "write"})'
)


@pytest.mark.parametrize("change", ["module rewritten", "module added"])
async def test_an_entry_point_changed_after_its_hash_never_runs_unapproved(
    arena: Arena, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    # The host hashes the package when it starts; the worker that serves the calls
    # (another policy than the probe's) starts on the first call, and again after a
    # crash: an upgrade in between would run code nobody approved.
    home = home_of(arena)
    site = site_package(
        arena, {"tak_helper_late/__init__.py": WRITER_INIT, "tak_helper_late/impl.py": IMPL}
    )
    monkeypatch.setattr(sys, "path", [str(site), *sys.path])
    source = entry_point(site, "tak_helper_late:plugin")
    await trust_plugin(source, home=home, workspace=arena.workspace)
    async with open_plugin_host(arena.workspace, plugins=[source], home=home) as host:
        assert not host.errors, host.errors
        package = site / "tak_helper_late"
        if change == "module rewritten":
            (package / "impl.py").write_text(IMPL_PWNED)
        else:
            (package / "impl.py").unlink()
            (package / "impl").mkdir()
            (package / "impl" / "__init__.py").write_text(IMPL_PWNED)
        answer = await call_hello(host)
        assert "pwned" not in answer
        assert "changed since it was approved" in answer, answer
    arena.assert_nothing_seen()


# -- class 4 / item 11: a relative entry of sys.path, resolved in the workspace ------------

#: setuptools' editable install (the project's own .venv is one) appends this name; a
#: worker's current directory is its workspace, where Python resolves a relative entry
#: as a directory, before the hook that owns the name gets it (``sys.path_hooks``).
RELATIVE_ENTRIES = [e for e in sys.path if e and not os.path.isabs(e)]
needs_relative_entry = pytest.mark.skipif(
    not RELATIVE_ENTRIES, reason="no relative entry on sys.path (not an editable install)"
)
SITECUSTOMIZE = """
import os
with open({marker!r}, "a") as f:
    f.write(f"ran in pid {{os.getpid()}}\\n")
"""


def plant_sitecustomize(folder: Path, marker: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE.format(marker=str(marker)))


async def recall_in_a_worker(workspace: Path, home: TakHome) -> str:
    async with open_plugin_host(workspace, plugins=["notes"], home=home) as host:
        with use_context(host.context()):
            [obs] = await run_tool_calls([ToolCall("1", "recall", {"query": "x"})], host.tools)
    return obs.content


@needs_relative_entry
async def test_a_workspace_holding_a_relative_sys_path_entry_is_refused(
    arena: Arena, tmp_path: Path
) -> None:
    # A cloned repository ships ``__editable__.….__path_hook__/sitecustomize.py``: every
    # worker process would run it at interpreter start, before it is confined, as the
    # kernel's user. The kernel's own directory is elsewhere: its check resolved the
    # entry there.
    home = home_of(arena)
    marker = tmp_path / "ran"
    plant_sitecustomize(arena.workspace / RELATIVE_ENTRIES[-1], marker)
    with pytest.raises(SandboxError, match=r"relative entry of sys\.path"):
        await recall_in_a_worker(arena.workspace, home)
    assert not marker.exists()
    arena.assert_nothing_seen()


@needs_relative_entry
async def test_a_relative_sys_path_entry_made_by_a_tool_never_runs_in_a_worker(
    arena: Arena, tmp_path: Path
) -> None:
    # The same directory, written by a tool after the start's check (fs.write_file can):
    # the next worker process that starts (a restart, a spare) must not run it.
    home = home_of(arena)
    marker = tmp_path / "ran"
    async with open_plugin_host(arena.workspace, plugins=["notes"], home=home) as host:
        plant_sitecustomize(arena.workspace / RELATIVE_ENTRIES[-1], marker)
        for _ in range(3):  # the spare made before the tool wrote, then fresh ones
            with use_context(host.context()):
                await run_tool_calls([ToolCall("1", "recall", {"query": "x"})], host.tools)
            for worker in list(host.pool.workers):
                await worker.aclose()
    assert not marker.exists(), marker.read_text()
    arena.assert_nothing_seen()


async def test_a_package_directory_linked_elsewhere_runs_no_unhashed_code(
    arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ``impl/`` is a link to a directory the hash never walks (os.walk does not follow
    # it); the import system does. Changing its files would need no new approval.
    home = home_of(arena)
    site = site_package(arena, {"tak_helper_link/__init__.py": PACKAGE_INIT})
    elsewhere = arena.root / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "__init__.py").write_text(IMPL)
    (site / "tak_helper_link" / "impl").symlink_to(elsewhere, target_is_directory=True)
    monkeypatch.setattr(sys, "path", [str(site), *sys.path])
    source = entry_point(site, "tak_helper_link:plugin")
    with pytest.raises(UsageError, match="not among the files of the approved package"):
        await trust_plugin(source, home=home, workspace=arena.workspace)
    (elsewhere / "__init__.py").write_text(IMPL_PWNED)
    async with open_plugin_host(
        arena.workspace, plugins=[source], home=home, report="silent"
    ) as host:
        assert "hello" not in host.tools
    arena.assert_nothing_seen()
