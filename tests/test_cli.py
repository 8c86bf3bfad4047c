"""The `tak` command, run as a real subprocess (each test on its own TAK_HOME)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import kernel
from tests.cli_kit import tak
from tests.mcp.mcp_kit import light_server_args

BUILTIN_TOOLS = {"read_file", "write_file", "edit_file", "list_dir", "glob", "grep"} | {
    "run_command", "fetch_url", "run_python", "remember", "recall", "forget",
}  # fmt: skip


@pytest.fixture
def home(tmp_path: Path) -> Path:
    (tmp_path / "workspace").mkdir()
    (tmp_path / "workspace" / "notes.txt").write_text("first line\nsecond line\n")
    return tmp_path


def test_version(home: Path) -> None:
    result = tak("--version", home=home)
    assert result.returncode == 0
    assert result.stdout.strip() == f"tak {kernel.__version__}"


def test_tools_lists_every_builtin_tool_with_its_schema(home: Path) -> None:
    result = tak("tools", home=home)
    assert result.returncode == 0, result.stderr
    listed = {line.split()[0] for line in result.stdout.splitlines() if line[:1].isalpha()}
    assert listed == BUILTIN_TOOLS  # the toy demo tools only come with --plugin demo
    assert '"required": ["path"]' in result.stdout


def test_tools_in_provider_formats(home: Path) -> None:
    openai = json.loads(tak("tools", "--format", "openai", home=home).stdout)
    assert {s["function"]["name"] for s in openai} == BUILTIN_TOOLS
    anthropic = json.loads(tak("tools", "--format", "anthropic", home=home).stdout)
    assert all("input_schema" in s for s in anthropic)
    gemini = json.loads(tak("tools", "--format", "gemini", home=home).stdout)
    assert gemini[0]["functionDeclarations"]
    with_demo = json.loads(tak("--plugin", "demo", "tools", "--format", "openai", home=home).stdout)
    assert {s["function"]["name"] for s in with_demo} == BUILTIN_TOOLS | {
        "add", "divide", "echo", "sleep",
    }  # fmt: skip


def test_call_prints_the_observation(home: Path) -> None:
    result = tak("call", "read_file", '{"path": "notes.txt", "start_line": 2}', home=home)
    assert result.returncode == 0, result.stderr
    assert "second line" in result.stdout and "first line" not in result.stdout


def test_call_json(home: Path) -> None:
    result = tak("--plugin", "demo", "call", "echo", '{"text": "hi"}', "--json", home=home)
    assert result.returncode == 0
    observation = json.loads(result.stdout)
    assert observation["content"] == "hi"
    assert observation["is_error"] is False and observation["error"] is None


def test_call_unknown_tool_is_an_observation_and_fails(home: Path) -> None:
    result = tak("call", "nope", "{}", "--json", home=home)
    assert result.returncode == 1
    observation = json.loads(result.stdout)
    assert observation["error"]["kind"] == "unknown_tool"
    assert "read_file" in observation["error"]["message"]


def test_call_bad_arguments(home: Path) -> None:
    result = tak("call", "read_file", '{"path": 3}', home=home)
    assert result.returncode == 1
    assert result.stdout.startswith("Error (bad_arguments): $.path: expected str")


def test_call_deadline(home: Path) -> None:
    result = tak(
        "--plugin", "demo", "call", "sleep", '{"seconds": 30}', "--timeout", "0.2", home=home
    )
    assert result.returncode == 1
    assert "did not finish within 0.2 s" in result.stdout


def test_call_in_a_sandbox_worker_stays_in_the_workspace(home: Path) -> None:
    result = tak("call", "run_command", '{"command": "cat notes.txt; cat /etc/passwd"}', home=home)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "first line" in result.stdout and "root:" not in result.stdout


def test_call_rejects_missing_workspace(home: Path) -> None:
    result = tak("call", "read_file", "{}", "--workspace", "/nonexistent/ws", home=home)
    assert result.returncode == 2
    assert "not a directory" in result.stderr


def test_demo_prints_the_table_in_declared_order_and_persists_it(home: Path) -> None:
    result = tak("demo", home=home)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    rows = [line for line in lines if line[:1].isdigit()]
    assert [r.split()[0] for r in rows] == ["0", "1", "2", "3", "4"]
    assert [r.split()[2] for r in rows] == [
        "run_command", "read_file", "read_file", "run_python", "run_command",
    ]  # fmt: skip
    assert [r.split()[3] for r in rows] == ["ok", "ok", "exception", "bad_arguments", "timeout"]
    order_line = next(line for line in lines if line.startswith("completion order: "))
    order = json.loads(order_line.split(": ", 1)[1].split("]")[0] + "]")
    # bad arguments finish before anything runs; the two reads race; then slow, then hang
    assert order[0] == 3 and set(order[1:3]) == {1, 2} and order[3:] == [0, 4]
    assert "wall time" in result.stdout
    show = next(line for line in lines if line.startswith("show it:"))
    command = show.split("tak ", 1)[1].split()
    shown = subprocess.run(
        [sys.executable, "-m", "kernel.cli", *command], capture_output=True, text=True
    )
    assert shown.returncode == 0, shown.stderr
    assert "Error (timeout): command did not finish within 1 s" in shown.stdout
    listing = tak("sessions", "ls", home=home)
    assert "demo: five parallel calls" in listing.stdout


# Printing help must not start the runtime: `tak --help` once took ~400 ms importing trio
# (attrs and kernel.home cost a fifth of what is left).
HEAVY_MODULES = ("trio", "httpx", "cattrs", "trio_websocket", "attrs", "kernel.home")

_HELP_PROBE = """
import argparse, contextlib, io, json, sys
from kernel.cli import build_parser, main

