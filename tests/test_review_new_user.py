"""A new user's pass over README.md and docs/{batch,web,mcp,tracing,models}.md.

Every command was run as the docs give it, with a temporary home; these are the
places where the behaviour and the docs (or the printed hints) disagreed, each a
strict xfail until it was fixed. Real ``tak`` subprocesses, a temporary home, the
scripted model; the MCP server is tests/mcp/server.py, approved with the
``tak mcp trust`` hint ``tak mcp ls`` prints.
"""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.cli_kit import tak
from tests.mcp.mcp_kit import light_server_args


def write_config(home: Path, text: str) -> None:
    (home / "config").mkdir(parents=True, exist_ok=True)
    (home / "config" / "tak.toml").write_text(text)


def approved_mcp_home(home: Path, *, start: str) -> None:
    """A home with an echo server (tests/mcp/light_server.py) as
    ``[mcp.servers.testsrv]``, approved by running the hint ``tak mcp ls`` prints,
    exactly as printed."""
    home.mkdir(parents=True, exist_ok=True)
    write_config(
        home,
        "[mcp.servers.testsrv]\n"
        f"command = {json.dumps(sys.executable)}\n"
        f"args = {json.dumps(light_server_args(home))}\n"
        f'start = "{start}"\n',
    )
    listed = tak("mcp", "ls", home=home)
    hint = next(
        line.split("approve it:", 1)[1].strip()
        for line in listed.stdout.splitlines()
        if "approve it:" in line
    )
    trusted = subprocess.run(shlex.split(hint), capture_output=True, text=True, timeout=120)
    assert trusted.returncode == 0, trusted.stderr
    assert tak("mcp", "ls", home=home).returncode == 0


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.stderr.count("\n") == 1, result.stderr
    return result.stderr


BUDGET_TYPO = "[budget.openai]\nmax_connections = 50\nrequests_per_minut = 500\n"


def test_tak_tools_lists_an_eager_mcp_servers_tools(tmp_path: Path) -> None:
    home = tmp_path / "home"
    approved_mcp_home(home, start="eager")
    listed = tak("tools", home=home)
    assert listed.returncode == 0, listed.stderr
    assert "testsrv.echo" in listed.stdout.splitlines()


def test_tak_tools_names_a_lazy_mcp_server_it_did_not_start(tmp_path: Path) -> None:
    home = tmp_path / "home"
    approved_mcp_home(home, start="lazy")
    listed = tak("tools", home=home)
    assert listed.returncode == 0, listed.stderr
    assert "testsrv.echo" not in listed.stdout.splitlines()
    assert "tak tools: MCP server 'testsrv' is lazy" in listed.stderr


def test_tak_call_calls_an_mcp_tool(tmp_path: Path) -> None:
    home = tmp_path / "home"
    approved_mcp_home(home, start="lazy")
    called = tak("call", "testsrv.echo", '{"text": "hi"}', home=home)
    assert (called.returncode, called.stdout) == (0, "hi\n"), called.stdout + called.stderr


def test_a_budget_typo_is_refused_by_tak_run_in_one_line(tmp_path: Path) -> None:
    home = tmp_path / "home"
    write_config(home, BUDGET_TYPO)
    ran = tak("--plugin", "demo", "run", "hi", "--model", "scripted:demo", home=home)
    assert ran.returncode == 2
    assert "requests_per_minut" in one_line(ran)


@pytest.mark.parametrize("command", [["tools"], ["mcp", "ls"], ["call", "echo", '{"text": "x"}']])
def test_a_budget_typo_is_refused_where_other_tak_toml_typos_are(
    tmp_path: Path, command: list[str]
) -> None:
    home = tmp_path / "home"
    write_config(home, "[model.settings]\ntemperatur = 1\n")
    assert tak("--plugin", "demo", *command, home=home).returncode == 2  # as every other typo
    write_config(home, BUDGET_TYPO)
    refused = tak("--plugin", "demo", *command, home=home)
    assert refused.returncode == 2
    assert "requests_per_minut" in one_line(refused)


def test_a_bad_budget_value_says_what_tak_toml_can_hold(tmp_path: Path) -> None:
    home = tmp_path / "home"
    write_config(home, "[budget.openai]\nmax_connections = 0\n")
    ran = tak("--plugin", "demo", "run", "hi", "--model", "scripted:demo", home=home)
    assert ran.returncode == 2
    line = one_line(ran)
    assert "max_connections" in line
    assert "none" not in line


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


def test_plugin_after_the_command_says_where_it_goes(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n")
    home = tmp_path / "home"
    ran: Any = tak("batch", str(tasks), "--model", "scripted:demo", "--plugin", "demo", home=home)
    assert ran.returncode == 0 or "tak --plugin" in one_line(ran)


def test_serve_refuses_a_port_out_of_range(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "kernel.cli", "--home", str(tmp_path / "home")]
    server = subprocess.Popen(
        [*argv, "serve", "--port", "99999"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        first = server.stdout.readline()  # a URL when it listens; "" when it refused
        assert first == "", f"listening: {first.strip()}"
        assert server.wait(timeout=60) == 2
        assert server.stderr is not None
        assert "--port" in server.stderr.read().splitlines()[-1]
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)  # stops cleanly, its workers too
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def test_mcp_ls_hint_for_a_missing_program_works_as_printed(tmp_path: Path) -> None:
    home = tmp_path / "home"
    missing = tmp_path / "no-such-server"
    write_config(home, f"[mcp.servers.gone]\ncommand = {json.dumps(str(missing))}\n")
    listed = tak("mcp", "ls", home=home)
    hints = [
        line.split("approve it:", 1)[1].strip()
        for line in listed.stdout.splitlines()
        if "approve it:" in line
    ]
    for hint in hints:  # a hint printed must work as printed
        ran = subprocess.run(shlex.split(hint), capture_output=True, text=True, timeout=120)
        assert ran.returncode == 0, ran.stderr
    assert str(missing) in listed.stdout + listed.stderr  # says what is wrong instead


def test_run_interrupted_says_where_its_transcript_is(tmp_path: Path) -> None:
    prompt = '/call sleep {"seconds": 60}\n/call echo {"text": "x"}'
    argv = [sys.executable, "-m", "kernel.cli", "--home", str(tmp_path / "home")]
    argv += ["--plugin", "demo", "run", prompt, "--model", "scripted:demo"]
    run = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as on a terminal
    )
    try:
        assert run.stdout is not None
        for line in run.stdout:
            if line.startswith("✓ [1] echo"):  # the sleep runs on
                break
        run.send_signal(signal.SIGINT)
        out, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 130
    assert "sessions show" in out + err, err


def test_repl_without_a_token_says_to_use_the_printed_url(tmp_path: Path) -> None:
    home = tmp_path / "home"
    argv = [sys.executable, "-m", "kernel.cli", "--home", str(home)]
    server = subprocess.Popen(
        [*argv, "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert server.stdout is not None
        ws = server.stdout.readline().strip()
        assert ws.startswith("ws://"), ws
        repl = subprocess.run(
            [*argv, "repl", ws.split("?", 1)[0]],
            input="hi\n",
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    assert repl.returncode != 0
    line = one_line(repl)
    assert line.startswith("tak repl:") and "token" in line


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
