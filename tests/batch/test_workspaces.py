"""Kernel.open_workspace: a job's own workspace for in-process tools and plugin workers."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from kernel import ToolCall, open_kernel
from kernel.batch._directory import open_run_dir
from kernel.batch._records import BatchTask
from kernel.batch._run import run_batch
from kernel.batch._workspace import seed_workspace_sync
from kernel.errors import SandboxError, UsageError
from kernel.messages import Message
from kernel.models import ModelRequest, ScriptedModel
from kernel.plugin import use_context
from sandbox import Workspace
from tests.batch import ws_probe


async def test_in_process_tools_write_in_the_jobs_workspace(tmp_path: Path) -> None:
    """The built-in fs tools of two jobs at once each write in their own directory;
    the kernel's workspace is untouched, and .tak/ of a job's workspace is read-only."""
    a, b = tmp_path / "a", tmp_path / "b"
    for path in (a, b, tmp_path / "main"):
        path.mkdir()
    async with open_kernel(
        home=tmp_path / "home", workspace=tmp_path / "main", plugins=["fs"]
    ) as k:

        async def job(path: Path, text: str) -> list[str]:
            async with k.open_workspace(path) as ws:
                session = k.session(path.name)
                observations = await k.call_tools(
                    session,
                    [
                        ToolCall("1", "write_file", {"path": "out.txt", "content": text}),
                        ToolCall("2", "write_file", {"path": ".tak/evil.py", "content": "x"}),
                    ],
                    workspace=ws,
                )
                return [o.content for o in observations]

        results: dict[str, list[str]] = {}

        async def run(path: Path, text: str) -> None:
            results[path.name] = await job(path, text)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, a, "from a")
            nursery.start_soon(run, b, "from b")
    assert (a / "out.txt").read_text() == "from a"
    assert (b / "out.txt").read_text() == "from b"
    assert not (tmp_path / "main" / "out.txt").exists()
    for name in ("a", "b"):
        assert "Error" in results[name][1] and not (tmp_path / name / ".tak/evil.py").exists()


async def test_a_jobs_plugin_workers_are_confined_to_it_and_reaped(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    (job / "mine.txt").write_text("mine")
    (tmp_path / "main").mkdir()
    (tmp_path / "main" / "kernels.txt").write_text("the kernel's")
    async with open_kernel(
        home=tmp_path / "home", workspace=tmp_path / "main", plugins=[ws_probe]
    ) as k:
        if k.plugins.errors:
            pytest.skip(f"the probe plugin did not load: {k.plugins.errors[0].reason}")
        confined = "unconfined" not in k.plugins.plugins[0].isolation
        session = k.session("s")
        async with k.open_workspace(job) as ws:
            here, theirs = await k.call_tools(
                session,
                [
                    ToolCall("1", "read_raw", {"path": "mine.txt"}),
                    ToolCall("2", "read_raw", {"path": str(tmp_path / "main" / "kernels.txt")}),
                ],
                workspace=ws,
            )
            (worker,) = [w for w in k.plugins.pool.workers if w.workspace == job]
            pid = worker.pid
        assert here.content == f"{job}|mine"
        if confined:
            assert theirs.error is not None, theirs
        assert worker not in k.plugins.pool.workers and worker.pid is None
        assert pid is not None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        # The kernel's own workspace still has its own worker.
        (main,) = await k.call_tools(session, [ToolCall("3", "read_raw", {"path": "kernels.txt"})])
        assert main.content == f"{tmp_path / 'main'}|the kernel's"


async def test_a_workspace_the_host_did_not_lend_runs_no_worker(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    async with open_kernel(home=tmp_path / "home", plugins=[ws_probe]) as k:
        if k.plugins.errors:
            pytest.skip(f"the probe plugin did not load: {k.plugins.errors[0].reason}")
        (tool,) = [t for t in k.tools if t.name == "read_raw"]
        assert tool.invoke is not None
        with Workspace(other) as foreign, use_context(k.plugins.context("p/s", foreign)):
            with pytest.raises(Exception, match="not opened by the plugin host"):
                await tool.invoke({"path": "x"})


async def test_a_workspace_inside_the_kernels_data_is_refused(tmp_path: Path) -> None:
    async with open_kernel(home=tmp_path / "home", plugins=[]) as k:
        inside = k.home.data / "sessions"
        with pytest.raises(SandboxError):
            async with k.open_workspace(inside):
                pass


def test_a_failed_seed_leaves_nothing_behind(tmp_path: Path) -> None:
    """A seed that fails (a path of files= leaving the workspace) fails the task
    saying which, and its half-made copy is removed."""
    root = tmp_path / "workspaces"
    bad = BatchTask(id="t1", prompt="p", files={"ok.txt": "fine", "../out.txt": "escape"})
    with pytest.raises(UsageError, match=r"files\['../out.txt'\]"):
        seed_workspace_sync(root, bad)
    assert sorted(os.listdir(root)) == []
    assert not (tmp_path / "out.txt").exists()


def test_files_may_not_write_into_the_kernels_own_directory(tmp_path: Path) -> None:
    """.tak/ of a workspace is the kernel's (a seed's is not copied): files= into it
    is refused, however the path is spelled."""
    root = tmp_path / "workspaces"
    for rel in (".tak/tmp/x", "./.tak/config", "a/../.tak/y"):
        task = BatchTask(id="t1", prompt="p", files={rel: "mine"})
        with pytest.raises(UsageError, match=r"\.tak/ is the kernel's own"):
            seed_workspace_sync(root, task)
    assert sorted(os.listdir(root)) == []


RUN = "run-1"


def task_of(request: ModelRequest) -> str:
    first = next(m for m in request.messages if m.role == "user")
    return first.text.split()[-1]


def observations(message: Message) -> list[str]:
    return [
        o.content if o.error is None else f"ERROR {o.error.message}" for o in message.observations
    ]


async def test_tasks_tools_never_reach_another_tasks_files(tmp_path: Path) -> None:
    """The built-in shell and python workers and the in-process fs tools of one task
    reach neither another task's workspace (by .., by absolute path, by a link or a
    hard link made from inside) nor the run's own files (tasks.jsonl holds every
    task's expected answer)."""
    run = tmp_path / RUN
    both = trio.Event()
    arrived = 0

    async def script(request: ModelRequest) -> Any:
        nonlocal arrived
        me = task_of(request)
        other = "b" if me == "a" else "a"
        step = sum(m.role == "assistant" for m in request.messages)
        if step == 0:
            arrived += 1
            if arrived == 2:
                both.set()
            await both.wait()  # both workspaces exist and both tasks run
            peek = (
                f"cat ../{other}/secret.txt; cat {run}/workspaces/{other}/secret.txt; "
                f"cat {run}/tasks.jsonl; ls {run}; ln ../{other}/secret.txt hard; "
                f"ln -s ../{other}/secret.txt soft; echo mine=$(cat secret.txt)"
            )
            code = (
                "for p in ['../OTHER/secret.txt', 'RUN/tasks.jsonl', 'RUN/workspaces/OTHER']:\n"
                "    try:\n"
                "        print(open(p).read())\n"
                "    except OSError as e:\n"
                "        print('denied', e.errno)\n"
            )
            code = code.replace("OTHER", other).replace("RUN", str(run))
            return ScriptedModel.reply(
                calls=[
                    ("run_command", {"command": peek}),
                    ("run_python", {"code": code}),
                ]
            )
        if step == 1:
            paths = [f"../{other}/secret.txt", f"{run}/tasks.jsonl", "soft", "hard"]
            return ScriptedModel.reply(
                calls=[("read_file", {"path": p}) for p in paths]
                + [("list_dir", {"path": ".."}), ("grep", {"pattern": "SECRET", "path": ".."})]
            )
        seen = [o for m in request.messages if m.role == "tool" for o in observations(m)]
        return json.dumps(seen)

    work = [
        BatchTask(id=i, prompt=f"task {i}", files={"secret.txt": f"SECRET-{i}"}, expected=i)
        for i in ("a", "b")
    ]
    (tmp_path / "kws").mkdir()
    async with open_kernel(
        home=tmp_path / "home", model=ScriptedModel(script), workspace=tmp_path / "kws"
    ) as k:
        try:
            await k.check_run(tools=["run_command", "run_python"])
        except UsageError:
            pytest.skip("the shell and python built-ins did not load here")
        if any("unconfined" in p.isolation for p in k.plugins.plugins):
            pytest.skip("plugin workers are not confined on this machine")
        async with open_run_dir(run) as ledger:
            summary = await run_batch(
                k,
                work,
                ledger=ledger,
                max_concurrency=2,
                tools=["run_command", "run_python", "read_file", "list_dir", "grep"],
            )
    for result in summary.results:
        assert result.reason == "final", result
        other = "b" if result.id == "a" else "a"
        seen = json.loads(result.text)
        assert f"mine=SECRET-{result.id}" in seen[0]
        assert all(f"SECRET-{other}" not in s and '"expected"' not in s for s in seen), seen
        assert seen[2:] == [s for s in seen[2:] if s.startswith("ERROR")], seen[2:]
        workspace = run / "workspaces" / result.id
        assert not (workspace / "hard").exists()  # a link may be made; read through, refused
