"""Stdio MCP servers run confined like plugin workers, and only once approved.

Each test names the guarantee of plugins/_mcp.py's docstring it checks (6: the
confinement, 7: approvals, 8: HTTP servers at their URL only). Every refused
operation is a call that returns an observation saying "refused", beside the
same operation working once the config permits it.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import trio
from mcp_kit import SERVER, stdio_server

from kernel import ToolCall, ToolRegistry, run_tool_calls
from kernel.home import McpServerConfig, TakHome
from kernel.tools import ToolFailure
from plugins._mcp import McpServers, open_mcp_servers, trust_mcp_server
from sandbox import landlock, seccomp

pytestmark = pytest.mark.skipif(
    landlock.abi_version() < 4 or not seccomp.available(),
    reason="needs Landlock with TCP rules (ABI 4+) and seccomp",
)


class Servers:
    """``open_mcp_servers`` over a workspace in ``tmp_path``, one call at a time."""

    def __init__(self, mcp: McpServers, registry: ToolRegistry) -> None:
        self.mcp = mcp
        self.registry = registry

    async def call(self, tool: str, **arguments: Any) -> tuple[str | None, str]:
        """``(error kind or None, content)`` of one call."""
        await self.mcp.list_tools_for([tool])
        [obs] = await run_tool_calls([ToolCall("1", tool, arguments)], self.registry)
        return (obs.error.kind if obs.error else None), obs.content


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "inside.txt").write_text("in the workspace")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside/secret.txt").write_text("not for the server")
    return ws


def serving(configs: Mapping[str, McpServerConfig], workspace: Path, **options: Any) -> Any:
    import contextlib

    @contextlib.asynccontextmanager
    async def open_them() -> AsyncIterator[Servers]:
        registry = ToolRegistry()
        async with open_mcp_servers(
            configs, registry, workspace=workspace, log_dir=workspace.parent / "logs", **options
        ) as mcp:
            yield Servers(mcp, registry)

    return open_them()


async def test_the_filesystem_is_the_workspace_and_what_is_declared(workspace: Path) -> None:
    """6: read in the workspace, nothing outside it unless declared in ``read``."""
    outside = workspace.parent / "outside"
    configs = {
        "t": stdio_server(startup_timeout=20),
        "r": stdio_server(startup_timeout=20, read=[str(outside)]),
    }
    async with serving(configs, workspace) as s:
        assert await s.call("t.read_file", path=str(workspace / "inside.txt")) == (
            None,
            "read: in the workspace",
        )
        kind, text = await s.call("t.read_file", path=str(outside / "secret.txt"))
        assert (kind, text) == (None, "refused: Permission denied")
        # The kernel's own files (its home, its secrets) are as far out of reach.
        assert (await s.call("t.read_file", path="/etc/shadow"))[1].startswith("refused")
        assert await s.call("r.read_file", path=str(outside / "secret.txt")) == (
            None,
            "read: not for the server",
        )
        [info, _] = s.mcp.info()
        assert info.confinement is not None and info.confinement.startswith("landlock ABI")
        assert "seccomp" in info.confinement and "UNCONFINED" not in info.confinement


async def test_writing_needs_workspace_write_and_never_leaves_it(workspace: Path) -> None:
    """6: workspace "read" (the default) refuses writes; "write" allows them inside only."""
    configs = {
        "ro": stdio_server(startup_timeout=20),
        "rw": stdio_server(startup_timeout=20, workspace="write"),
        "no": stdio_server(startup_timeout=20, workspace="none"),
    }
    target = workspace / "new.txt"
    outside = workspace.parent / "outside/new.txt"
    async with serving(configs, workspace) as s:
        assert await s.call("ro.write_file", path=str(target), text="x") == (
            None,
            "refused: Permission denied",
        )
        assert not target.exists()
        assert await s.call("rw.write_file", path=str(target), text="x") == (None, "written")
        assert target.read_text() == "x"
        assert (await s.call("rw.write_file", path=str(outside), text="x"))[1].startswith("refused")
        assert not outside.exists()
        assert (await s.call("no.read_file", path=str(target)))[1].startswith("refused")
        # Its own directory (HOME, TMPDIR) is writable, outside the workspace.
        home = workspace.parent / "logs/ro"
        assert await s.call("ro.env", name="HOME") == (None, str(home))
        assert await s.call("ro.write_file", path=str(home / "cache"), text="c") == (
            None,
            "written",
        )


async def test_no_setuid_file_even_with_write(workspace: Path) -> None:
    """6: seccomp refuses a setuid file where Landlock would let it be made."""
    async with serving({"rw": stdio_server(startup_timeout=20, workspace="write")}, workspace) as s:
        kind, text = await s.call("rw.setuid_file", path=str(workspace / "suid"))
        assert (kind, text) == (None, "refused: Operation not permitted")
        assert not (workspace / "suid").exists()
        assert await s.call("rw.write_file", path=str(workspace / "plain"), text="") == (
            None,
            "written",
        )


async def test_network_only_to_declared_ports(workspace: Path) -> None:
    """6: no network unless declared; then TCP to the declared ports only."""
    listeners = []
    ports = []
    for _ in range(2):
        sock = trio.socket.socket()
        await sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        listeners.append(sock)
        ports.append(sock.getsockname()[1])
    allowed, other = ports
    configs = {
        "off": stdio_server(startup_timeout=20),
        "on": stdio_server(startup_timeout=20, network=[f"127.0.0.1:{allowed}"]),
    }
    try:
        async with serving(configs, workspace) as s:
            assert (await s.call("off.connect", port=allowed))[1].startswith("refused")
            assert await s.call("on.connect", port=allowed) == (None, "connected")
            assert (await s.call("on.connect", port=other))[1].startswith("refused")
    finally:
        for sock in listeners:
            sock.close()


async def test_programs_only_with_subprocess(workspace: Path) -> None:
    """6: no child process unless ``subprocess``."""
    configs = {
        "plain": stdio_server(startup_timeout=20),
        "sub": stdio_server(startup_timeout=20, subprocess=True),
    }
    async with serving(configs, workspace) as s:
        kind, text = await s.call("plain.run_program")
        assert kind is None and text.startswith("refused")
        assert await s.call("sub.run_program") == (None, "ran")


async def test_a_script_runs_through_its_env_interpreter(workspace: Path, tmp_path: Path) -> None:
    """6: ``#!/usr/bin/env python``: env, then the python it finds on the server's PATH,
    may be executed (and nothing else: it still cannot start a program)."""
    script = _write_script(tmp_path / "bin/server", "#!/usr/bin/env python\n")
    path = f"{os.path.dirname(sys.executable)}:/usr/bin:/bin"
    config = McpServerConfig(command=str(script), env={"PATH": path}, startup_timeout=20)
    async with serving({"s": config}, workspace) as s:
        assert await s.call("s.echo", text="via env") == (None, "via env")
        assert (await s.call("s.run_program"))[1].startswith("refused")


async def test_a_cgroup_holds_its_process_tree_while_it_runs(workspace: Path) -> None:
    """6: memory and tasks of the whole tree in a cgroup set, removed when it closes."""
    from sandbox.exec import make_cgroups, remove_cgroups

    try:
        probe = make_cgroups(memory_bytes=1 << 30, processes=8)
    except OSError:
        probe = []
    if not probe:
        pytest.skip("this process cannot make cgroups")
    remove_cgroups(probe)
    async with serving({"t": stdio_server(startup_timeout=20)}, workspace) as s:
        pid = int((await s.call("t.pid"))[1])
        [info] = s.mcp.info()
        assert info.confinement is not None
        paths = info.confinement.partition("; cgroup ")[2].partition(";")[0].split(", ")
        assert paths and all(pid in _members(p) for p in paths)
    assert not any(_exists(p) for p in paths)


def _write_script(script: Path, shebang: str) -> Path:
    script.parent.mkdir()
    script.write_text(shebang + Path(SERVER).read_text())
    script.chmod(0o755)
    return script


def _members(cgroup: str) -> list[int]:
    with open(os.path.join(cgroup, "cgroup.procs")) as f:
        return [int(p) for p in f.read().split()]


def _exists(path: str) -> bool:
    return os.path.exists(path)


async def test_the_kernel_dying_takes_its_servers_along(tmp_path: Path) -> None:
    """6: PDEATHSIG: a kernel killed outright leaves no server behind."""
    script = tmp_path / "host.py"
    script.write_text(
        "import sys, trio\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from mcp_kit import stdio_server\n"
        "from kernel import ToolRegistry, ToolCall, run_tool_calls\n"
        "from plugins._mcp import open_mcp_servers\n"
        "async def main():\n"
        "    registry = ToolRegistry()\n"
        "    async with open_mcp_servers({'t': stdio_server()}, registry) as mcp:\n"
        "        await mcp.list_tools()\n"
        "        [obs] = await run_tool_calls([ToolCall('1', 't.pid', {})], registry)\n"
        "        print(obs.content, flush=True)\n"
        "        await trio.sleep_forever()\n"
        "trio.run(main)\n"
    )
    kernel = await trio.lowlevel.open_process(
        [sys.executable, str(script), str(Path(SERVER).parent)], stdout=subprocess.PIPE
    )
    try:
        assert kernel.stdout is not None
        with trio.fail_after(30):
            line = b""
            while not line.endswith(b"\n"):
                chunk = await kernel.stdout.receive_some(100)
                assert chunk, "the kernel process ended"
                line += chunk
        server = int(line)
        os.kill(server, 0)  # it runs
    finally:
        kernel.kill()
        await kernel.wait()
    for _ in range(500):
        if not _alive(server):
            break
        await trio.sleep(0.02)
    else:
        raise AssertionError(f"server {server} outlived its kernel")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone between open and read: ESRCH
        return False


# -- approvals ----------------------------------------------------------------------


def _home(tmp_path: Path, servers: Mapping[str, McpServerConfig]) -> TakHome:
    home = TakHome(tmp_path / "home")
    home.ensure()
    lines = []
    for name, config in servers.items():
        lines.append(f"[mcp.servers.{name}]")
        lines.append(f"command = {json.dumps(config.command)}")
        lines.append(f"args = {json.dumps(config.args)}")
        lines.append(f"workspace = {json.dumps(config.workspace)}")
    home.config_file.write_text("\n".join(lines) + "\n")
    return home


async def test_an_unapproved_server_is_denied_with_a_hint_that_works(
    workspace: Path, tmp_path: Path
) -> None:
    """7: not approved: never started, its calls are denied observations naming the
    command that approves it; that command, run as printed, lets the next call run."""
    home = _home(tmp_path, {"t": stdio_server()})
    configs = home.read_config().mcp.servers
    async with serving(configs, workspace, home=home) as s:
        # Its tools are unknown until it runs: none is offered, and a call by name
        # reaches the server, which answers it.
        await s.mcp.list_tools()
        assert "t.echo" not in s.registry
        with pytest.raises(ToolFailure) as caught:
            await s.mcp.servers["t"].call("t.echo", {"text": "hi"})
        kind, text = caught.value.kind, str(caught.value)
        assert kind == "denied"
        assert "not approved" in text
        [info] = s.mcp.info()
        assert (info.state, info.approval, info.confinement) == (
            "not approved",
            "not approved",
            None,
        )
        hint = text.rpartition("run `")[2].rstrip("`")
        assert hint.split()[-5:] == ["--home", str(home.root), "mcp", "trust", "t"]
        ran = await trio.run_process(shlex.split(hint), capture_stdout=True, check=False)
        assert ran.returncode == 0, ran.stdout
        assert await s.call("t.echo", text="hi") == (None, "hi")
        assert s.mcp.info()[0].approval == "approved"


async def test_a_missing_program_is_named_not_offered_for_approval(
    workspace: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """7: approving a program that is not there cannot help: a call says it is missing,
    and no `tak mcp trust` hint is given (run as printed, it would fail)."""
    home = _home(tmp_path, {"t": McpServerConfig(command=str(tmp_path / "gone"))})
    configs = home.read_config().mcp.servers
    async with serving(configs, workspace, home=home) as s:
        with pytest.raises(ToolFailure) as caught:
            await s.mcp.servers["t"].call("t.echo", {"text": "hi"})
        assert caught.value.kind == "crashed"
        assert "gone" in str(caught.value) and "trust" not in str(caught.value)
        assert s.mcp.info()[0].state == "failed"
    assert "mcp trust" not in caplog.text


async def test_a_changed_program_or_permission_voids_the_approval(
    workspace: Path, tmp_path: Path
) -> None:
    """7: the program's files, its arguments and its permissions are what was approved."""
    script = tmp_path / "server.py"
    shutil.copy(SERVER, script)
    config = McpServerConfig(command=sys.executable, args=[str(script)], startup_timeout=20)
    home = TakHome(tmp_path / "home")
    home.ensure()
    await trio.to_thread.run_sync(trust_mcp_server, home, "t", config)
    async with serving({"t": config}, workspace, home=home) as s:
        assert await s.call("t.echo", text="approved") == (None, "approved")
        # Changed while the kernel runs: the restart after a crash is refused.
        with script.open("a") as f:
            f.write("# a change\n")
        assert (await s.call("t.exit_now"))[0] == "crashed"
        kind, text = await s.call("t.echo", text="changed")
        assert kind == "denied"
        assert "approval void: its program's files changed" in text
        assert "mcp trust t" in text
    await trio.to_thread.run_sync(trust_mcp_server, home, "t", config)
    wider = McpServerConfig(
        command=sys.executable, args=[str(script)], workspace="write", startup_timeout=20
    )
    async with serving({"t": wider}, workspace, home=home) as s:
        with pytest.raises(ToolFailure, match="approval void: its permissions changed"):
            await s.mcp.servers["t"].list_tools()
        # A server the caller names in code needs no approval (like --plugin PATH).
    async with serving({"t": wider}, workspace, home=home, vouched=["t"]) as s:
        assert await s.call("t.echo", text="vouched") == (None, "vouched")
        assert s.mcp.info()[0].approval == "vouched"


