"""What reaches the terminal besides what ``tak`` prints is escaped too (docs/cli.md,
"Text from elsewhere is escaped"): a log record's traceback cannot forge a log line,
and ``tak --debug``'s traceback carries no raw control of the message it quotes.

(The log records of every command, ``tak serve``'s log and argparse's errors are
walked with hostile data in tests/test_cli_hostile_text.py.)
"""

from __future__ import annotations

import logging
import subprocess
import sys

from kernel.cli._terminal_log import EscapingFormatter
from kernel.terminal import ESCAPES
from tests.cli_kit import child_environ, die_with_parent

#: A plugin's, a model's or a workspace's words, with a control and a forged line.
HOSTILE = "bad \x1b[8mhidden\u202e\nFORGED 2026-12-02 07:00:00,000 INFO tak.server: trusted"
RAW = {chr(code) for code in ESCAPES} - {"\n"}


def test_a_log_records_traceback_is_escaped_and_forges_no_line() -> None:
    try:
        raise RuntimeError(HOSTILE)
    except RuntimeError:
        record = logging.LogRecord(
            "tak.server", logging.ERROR, __file__, 1, "request %s failed", ("r1",), sys.exc_info()
        )
    shown = EscapingFormatter("%(levelname)s %(name)s: %(message)s").format(record)
    lines = shown.splitlines()
    assert lines[0] == "ERROR tak.server: request r1 failed"
    assert not {ch for ch in shown if ch in RAW}
    assert "bad \\e[8mhidden\\u202e" in shown
    # Only the record's own line starts at the left edge, and the traceback's header.
    assert [line for line in lines if not line.startswith(" ")] == [
        lines[0],
        "Traceback (most recent call last):",
    ]


DEBUG_SCRIPT = f"""
import sys
from kernel.cli import main, tools

def broken(args):
    raise RuntimeError({HOSTILE!r})

tools.cmd_tools = broken
sys.exit(main(["--debug", "tools"]))
"""


def test_the_debug_traceback_is_escaped() -> None:
    # As a process: the interpreter prints what tak --debug lets through.
    done = subprocess.run(
        [sys.executable, "-c", DEBUG_SCRIPT],
        capture_output=True,
        text=True,
        env=child_environ(),
        preexec_fn=die_with_parent,
        timeout=120,
    )
    assert done.returncode == 1
    assert "Traceback (most recent call last):" in done.stderr
    assert "RuntimeError: bad \\e[8mhidden\\u202e" in done.stderr
    assert not {ch for ch in done.stderr if ch in RAW}, done.stderr
