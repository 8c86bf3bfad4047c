"""Third wave, classes 3 and 4: what an approval grants, and what runs under it.

Class 3, tool names are owned: a source registers names only in its own namespace
(a plugin ``p``: ``p.x`` or bare names; an MCP server ``m3``: ``m3.*``), so an
approved plugin cannot capture the calls meant for another source, and two sources
claiming one namespace is a start error naming both.

Class 4, approval vs cached bytecode: an approval is of source bytes; a ``.pyc``
whose header records the approved source's mtime and size (planted in
``__pycache__``, or shipped in a wheel) must never run in their place, nor
bytecode without source the hash never saw.
"""

from __future__ import annotations

import importlib.util
import marshal
import os
import sys
from pathlib import Path

import pytest
from kit import Arena

from kernel.executor import run_tool_calls
from kernel.home import TakHome
from kernel.messages import ToolCall
from kernel.plugin import use_context
from plugins import PluginSource, discover_plugins, open_plugin_host
from plugins._host import PluginHost, trust_plugin
from plugins._trust import APPROVED_DIR

pytestmark = pytest.mark.usefixtures("confined")

BENIGN = '''
from kernel import Plugin
plugin = Plugin("helper", version="1.0", description="Harmless.")

@plugin.tool
def hello(name: str) -> str:
    """Say hello."""
    return f"hello {name}"
'''

#: What the planted bytecode does instead: the same plugin, another answer.
PWNED = BENIGN.replace('f"hello {name}"', '"pwned by bytecode"')


def home_of(arena: Arena) -> TakHome:
    return TakHome(arena.root / "home").ensure()


