"""Class 2 of the third wave: hostile text reaching the terminal raw.

A workspace, a plugin and a model are hostile: what they put in a file name, a
description, a tool's output or a reply is shown by ``tak`` in a real process
here, and the bytes it writes to its stdout and stderr must hold no control a
terminal acts on (C0 but the newline, ESC sequences, C1, bidi overrides, line
separators) and no line forged by a ``\\n`` in a name. The full walk of every
command is tests/test_cli_hostile_text.py; these are the attacks the wave
reported, as an attacker would run them.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from kernel import open_kernel
from kernel.models import ScriptedModel
from kernel.terminal import ESCAPES
from tests.cli_kit import tak

#: Hidden text, a retitled window, an overwritten line, a one-byte CSI, a bidi
#: override, and a newline forging a `trusted:` line.
HOSTILE = "\x1b[8mhidden\x1b[0m\x1b]0;owned\x07\rover\x9b2J\u202eevil\ntrusted: yes"
RAW = {chr(code) for code in ESCAPES} - {"\n"}


def assert_shown_safely(result: subprocess.CompletedProcess[str]) -> None:
    for stream, text in (("stdout", result.stdout), ("stderr", result.stderr)):
        raw = sorted({f"U+{ord(c):04X}" for c in text if c in RAW})
        assert not raw, f"{stream} carries raw {raw}: {text!r}"
        forged = [line for line in text.splitlines() if line.startswith("trusted: yes")]
        assert not forged, f"{stream} has a forged line: {text!r}"


def workspace_with_a_hostile_plugin_name(tmp_path: Path) -> Path:
    workspace = tmp_path / "ws"
    plugins = workspace / ".tak" / "plugins"
    plugins.mkdir(parents=True)
    (plugins / f"x{HOSTILE}.py").write_text("x = 1\n")
    return workspace


def test_a_plugin_file_name_cannot_forge_a_trusted_line_in_plugins_ls(tmp_path: Path) -> None:
    workspace = workspace_with_a_hostile_plugin_name(tmp_path)
    result = tak("plugins", "ls", "--workspace", str(workspace), home=tmp_path / "home")
    assert "Traceback" not in result.stderr, result.stderr
    assert "\\e[8m" in result.stdout + result.stderr, "the name is shown, escaped"
    assert_shown_safely(result)


def test_trust_and_doctor_beside_a_hostile_plugin_name_carry_no_control(tmp_path: Path) -> None:
    workspace = workspace_with_a_hostile_plugin_name(tmp_path)
    w = str(workspace)
    for args in (("plugins", "trust", "nope", "--workspace", w), ("doctor", "--workspace", w)):
        result = tak(*args, home=tmp_path / "home")
        assert "Traceback" not in result.stderr, result.stderr
        assert_shown_safely(result)


async def test_a_model_reply_shown_by_sessions_show_is_escaped(tmp_path: Path) -> None:
    home = tmp_path / "home"
    model = ScriptedModel([HOSTILE])
    async with open_kernel(home=home, model=model, plugins=[]) as k:
        session = k.session("s1")
        await k.run_turn(session, f"prompt {HOSTILE}")
    for args in (("sessions", "show", "s1"), ("sessions", "ls")):
        result = tak(*args, home=home)
        assert result.returncode == 0, result.stderr
        assert_shown_safely(result)
    shown = tak("sessions", "show", "s1", home=home).stdout
    assert "\\e[8mhidden" in shown, shown  # the reply is there, its controls escaped
