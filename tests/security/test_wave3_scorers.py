"""Class 5 of the third wave: a task's workspace, as its scorer sees it.

A batch scorer runs in the kernel's process, after the task, and reads what the
task left (its answer file): every byte of that workspace is the task's, so
hostile. Each attempt here is a real ``run_batch`` in which a task plants
symbolic links (what ``ln -s`` in its shell would do) so that the eval's own
scorer, reading the path it always reads, gets another task's answer or a
file of the host. ``TaskOutcome.workspace`` is a ``sandbox.Workspace`` of the
task's directory (``openat2`` with ``RESOLVE_BENEATH``): each read must be
refused with ``SandboxError``, and no secret may reach the scorer.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kernel import open_kernel, tool
from kernel.batch import BatchTask, TaskOutcome, open_run_dir, run_batch
from kernel.models import ModelRequest, ScriptedModel
from kernel.plugin import context
from sandbox import Workspace

SECRET = "the victim's answer: 42"
HOST_SECRET = "a file of the host"


@tool
def write_answer(text: str) -> str:
    """Write answer.txt in this task's workspace.

    Args:
        text: The answer.
    """
    context().workspace.write_text("answer.txt", text)
    return "written"


@tool
def plant(target: str, name: str) -> str:
    """Make a symbolic link in this task's workspace, as ``ln -s`` in its shell would.

    Args:
        target: What the link points to (absolute, or relative to the link).
        name: The link's path in the workspace.
    """
    link = context().workspace.path / name
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, link)
    return "planted"


# Each attempt: (the links the attacking task plants, given the run's workspace root
# and a host file; the path the scorer reads). The victim's workspace is "victim".
Plan = Callable[[Path, Path], list[tuple[str, str]]]
ATTEMPTS: dict[str, tuple[Plan, str]] = {
    "absolute link to another task's answer": (
        lambda root, host: [(str(root / "victim" / "answer.txt"), "answer.txt")],
        "answer.txt",
    ),
    "relative link to another task's answer": (
        lambda root, host: [("../victim/answer.txt", "answer.txt")],
        "answer.txt",
    ),
    "link to another task's directory": (
        lambda root, host: [("../victim", "out")],
        "out/answer.txt",
    ),
    "link to a file of the host": (
        lambda root, host: [(str(host), "answer.txt")],
        "answer.txt",
    ),
    "a chain of links, the first inside": (
        lambda root, host: [("step", "answer.txt"), ("../victim/answer.txt", "step")],
        "answer.txt",
    ),
    "a link in a subdirectory climbing out": (
        lambda root, host: [("../../victim/answer.txt", "deep/answer.txt")],
        "deep/answer.txt",
    ),
}


@pytest.mark.parametrize("attempt", list(ATTEMPTS))
async def test_a_scorer_never_reads_past_its_tasks_workspace(tmp_path: Path, attempt: str) -> None:
    plan, read = ATTEMPTS[attempt]
    host = tmp_path / "host-secret.txt"
    host.write_text(HOST_SECRET)
    run_dir = tmp_path / "run"
    root = run_dir / "workspaces"
    steps: dict[str, list[tuple[str, dict[str, Any]]]] = {
        "victim": [("write_answer", {"text": SECRET})],
        "attacker": [("plant", {"target": t, "name": n}) for t, n in plan(root, host)],
    }

    async def model(request: ModelRequest) -> Any:
        task_id = next(m for m in request.messages if m.role == "user").text.split()[-1]
        done = sum(1 for m in request.messages if m.role == "tool")
        todo = steps[task_id][done:]
        if todo:
            return ScriptedModel.reply(calls=[todo[0]])
        return "done"

    seen: dict[str, str] = {}
    workspaces: list[object] = []

    def scorer(task: BatchTask, outcome: TaskOutcome) -> float:
        workspaces.append(outcome.workspace)
        path = read if task.id == "attacker" else "answer.txt"
        where: Any = outcome.workspace
        # A plain directory (what a scorer got before): the attack as it worked then.
        seen[task.id] = (
            where.read_text(path) if isinstance(where, Workspace) else (where / path).read_text()
        )
        return 1.0

    work = [BatchTask(id=i, prompt=f"task {i}") for i in ("victim", "attacker")]
    async with (
        open_kernel(
            home=tmp_path / "home",
            model=ScriptedModel(model),
            tools=[write_answer, plant],
            plugins=[],
        ) as kernel,
        open_run_dir(run_dir) as ledger,
    ):
        summary = await run_batch(kernel, work, ledger=ledger, max_concurrency=1, scorer=scorer)
    results = {r.id: r for r in summary.results}
    assert results["victim"].score == 1.0 and seen["victim"] == SECRET  # scoring works
    assert "attacker" not in seen, f"the scorer read {seen['attacker']!r}"
    assert all(isinstance(w, Workspace) for w in workspaces)
    assert results["attacker"].score is None
    error = results["attacker"].error or ""
    assert error.startswith("scorer: SandboxError: "), error
    assert SECRET not in error and HOST_SECRET not in error