# -- the launcher ---------------------------------------------------------------------


def _launch(policy: bytes) -> subprocess.CompletedProcess[bytes]:
    from sandbox.exec import launcher_argv

    policy_r, policy_w = os.pipe()
    report_r, report_w = os.pipe()
    os.write(policy_w, policy)
    os.close(policy_w)
    try:
        done = subprocess.run(
            launcher_argv(policy_r, report_w),
            pass_fds=(policy_r, report_w),
            capture_output=True,
            timeout=60,
        )
    finally:
        os.close(policy_r)
        os.close(report_w)
    with os.fdopen(report_r, "rb") as report:
        done.stdout = report.read()  # the report, in place of the (unused) stdout
    return done


def test_the_launcher_fails_closed_in_one_line(tmp_path: Path) -> None:
    """6: a launch that cannot happen as asked stops with one line and status 126."""
    from sandbox.exec import ExecPolicy

    bad = _launch(b'{"argv": ["relative"]}')
    assert bad.returncode == 126
    assert bad.stderr.decode() == "sandbox.exec: bad policy: $.argv[0]: expected an absolute path\n"
    assert json.loads(bad.stdout) == {"error": "bad policy: $.argv[0]: expected an absolute path"}
    missing = ExecPolicy(argv=(str(tmp_path / "nothing"),), kernel_pid=os.getpid())
    gone = _launch(missing.to_json())
    assert gone.returncode == 126
    [confined, error] = gone.stdout.splitlines()
    assert "landlock" in json.loads(confined)["confinement"]
    assert json.loads(error)["error"].startswith(f"cannot execute {tmp_path / 'nothing'}: ")


