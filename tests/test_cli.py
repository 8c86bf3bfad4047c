"""The `tak` command, run as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import kernel


def tak(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kernel.cli", *args], capture_output=True, text=True, timeout=60
    )


def test_version() -> None:
    result = tak("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"tak {kernel.__version__}"


def test_tools_lists_names_and_schemas() -> None:
    result = tak("tools")
    assert result.returncode == 0
    assert "add" in result.stdout and '"required": ["a", "b"]' in result.stdout


def test_tools_in_provider_formats() -> None:
    openai = json.loads(tak("tools", "--format", "openai").stdout)
    assert {s["function"]["name"] for s in openai} >= {"add", "sleep", "divide", "echo"}
    anthropic = json.loads(tak("tools", "--format", "anthropic").stdout)
    assert all("input_schema" in s for s in anthropic)
    gemini = json.loads(tak("tools", "--format", "gemini").stdout)
    assert gemini[0]["functionDeclarations"]


def test_call_prints_the_observation() -> None:
    result = tak("call", "add", '{"a": 2, "b": 3}')
    assert result.returncode == 0
    assert result.stdout == "5\n"


def test_call_json() -> None:
    result = tak("call", "echo", '{"text": "hi"}', "--json")
    assert result.returncode == 0
    observation = json.loads(result.stdout)
    assert observation["content"] == "hi"
    assert observation["is_error"] is False and observation["error"] is None


def test_call_unknown_tool_is_an_observation_and_fails() -> None:
    result = tak("call", "nope", "{}", "--json")
    assert result.returncode == 1
    observation = json.loads(result.stdout)
    assert observation["error"]["kind"] == "unknown_tool"
    assert "add" in observation["error"]["message"]


def test_call_bad_arguments() -> None:
    result = tak("call", "add", '{"a": "x"}')
    assert result.returncode == 1
    assert result.stdout.startswith("Error (bad_arguments): ")


def test_call_deadline() -> None:
    result = tak("call", "sleep", '{"seconds": 30}', "--timeout", "0.2")
    assert result.returncode == 1
    assert "did not finish within 0.2 s" in result.stdout


def test_call_rejects_missing_workspace() -> None:
    result = tak("call", "add", "{}", "--workspace", "/nonexistent/ws")
    assert result.returncode == 2
    assert "not a directory" in result.stderr


def test_demo_prints_the_table_in_declared_order_and_persists_it(tmp_path: Path) -> None:
    result = tak("--home", str(tmp_path), "demo")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    rows = [line for line in lines if line[:1].isdigit()]
    assert [r.split()[0] for r in rows] == ["0", "1", "2", "3", "4"]
    assert [r.split()[3] for r in rows] == ["ok", "ok", "exception", "bad_arguments", "timeout"]
    order_line = next(line for line in lines if line.startswith("completion order: "))
    order = json.loads(order_line.split(": ", 1)[1].split("]")[0] + "]")
    # bad arguments finish before anything runs; the two thread tools race; then slow, hang
    assert order[0] == 3 and set(order[1:3]) == {1, 2} and order[3:] == [0, 4]
    assert "wall time" in result.stdout
    show = next(line for line in lines if line.startswith("show it:"))
    command = show.split("tak ", 1)[1].split()
    shown = tak(*command)
    assert shown.returncode == 0, shown.stderr
    assert "Error (timeout): sleep did not finish within 1 s" in shown.stdout
    listing = tak("--home", str(tmp_path), "sessions", "ls")
    assert "demo: five parallel calls" in listing.stdout
