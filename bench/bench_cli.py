"""Start-up wall time of `tak --help` and `tak --version` next to `python -c pass`.

Each command runs as a fresh process, as a person types it, with the same
interpreter as this script; rounds alternate baseline / `--help` / `--version`
so a busy machine slows all three alike. Printed: the best and the median of
the rounds, the best over the baseline's best, and the target (< 100 ms wall,
judged on the best round: on a loaded machine every median grows, the
baseline's too). `tak <command> --help` rows show that a subcommand's help is
cheap too.

Bytecode is cached as on an installed machine (under a temporary
``PYTHONPYCACHEPREFIX``, written by the warm-up round) even when
``PYTHONDONTWRITEBYTECODE`` is set here: otherwise every start would compile
the CLI's sources again.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

ROUNDS = 21
TARGET_MS = 100.0

BASELINE = ("python -c pass", [sys.executable, "-c", "pass"])
TAK = [sys.executable, "-m", "kernel.cli"]
COMMANDS = [
    ("tak --help", [*TAK, "--help"]),
    ("tak --version", [*TAK, "--version"]),
    ("tak run --help", [*TAK, "run", "--help"]),
    ("tak sessions --help", [*TAK, "sessions", "--help"]),
    ("tak serve --help", [*TAK, "serve", "--help"]),
]


def wall(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=env)
    return time.perf_counter() - started


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="bench-cli-pyc-") as pycache:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = pycache
        measure(env)


def measure(env: dict[str, str]) -> None:
    rows = [BASELINE, *COMMANDS]
    times: dict[str, list[float]] = {name: [] for name, _ in rows}
    for _, argv in rows:  # warm the page cache and the .pyc files first
        wall(argv, env)
    for _ in range(ROUNDS):
        for name, argv in rows:
            times[name].append(wall(argv, env))
    base = min(times[BASELINE[0]])
    print(f"CLI start-up, {ROUNDS} alternating rounds (fresh process each)")
    print(f"{'':<22} {'best ms':>8}  {'median ms':>9}  {'best vs python -c pass':>22}  target")
    for name, _ in rows:
        best, median = min(times[name]), statistics.median(times[name])
        if name == BASELINE[0]:
            target = "baseline"
        else:
            target = f"< {TARGET_MS:g} ms  " + ("met" if best * 1e3 < TARGET_MS else "NOT met")
        print(
            f"{name:<22} {best * 1e3:>8.1f}  {median * 1e3:>9.1f}  {best / base:>21.1f}x  {target}"
        )


if __name__ == "__main__":
    main()