def paths(parser, prefix):
    yield prefix
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from paths(child, [*prefix, name])

out = {}
for path in [["--version"], *([*p, "--help"] for p in paths(build_parser(), []))]:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        try:
            main(path)
            code = 0
        except SystemExit as exc:
            code = exc.code
    out[" ".join(path)] = [code, buffer.getvalue()]
heavy = sorted(m for m in sys.modules if m in sys.argv[1:] or m.split(".")[0] in sys.argv[1:])
print(json.dumps({"help": out, "heavy": heavy}))
"""


def test_help_and_version_import_no_runtime_and_every_command_has_help() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _HELP_PROBE, *HEAVY_MODULES],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    probe = json.loads(result.stdout)
    assert probe["heavy"] == []
    helps = probe["help"]
    assert helps["--version"] == [0, f"tak {kernel.__version__}\n"]
    for command in ("run", "tools", "call", "demo", "sessions", "doctor", "plugins", "serve"):
        assert f"{command} --help" in helps, sorted(helps)
    assert "sessions ls --help" in helps and "plugins trust --help" in helps
    for path, (code, text) in helps.items():
        if path != "--version":
            assert code == 0 and text.startswith("usage: tak"), path


def test_help_from_the_command_line_imports_no_runtime() -> None:
    # The same check through `python -m kernel.cli`, the way `tak` starts.
    probe = (
        "import runpy, sys\n"
        "sys.argv = ['tak', sys.argv[1]]\n"
        "try:\n    runpy.run_module('kernel.cli', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        f"heavy = {HEAVY_MODULES!r}\n"
        "print(sorted(m for m in sys.modules if m in heavy or m.split('.')[0] in heavy))\n"
    )
    for flag in ("--help", "--version"):
        result = subprocess.run(
            [sys.executable, "-c", probe, flag], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines()[-1] == "[]", (flag, result.stdout)


def test_the_cli_default_project_is_the_homes() -> None:
    # kernel.cli spells it so that building the parser does not import kernel.home.
    from kernel.cli import DEFAULT_PROJECT
    from kernel.home import DEFAULT_PROJECT as HOME_DEFAULT_PROJECT

    assert DEFAULT_PROJECT == HOME_DEFAULT_PROJECT


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "hi", "--max-tokens"], "tak run: argument --max-tokens: expected one argument"),
        (["run"], "tak run: the following arguments are required: prompt"),
        (["run", "hi", "--bogus"], "tak: unrecognized arguments: --bogus"),
        (["teleport"], "tak: argument COMMAND: invalid choice: 'teleport'"),
    ],
)
def test_a_usage_error_is_one_line_pointing_at_help(
    home: Path, args: list[str], message: str
) -> None:
    result = tak(*args, home=home)
    assert result.returncode == 2
    assert result.stderr.startswith(message), result.stderr
    assert result.stderr.rstrip().endswith("--help)") and result.stderr.count("\n") == 1


def test_run_help_lists_the_model_settings_flags(home: Path) -> None:
    result = tak("run", "--help", home=home)
    assert result.returncode == 0
    for flag in (
        "--temperature", "--top-p", "--max-tokens", "--stop", "--seed", "--tool-choice",
        "--parallel-tool-calls", "--no-parallel-tool-calls", "--reasoning-effort", "--set",
        "--tools",
    ):  # fmt: skip
        assert flag in result.stdout, flag


def test_tak_tools_without_mcp_servers_does_not_import_mcp(tmp_path: Path) -> None:
    # tak tools opens [mcp.servers] when there are some; none: the mcp package stays out.
    probe = (
        "import sys\n"
        "from kernel.cli import main\n"
        "code = main(['--home', sys.argv[1], 'tools'])\n"
        "print(code, sorted(m for m in sys.modules if m.split('.')[0] == 'mcp'))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path / "home")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "0 []"


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
