"""`tak batch` end to end: real `tak` subprocesses, the scripted model, a temporary home.

``scripted:demo`` calls the tools a prompt names (``/call NAME {json}``) and then
answers with how each call went; the demo plugin gives it ``add``, ``divide``
and ``sleep``.
"""

from __future__ import annotations

import json
import os
import pty
import re
import resource
import select
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kernel.batch import MAX_RUN_ID, TaskResult, converter
from kernel.batch._directory import RESULTS
from tests.cli_kit import one_line, tak, tak_argv


def call(name: str, **arguments: Any) -> str:
    return f"/call {name} {json.dumps(arguments)}"


def write_tasks(path: Path, tasks: Sequence[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return path


def results(run_dir: Path) -> list[TaskResult]:
    """Every line of results.jsonl, in order."""
    lines = (run_dir / "results.jsonl").read_text().splitlines()
    return [converter.structure(json.loads(line), TaskResult) for line in lines]


def transcript_path(home: Path, run_id: str, task_id: str) -> Path:
    """Where a task's transcript is: in project ``batch.<run id>.<nonce>`` (the nonce
    tells a run's sessions from an earlier run's of the same id), once the run made it."""
    sessions = home / "data" / "sessions"
    found = list(sessions.glob(f"batch.{run_id}.*"))
    project = found[0] if len(found) == 1 else sessions / f"batch.{run_id}.(not made yet)"
    return project / task_id / "transcript.jsonl"


def transcript(home: Path, run_id: str, task_id: str) -> list[dict[str, Any]]:
    path = transcript_path(home, run_id, task_id)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def progress_lines(stderr: str, run_id: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(f"{run_id}: ")]


THREE = [
    {"id": "add", "prompt": call("add", a=1, b=2)},
    {"id": "divide", "prompt": call("divide", a=1, b=0)},
    {"id": "hello", "prompt": "hello"},
]


def test_a_run_finishes_every_task_and_running_it_again_does_nothing(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path / "evals.jsonl", THREE)
    out = tmp_path / "out"
    command = ["batch", str(tasks), "--out", str(out), "--concurrency", "2"]
    first = tak(*command, "--progress-every", "0.1", home=tmp_path / "home", demo=True)
    assert first.returncode == 0, first.stderr
    by_id = {r.id: r for r in results(out)}
    assert sorted(by_id) == ["add", "divide", "hello"]
    assert {r.reason for r in by_id.values()} == {"final"}
    assert "add: ok" in by_id["add"].text and "division by zero" in by_id["divide"].text
    assert by_id["hello"].text == "You said: hello"
    # the summary table on stdout; plain progress lines on stderr (not a terminal)
    assert "finished    3 of 3 tasks" in first.stdout
    assert re.search(r"^  final +3$", first.stdout, re.M), first.stdout
    lines = progress_lines(first.stderr, "out")
    assert lines and "\r" not in first.stderr and "\x1b[" not in first.stderr
    assert lines[-1].startswith("out: 3/3 done, 0 running, 0 failed"), lines
    # the run is listed under the home by its id (a link to --out)
    assert (tmp_path / "home" / "batch" / "out").resolve() == out.resolve()

    again = tak(*command, home=tmp_path / "home", demo=True)
    assert again.returncode == 0, again.stderr
    assert len(results(out)) == 3  # nothing ran again
    assert "finished    3 of 3 tasks" in again.stdout
    for task in ("add", "divide", "hello"):
        users = [e for e in transcript(tmp_path / "home", "out", task) if e["type"] == "user"]
        assert len(users) == 1, task


def test_the_shorthand_is_tak_batch_run_and_the_run_id_defaults_to_the_file_stem(
    tmp_path: Path,
) -> None:
    tasks = write_tasks(tmp_path / "my evals.jsonl", THREE[2:])
    home = tmp_path / "home"
    done = tak("batch", "run", str(tasks), home=home, demo=True)
    assert done.returncode == 0, done.stderr
    assert [r.id for r in results(home / "batch" / "my-evals")] == ["hello"]
    # the same command in its short form is the same run: nothing to do
    again = tak("batch", str(tasks), home=home, demo=True)
    assert again.returncode == 0, again.stderr
    assert len(results(home / "batch" / "my-evals")) == 1


def test_running_again_with_other_settings_is_refused_in_one_line(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path / "evals.jsonl", THREE[2:])
    home = tmp_path / "home"
    assert tak("batch", str(tasks), home=home, demo=True).returncode == 0
    other = tak(
        "batch", str(tasks), "--model", "scripted:echo", "--max-steps", "3", home=home, demo=True
    )
    assert other.returncode == 2
    assert other.stderr == (
        "tak batch: run 'evals' was started with other --model, limits; run it as it was "
        "(tak batch resume) or give a new --run-id\n"
    )
    # concurrency is the command's own: not a difference
    assert tak("batch", str(tasks), "--concurrency", "3", home=home, demo=True).returncode == 0


def test_a_run_with_limits_resumes_and_runs_again_with_them(tmp_path: Path) -> None:
    """The limits the ledger keeps read back as they were given (a step count of 2,
    not 2.0, which no step limit takes: resume refused every such run)."""
    tasks = write_tasks(tmp_path / "evals.jsonl", THREE[2:])
    home = tmp_path / "home"
    limits = ("--max-steps", "2", "--wall-time", "60")
    assert tak("batch", str(tasks), *limits, home=home, demo=True).returncode == 0
    resumed = tak("batch", "resume", "evals", home=home, demo=True)
    assert resumed.returncode == 0 and "finished    1 of 1 tasks" in resumed.stdout, resumed
    again = tak("batch", str(tasks), *limits, home=home, demo=True)
    assert again.returncode == 0, again.stderr  # the same limits: the same run


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ('{"id": "b", "prompt": "hi", "colour": 1}', "colour"),
        ('{"id": "b", "prompt": "hi"', "not valid JSON"),
        ('{"id": "../b", "prompt": "hi"}', "A-Z a-z 0-9"),
    ],
)
def test_a_bad_tasks_file_is_one_line_naming_the_file_and_line(
    tmp_path: Path, line: str, error: str
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "a", "prompt": "hi"}\n' + line + "\n")
    result = tak("batch", str(tasks), home=tmp_path / "home", demo=True)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"tak batch: {tasks}:2: "), result.stderr
    assert error in result.stderr
    assert not (tmp_path / "home" / "batch" / "tasks").exists()  # nothing started


