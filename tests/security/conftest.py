"""The red-team suite: every test is one attempt, and must be refused.

``make redteam`` runs this directory alone; the summary line
``redteam: N/M refused`` counts the attempts that passed (were refused).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

import pytest  # noqa: E402
from kit import Arena  # noqa: E402

from sandbox import probe_isolation  # noqa: E402


@pytest.fixture
def arena(tmp_path: Path) -> Iterator[Arena]:
    a = Arena(tmp_path)
    try:
        yield a
    finally:
        a.close()


@pytest.fixture
def confined() -> None:
    """Skip where this machine cannot confine a worker (never on CI here)."""
    if probe_isolation().level != "full":
        pytest.skip("needs Landlock ABI 6+ and seccomp")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    here = Path(__file__).parent
    counts = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    for outcome in counts:
        for report in terminalreporter.stats.get(outcome, []):
            path = getattr(report, "fspath", None) or ""
            if "::test_kit_" in report.nodeid:
                continue  # checks of the arena itself, not attempts
            if str(here) in str(Path(str(path)).resolve()) and report.when in ("call", "setup"):
                if outcome == "passed" and report.when != "call":
                    continue
                counts[outcome] += 1
    total = sum(counts.values())
    if total:
        terminalreporter.write_line(f"redteam: {counts['passed']}/{total} refused")
