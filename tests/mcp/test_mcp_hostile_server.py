"""A hostile stdio MCP server, confined: what it can reach, what it cannot outlive.

The server is tests/mcp/hostile_server.py, whose one tool runs the Python source it
is given in the confined process: each attack is one call. Out of reach: the kernel,
its home and the other servers; sockets but TCP to declared ports; processes and
other programs without ``subprocess``, and with it no more than ``processes``;
files past the size limit; a read path retargeted after its approval. A kernel
killed outright takes the server and its children along. What voids an approval
without starting anything is in tests/mcp/test_mcp_supervise.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import trio

from kernel import ToolCall, ToolRegistry, run_tool_calls
from kernel.home import McpServerConfig, TakHome
from plugins._mcp import McpServers, open_mcp_servers, trust_mcp_server
from sandbox import landlock, seccomp

pytestmark = pytest.mark.skipif(
    landlock.abi_version() < 6 or not seccomp.available(),
    reason="needs Landlock with TCP rules and scopes (ABI 6+) and seccomp",
)

HOSTILE = str(Path(__file__).with_name("hostile_server.py"))


def hostile(**options: Any) -> McpServerConfig:
    """The hostile server over stdio."""
    return McpServerConfig(command=sys.executable, args=[HOSTILE], startup_timeout=30, **options)


class Servers:
    def __init__(self, mcp: McpServers, registry: ToolRegistry) -> None:
        self.mcp = mcp
        self.registry = registry

    async def probe(self, server: str, code: str) -> str:
        """What ``code`` left in ``result`` in ``server``'s process (or its refusal)."""
        tool = f"{server}.probe"
        await self.mcp.list_tools_for([tool])
        [obs] = await run_tool_calls([ToolCall("1", tool, {"code": code})], self.registry)
        assert obs.error is None, obs.content
        return obs.content


@contextlib.asynccontextmanager
async def serving(
    configs: Mapping[str, McpServerConfig], workspace: Path, **options: Any
) -> AsyncIterator[Servers]:
    registry = ToolRegistry()
    async with open_mcp_servers(
        configs, registry, workspace=workspace, log_dir=workspace.parent / "data/mcp", **options
    ) as mcp:
        yield Servers(mcp, registry)


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    return ws


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone between open and read: ESRCH
        return False


def _has_cgroups() -> bool:
    from sandbox.exec import make_cgroups, remove_cgroups

    try:
        probe = make_cgroups(memory_bytes=1 << 30, processes=8)
    except OSError:
        return False
    remove_cgroups(probe)
    return bool(probe)


#: The server's pid as the kernel sees it (getpid() names it in its own PID namespace).
_PID = "import os; result = int(os.readlink('/proc/self'))"

_BOMB = (
    "import subprocess\n"
    "children = []\n"
    "try:\n"
    "    for _ in range(40):\n"
    "        children.append(subprocess.Popen(['/bin/sleep', '60']))\n"
    "    result = 'started 40'\n"
    "except OSError as exc:\n"
    "    result = f'stopped after {len(children)}: {exc.strerror}'\n"
    "for child in children:\n"
    "    child.kill(); child.wait()\n"
)


# -- the kernel, its home, the other servers: out of reach ------------------------------


async def test_the_kernel_its_home_and_other_servers_are_out_of_reach(
    workspace: Path, tmp_path: Path
) -> None:
    """Its home (config, approvals, sessions), the kernel's /proc, another server's
    directory and process: neither read, written nor signalled; no ptrace."""
    home = TakHome(tmp_path / "home")
    home.ensure()
    a, b = hostile(workspace="write"), hostile()
    for name in ("a", "b"):
        await trio.to_thread.run_sync(trust_mcp_server, home, name, a if name == "a" else b)
    trust_file = home.config / "trusted-mcp-servers.json"
    before = trust_file.read_bytes()
    (home.data / "sessions").mkdir(parents=True, exist_ok=True)
    (home.data / "sessions/s1.jsonl").write_text("a transcript")
    async with serving({"a": a, "b": b}, workspace, home=home) as s:
        kernel = os.getpid()
        other = int(await s.probe("b", _PID))
        (workspace.parent / "data/mcp/b/private").write_text("b's own")
        for path in (
            trust_file,
            home.config_file,
            home.data / "sessions/s1.jsonl",
            workspace.parent / "data/mcp/b/private",
            workspace.parent / "data/mcp/b.log",
            f"/proc/{kernel}/environ",
            f"/proc/{kernel}/mem",
            "/proc/self/environ",
            "/etc/shadow",
        ):
            said = await s.probe("a", f"result = open({str(path)!r}, 'rb').read()[:20]")
            assert said.startswith("refused: "), (path, said)
        for path in (trust_file, home.config_file, home.root / "tak.toml"):
            said = await s.probe("a", f"result = open({str(path)!r}, 'a').write('x')")
            assert said.startswith("refused: "), (path, said)
        assert trust_file.read_bytes() == before
        # In a PID namespace of its own, neither is even named (ESRCH).
        for pid in (kernel, other):
            said = await s.probe("a", f"import os; os.kill({pid}, 0)")
            assert said in ("refused: EPERM", "refused: ESRCH"), said
        ptrace = (
            "import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"
            f"result = (libc.ptrace(16, {kernel}, 0, 0), ctypes.get_errno())\n"
        )
        assert await s.probe("a", ptrace) in ("(-1, 1)", "(-1, 3)")  # EPERM, ESRCH