def test_a_tasks_file_without_tasks_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    result = tak("batch", str(empty), home=tmp_path / "home", demo=True)
    assert (result.returncode, result.stderr) == (
        2,
        f"tak batch: {empty}: no tasks (a task is a JSON object a line: docs/batch.md)\n",
    )


def test_bad_flags_and_runs_are_one_line(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path / "t.jsonl", THREE[2:])
    home = tmp_path / "home"
    for args, expected in [
        (["--concurrency", "0"], "tak batch: --concurrency: expected 1 or more, got 0\n"),
        (["--max-cost", "-1"], "tak batch: --max-cost: expected a positive number, got -1.0\n"),
        (["--set", "temperature=9"], "tak batch: --set temperature: "),
        (["--run-id", "a/b"], "tak batch: --run-id: expected 1-128 of"),
    ]:
        result = tak("batch", str(tasks), *args, home=home, demo=True)
        assert result.returncode == 2 and result.stderr.startswith(expected), (args, result)
        assert result.stderr.count("\n") == 1
    # a mistake found when the kernel opens makes no run (the same command, fixed, runs)
    for args, expected in [
        (["--tools", "nope"], "tak batch: "),
        (["--model", "nope:x"], "tak batch: "),
        (["--set", "tool_choice=nope"], "tak batch: "),
    ]:
        result = tak(
            "batch", str(tasks), "--out", str(tmp_path / "out"), *args, home=home, demo=True
        )
        assert result.returncode == 2 and result.stderr.startswith(expected), (args, result)
        assert result.stderr.count("\n") == 1 and "nope" in result.stderr, result.stderr
        assert not (tmp_path / "out").exists() and not (home / "batch" / "out").exists()
    inside = tak(
        "batch", str(tasks), "--out", str(home / "data" / "runs" / "x"), home=home, demo=True
    )
    assert inside.returncode == 2 and inside.stderr.startswith(
        f"tak batch: --out {home / 'data' / 'runs' / 'x'}: lies inside the home's data"
    ), inside.stderr
    missing = tak("batch", "resume", "nope", home=home, demo=True)
    assert (missing.returncode, missing.stderr) == (
        2,
        f"tak batch resume: no run 'nope' under {home / 'batch'} (see tak batch ls)\n",
    )
    shown = tak("batch", "show", str(tmp_path), home=home, demo=True)
    assert shown.returncode == 2
    assert (
        shown.stderr
        == f"tak batch show: {tmp_path}: not a batch run's directory (no manifest.json)\n"
    )


