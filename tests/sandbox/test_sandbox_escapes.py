"""Plugin code tries to get out of its worker; the operating system must say no.

Every test runs real hostile code (tests/sandbox/plugins/escapes.py) in a
real confined worker against real files and sockets, and checks both that
the attempt was refused and that the canary outside the workspace was
neither read nor changed.
"""

# One test starts a target process directly.
# ruff: noqa: ASYNC220

from __future__ import annotations

import os
import shutil
import signal
import site
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from sandbox_kit import Canary, group_members, open_sandbox, process_state, wait_until_gone

from sandbox import Limits, Policy, probe_isolation

pytestmark = pytest.mark.skipif(
    probe_isolation().level != "full", reason="needs Landlock ABI 6+ and seccomp"
)

# Refusals look like this: EACCES from Landlock, EPERM from seccomp, EXDEV for links.
DENIED = ("denied: EACCES", "denied: EPERM", "denied: EXDEV")


def assert_denied(content: str) -> None:
    assert content.startswith(DENIED), content


async def test_dot_dot_paths(workspace: Path, canary: Canary) -> None:
    (workspace / "sub").mkdir()
    async with open_sandbox(workspace) as sb:
        seen = [
            await sb.text("read_file", path="../canary.txt"),
            await sb.text("write_file", path="../canary.txt"),
            await sb.text("list_dir", path=".."),
            await sb.text("read_file", path="sub/../../canary.txt"),
        ]
    for content in seen:
        assert_denied(content)
    canary.assert_untouched(seen)


async def test_absolute_paths(workspace: Path, canary: Canary) -> None:
    outside_new = canary.path.with_name("created-by-plugin")
    async with open_sandbox(workspace) as sb:
        seen = [
            await sb.text("read_file", path="/etc/passwd"),
            await sb.text("read_file", path=str(canary.path)),
            await sb.text("append_file", path=str(canary.path)),
            await sb.text("write_file", path=str(outside_new)),
            await sb.text("list_dir", path="/"),
        ]
    for content in seen:
        assert_denied(content)
    assert not outside_new.exists()
    canary.assert_untouched(seen)


async def test_symlink_planted_in_the_workspace(workspace: Path, canary: Canary) -> None:
    (workspace / "link").symlink_to(canary.path)
    async with open_sandbox(workspace) as sb:
        seen = [
            await sb.text("read_file", path="link"),
            await sb.text("write_file", path="link"),
            await sb.text("append_file", path="link"),
        ]
    for content in seen:
        assert_denied(content)
    canary.assert_untouched(seen)


async def test_symlink_the_plugin_makes(workspace: Path, canary: Canary) -> None:
    async with open_sandbox(workspace) as sb:
        content = await sb.text("symlink_then_read", target=str(canary.path), link="mine")
    # Making a link inside the workspace is allowed; following it out is not.
    assert content.startswith("symlink ALLOWED"), content
    assert "read denied: EACCES" in content
    canary.assert_untouched([content])