# -- sockets, processes, code on no disk ----------------------------------------------


async def test_only_tcp_to_declared_ports_whatever_the_family(workspace: Path) -> None:
    """UDP, pathname and abstract unix sockets, IPv6 to another port: all refused, with
    and without ``network``."""
    listener = trio.socket.socket(trio.socket.AF_INET6)
    await listener.bind(("::1", 0))
    listener.listen(4)
    other = trio.socket.socket(trio.socket.AF_INET6)
    await other.bind(("::1", 0))
    other.listen(4)
    port, other_port = listener.getsockname()[1], other.getsockname()[1]
    unix = workspace.parent / "kernel.sock"
    unix_listener = trio.socket.socket(trio.socket.AF_UNIX)
    await unix_listener.bind(str(unix))
    unix_listener.listen(4)
    attacks = {
        "udp": "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)"
        "; s.sendto(b'x', ('127.0.0.1', 53))",
        "unix": f"import socket; socket.socket(socket.AF_UNIX).connect({str(unix)!r})",
        "abstract": "import socket; socket.socket(socket.AF_UNIX).connect('\\0tak')",
        "unix dgram": "import socket; socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)",
        "other port": "import socket; s = socket.socket(socket.AF_INET6); s.settimeout(5)"
        f"; s.connect(('::1', {other_port}))",
        "raw": "import socket; socket.socket(socket.AF_INET, socket.SOCK_RAW, 1)",
    }
    try:
        async with serving(
            {"off": hostile(), "on": hostile(network=[f"localhost:{port}"])}, workspace
        ) as s:
            for server in ("off", "on"):
                for what, code in attacks.items():
                    said = await s.probe(server, code)
                    assert said.startswith("refused: "), (server, what, said)
            declared = (
                "import socket; s = socket.socket(socket.AF_INET6); s.settimeout(5)"
                f"; s.connect(('::1', {port})); result = 'connected'"
            )
            assert await s.probe("on", declared) == "connected"
            assert (await s.probe("off", declared)).startswith("refused: ")
    finally:
        for sock in (listener, other, unix_listener):
            sock.close()


async def test_no_process_and_no_other_program_without_subprocess(workspace: Path) -> None:
    """fork, vfork (clone), clone3, posix_spawn; execve of another program, execveat,
    a memfd: refused; the server is still the only process."""
    attacks = {
        "fork": "import os; result = os.fork()",
        "posix_spawn": "import os; result = os.posix_spawn('/bin/true', ['true'], {})",
        "vfork": "import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"
        "r = libc.syscall(56, 0x4000 | 0x100 | 17, 0, 0, 0, 0)\n"  # CLONE_VFORK|VM|SIGCHLD
        "result = 'refused: EPERM' if r < 0 else 'forked'",
        "clone3": "import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"
        "args = (ctypes.c_uint64 * 11)(); args[4] = 17\n"
        "r = libc.syscall(435, ctypes.byref(args), 88)\n"
        "result = f'refused: {ctypes.get_errno()}' if r < 0 else 'forked'",
        "memfd": "import os; result = os.memfd_create('x')",
        "execveat": "import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"
        "argv = (ctypes.c_char_p * 2)(b'true', None)\n"
        "r = libc.syscall(322, -100, b'/bin/true', argv, None, 0)\n"
        "result = f'refused: {ctypes.get_errno()}'",
        "execve /bin/sh": "import os; os.execv('/bin/sh', ['sh', '-c', 'exit 0'])",
    }
    async with serving({"h": hostile()}, workspace) as s:
        pid = await s.probe("h", "import os; result = os.getpid()")
        for what, code in attacks.items():
            said = await s.probe("h", code)
            assert said.startswith("refused: "), (what, said)
        assert await s.probe("h", "import os; result = os.getpid()") == pid


