"""A second engineer's attack on `tak batch` (kernel/cli/batch.py, kernel/cli/_batch.py).

Real `tak` subprocesses with a temporary home and the scripted model, as
tests/test_cli_batch.py runs them. The tests under "bugs" are the bugs the attack
found (strict xfails until they were fixed); those under "what held", attacks that held.

Runs for ``ls`` and ``show`` are written by hand where no task needs to run: a
run's directory is its ``manifest.json``, ``tasks.jsonl`` and ``results.jsonl``.
"""

from __future__ import annotations

import json
import os
import resource
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kernel.batch import MAX_RUN_ID, TaskResult, converter
from tests.cli_kit import tak, tak_argv
from tests.test_cli_batch import transcript_path


def call(name: str, **arguments: Any) -> str:
    return f"/call {name} {json.dumps(arguments)}"


def write_tasks(path: Path, tasks: Sequence[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return path


def results(run_dir: Path) -> list[TaskResult]:
    lines = (run_dir / "results.jsonl").read_text().splitlines()
    return [converter.structure(json.loads(line), TaskResult) for line in lines]


def finished(run_dir: Path) -> list[str]:
    """The ids of the run's results so far (none before its results file exists)."""
    try:
        return [r.id for r in results(run_dir)]
    except (FileNotFoundError, ValueError):  # not there yet, or a line half written
        return []


def one_line(result: subprocess.CompletedProcess[str], prefix: str) -> bool:
    return result.stderr.startswith(prefix) and result.stderr.count("\n") == 1


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


def wait_for(predicate: Callable[[], bool], what: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"tak exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


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


# --- bugs --------------------------------------------------------------------


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


# --- what held ---------------------------------------------------------------


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
