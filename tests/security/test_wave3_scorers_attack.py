"""Class 5 of the third wave, attacked again: a scorer's view of a task's workspace.

``test_wave3_scorers.py`` plants symbolic links; these attempts use what
``RESOLVE_BENEATH`` does not see (a hard link, made by the task's own confined
worker, to another task's answer) and what a hostile tree can hold besides links
(a FIFO where the answer should be, a file past the 16 MiB cap, names with
``..`` or absolute ones). Real ``run_batch`` runs and real confined workers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import trio

from kernel import open_kernel, tool
from kernel.batch import BatchTask, TaskOutcome, open_run_dir, run_batch
from kernel.executor import run_tool_calls
from kernel.home import TakHome
from kernel.messages import ToolCall
from kernel.models import ModelRequest, ScriptedModel
from kernel.plugin import context, use_context
from plugins import open_plugin_host
from sandbox import Workspace

SECRET = "the victim's answer: 42"

# What the attacking task's worker runs, in its own workspace (the task's directory).
_LINKER = r"""
import os
tried = []
for source in ("../victim/answer.txt", os.path.abspath("../victim/answer.txt")):
    try:
        os.link(source, "answer.txt")
        tried.append("linked")
    except OSError as exc:
        tried.append(type(exc).__name__)
print(tried)
"""


async def test_a_task_cannot_hard_link_another_tasks_answer(tmp_path: Path, confined: None) -> None:
    """A hard link is the one name RESOLVE_BENEATH cannot tell from the task's own
    file: it must never be made. Two tasks' directories side by side, as run_batch
    lays them out; the attacker's worker (confined to its task's directory, as
    ``Kernel.open_workspace`` lends it) links the victim's answer by a relative and
    an absolute name: both refused, and the scorer's read finds nothing."""
    root = tmp_path / "workspaces"
    (root / "victim").mkdir(parents=True)
    (root / "victim" / "answer.txt").write_text(SECRET)
    attacker = root / "attacker"
    attacker.mkdir()
    host_ws = tmp_path / "ws"
    host_ws.mkdir()
    home = TakHome(tmp_path / "home").ensure()
    async with (
        open_plugin_host(host_ws, plugins=["python"], home=home) as host,
        host.open_workspace(attacker) as lent,
    ):
        with use_context(host.context(workspace=lent)):
            [obs] = await run_tool_calls(
                [ToolCall("1", "run_python", {"code": _LINKER})], host.tools
            )
    assert not obs.is_error, obs.content
    assert "linked" not in obs.content, obs.content
    assert obs.content.count("Error'") == 2, obs.content  # both tries ran, and failed
    assert not (attacker / "answer.txt").exists()
    with Workspace(attacker) as seen, pytest.raises(FileNotFoundError):
        seen.read_text("answer.txt")


@tool
def make_fifo(name: str) -> str:
    """Make a FIFO in this task's workspace, as ``mkfifo`` in its shell would.

    Args:
        name: Its path in the workspace.
    """
    os.mkfifo(context().workspace.path / name)
    return "made"


@tool
def make_big(name: str, mib: int) -> str:
    """Write a sparse file of ``mib`` MiB in this task's workspace.

    Args:
        name: Its path in the workspace.
        mib: Its size in MiB.
    """
    with open(context().workspace.path / name, "wb") as f:
        f.truncate(mib << 20)
    return "made"


@tool
def write_answer(text: str) -> str:
    """Write answer.txt in this task's workspace.

    Args:
        text: The answer.
    """
    context().workspace.write_text("answer.txt", text)
    return "written"


# Each attempt: the attacking task's calls, and the path its (naive) scorer reads.
ATTEMPTS: dict[str, tuple[list[tuple[str, dict[str, Any]]], str]] = {
    "a FIFO as the answer (a read would block forever)": (
        [("make_fifo", {"name": "answer.txt"})],
        "answer.txt",
    ),
    "an answer past the 16 MiB cap": (
        [("make_big", {"name": "answer.txt", "mib": 17})],
        "answer.txt",
    ),
    "the answer's name climbing out with ..": ([], "../victim/answer.txt"),
    "the answer's name absolute": ([], "{root}/victim/answer.txt"),
}


@pytest.mark.parametrize("attempt", list(ATTEMPTS))
async def test_a_scorer_is_refused_what_a_hostile_tree_holds(tmp_path: Path, attempt: str) -> None:
    calls, read = ATTEMPTS[attempt]
    run_dir = tmp_path / "run"
    root = run_dir / "workspaces"
    steps = {"victim": [("write_answer", {"text": SECRET})], "attacker": calls}

    async def model(request: ModelRequest) -> Any:
        task_id = next(m for m in request.messages if m.role == "user").text.split()[-1]
        done = sum(1 for m in request.messages if m.role == "tool")
        todo = steps[task_id][done:]
        return ScriptedModel.reply(calls=[todo[0]]) if todo else "done"

    seen: dict[str, str] = {}

    def scorer(task: BatchTask, outcome: TaskOutcome) -> float:
        path = read.format(root=root) if task.id == "attacker" else "answer.txt"
        seen[task.id] = outcome.workspace.read_text(path)
        return 1.0

    work = [BatchTask(id=i, prompt=f"task {i}") for i in ("victim", "attacker")]
    async with (
        open_kernel(
            home=tmp_path / "home",
            model=ScriptedModel(model),
            tools=[write_answer, make_fifo, make_big],
            plugins=[],
        ) as kernel,
        open_run_dir(run_dir) as ledger,
    ):
        # A hang guard, not a measure: a scorer blocked on the FIFO would stay there.
        with trio.fail_after(120):
            summary = await run_batch(kernel, work, ledger=ledger, max_concurrency=1, scorer=scorer)
    results = {r.id: r for r in summary.results}
    assert results["victim"].score == 1.0 and seen["victim"] == SECRET
    assert "attacker" not in seen, f"the scorer read {seen['attacker'][:80]!r}"
    error = results["attacker"].error or ""
    assert error.startswith("scorer: SandboxError: "), error
    assert SECRET not in error
