"""What the sandbox tests share: a worker to attack, and process inspection."""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from kernel.executor import run_tool_calls
from kernel.messages import Observation, ToolCall
from plugins import remote_tools
from sandbox import Policy, Worker, WorkerPool, open_worker_pool

PLUGINS = Path(__file__).parent / "plugins"


class Canary:
    """A file outside the workspace that no plugin may read or change."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.secret = f"CANARY-{secrets.token_hex(8)}"
        path.write_text(self.secret)
        self._initial = self._snapshot()

    def _snapshot(self) -> tuple[Any, ...]:
        st = os.lstat(self.path)
        return (
            self.path.read_bytes(),
            st.st_mode,
            st.st_uid,
            st.st_gid,
            st.st_nlink,
            st.st_ino,
            st.st_mtime_ns,
            st.st_ctime_ns,
        )

    def assert_untouched(self, seen: Iterable[str] = ()) -> None:
        """Unchanged on disk (content, mode, owner, links, times), and its secret never seen."""
        assert self._snapshot() == self._initial
        for text in seen:
            assert self.secret not in text


class Sandbox:
    def __init__(self, pool: WorkerPool, worker: Worker) -> None:
        self.pool = pool
        self.worker = worker

    async def call(self, tool: str, **arguments: Any) -> Observation:
        [observation] = await run_tool_calls(
            [ToolCall("call-1", tool, arguments)], remote_tools(self.worker)
        )
        return observation

    async def text(self, tool: str, **arguments: Any) -> str:
        """The content of a call that must not fail."""
        observation = await self.call(tool, **arguments)
        assert not observation.is_error, observation
        return observation.content


@asynccontextmanager
async def open_sandbox(
    workspace: Path,
    plugin: str = "escapes",
    policy: Policy | None = None,
    **pool_options: Any,
) -> AsyncIterator[Sandbox]:
    async with open_worker_pool(workspace, **pool_options) as pool:
        worker = await pool.start(str(PLUGINS / f"{plugin}.py"), policy=policy or Policy())
        yield Sandbox(pool, worker)


def process_state(pid: int) -> str | None:
    """The state letter of a process (``Z`` for a zombie), or ``None`` when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return None


def is_gone(pid: int) -> bool:
    return process_state(pid) in (None, "Z", "X")


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry))
    return members


async def wait_until_gone(pgid: int, *, within_s: float = 5.0) -> None:
    """Wait until no live process is left in the group (SIGKILL takes a moment to land)."""
    with trio.move_on_after(within_s):
        while group_members(pgid):  # noqa: ASYNC110 (nothing to wait on but /proc)
            await trio.sleep(0.02)
    assert group_members(pgid) == []
