"""What every red-team attempt shares: the arena it attacks and what must stay quiet.

An ``Arena`` is a workspace plus everything an attacker must not reach: a
directory of canary files beside it (content, modes, owners, times and
names are checked), listeners on 127.0.0.1 (a TCP port the plugin may be
allowed, a TCP port it never is, a UDP socket on the allowed port number
and an abstract Unix socket) that record anything that reaches them, and
the kernel's log, where no plugin line may carry control characters.

``await arena.attack(code, policy=...)`` runs ``code`` in a real confined
worker (``plugins/attack.py``) and returns what the tool said;
``arena.assert_refused(result)`` checks it was refused *and* that nothing
outside saw anything.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import socket
import subprocess
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from kernel.executor import run_tool_calls
from kernel.messages import Observation, ToolCall
from plugins import remote_tools
from sandbox import Policy, open_worker_pool

PLUGINS = Path(__file__).parent / "plugins"

#: Refusals: EACCES (Landlock), EPERM (seccomp), ENOSYS (seccomp, so libc falls back),
#: EXDEV (cross-directory links), or an attempt that ran and had no effect.
DENIED_PREFIX = "denied:"


@contextlib.contextmanager
def own_file_system(path: Path, size: str = "64m") -> Iterator[None]:
    """``path`` (an empty directory) on a tmpfs of its own while the block runs, as root
    (else as it is): what frees space there is the test alone, so space other tests
    free on /tmp meanwhile cannot hide what a worker holds (the free-space bound's
    stated limit, which made the unlinked-file budget tests flake under load)."""
    if os.geteuid() != 0:
        yield
        return
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


class Listener:
    """A socket on loopback, in a thread, recording every connection or datagram."""

    def __init__(self, family: int, kind: int, address: Any) -> None:
        self.sock = socket.socket(family, kind)
        self.sock.bind(address)
        if kind == socket.SOCK_STREAM:
            self.sock.listen(64)
        self.seen: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def address(self) -> Any:
        return self.sock.getsockname()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self.sock], [], [], 0.05)
            except (OSError, ValueError):
                return
            if not ready:
                continue
            try:
                if self.sock.type == socket.SOCK_STREAM:
                    conn, peer = self.sock.accept()
                    self.seen.append(f"connection from {peer!r}")
                    conn.close()
                else:
                    data, peer = self.sock.recvfrom(65536)
                    self.seen.append(f"datagram {data[:40]!r} from {peer!r}")
            except OSError:
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


class _LogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class Arena:
    """A workspace to attack from, and everything outside it that must see nothing."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.workspace = root / "ws"
        self.workspace.mkdir()
        self.outside = root / "outside"
        self.outside.mkdir()
        self.secret = f"CANARY-{secrets.token_hex(8)}"
        (self.outside / "canary.txt").write_text(self.secret)
        (self.outside / "secret.key").write_text(self.secret + "-key")
        (self.outside / "sub").mkdir()
        (self.outside / "sub" / "deep.txt").write_text(self.secret + "-deep")
        self._initial = self._snapshot()
        self.allowed_tcp = Listener(socket.AF_INET, socket.SOCK_STREAM, ("127.0.0.1", 0))
        self.forbidden_tcp = Listener(socket.AF_INET, socket.SOCK_STREAM, ("127.0.0.1", 0))
        self.udp = Listener(socket.AF_INET, socket.SOCK_DGRAM, ("127.0.0.1", self.allowed_port))
        self.abstract_name = f"tak-redteam-{secrets.token_hex(6)}"
        self.abstract = Listener(socket.AF_UNIX, socket.SOCK_STREAM, "\0" + self.abstract_name)
        self._log = _LogCapture()
        logging.getLogger().addHandler(self._log)

    @property
    def allowed_port(self) -> int:
        return int(self.allowed_tcp.address[1])

    @property
    def forbidden_port(self) -> int:
        return int(self.forbidden_tcp.address[1])

    @property
    def canary(self) -> Path:
        return self.outside / "canary.txt"

    def network_policy(self, **options: Any) -> Policy:
        """A plugin allowed exactly ``127.0.0.1:<allowed_port>``."""
        return Policy(network=(f"127.0.0.1:{self.allowed_port}",), **options)

    def _snapshot(self) -> dict[str, tuple[Any, ...]]:
        state: dict[str, tuple[Any, ...]] = {}
        for path in sorted([self.outside, *self.outside.rglob("*")]):
            st = os.lstat(path)
            content = path.read_bytes() if path.is_file() else b""
            state[str(path)] = (
                content,
                st.st_mode,
                st.st_uid,
                st.st_gid,
                st.st_nlink,
                st.st_ino,
                st.st_mtime_ns,
                st.st_ctime_ns,
            )
        return state

    def listeners(self) -> Iterator[Listener]:
        yield from (self.forbidden_tcp, self.udp, self.abstract)

    def assert_nothing_seen(self, outputs: Iterable[str] = ()) -> None:
        """Canaries unchanged and unread, forbidden listeners untouched, the log clean."""
        assert self._snapshot() == self._initial, "a file outside the workspace changed"
        for text in outputs:
            assert self.secret not in text, f"canary secret leaked: {text[:200]}"
        for listener in self.listeners():
            assert listener.seen == [], f"a forbidden listener was reached: {listener.seen}"
        for record in self._log.records:
            message = record.getMessage()
            bad = [c for c in message if c != "\t" and (ord(c) < 0x20 or ord(c) == 0x7F)]
            assert not bad, f"a log line carries control characters: {message[:200]!r}"

    def assert_refused(self, *results: str) -> None:
        """Every result is a refusal, and nothing outside saw anything."""
        for result in results:
            assert result.startswith(DENIED_PREFIX), result
        self.assert_nothing_seen(results)

    async def call(
        self, tool_name: str, policy: Policy | None = None, **arguments: Any
    ) -> Observation:
        """One call of a ``plugins/attack.py`` tool in a fresh confined worker."""
        async with open_worker_pool(self.workspace, spare=False) as pool:
            worker = await pool.start(str(PLUGINS / "attack.py"), policy=policy or Policy())
            [observation] = await run_tool_calls(
                [ToolCall("attempt", tool_name, arguments)], remote_tools(worker)
            )
        return observation

    async def attack(self, code: str, *, policy: Policy | None = None) -> str:
        """Run ``code`` as an attempt in a confined worker; the tool's answer.

        A call that failed outright (the worker crashed, a timeout) is returned as
        ``"failed: ..."``: neither allowed nor a clean refusal.
        """
        observation = await self.call("attack", policy, code=code)
        if observation.is_error:
            return f"failed: {observation.content}"
        return observation.content

    def close(self) -> None:
        logging.getLogger().removeHandler(self._log)
        for listener in (self.allowed_tcp, *self.listeners()):
            listener.close()
