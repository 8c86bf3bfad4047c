from __future__ import annotations

import subprocess
import sys

import kernel.store


def test_public_names() -> None:
    assert sorted(kernel.store.__all__) == [
        "Durability",
        "FileStore",
        "MemoryStore",
        "PostgresStore",
        "RepairReport",
        "SessionInfo",
        "SessionKey",
        "SessionStore",
        "SessionSummary",
        "SummaryData",
        "fold_session_summary",
        "open_store",
    ]
    for name in kernel.store.__all__:
        assert getattr(kernel.store, name) is not None


def test_import_is_light() -> None:
    code = "import sys, kernel.store; print(sorted(m for m in ('httpx', 'trio_websocket', 'kernel.agent') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
