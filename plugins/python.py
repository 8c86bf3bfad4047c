"""The ``python`` built-in plugin: run a snippet in a fresh interpreter, like a notebook cell.

Each call starts ``sys.executable -I -u -c <runner>`` in the workspace
directory: isolated mode (no user site-packages, no ``PYTHON*`` variables),
unbuffered so that output written before a deadline is not lost. The runner
parses the snippet with ``ast``, executes every statement but a trailing
expression, then evaluates that expression and writes its ``repr`` to a pipe
of its own, so the value never mixes with what the snippet prints.

Deadlines and output caps are those of ``plugins.shell.run_process``. Nothing
persists between calls: each snippet starts from an empty namespace.
"""

from __future__ import annotations

import sys

from kernel.plugin import Plugin
from kernel.tools import ToolFailure
from plugins.shell import (
    MAX_STREAM_BYTES,
    describe_exit,
    format_streams,
    run_process,
    workspace_directory,
)

__all__ = ["MAX_VALUE_BYTES", "plugin", "run_python"]

plugin = Plugin(
    "python",
    version="0.1.0",
    description="Run Python snippets in a fresh interpreter.",
    permissions={"workspace": "write", "subprocess": True},
)

#: Longest deadline a call may ask for, in seconds.
MAX_TIMEOUT = 600.0
#: Bytes of the value's ``repr`` kept.
MAX_VALUE_BYTES = 16_000
#: The snippet travels as one argument; Linux refuses a single argument over 128 KiB.
MAX_CODE_BYTES = 120_000

# Runs in the child. argv: [-c, code, result fd]. Its own frames are cut from
# tracebacks so the snippet's error reads as if the snippet were the program.
_RUNNER = r"""
import ast, linecache, os, sys, traceback
code, fd = sys.argv[1], int(sys.argv[2])
os.set_inheritable(fd, False)
sys.argv = ["<cell>"]
linecache.cache["<cell>"] = (len(code), None, code.splitlines(True), "<cell>")
def fail(exc):
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != "<cell>":
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)
    sys.exit(1)
try:
    tree = ast.parse(code, "<cell>", "exec")
except SyntaxError as exc:
    traceback.print_exception(type(exc), exc, None)
    sys.exit(1)
last = None
if tree.body and isinstance(tree.body[-1], ast.Expr):
    last = ast.Expression(tree.body.pop().value)
namespace = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    exec(compile(tree, "<cell>", "exec"), namespace)
    value = None if last is None else eval(compile(last, "<cell>", "eval"), namespace)
except SystemExit:
    raise
except BaseException as exc:
    fail(exc)
if value is not None:
    try:
        text = repr(value)
    except BaseException as exc:
        text = f"<repr failed: {type(exc).__name__}: {exc}>"
    sys.stdout.flush()
    with open(fd, "w", encoding="utf-8", errors="backslashreplace") as out:
        out.write(text)
"""


@plugin.tool(timeout=MAX_TIMEOUT + 30)
def run_python(code: str, timeout: float = 30) -> str:
    """Run Python code in a fresh interpreter in the workspace directory.

    Like a notebook cell: stdout and stderr come back, and when the code ends
    with an expression, the ``repr`` of its value. An exception shows its
    traceback with exit code 1. Nothing is kept between calls. Output keeps
    the first and last 32 000 bytes of each stream.

    Args:
        code: Python source; a trailing expression's value is shown.
        timeout: Seconds before the interpreter is killed (at most 600).
    """
    if not 0 < timeout <= MAX_TIMEOUT:
        raise ValueError(f"timeout must be more than 0 and at most {MAX_TIMEOUT:g} s")
    size = len(code.encode("utf-8", errors="surrogatepass"))
    if size > MAX_CODE_BYTES:
        raise ValueError(
            f"code is {size} bytes, more than {MAX_CODE_BYTES}; write it to a file in the "
            "workspace and run that file instead"
        )
    if "\x00" in code:
        raise ValueError("code contains a NUL character")
    result = run_process(
        [sys.executable, "-I", "-u", "-c", _RUNNER, code, "{fd}"],
        cwd=workspace_directory(),
        timeout=timeout,
        max_bytes=MAX_STREAM_BYTES,
        extra_output=MAX_VALUE_BYTES,
    )
    streams = format_streams(result) if any(b.total for b in result.outputs[:2]) else ""
    if result.timed_out:
        raise ToolFailure(
            "timeout",
            f"code did not finish within {timeout:g} s and was killed\n{streams}".rstrip("\n"),
            type="CodeTimeout",
        )
    parts = [] if result.returncode == 0 else [describe_exit(result.returncode) + "\n"]
    parts.append(streams)
    value = result.outputs[2]
    if value.total:
        parts.append(f"value:\n{value.text('value')}\n")
    return "".join(parts).rstrip("\n") or "(no output and no value)"