async def test_symlinked_directory_component(
    workspace: Path, canary: Canary, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text(canary.secret)
    (workspace / "dirlink").symlink_to(outside)
    async with open_sandbox(workspace) as sb:
        seen = [
            await sb.text("read_file", path="dirlink/secret.txt"),
            await sb.text("write_file", path="dirlink/new.txt"),
            await sb.text("list_dir", path="dirlink"),
        ]
    for content in seen:
        assert_denied(content)
    assert sorted(os.listdir(outside)) == ["secret.txt"]
    canary.assert_untouched(seen)


async def test_proc_self_root(workspace: Path, canary: Canary) -> None:
    async with open_sandbox(workspace) as sb:
        seen = [
            await sb.text("read_file", path=f"/proc/self/root{canary.path}"),
            await sb.text("write_file", path=f"/proc/self/root{canary.path}"),
            await sb.text("read_file", path="/proc/self/root/etc/passwd"),
        ]
    for content in seen:
        assert_denied(content)
    canary.assert_untouched(seen)


async def test_proc_of_the_kernel(workspace: Path, canary: Canary) -> None:
    async with open_sandbox(workspace) as sb:
        seen = [
            await sb.text("read_file", path=f"/proc/{os.getpid()}/environ"),
            await sb.text("read_file", path=f"/proc/{os.getpid()}/cmdline"),
            await sb.text("read_file", path=f"/proc/{os.getpid()}/mem"),
            await sb.text("read_file", path="/proc/self/environ"),
        ]
    for content in seen:
        assert_denied(content)
    canary.assert_untouched(seen)


async def test_hard_link_of_an_outside_file(workspace: Path, canary: Canary) -> None:
    async with open_sandbox(workspace) as sb:
        linked = await sb.text("hard_link", source=str(canary.path), link="hl")
        # Also: a file the worker may read (its own interpreter) must not become writable.
        runtime = await sb.text("hard_link", source=os.__file__, link="os.py")
        read_back = await sb.text("read_file", path="hl")
    assert_denied(linked)
    assert_denied(runtime)
    assert read_back.startswith("denied: ENOENT"), read_back
    assert not (workspace / "hl").exists()
    canary.assert_untouched([linked, read_back])


async def test_rename_out_of_the_workspace(workspace: Path, tmp_path: Path, canary: Canary) -> None:
    (workspace / "inside.txt").write_text("mine")
    async with open_sandbox(workspace) as sb:
        out = await sb.text("rename", source="inside.txt", destination=str(tmp_path / "out.txt"))
        over = await sb.text("rename", source="inside.txt", destination=str(canary.path))
        into = await sb.text("rename", source=str(canary.path), destination="stolen.txt")
    for content in (out, over, into):
        assert_denied(content)
    assert (workspace / "inside.txt").read_text() == "mine"
    assert not (tmp_path / "out.txt").exists()
    canary.assert_untouched([out, over, into])


@pytest.fixture
def runtime_files() -> Iterator[tuple[list[Path], Path]]:
    """Names to create in site-packages and the standard library, and an existing file there.

    Should confinement ever fail, the test removes what got written: a broken
    sandbox must not leave a .pth file behind for every later Python.
    """
    packages = Path(site.getsitepackages()[0])
    new = [
        packages / "tak-escape.pth",
        packages / "sitecustomize.py",
        Path(sys.base_prefix) / "lib" / "tak-escape.py",
    ]
    if any(p.exists() for p in new):
        pytest.skip("a file this test would create already exists")
    existing = packages / "tak_escape_target.py"
    existing.write_text("ORIGINAL = True\n")
    try:
        yield new, existing
    finally:
        for p in [*new, existing]:
            p.unlink(missing_ok=True)


async def test_writing_into_site_packages(
    workspace: Path, canary: Canary, runtime_files: tuple[list[Path], Path]
) -> None:
    new, existing = runtime_files
    async with open_sandbox(workspace) as sb:
        seen = [await sb.text("write_file", path=str(t), text="import os") for t in new]
        seen.append(await sb.text("append_file", path=str(existing), text="# pwned"))
        # Reading the runtime is allowed (the worker imports from it).
        readable = await sb.text("read_file", path=str(existing))
    for content in seen:
        assert_denied(content)
    assert readable == "ALLOWED: 'ORIGINAL = True\\n'"
    assert not any(t.exists() for t in new)
    assert existing.read_text() == "ORIGINAL = True\n"
    canary.assert_untouched(seen)


async def test_device_nodes_and_metadata(workspace: Path, canary: Canary) -> None:
    async with open_sandbox(workspace) as sb:
        device = await sb.text("make_device", path="null")
        metadata = await sb.text("change_metadata", path=str(canary.path))
    assert_denied(device)
    assert not (workspace / "null").exists()
    assert metadata.count("denied: EPERM") == 3, metadata
    canary.assert_untouched([device, metadata])


async def test_exec_without_subprocess_permission(workspace: Path, canary: Canary) -> None:
    async with open_sandbox(workspace) as sb:
        ran = await sb.text("execute", argv=["/bin/cat", str(canary.path)])
        replaced = await sb.text("exec_replace", path="/bin/ls")
        forked = await sb.text("fork_once")
        still_there = await sb.text("identity")
    for content in (ran, replaced, forked):
        assert_denied(content)
    assert '"pid"' in still_there
    canary.assert_untouched([ran, replaced, forked])


async def test_exec_outside_the_allowed_binaries(workspace: Path, canary: Canary) -> None:
    shutil.copy("/bin/cat", workspace / "mycat")
    policy = Policy(subprocess=True)
    async with open_sandbox(workspace, policy=policy) as sb:
        allowed = await sb.text("execute", argv=["/bin/true"])
        sbin = await sb.text("execute", argv=["/usr/sbin/ldconfig", "-p"])
        copied = await sb.text("execute", argv=["./mycat", str(canary.path)])
        cat = await sb.text("execute", argv=["/bin/cat", str(canary.path)])
    assert allowed == "ALLOWED: 0"
    assert_denied(sbin)
    assert_denied(copied)
    # /bin/cat may run, but it inherits the confinement: it cannot open the canary.
    assert cat == "ALLOWED: 1", cat
    canary.assert_untouched([sbin, copied, cat])


async def test_tcp_connect_to_a_local_listener(workspace: Path, canary: Canary) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        async with open_sandbox(workspace) as sb:
            content = await sb.text("tcp_connect", host="127.0.0.1", port=port)
        # A plugin with network access to another port still cannot reach this one.
        async with open_sandbox(workspace, policy=Policy(network=("*:1",))) as sb:
            other_port = await sb.text("tcp_connect", host="127.0.0.1", port=port)
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
    assert_denied(content)
    assert_denied(other_port)
    canary.assert_untouched([content])


async def test_tcp_connect_to_a_declared_port(workspace: Path) -> None:
    # The counterpart: the same listener is reachable once its port is declared.
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    try:
        async with open_sandbox(workspace, policy=Policy(network=(f"127.0.0.1:{port}",))) as sb:
            content = await sb.text("tcp_connect", host="127.0.0.1", port=port)
    finally:
        listener.close()
    assert content.startswith("ALLOWED: \"connected from ('127.0.0.1'"), content


async def test_udp_send(workspace: Path, canary: Canary) -> None:
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.bind(("127.0.0.1", 0))
    receiver.setblocking(False)
    try:
        async with open_sandbox(workspace) as sb:
            content = await sb.text("udp_send", host="127.0.0.1", port=receiver.getsockname()[1])
        with pytest.raises(BlockingIOError):
            receiver.recv(100)
    finally:
        receiver.close()
    assert_denied(content)
    canary.assert_untouched([content])


async def test_pathname_unix_socket_outside(
    workspace: Path, tmp_path: Path, canary: Canary
) -> None:
    path = str(tmp_path / "kernel.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    listener.setblocking(False)
    datagrams = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dgram_path = str(tmp_path / "kernel.dgram")
    datagrams.bind(dgram_path)
    datagrams.setblocking(False)
    try:
        async with open_sandbox(workspace) as sb:
            stream = await sb.text("unix_connect", address=path)
            dgram = await sb.text("unix_datagram", address=dgram_path)
        with pytest.raises(BlockingIOError):
            listener.accept()
        with pytest.raises(BlockingIOError):
            datagrams.recv(100)
    finally:
        listener.close()
        datagrams.close()
    assert_denied(stream)
    assert_denied(dgram)
    canary.assert_untouched([stream, dgram])


async def test_abstract_unix_socket(workspace: Path, canary: Canary) -> None:
    name = f"tak-test-{os.getpid()}-{id(workspace)}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen()
    listener.setblocking(False)
    try:
        async with open_sandbox(workspace) as sb:
            content = await sb.text("unix_connect", address=name, abstract=True)
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
    assert_denied(content)
    canary.assert_untouched([content])


async def test_signals_to_the_kernel(workspace: Path, canary: Canary) -> None:
    received: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    try:
        async with open_sandbox(workspace) as sb:
            seen = [
                await sb.text("signal_process", pid=os.getpid(), signal_number=int(signal.SIGUSR1)),
                await sb.text("signal_process", pid=os.getpid(), signal_number=0),
                await sb.text("signal_process", pid=-1, signal_number=0),
                await sb.text("signal_process", pid=1, signal_number=0),
            ]
            await trio.sleep(0.05)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    for content in seen:
        assert_denied(content)
    assert received == []
    canary.assert_untouched(seen)


async def test_other_processes_state(workspace: Path, canary: Canary) -> None:
    # The target is a process of the kernel's user; were confinement broken, the
    # damage would land on it and not on the test run.
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        async with open_sandbox(workspace) as sb:
            seen = [
                await sb.text("ptrace_attach", pid=target.pid),
                await sb.text("read_memory", pid=target.pid),
                await sb.text("limit_other_process", pid=target.pid),
                await sb.text("unshare_namespaces"),
                await sb.text("new_session"),
            ]
        import resource

        assert resource.prlimit(target.pid, resource.RLIMIT_NOFILE)[0] > 0
        assert process_state(target.pid) == "S"  # not stopped by a tracer
    finally:
        target.kill()
        target.wait()
    for content in seen:
        assert_denied(content)
    canary.assert_untouched(seen)


async def test_fork_bomb_without_subprocess(workspace: Path, canary: Canary) -> None:
    async with open_sandbox(workspace) as sb:
        content = await sb.text("fork_bomb", give_up_after=5)
        assert content == "contained: 0 forks succeeded before 5 refusals"
        assert await sb.text("fork_once") == "denied: EPERM"
    canary.assert_untouched([content])


async def test_fork_bomb_with_subprocess(workspace: Path, canary: Canary) -> None:
    if not probe_isolation().process_limit.startswith("cgroup:") and os.getuid() == 0:
        pytest.skip("root without a pids cgroup: subprocess plugins are refused")
    limit = 24
    policy = Policy(subprocess=True, limits=Limits(processes=limit))
    async with open_sandbox(workspace, policy=policy) as sb:
        pgid = sb.worker.pid
        assert pgid is not None
        content = await sb.text("fork_bomb", give_up_after=20)
        made = int(content.split()[1])
        # The worker and its call thread take two of the tasks the limit allows.
        assert 0 < made <= limit - 2, content
        assert len(group_members(pgid)) <= limit
        # The kernel is fine; the worker's group is full of sleeping bomb processes.
        assert str(pgid) in await sb.text("identity")
    # Closing the pool took all of them down.
    await wait_until_gone(pgid)
    canary.assert_untouched([content])


async def test_memory_bomb(workspace: Path, canary: Canary) -> None:
    policy = Policy(limits=Limits(memory_bytes=1024**3))
    async with open_sandbox(workspace, policy=policy) as sb:
        content = await sb.text("memory_bomb", chunk_mb=64)
        pid = sb.worker.pid
        # Same worker, still serving.
        assert (await sb.text("identity")).count(str(pid)) == 2
    assert content.startswith("contained: MemoryError after"), content
    assert int(content.split()[-2]) < 1024
    canary.assert_untouched([content])


async def test_api_keys_do_not_reach_the_worker(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-must-not-leak")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-must-not-leak")
    async with open_sandbox(workspace) as sb:
        content = await sb.text("environment")
    assert "must-not-leak" not in content
    assert "API_KEY" not in content
    ws = str(workspace)
    assert f'"HOME": "{ws}"' in content
    assert f'"TMPDIR": "{ws}/.tak/tmp"' in content


async def test_only_stdio_and_the_channel_are_open(workspace: Path) -> None:
    async with open_sandbox(workspace) as sb:
        assert await sb.text("open_fds") == "[0, 1, 2, 3]"


async def test_worker_identity(workspace: Path) -> None:
    async with open_sandbox(workspace) as sb:
        content = await sb.text("identity")
        pid = sb.worker.pid
    assert f'"pgid": {pid}' in content  # its own process group
    assert f'"cwd": "{workspace}"' in content