async def test_a_fork_bomb_stops_at_processes(workspace: Path) -> None:
    """With ``subprocess``, the pids cgroup holds ``processes`` tasks (root ignores
    RLIMIT_NPROC)."""
    if not await trio.to_thread.run_sync(_has_cgroups):
        pytest.skip("this process cannot make cgroups")
    async with serving({"h": hostile(subprocess=True, processes=8)}, workspace) as s:
        said = await s.probe("h", _BOMB)
    assert said.startswith("stopped after "), said
    assert int(said.split()[2].rstrip(":")) < 8


async def test_without_a_pids_cgroup_root_refuses_a_subprocess_server(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/sandbox.md: "without a writable pids hierarchy, root refuses subprocess
    plugins". A server with ``subprocess`` must be refused too, or bounded otherwise."""
    if os.getuid() != 0:
        pytest.skip("RLIMIT_NPROC binds every user but root")
    import plugins._mcp

    monkeypatch.setattr(plugins._mcp, "make_cgroups", lambda **_: [])
    registry = ToolRegistry()
    async with open_mcp_servers(
        {"h": hostile(subprocess=True, processes=8)},
        registry,
        workspace=workspace,
        log_dir=workspace.parent / "data/mcp",
    ) as mcp:
        await mcp.list_tools_for(["h.probe"])
        call = ToolCall("1", "h.probe", {"code": _BOMB})
        [obs] = await run_tool_calls([call], registry)
    if obs.error is None:
        assert obs.content.startswith("stopped after "), obs.content
        assert int(obs.content.split()[2].rstrip(":")) < 8


# -- a kernel killed outright, files, a read path retargeted ----------------------------


async def test_a_server_cannot_outlive_a_killed_kernel(tmp_path: Path) -> None:
    """docs/mcp.md: "PR_SET_PDEATHSIG(SIGKILL): it dies with the kernel". The signal is
    per thread and new threads start without it; an ``execve`` from a thread that is not
    the launcher's keeps the exec'ing thread's (none). The probe runs in a worker thread
    of the SDK: it clears its own (a no-op here) and replaces the process."""
    marker = tmp_path / "data/h/undone"
    sleeper = f"import time; open({str(marker)!r}, 'w').close(); time.sleep(300)"
    undo = (
        "import ctypes, os, sys\n"
        "ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)\n"  # PR_SET_PDEATHSIG: none
        f"os.execv(sys.executable, [sys.executable, '-c', {sleeper!r}])\n"
    )
    [server] = await _kill_a_kernel_after(tmp_path, hostile(), _PID, then=undo, marker=marker)
    assert await _dies(server), f"server {server} outlived its kernel"


async def test_a_servers_children_die_with_a_killed_kernel(tmp_path: Path) -> None:
    """docs/mcp.md says a server dies with the kernel; its children do not. With cgroups,
    the next worker pool's sweep kills them (docs/sandbox.md); without, nothing does."""
    start = f"import subprocess; subprocess.Popen(['/bin/sleep', '300'])\n{_PID}\n"
    server, *children = await _kill_a_kernel_after(tmp_path, hostile(subprocess=True), start)
    assert children, "the server started a child"
    assert await _dies(server), "the server itself dies (PDEATHSIG)"
    for child in children:
        assert await _dies(child), f"child {child} of the server outlived the kernel"


async def test_a_servers_files_are_bounded(workspace: Path) -> None:
    """A plugin worker gets ``Limits.file_size_bytes`` (1 GiB); a server must be bounded too
    (DESIGN §11: bounded disk)."""
    async with serving({"h": hostile(workspace="write")}, workspace) as s:
        said = await s.probe(
            "h", "import resource; result = resource.getrlimit(resource.RLIMIT_FSIZE)[0]"
        )
    assert int(said) != resource.RLIM_INFINITY


async def test_a_retargeted_read_link_voids_the_approval(workspace: Path, tmp_path: Path) -> None:
    """``read = [".../datasets"]`` approved while it was the data; a tool with write
    access there (or the workspace) points it at $TAK_HOME/config."""
    home = TakHome(tmp_path / "home")
    home.ensure()
    home.config_file.write_text('[providers.openai]\napi_key = "sk-secret"\n')
    data = tmp_path / "data"
    data.mkdir()
    link = workspace / "datasets"
    link.symlink_to(data)
    config = hostile(workspace="none", read=[str(link)])
    await trio.to_thread.run_sync(trust_mcp_server, home, "h", config)
    link.unlink()
    link.symlink_to(home.config)
    async with serving({"h": config}, workspace, home=home) as s:
        await s.mcp.list_tools()
        [info] = s.mcp.info()
        code = f"result = open({str(link / 'tak.toml')!r}).read()"
        [obs] = await run_tool_calls([ToolCall("1", "h.probe", {"code": code})], s.registry)
        assert "sk-secret" not in obs.content, info.approval


# -- helpers for a kernel killed outright ---------------------------------------------


async def _kill_a_kernel_after(
    tmp_path: Path,
    config: McpServerConfig,
    code: str,
    *,
    then: str | None = None,
    marker: Path | None = None,
) -> list[int]:
    """Run a kernel process without cgroups with ``config`` as server ``h`` (its directory in
    ``tmp_path/data``), ``code`` in the server, then ``then`` (which never answers) until
    ``marker`` exists; SIGKILL the kernel; the pids ``code`` put in ``result`` (as the
    kernel sees them), then their descendants.
    Whatever survives is killed after the test."""
    script = tmp_path / "host.py"
    script.write_text(
        "import json, os, sys, trio\n"
        "from kernel import ToolRegistry, ToolCall, run_tool_calls\n"
        "from kernel.home import McpServerConfig\n"
        "import plugins._mcp\n"
        "from plugins._mcp import open_mcp_servers\n"
        "config = McpServerConfig(**json.loads(sys.argv[1]))\n"
        "code, then, marker, root = json.loads(sys.argv[2])\n"
        "# No cgroup, as for a user who may make none (and out of other pools' sweeps);\n"
        "# root refuses a server that may fork without one (the pids cgroup).\n"
        "if os.getuid() != 0 or not config.subprocess:\n"
        "    plugins._mcp.make_cgroups = lambda **_: []\n"
        "async def call(registry, code):\n"
        "    [obs] = await run_tool_calls([ToolCall('1', 'h.probe', {'code': code})], registry)\n"
        "    return obs.content\n"
        "async def main():\n"
        "    registry = ToolRegistry()\n"
        "    async with open_mcp_servers(\n"
        "        {'h': config}, registry, workspace=root + '/ws', log_dir=root + '/data'\n"
        "    ) as m:\n"
        "        await m.list_tools()\n"
        "        said = await call(registry, code)\n"
        "        async with trio.open_nursery() as nursery:\n"
        "            if then is not None:\n"
        "                nursery.start_soon(call, registry, then)\n"
        "                while not os.path.exists(marker):\n"
        "                    await trio.sleep(0.02)\n"
        "            print(said, flush=True)\n"
        "            await trio.sleep_forever()\n"
        "trio.run(main)\n"
    )
    options = {
        "command": config.command,
        "args": config.args,
        "subprocess": config.subprocess,
        "startup_timeout": config.startup_timeout,
    }
    (tmp_path / "ws").mkdir(exist_ok=True)
    codes = [code, then, str(marker), str(tmp_path)]
    kernel = await trio.lowlevel.open_process(
        [sys.executable, str(script), json.dumps(options), json.dumps(codes)],
        stdout=subprocess.PIPE,
    )
    try:
        assert kernel.stdout is not None
        with trio.fail_after(60):
            line = b""
            while not line.endswith(b"\n"):
                chunk = await kernel.stdout.receive_some(100)
                assert chunk, "the kernel process ended"
                line += chunk
        pids = [int(p) for p in line.split()]
        pids += [d for p in pids for d in _descendants(p)]
    finally:
        kernel.kill()
        await kernel.wait()
    _survivors.extend(pids)
    return pids


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                for child in map(int, f.read().split()):
                    found += [child, *_descendants(child)]
    return found


_survivors: list[int] = []


@pytest.fixture(autouse=True)
def _kill_survivors() -> Any:
    yield
    for pid in _survivors:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _survivors.clear()
    with contextlib.suppress(OSError):
        from sandbox import _cgroup

        _cgroup.sweep(_cgroup.find_parents())  # the dead kernel's cgroups


async def _dies(pid: int) -> bool:
    """Whether ``pid`` is gone within ten seconds (a signal's delivery, not a benchmark)."""
    for _ in range(500):
        if not _alive(pid):
            return True
        await trio.sleep(0.02)
    return False
