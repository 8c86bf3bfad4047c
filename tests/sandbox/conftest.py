"""Fixtures for the sandbox tests: a workspace, and a canary file outside it."""

from __future__ import annotations

import sys
from pathlib import Path

# pytest puts tests/ on sys.path, where this directory would pass for a
# namespace package named "sandbox" unless the project root is on it too:
# a regular package anywhere on sys.path wins over a namespace one.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

import pytest  # noqa: E402
from sandbox_kit import Canary  # noqa: E402


@pytest.fixture
def canary(tmp_path: Path) -> Canary:
    return Canary(tmp_path / "canary.txt")


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    return ws