def wait_for(predicate: Any, what: str, proc: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"tak exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


SLOW = [
    {"id": "t1", "prompt": call("add", a=1, b=1)},
    {"id": "t2", "prompt": call("add", a=2, b=2)},
    {"id": "t3", "prompt": call("sleep", seconds=600)},
    {"id": "t4", "prompt": call("sleep", seconds=600)},
    {"id": "t5", "prompt": call("add", a=5, b=5)},
    {"id": "t6", "prompt": call("add", a=6, b=6)},
]


def test_ctrl_c_records_cancelled_and_the_printed_resume_finishes_the_rest_once(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    tasks = write_tasks(tmp_path / "slow.jsonl", SLOW)
    run_dir = home / "batch" / "slow"
    proc = subprocess.Popen(
        tak_argv(
            "batch",
            str(tasks),
            "--concurrency",
            "2",
            "--progress-every",
            "0.1",
            home=home,
            demo=True,
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # t1 and t2 finish; t3 and t4 are in their sleep call, recorded before it runs

        def sleeping() -> bool:
            return all(
                any(e["type"] == "assistant" for e in transcript(home, "slow", t))
                for t in ("t3", "t4")
            )

        wait_for(sleeping, "t3 and t4 to be in their sleep calls", proc)
        # meanwhile: ls reads the run as it goes; a second process may not run it
        listed = tak("batch", "ls", home=home, demo=True)
        assert listed.stdout.splitlines()[1].split()[3:6] == ["6", "2", "0"], listed.stdout
        second = tak("batch", "resume", "slow", home=home, demo=True)
        assert second.returncode == 2 and f"in use by process {proc.pid} " in second.stderr
        assert second.stderr.count("\n") == 1
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    first = {r.id: r.reason for r in results(run_dir)}
    assert first == {"t1": "final", "t2": "final", "t3": "cancelled", "t4": "cancelled"}
    assert "finished    2 of 6 tasks" in stdout
    assert re.search(r"^    t3  cancelled", stdout, re.M), stdout
    hint = stderr.splitlines()[-1]
    prefix = "tak batch: interrupted; to finish the run: "
    assert hint.startswith(prefix), stderr
    resume = shlex.split(hint.removeprefix(prefix))
    assert resume[-3:] == ["batch", "resume", "slow"]

    # as printed, where it was printed, with no tak on PATH (the venv's is named)
    env = {k: v for k, v in os.environ.items() if k != "PATH"}
    env["PATH"] = "/usr/bin:/bin"
    finished = subprocess.run(resume, capture_output=True, text=True, timeout=120, env=env)
    assert finished.returncode == 0, finished.stderr
    assert "finished    6 of 6 tasks" in finished.stdout
    every = results(run_dir)
    finals = [r for r in every if r.finished]
    assert sorted(r.id for r in finals) == ["t1", "t2", "t3", "t4", "t5", "t6"]  # once each
    assert {r.id: r.attempt for r in finals if r.id in ("t3", "t4")} == {"t3": 2, "t4": 2}
    # the interrupted sleeps were answered from the transcript, never run again
    for task in ("t3", "t4"):
        entries = transcript(home, "slow", task)
        assert sum(e["type"] == "user" for e in entries) == 1
        observed = [e for e in entries if e["type"] == "tool"]
        assert len(observed) == 1, entries
    for task in ("t1", "t2"):  # finished before the Ctrl-C: not run again
        assert sum(e["type"] == "assistant" for e in transcript(home, "slow", task)) == 2


def test_progress_on_a_terminal_is_one_line_redrawn(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path / "tty.jsonl", THREE)
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        tak_argv("batch", str(tasks), home=tmp_path / "home", demo=True),
        stdout=subprocess.PIPE,
        stderr=slave,
        text=True,
    )
    os.close(slave)
    drawn = b""
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 60)
            assert ready, "no output on the terminal"
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the process closed its end
                break
            if not chunk:
                break
            drawn += chunk
        stdout, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        os.close(master)
    text = drawn.decode()
    assert proc.returncode == 0, text
    # each drawing clears the line and draws it in place; only the last ends it
    *drawings, last = text.split("\r\x1b[2K")
    assert all(re.fullmatch(r"tty: \d/3 done, [^\r\n]*", d) for d in drawings if d), text
    assert re.fullmatch(r"tty: 3/3 done, 0 running, 0 failed, [^\r\n]*\r?\n", last), text
    assert "finished    3 of 3 tasks" in stdout


@pytest.fixture
def finished_run(tmp_path: Path) -> Iterator[Path]:
    """A run of two tasks: one final, one stopped by its own limit (one step)."""
    tasks = write_tasks(
        tmp_path / "graded.jsonl",
        [
            {"id": "ok", "prompt": "fine"},
            {"id": "short", "prompt": call("add", a=1, b=1), "limits": {"max_steps": 1}},
        ],
    )
    result = tak("batch", str(tasks), "--run-id", "graded", home=tmp_path / "home", demo=True)
    assert result.returncode == 0, result.stderr
    yield tmp_path / "home"


def test_ls_lists_the_runs_under_the_home(finished_run: Path, tmp_path: Path) -> None:
    listed = tak("batch", "ls", home=finished_run, demo=True)
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()
    assert header.split() == ["ID", "CREATED", "TASKS", "FINISHED", "FAILED", "COST", "MODEL"]
    fields = row.split()
    assert fields[0] == "graded" and fields[3:] == ["2", "2", "1", "-", "scripted:demo"]
    as_json = json.loads(tak("batch", "ls", "--json", home=finished_run, demo=True).stdout)
    assert as_json == [
        {
            "run_id": "graded",
            "where": str(finished_run / "batch" / "graded"),
            "created": as_json[0]["created"],
            "model": "scripted:demo",
            "session_project": as_json[0]["session_project"],
            "total": 2,
            "finished": 2,
            "failed": 1,
            "unfinished": 0,
            "reasons": {"final": 1, "max_steps": 1},
            "input_tokens": as_json[0]["input_tokens"],
            "output_tokens": as_json[0]["output_tokens"],
            "cost_usd": None,
            "score_mean": None,
        }
    ]
    assert all(isinstance(as_json[0][k], int) for k in ("input_tokens", "output_tokens"))
    assert isinstance(as_json[0]["created"], float)
    empty = tak("batch", "ls", home=tmp_path / "empty", demo=True)
    assert empty.stdout == f"no batch runs under {tmp_path / 'empty' / 'batch'}\n"


def test_show_prints_the_summary_and_each_task_not_final(finished_run: Path) -> None:
    shown = tak("batch", "show", "graded", home=finished_run, demo=True)
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"^  final +1$", shown.stdout, re.M)
    assert re.search(r"^  max_steps +1$", shown.stdout, re.M)
    assert "finished    2 of 2 tasks" in shown.stdout
    assert re.search(r"^  not final \(1\):\n    short  max_steps", shown.stdout, re.M)
    # by its directory too
    by_path = tak(
        "batch", "show", str(finished_run / "batch" / "graded"), home=finished_run, demo=True
    )
    assert by_path.stdout == shown.stdout


def test_show_json_schema(finished_run: Path) -> None:
    shown = tak("batch", "show", "graded", "--json", home=finished_run, demo=True)
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    assert sorted(data) == sorted(
        [
            "run_id", "where", "created", "model", "session_project", "total", "finished", "failed",
            "unfinished", "reasons", "input_tokens", "output_tokens", "cost_usd",
            "score_mean", "not_final", "results",
        ]
    )  # fmt: skip
    assert (data["run_id"], data["model"], data["total"]) == ("graded", "scripted:demo", 2)
    assert (finished_run / "data" / "sessions" / data["session_project"] / "ok").is_dir()
    assert (data["finished"], data["failed"], data["unfinished"]) == (2, 1, 0)
    assert data["reasons"] == {"final": 1, "max_steps": 1}
    assert isinstance(data["created"], float) and data["cost_usd"] is None
    assert [t["id"] for t in data["not_final"]] == ["short"]
    assert data["not_final"][0]["reason"] == "max_steps"
    # every result is a results.jsonl record, in task order
    records = [converter.structure(r, TaskResult) for r in data["results"]]
    assert [r.id for r in records] == ["ok", "short"]


def test_a_run_on_postgresql_and_a_worker_for_it(tmp_path: Path, db_url: str) -> None:
    home = tmp_path / "home"
    tasks = write_tasks(tmp_path / "pg.jsonl", THREE)
    first = tak("batch", str(tasks), "--store", db_url, "--run-id", "shared", home=home, demo=True)
    assert first.returncode == 0, first.stderr
    assert "finished    3 of 3 tasks" in first.stdout
    # a worker of the same run, settings from the run: nothing left to claim
    worker = tak("batch", "worker", "--run", "shared", "--store", db_url, home=home, demo=True)
    assert worker.returncode == 0, worker.stderr
    assert "finished    3 of 3 tasks" in worker.stdout
    shown = tak("batch", "show", "shared", "--store", db_url, "--json", home=home, demo=True)
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    assert (data["total"], data["finished"], data["model"]) == (3, 3, "scripted:demo")
    assert [r["attempt"] for r in data["results"]] == [1, 1, 1]
    # the tasks' sessions are in PostgreSQL too, where every worker sees them
    project = data["session_project"]
    assert project.startswith("batch.shared.") and f"project {project}\n" in first.stdout
    assert not (home / "data" / "sessions" / project).exists()
    sessions = subprocess.run(
        [*tak_argv("sessions", "ls", "--project", project, home=home, demo=True)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "TAK_STORE_URL": db_url},
    )
    assert sessions.returncode == 0, sessions.stderr
    assert sorted(line.split()[0] for line in sessions.stdout.splitlines()[1:]) == sorted(
        t["id"] for t in THREE
    )
    missing = tak("batch", "worker", "--run", "nope", "--store", db_url, home=home, demo=True)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1, missing.stderr
    assert missing.stderr.startswith("tak batch worker: ")


def test_help_names_the_shorthand_and_every_command() -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "kernel.cli", "batch", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0
    assert shown.stdout.startswith("usage: tak batch TASKS.jsonl [options]")
    for command in ("run", "resume", "ls", "show", "worker"):
        assert re.search(rf"^    {command} ", shown.stdout, re.M), command
    assert "130 stopped by Ctrl-C" in " ".join(shown.stdout.split())
    for command in ("run", "resume", "ls", "show", "worker"):
        sub = subprocess.run(
            [sys.executable, "-m", "kernel.cli", "batch", command, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert sub.stdout.startswith(f"usage: tak batch {command} [-h]"), sub.stdout


def test_the_store_variable_is_the_homes() -> None:
    from kernel.cli import batch
    from kernel.home import STORE_URL_ENV

    assert batch.STORE_URL_ENV == STORE_URL_ENV


async def test_the_progress_line_has_an_eta_and_each_providers_load(autojump_clock: Any) -> None:
    import io
    from types import SimpleNamespace

    import trio

    from kernel.batch import BatchProgress
    from kernel.cli._batch_progress import ProgressView
    from kernel.models import ProviderLoad

    def load(model: str | None, in_flight: int, waiting: int, paused: float = 0.0) -> Any:
        return ProviderLoad(
            provider="openai", model=model, in_flight=in_flight, waiting=waiting, limit=50,
            requests_used=0, requests_per_minute=None, tokens_used=0, tokens_per_minute=None,
            paused_for=paused,
        )  # fmt: skip

    loads = [load(None, 50, 150), load("gpt-4.1", 50, 150)]
    kernel = SimpleNamespace(budget=SimpleNamespace(snapshot=lambda: loads))
    out = io.StringIO()
    view = ProgressView(out, kernel, every=5)  # type: ignore[arg-type]

    def progress(done: int) -> BatchProgress:
        return BatchProgress(
            run_id="r", total=100, done=done, running=50, failed=2, input_tokens=12_345,
            output_tokens=678, cost_usd=0.1234, started_at=trio.current_time(),
        )  # fmt: skip

    view.update(progress(0))
    await trio.sleep(30)
    view.update(progress(10))  # 10 tasks in 30 s: 90 more take 4.5 min
    assert view.line() == (
        "r: 10/100 done, 50 running, 2 failed, 12,345 in / 678 out tokens, $0.1234, "
        "ETA 4m30s | openai 50/50 in flight, 150 waiting"
    )
    loads[0] = load(None, 0, 200, paused=11.5)
    assert view.line().endswith("| openai 0/50 in flight, 200 waiting, paused 12s")  # type: ignore[union-attr]
    # not a terminal: a line when something changed, and the last one at the end
    async with trio.open_nursery() as nursery:
        nursery.start_soon(view.redraw)
        await trio.sleep(12)
        nursery.cancel_scope.cancel()
    view.finish()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[-1] == view.line()
    assert all(line.startswith("r: 10/100 done") for line in lines)


def test_ctrl_c_on_postgresql_prints_the_worker_that_finishes_the_run(
    tmp_path: Path,
    db_url: str,
) -> None:
    home = tmp_path / "home"
    tasks = write_tasks(tmp_path / "slow.jsonl", SLOW)
    command = ["batch", str(tasks), "--store", db_url, "--run-id", "pgslow", "--concurrency", "2"]
    proc = subprocess.Popen(
        tak_argv(*command, "--progress-every", "0.1", home=home, demo=True),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: list[str] = []  # stderr, read as it comes (the lines wait for no one)
    reader = threading.Thread(target=lambda: seen.extend(proc.stderr or ()), daemon=True)
    reader.start()
    try:
        wait_for(
            lambda: any("pgslow: 2/6 done, 2 running" in line for line in seen),
            "t1, t2 done and t3, t4 running",
            proc,
        )
        shown = tak("batch", "show", "pgslow", "--store", db_url, "--json", home=home, demo=True)
        project = json.loads(shown.stdout)["session_project"]

        def recorded(task: str) -> bool:
            # the sleep call is in the shared store: the worker answers it, never reruns it
            shown = subprocess.run(
                tak_argv("sessions", "show", task, "--project", project, home=home, demo=True),
                capture_output=True,
                text=True,
                timeout=60,
                env={**os.environ, "TAK_STORE_URL": db_url},
            )
            return "-> sleep(" in shown.stdout

        wait_for(lambda: recorded("t3") and recorded("t4"), "the sleep calls recorded", proc)
        proc.send_signal(signal.SIGINT)
        stdout = proc.stdout.read() if proc.stdout else ""
        proc.wait(timeout=60)
        reader.join(timeout=60)
    finally:
        proc.kill()
    stderr = "".join(seen)
    assert proc.returncode == 130, stderr
    assert "finished    2 of 6 tasks" in stdout
    hint = stderr.splitlines()[-1]
    prefix = "tak batch: interrupted; to finish the run: "
    assert hint.startswith(prefix), stderr
    worker = shlex.split(hint.removeprefix(prefix))
    assert worker[-6:] == ["batch", "worker", "--run", "pgslow", "--store", db_url]
    finished = subprocess.run(worker, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stderr
    assert "finished    6 of 6 tasks" in finished.stdout
    shown = json.loads(
        tak("batch", "show", "pgslow", "--store", db_url, "--json", home=home, demo=True).stdout
    )
    assert shown["reasons"] == {"final": 6}
    assert {r["id"]: r["attempt"] for r in shown["results"]} == {
        "t1": 1, "t2": 1, "t3": 2, "t4": 2, "t5": 1, "t6": 1,
    }  # fmt: skip


def test_show_json_names_a_runs_own_directory_not_its_link(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path / "evals.jsonl", [{"id": "a", "prompt": "hi"}])
    out = tmp_path / "out"
    home = tmp_path / "home"
    assert tak("batch", str(tasks), "--out", str(out), home=home, demo=True).returncode == 0
    shown = tak("batch", "show", "out", "--json", home=home, demo=True)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["where"] == str(out.resolve())


def test_progress_every_below_a_tenth_of_a_second_is_refused(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path / "evals.jsonl", [{"id": "a", "prompt": "hi"}])
    ran = tak("batch", str(tasks), "--progress-every", "0", home=tmp_path / "home", demo=True)
    assert ran.returncode == 2
    assert ran.stderr == "tak batch: --progress-every: expected at least 0.1 seconds, got 0\n"


# -- odd input, damaged runs, interruptions --------------------------------------------
#
# Runs for ``ls`` and ``show`` are written by hand where no task needs to run: a run's
# directory is its ``manifest.json``, ``tasks.jsonl`` and ``results.jsonl``.


def finished(run_dir: Path) -> list[str]:
    """The ids of the run's results so far (none before its results file exists)."""
    try:
        return [r.id for r in results(run_dir)]
    except (FileNotFoundError, ValueError):  # not there yet, or a line half written
        return []


def hand_made_run(root: Path, run_id: str, task_ids: Sequence[str], *, done: int) -> Path:
    """A finished-looking run directory under ``root`` (what the ledger writes)."""
    run = root / run_id
    run.mkdir(parents=True)
    settings: dict[str, Any] = {"model": "scripted:demo", "fallbacks": [], "system": None,
                                "plugins": [], "tools": None, "settings": None, "limits": {},
                                "concurrency": 10}  # fmt: skip
    manifest = {"run_id": run_id, "created": time.time(), "settings": settings}
    (run / "manifest.json").write_text(json.dumps(manifest))
    write_tasks(run / "tasks.jsonl", [{"id": t, "prompt": "hi"} for t in task_ids])
    lines = [
        json.dumps(converter.unstructure(TaskResult(id=t, reason="final", text="x" * 40)))
        for t in task_ids[:done]
    ]
    (run / "results.jsonl").write_text("".join(line + "\n" for line in lines))
    return run


def in_its_call(home: Path, run_id: str, task_id: str) -> Callable[[], bool]:
    """Whether the task's transcript has the model's tool call (the tool is running)."""

    def check() -> bool:
        try:
            text = transcript_path(home, run_id, task_id).read_text()
        except FileNotFoundError:
            return False
        return any(json.loads(line)["type"] == "assistant" for line in text.splitlines() if line)

    return check


SLEEPY = [
    {"id": "quick", "prompt": call("add", a=1, b=1)},
    {"id": "sleepy", "prompt": call("sleep", seconds=600)},
]


def start_sleepy(home: Path, tmp_path: Path, *args: str, cwd: Path | None = None) -> Any:
    tasks = write_tasks(tmp_path / "sleepy.jsonl", SLEEPY)
    proc = subprocess.Popen(
        tak_argv("batch", str(tasks), *args, home=home, demo=True),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
    )
    return proc


def test_out_at_a_directory_of_other_files_is_refused_and_left_alone(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    mine = '{"id":"a","prompt":"my own file"}\n'
    (project / "tasks.jsonl").write_text(mine)
    (project / "notes.txt").write_text("keep\n")
    tasks = write_tasks(tmp_path / "evals.jsonl", [{"id": "z", "prompt": "hi"}])
    result = tak("batch", str(tasks), "--out", str(project), home=tmp_path / "home", demo=True)
    assert (project / "tasks.jsonl").read_text() == mine  # today: task z appended to it
    assert sorted(p.name for p in project.iterdir()) == ["notes.txt", "tasks.jsonl"]
    assert result.returncode == 2 and one_line(result, "tak batch: "), result
    assert str(project) in result.stderr


def test_a_run_that_could_not_start_does_not_keep_its_id(tmp_path: Path) -> None:
    home = tmp_path / "home"
    tasks = write_tasks(tmp_path / "t.jsonl", [{"id": "a", "prompt": "hi"}])
    (tmp_path / "evals").write_text("a file\n")
    failed = tak("batch", str(tasks), "--out", str(tmp_path / "evals"), home=home, demo=True)
    assert failed.returncode != 0 and failed.stderr.count("\n") == 1, failed.stderr
    # and a start that fails once it makes the run (below a file: the OS refuses)
    below = tak(
        "batch", str(tasks), "--out", str(tmp_path / "evals" / "evals"), home=home, demo=True
    )
    assert below.returncode == 1 and "Not a directory" in below.stderr, below.stderr
    assert not (home / "batch" / "evals").is_symlink()
    # the user fixes the mistake: the run of that name goes elsewhere
    (tmp_path / "runs").mkdir()
    fixed = tak(
        "batch", str(tasks), "--out", str(tmp_path / "runs" / "evals"), home=home, demo=True
    )
    assert fixed.returncode == 0, fixed.stderr  # today: run id 'evals' is taken by the file


def test_ls_lists_the_good_runs_beside_a_damaged_one(tmp_path: Path) -> None:
    home = tmp_path / "home"
    hand_made_run(home / "batch", "good", ["a", "b"], done=2)
    bad = hand_made_run(home / "batch", "bad", ["a"], done=1)
    (bad / "manifest.json").write_text("{not json")
    for args in ([], ["--json"]):
        listed = tak("batch", "ls", *args, home=home, demo=True)
        assert "good" in listed.stdout, listed
        assert "bad" in listed.stderr, listed


def test_show_of_results_not_utf8_names_the_file_and_line(tmp_path: Path) -> None:
    home = tmp_path / "home"
    run = hand_made_run(home / "batch", "r", ["a", "b"], done=1)
    with (run / "results.jsonl").open("ab") as f:
        f.write(b'{"id": "b", "reason": "final", "text": "\xff"}\n')
    shown = tak("batch", "show", "r", home=home, demo=True)
    assert shown.returncode == 2, shown
    assert one_line(shown, "tak batch show: "), shown.stderr
    assert f"{run / 'results.jsonl'}:2" in shown.stderr


def test_show_of_a_result_missing_a_field_names_the_field(tmp_path: Path) -> None:
    home = tmp_path / "home"
    run = hand_made_run(home / "batch", "r", ["a", "b"], done=1)
    with (run / "results.jsonl").open("a") as f:
        f.write('{"id": "b"}\n')
    shown = tak("batch", "show", "r", home=home, demo=True)
    assert shown.returncode == 2 and one_line(shown, "tak batch show: "), shown
    assert f"{run / 'results.jsonl'}:2" in shown.stderr and "$.reason" in shown.stderr


def test_show_of_a_run_without_its_tasks_file_says_so(tmp_path: Path) -> None:
    home = tmp_path / "home"
    run = hand_made_run(home / "batch", "r", ["a", "b"], done=2)
    (run / "tasks.jsonl").unlink()
    resumed = tak("batch", "resume", "r", home=home, demo=True)
    assert resumed.returncode == 2 and "not in tasks.jsonl" in resumed.stderr  # held
    shown = tak("batch", "show", "r", home=home, demo=True)
    assert "of 0 tasks" not in shown.stdout, shown.stdout
    assert "tasks.jsonl" in shown.stderr, shown


def limit_memory(megabytes: int) -> Callable[[], None]:
    """A ``preexec_fn``: at most this much memory (enough for tak and a small run)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (megabytes * 2**20, megabytes * 2**20))

    return limit


def test_a_huge_concurrency_runs_the_one_task_or_is_refused(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path / "one.jsonl", [{"id": "a", "prompt": "hi"}])
    result = tak(
        "batch",
        str(tasks),
        "--concurrency",
        "1000000000",
        # A hang detector, not a measure: fixed, this run takes a second or two. Today
        # it makes runner tasks until the memory limit (or the timeout) stops it.
        timeout=20,
        preexec_fn=limit_memory(2048),
        home=tmp_path / "home",
        demo=True,
    )
    if result.returncode == 2:  # refusing is a fix too
        assert one_line(result, "tak batch: --concurrency: "), result.stderr
    else:
        assert result.returncode == 0, result.stderr[-500:]
        assert "finished    1 of 1 tasks" in result.stdout


def test_an_infinite_limit_is_refused_naming_its_flag(tmp_path: Path) -> None:
    home = tmp_path / "home"
    tasks = write_tasks(tmp_path / "t.jsonl", [{"id": "a", "prompt": "hi"}])
    result = tak("batch", str(tasks), "--max-cost", "inf", home=home, demo=True)
    assert result.returncode == 2, result
    assert not (home / "batch" / "t").exists()
    assert one_line(result, "tak batch: --max-cost: "), result.stderr


def test_progress_every_nan_is_a_bad_flag(tmp_path: Path) -> None:
    home = tmp_path / "home"
    tasks = write_tasks(tmp_path / "t.jsonl", [{"id": "a", "prompt": "hi"}])
    result = tak("batch", str(tasks), "--progress-every", "nan", home=home, demo=True)
    assert result.returncode == 2 and one_line(result, "tak batch: --progress-every: "), result
    assert not (home / "batch" / "t").exists()


def test_an_endless_tasks_file_is_refused_in_one_line(tmp_path: Path) -> None:
    result = tak(
        "batch", "/dev/zero", preexec_fn=limit_memory(700), home=tmp_path / "home", demo=True
    )
    assert result.returncode == 2 and one_line(result, "tak batch: /dev/zero"), result


def test_a_run_id_from_an_unusable_name_names_that_name(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path / "t.jsonl", [{"id": "a", "prompt": "hi"}])
    result = tak(
        "batch", str(tasks), "--out", str(tmp_path / "評価"), home=tmp_path / "home", demo=True
    )
    assert result.returncode == 2 and one_line(result, "tak batch: "), result
    assert "評価" in result.stderr and "--run-id" in result.stderr, result.stderr
    # a long name is cut to the longest run id, whose tasks run
    long = write_tasks(tmp_path / f"{'x' * 200}.jsonl", [{"id": "a", "prompt": "hi"}])
    ran = tak("batch", str(long), home=tmp_path / "home", demo=True)
    assert ran.returncode == 0, ran.stderr
    assert [r.reason for r in results(tmp_path / "home" / "batch" / ("x" * MAX_RUN_ID))] == [
        "final"
    ]


def test_another_tasks_file_of_the_same_name_is_not_merged_into_the_run(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    for project, task in (("a", "first"), ("b", "second")):
        (tmp_path / project).mkdir()
        write_tasks(tmp_path / project / "tasks.jsonl", [{"id": task, "prompt": "hi"}])
    assert tak("batch", str(tmp_path / "a" / "tasks.jsonl"), home=home, demo=True).returncode == 0
    second = tak("batch", str(tmp_path / "b" / "tasks.jsonl"), home=home, demo=True)
    # refused (give --run-id), or a run of its own: not project a's run grown
    assert [r.id for r in results(home / "batch" / "tasks")] == ["first"], second
    assert second.returncode == 2 and one_line(second, "tak batch: run 'tasks' has the "), second
    assert str(tmp_path / "b" / "tasks.jsonl") in second.stderr and "--run-id" in second.stderr
    # the run's own file, grown, adds its tasks; a copy of it, moved elsewhere, is the run's
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "tasks.jsonl").write_bytes((tmp_path / "a" / "tasks.jsonl").read_bytes())
    write_tasks(
        tmp_path / "a" / "tasks.jsonl", [{"id": t, "prompt": "hi"} for t in ("first", "more")]
    )
    for project in ("a", "c"):
        again = tak("batch", str(tmp_path / project / "tasks.jsonl"), home=home, demo=True)
        assert again.returncode == 0, again.stderr
    assert [r.id for r in results(home / "batch" / "tasks")] == ["first", "more"]


def test_sigterm_stops_like_ctrl_c(tmp_path: Path) -> None:
    home = tmp_path / "home"
    proc = start_sleepy(home, tmp_path)
    try:
        wait_for(in_its_call(home, "sleepy", "sleepy"), "the sleep call", proc)
        # (on a loaded machine the quick task may still be on its way)
        wait_for(lambda: finished(home / "batch" / "sleepy") == ["quick"], "the quick task", proc)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "tak batch: terminated; to finish the run: " in stderr, stderr
    assert "finished    1 of 2 tasks" in stdout
    by_id = {r.id: r.reason for r in results(home / "batch" / "sleepy")}
    assert by_id == {"quick": "final", "sleepy": "cancelled"}


def test_the_interrupted_hint_runs_as_printed_with_a_quoted_home_and_an_odd_out(
    tmp_path: Path,
) -> None:
    """A relative --home with a space and both quotes, an --out with a space and
    unicode elsewhere; the hint pasted into a shell in the same directory, no tak
    on PATH."""
    cwd = tmp_path / "it's here"
    cwd.mkdir()
    home_arg = "h 'o\"me"
    home = cwd / home_arg
    proc = subprocess.Popen(
        [sys.executable, "-m", "kernel.cli", "--home", home_arg, "--plugin", "demo", "batch",
         str(write_tasks(cwd / "sleepy.jsonl", SLEEPY)), "--out", "out dir/é x"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
    )  # fmt: skip
    try:
        wait_for(in_its_call(home, "x", "sleepy"), "the sleep call", proc)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    prefix = "tak batch: interrupted; to finish the run: "
    hint = stderr.splitlines()[-1]
    assert hint.startswith(prefix), stderr
    assert shlex.split(hint.removeprefix(prefix))[-3:] == ["batch", "resume", "x"]
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    finished = subprocess.run(
        ["/bin/sh", "-c", hint.removeprefix(prefix)],
        capture_output=True, text=True, timeout=120, cwd=cwd, env=env,
    )  # fmt: skip
    assert finished.returncode == 0, finished.stderr
    assert "finished    2 of 2 tasks" in finished.stdout
    assert (home / "batch" / "x").resolve() == (cwd / "out dir" / "é x").resolve()


def test_sigkill_then_resume_finishes_each_task_once(tmp_path: Path) -> None:
    """And a plain progress line only when the run moved: none while a task sleeps
    (fifteen chances to repeat itself, every 0.1 s)."""
    home = tmp_path / "home"
    proc = start_sleepy(home, tmp_path, "--progress-every", "0.1")
    try:
        wait_for(in_its_call(home, "sleepy", "sleepy"), "the sleep call", proc)
        time.sleep(1.5)
        proc.kill()
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    lines = [line for line in stderr.splitlines() if line.startswith("sleepy: ")]
    assert 1 <= len(lines) <= 3 and len(set(lines)) == len(lines), stderr
    run = home / "batch" / "sleepy"
    assert [r.id for r in results(run)] == ["quick"]
    resumed = tak("batch", "resume", "sleepy", home=home, demo=True)
    assert resumed.returncode == 0, resumed.stderr
    finals = {r.id: r.attempt for r in results(run) if r.finished}
    assert finals == {"quick": 1, "sleepy": 2}
    assert len(results(run)) == 2


def test_a_bom_crlf_and_blank_lines_are_read_and_odd_task_files_refused(tmp_path: Path) -> None:
    home = tmp_path / "home"
    odd = tmp_path / "odd.jsonl"
    odd.write_bytes(
        b'\xef\xbb\xbf{"id": "a", "prompt": "hi"}\r\n\r\n\n  \n{"id": "b", "prompt": "yo"}\r\n'
    )
    ran = tak("batch", str(odd), home=home, demo=True)
    assert ran.returncode == 0, ran.stderr
    assert sorted(r.id for r in results(home / "batch" / "odd")) == ["a", "b"]
    (tmp_path / "dir.jsonl").mkdir()
    (tmp_path / "latin1.jsonl").write_bytes(b'{"id": "a", "prompt": "caf\xe9"}\n')
    for name, expected in [
        ("dir.jsonl", "cannot read the task file: Is a directory"),
        ("latin1.jsonl", ":1: not valid JSON ("),
    ]:
        refused = tak("batch", str(tmp_path / name), home=home, demo=True)
        assert refused.returncode == 2 and one_line(refused, "tak batch: "), refused
        assert expected in refused.stderr, refused.stderr


def test_bad_numbers_are_refused_in_one_line_before_a_run_is_made(tmp_path: Path) -> None:
    home = tmp_path / "home"
    tasks = write_tasks(tmp_path / "t.jsonl", [{"id": "a", "prompt": "hi"}])
    for args, expected in [
        (["--concurrency", "-1"], "tak batch: --concurrency: expected 1 or more, got -1\n"),
        (["--wall-time", "0"], "tak batch: --wall-time: expected a positive number, got 0.0\n"),
        (["--max-cost", "nan"], "tak batch: --max-cost: expected a positive number, got nan\n"),
    ]:
        result = tak("batch", str(tasks), *args, home=home, demo=True)
        assert (result.returncode, result.stderr) == (2, expected), args
    assert not (home / "batch" / "t").exists()
    resumed = tak("batch", "resume", "t", "--concurrency", "0", home=home, demo=True)
    assert (resumed.returncode, resumed.stderr) == (
        2,
        "tak batch resume: --concurrency: expected 1 or more, got 0\n",
    )


def test_a_worker_without_a_store_is_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TAK_STORE_URL"}
    result = tak("batch", "worker", "--run", "r", env=env, home=tmp_path / "home", demo=True)
    assert (result.returncode, result.stderr) == (
        2,
        "tak batch worker: --store URL is needed (or $TAK_STORE_URL)\n",
    )


def test_json_is_valid_for_no_runs_and_an_empty_run_and_a_closed_pipe_is_quiet(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    empty = tak("batch", "ls", "--json", home=home, demo=True)
    assert (empty.returncode, json.loads(empty.stdout)) == (0, [])
    hand_made_run(home / "batch", "none", [], done=0)
    shown = json.loads(tak("batch", "show", "none", "--json", home=home, demo=True).stdout)
    assert (shown["total"], shown["results"], shown["score_mean"]) == (0, [], None)
    # more than a pipe holds, read by `head -1`: no traceback, status 0
    hand_made_run(home / "batch", "big", [f"t{i}" for i in range(600)], done=600)
    for args in (["show", "big", "--json"], ["ls"]):
        piped = subprocess.run(
            f"{shlex.join(tak_argv('batch', *args, home=home, demo=True))} | head -1; "
            'echo "status ${PIPESTATUS[0]}" >&2',
            shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert piped.stderr == "status 0\n", piped.stderr
        assert piped.stdout.count("\n") == 1


def test_ls_names_a_run_whose_directory_is_gone_and_lists_the_rest(tmp_path: Path) -> None:
    home = tmp_path / "home"
    hand_made_run(home / "batch", "good", ["a"], done=1)
    (home / "batch" / "gone").symlink_to(tmp_path / "nowhere", target_is_directory=True)
    (home / "batch" / "loop").symlink_to(home / "batch" / "loop")
    listed = tak("batch", "ls", home=home, demo=True)
    assert listed.returncode == 0, listed
    assert listed.stdout.splitlines()[1].split()[0] == "good"
    assert f"tak batch ls: gone: its directory is gone ({tmp_path / 'nowhere'})" in listed.stderr


def test_a_second_run_of_the_same_id_elsewhere_is_refused_and_makes_nothing(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    tasks = write_tasks(tmp_path / "t.jsonl", [{"id": "a", "prompt": "hi"}])
    hand_made_run(home / "batch", "evals", ["a"], done=1)
    other = tmp_path / "elsewhere" / "evals"
    refused = tak("batch", str(tasks), "--out", str(other), home=home, demo=True)
    assert refused.returncode == 2 and one_line(
        refused, f"tak batch: run id 'evals' is taken by {home / 'batch' / 'evals'}"
    ), refused
    assert not other.exists()


def test_the_hint_names_a_home_given_by_the_environment(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path / "sleepy.jsonl", SLEEPY)
    env = {**os.environ, "TAK_HOME": str(tmp_path / "home"), "HOME": str(tmp_path / "user")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kernel.cli", "--plugin", "demo", "batch", str(tasks)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        wait_for(in_its_call(tmp_path / "home", "sleepy", "sleepy"), "the sleep call", proc)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    hint = stderr.splitlines()[-1].removeprefix("tak batch: interrupted; to finish the run: ")
    fresh = {k: v for k, v in env.items() if k != "TAK_HOME"}  # another terminal
    finished = subprocess.run(
        ["/bin/sh", "-c", hint], capture_output=True, text=True, timeout=120, env=fresh
    )
    assert finished.returncode == 0, (hint, finished.stderr)


def test_a_plugin_given_by_a_relative_path_is_the_runs_wherever_it_resumes(
    tmp_path: Path,
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "mine.py").write_text(
        "from kernel.plugin import Plugin\n\n"
        'plugin = Plugin("mine", version="1.0.0", description="x", in_process=True)\n\n\n'
        "@plugin.tool\nasync def hello() -> str:\n"
        '    """Say hello."""\n    return "hello there"\n'
    )
    tasks = [{"id": "sleepy", "prompt": call("sleep", seconds=600)},
             {"id": "hi", "prompt": call("hello")}]  # fmt: skip
    write_tasks(project / "tasks.jsonl", tasks)
    home = tmp_path / "home"
    argv = [
        *tak_argv("--plugin", "./mine.py", "batch", "tasks.jsonl", home=home, demo=True),
        "--concurrency",
        "1",
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=project)  # fmt: skip
    try:
        wait_for(in_its_call(home, "tasks", "sleepy"), "the sleep call", proc)
        proc.kill()
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    resumed = tak(
        "batch", "resume", "tasks", cwd=tmp_path, home=home, demo=True
    )  # not the project's directory
    assert resumed.returncode == 0, resumed.stderr
    hi = [r for r in results(home / "batch" / "tasks") if r.id == "hi"]
    assert "hello there" in hi[-1].text, (hi, resumed.stderr)


def refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def test_show_json_is_json_even_from_a_hand_edited_result(tmp_path: Path) -> None:
    home = tmp_path / "home"
    run = hand_made_run(home / "batch", "r", ["a"], done=1)
    text = (run / "results.jsonl").read_text()
    (run / "results.jsonl").write_text(text.replace('"cost_usd": null', '"cost_usd": NaN'))
    resumed = tak("batch", "resume", "r", home=home, demo=True)
    assert resumed.returncode == 2 and "NaN is not valid JSON" in resumed.stderr  # held
    shown = tak("batch", "show", "r", "--json", home=home, demo=True)
    if shown.returncode == 0:
        json.loads(shown.stdout, parse_constant=refuse_constant)
    else:
        assert shown.returncode == 2 and one_line(shown, "tak batch show: "), shown


def test_ls_survives_an_absurd_created_time(tmp_path: Path) -> None:
    home = tmp_path / "home"
    hand_made_run(home / "batch", "good", ["a"], done=1)
    odd = hand_made_run(home / "batch", "odd", ["a"], done=0)
    manifest = json.loads((odd / "manifest.json").read_text())
    (odd / "manifest.json").write_text(json.dumps({**manifest, "created": 1e300}))
    listed = tak("batch", "ls", home=home, demo=True)
    assert "internal error" not in listed.stderr, listed.stderr
    assert "good" in listed.stdout, listed


def test_ls_json_has_the_totals_of_show_json(tmp_path: Path) -> None:
    home = tmp_path / "home"
    hand_made_run(home / "batch", "r", ["a", "b"], done=1)
    shown = json.loads(tak("batch", "show", "r", "--json", home=home, demo=True).stdout)
    [listed] = json.loads(tak("batch", "ls", "--json", home=home, demo=True).stdout)
    totals = {k: v for k, v in shown.items() if k not in ("not_final", "results")}
    assert listed == totals


def test_batch_ls_does_not_say_no_runs_when_it_left_one_out(tmp_path: Path) -> None:
    home = tmp_path / "home"
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(
            json.dumps({"id": f"t{i}", "prompt": f'/call echo {{"text": "{i}"}}'}) + "\n"
            for i in range(3)
        )
    )
    ran = tak("--plugin", "demo", "batch", str(tasks), "--model", "scripted:demo", home=home)
    assert ran.returncode == 0, ran.stderr
    results = home / "batch" / "tasks" / "results.jsonl"
    lines = results.read_text().splitlines()
    lines[1] = "{garbage"
    results.write_text("\n".join(lines) + "\n")
    listed = tak("batch", "ls", home=home)
    assert "tasks: left out:" in listed.stderr
    assert "no batch runs" not in listed.stdout


def test_batch_show_heads_an_unfinished_run_with_its_task_count(tmp_path: Path) -> None:
    home = tmp_path / "home"
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "prompt": "hi"}) + "\n" for i in range(3)))
    ran = tak("--plugin", "demo", "batch", str(tasks), "--model", "scripted:demo", home=home)
    assert ran.returncode == 0, ran.stderr
    results = home / "batch" / "tasks" / "results.jsonl"
    results.write_text("".join(results.read_text().splitlines(keepends=True)[:2]))
    shown = tak("batch", "show", "tasks", home=home)
    assert "finished    2 of 3 tasks" in shown.stdout  # the run is unfinished: t2 is left
    assert shown.stdout.splitlines()[0] == "run tasks: 3 tasks"


def test_a_relative_seed_is_the_task_files(tmp_path: Path) -> None:
    here = tmp_path / "evals"
    (here / "seeds" / "s1").mkdir(parents=True)
    (here / "seeds" / "s1" / "question.txt").write_text("seeded")
    (here / "tasks.jsonl").write_text(
        json.dumps({"id": "t1", "prompt": "hello", "workspace": "seeds/s1"}) + "\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "out"
    tak = [sys.executable, "-m", "kernel.cli", "--home", str(tmp_path / "home"), "batch"]
    done = subprocess.run(
        [*tak, str(here / "tasks.jsonl"), "--model", "scripted:echo", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=elsewhere,
        check=False,
    )
    line = json.loads((out / RESULTS).read_text().splitlines()[0])
    assert (line["reason"], line["error"]) == ("final", None), done.stdout + done.stderr
    assert (out / "workspaces" / "t1" / "question.txt").read_text() == "seeded"