def test_a_missing_layer_refuses_the_launch_unless_allowed() -> None:
    """6: fail closed: a layer that cannot be applied stops the launch (``require``)."""
    program = (
        "from sandbox._confine import Layers, apply_layers\n"
        "import sys\n"
        "layers = Layers(env={}, limits={}, workspace=None, seccomp=False,"
        " require=sys.argv[1] == 'require')\n"
        "print(apply_layers(layers, lambda: []).unconfined)\n"
    )
    refused = subprocess.run(
        [sys.executable, "-c", program, "require"], capture_output=True, text=True, timeout=60
    )
    assert refused.returncode != 0
    assert "refusing to run unconfined: seccomp is not available" in refused.stderr
    allowed = subprocess.run(
        [sys.executable, "-c", program, "allow"], capture_output=True, text=True, timeout=60
    )
    assert allowed.stdout == "['seccomp is not available']\n", allowed.stderr


# -- HTTP ---------------------------------------------------------------------------


async def test_an_http_server_is_reached_at_its_url_only() -> None:
    """8: a redirect elsewhere is not followed: the start fails, nothing reaches the target."""
    reached: list[bytes] = []

    async def redirect(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        await stream.send_all(
            b"HTTP/1.1 307 Temporary Redirect\r\n"
            + f"Location: http://127.0.0.1:{target_port}/mcp\r\n".encode()
            + b"Content-Length: 0\r\nConnection: close\r\n\r\n"
        )
        await stream.aclose()

    async def target(stream: trio.SocketStream) -> None:
        reached.append(await stream.receive_some(65536))
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        [listener] = await nursery.start(
            functools.partial(trio.serve_tcp, target, 0, host="127.0.0.1")
        )
        target_port = listener.socket.getsockname()[1]
        [front] = await nursery.start(
            functools.partial(trio.serve_tcp, redirect, 0, host="127.0.0.1")
        )
        front_port = front.socket.getsockname()[1]
        config = McpServerConfig(url=f"http://127.0.0.1:{front_port}/mcp", startup_timeout=5)
        registry = ToolRegistry()
        async with open_mcp_servers({"web": config}, registry) as mcp:
            await mcp.list_tools()
            [info] = mcp.info()
            assert info.state == "failed" and info.approval == "not needed"
        assert reached == []
        nursery.cancel_scope.cancel()
