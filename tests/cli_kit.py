"""``tak`` as a subprocess, the one way the tests run it; what a refusal looks like; and
children that die with us.

Import it as ``from tests.cli_kit import tak`` from any folder (the project root is on
``sys.path``: pyproject.toml's ``pythonpath``).

Every process a test starts dies with the test process, even when that is SIGKILLed
(a CI timeout, Ctrl-C twice): ``die_with_parent`` arms ``PR_SET_PDEATHSIG`` in the
child between fork and exec. It fires when the *thread* that started the child ends,
so start long-lived children from the thread that owns them (the main thread, for
fixtures), as ``sandbox/pool.py`` explains for the workers.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

#: ``tak`` as a module of this interpreter (the installed script: tests/test_front_door.py).
TAK_MODULE = (sys.executable, "-m", "kernel.cli")

_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def die_with_parent() -> None:
    """A ``preexec_fn``: SIGKILL this child when the process that starts it dies."""
    parent = os.getppid()
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the prctl took effect
        os._exit(1)


def child_environ(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without provider API keys (no test reaches a real
    provider), updated with ``env``."""
    environ = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    environ.update(env or {})
    return environ


def tak_argv(
    *args: str,
    home: Path | str | None = None,
    demo: bool = False,
    program: Sequence[str] = TAK_MODULE,
) -> list[str]:
    """The command line of ``tak [--home HOME] [--plugin demo] ARGS``."""
    argv = [*program]
    if home is not None:
        argv += ["--home", str(home)]
    if demo:  # the toy tools (add, divide, sleep) a scripted or fake model calls
        argv += ["--plugin", "demo"]
    return [*argv, *args]


def tak(
    *args: str,
    home: Path | str | None = None,
    demo: bool = False,
    cwd: Path | None = None,
    stdin: str = "",
    env: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
    program: Sequence[str] = TAK_MODULE,
    timeout: float = 120,
    preexec_fn: Callable[[], object] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``tak ARGS`` to its end; its status and output, as text.

    ``env`` is added to the test environment (``child_environ``); ``environ``, if
    given, is the whole environment instead. ``timeout`` is a hang guard: past it the
    command is killed and the test fails with ``TimeoutExpired``. ``preexec_fn`` runs
    in the child after ``die_with_parent`` (rlimits, say).
    """

    def preexec() -> None:
        die_with_parent()
        if preexec_fn is not None:
            preexec_fn()

    return subprocess.run(
        tak_argv(*args, home=home, demo=demo, program=program),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=dict(environ) if environ is not None else child_environ(env),
        preexec_fn=preexec,
    )


def one_line(result: subprocess.CompletedProcess[str], prefix: str = "") -> str:
    """What ``tak`` wrote to stderr, checked to be one line starting with ``prefix``: a
    refusal is the command's whole output."""
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(prefix), result.stderr
    return result.stderr