def timestamp_pyc(source: Path, code_text: str) -> bytes:
    """A ``.pyc`` of ``code_text`` whose header says it was compiled from ``source``
    as it is now (its mtime and size): what the default loader checks, and all."""
    st = source.stat()
    code = compile(code_text, str(source), "exec")
    header = importlib.util.MAGIC_NUMBER + (0).to_bytes(4, "little")
    header += (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
    header += (st.st_size & 0xFFFFFFFF).to_bytes(4, "little")
    return header + marshal.dumps(code)


def plant_pyc(source: Path, code_text: str, *, linked_from: Path | None = None) -> Path:
    """Write the pyc where the import system looks for ``source``'s; with ``linked_from``,
    ``__pycache__`` is a symbolic link to that directory, which holds it."""
    pyc = Path(importlib.util.cache_from_source(str(source)))
    if linked_from is not None:
        linked_from.mkdir(parents=True, exist_ok=True)
        pyc.parent.symlink_to(linked_from, target_is_directory=True)
    pyc.parent.mkdir(exist_ok=True)
    pyc.write_bytes(timestamp_pyc(source, code_text))
    return pyc


async def call_hello(host: PluginHost) -> str:
    with use_context(host.context()):
        [obs] = await run_tool_calls([ToolCall("1", "hello", {"name": "ada"})], host.tools)
    return obs.content


def site_package(arena: Arena, files: dict[str, str]) -> Path:
    site = arena.root / "site"
    for rel, text in files.items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return site


def entry_point(site: Path, target: str) -> PluginSource:
    # As discovery names an installed entry point; the worker finds it on ``path``.
    return PluginSource("entry_point", target, "entry point helper", (str(site),), "helper")


# -- class 4: approval vs cached bytecode ------------------------------------------------


@pytest.mark.parametrize("cache", ["__pycache__", "symlinked __pycache__"])
async def test_a_pyc_beside_an_approved_workspace_copy_never_runs(arena: Arena, cache: str) -> None:
    home = home_of(arena)
    folder = arena.workspace / ".tak" / "plugins"
    folder.mkdir(parents=True)
    (folder / "helper.py").write_text(BENIGN)
    [source] = [s for s in discover_plugins(arena.workspace) if s.name == "helper"]
    approval, _ = await trust_plugin(source, home=home, workspace=arena.workspace)
    copy = home.data / APPROVED_DIR / approval.sha256 / "helper.py"
    assert copy.read_text() == BENIGN
    # A link to a directory the worker can read (the copy's own), or it proves nothing.
    linked = copy.parent / ".cache" if cache != "__pycache__" else None
    plant_pyc(copy, PWNED, linked_from=linked)
    async with open_plugin_host(arena.workspace, home=home) as host:
        assert [p.name for p in host.plugins if p.name == "helper"] == ["helper"]
        assert await call_hello(host) == "hello ada"
    arena.assert_nothing_seen()


async def test_a_pyc_beside_an_approved_entry_point_module_never_runs(
    arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = home_of(arena)
    site = site_package(arena, {"tak_helper_mod.py": BENIGN})
    monkeypatch.setattr(sys, "path", [str(site), *sys.path])
    source = entry_point(site, "tak_helper_mod:plugin")
    await trust_plugin(source, home=home, workspace=arena.workspace)
    plant_pyc(site / "tak_helper_mod.py", PWNED)
    async with open_plugin_host(arena.workspace, plugins=[source], home=home) as host:
        assert not host.errors, host.errors
        assert await call_hello(host) == "hello ada"
    arena.assert_nothing_seen()


PACKAGE_INIT = '''
from kernel import Plugin
from .impl import greeting

plugin = Plugin("helper", version="1.0", description="Harmless.")

@plugin.tool
def hello(name: str) -> str:
    """Say hello."""
    return greeting(name)
'''
IMPL = "def greeting(name):\n    return f'hello {name}'\n"
IMPL_PWNED = "def greeting(name):\n    return 'pwned by bytecode'\n"


async def test_a_pyc_of_a_submodule_of_an_approved_package_never_runs(
    arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = home_of(arena)
    site = site_package(
        arena, {"tak_helper_pkg/__init__.py": PACKAGE_INIT, "tak_helper_pkg/impl.py": IMPL}
    )
    monkeypatch.setattr(sys, "path", [str(site), *sys.path])
    source = entry_point(site, "tak_helper_pkg:plugin")
    await trust_plugin(source, home=home, workspace=arena.workspace)
    plant_pyc(site / "tak_helper_pkg" / "impl.py", IMPL_PWNED)
    plant_pyc(
        site / "tak_helper_pkg" / "__init__.py",
        PACKAGE_INIT.replace("greeting(name)\n", "'pwned by bytecode'\n"),
    )
    async with open_plugin_host(arena.workspace, plugins=[source], home=home) as host:
        assert not host.errors, host.errors
        assert await call_hello(host) == "hello ada"
    arena.assert_nothing_seen()


async def test_bytecode_without_source_in_an_approved_package_is_refused(
    arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The hash leaves .pyc files out: a package that ships impl.pyc alone (no impl.py)
    # would run code nobody approved.
    home = home_of(arena)
    site = site_package(arena, {"tak_helper_bare/__init__.py": PACKAGE_INIT})
    (site / "tak_helper_bare" / "impl.pyc").write_bytes(
        timestamp_pyc(site / "tak_helper_bare" / "__init__.py", IMPL_PWNED)
    )
    monkeypatch.setattr(sys, "path", [str(site), *sys.path])
    source = entry_point(site, "tak_helper_bare:plugin")
    with pytest.raises(Exception, match="bytecode without its source"):
        await trust_plugin(source, home=home, workspace=arena.workspace)
    async with open_plugin_host(arena.workspace, plugins=[source], home=home) as host:
        assert "hello" not in host.tools
    arena.assert_nothing_seen()


def test_kit_the_planted_pyc_is_what_the_default_loader_runs(tmp_path: Path) -> None:
    # Not an attempt: the bytecode above is valid, so the attempts mean something.
    source = tmp_path / "tak_kit_mod.py"
    source.write_text(IMPL)
    plant_pyc(source, IMPL_PWNED)
    spec = importlib.util.spec_from_file_location("tak_kit_mod", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.greeting("ada") == "pwned by bytecode"
    assert os.path.exists(source)
