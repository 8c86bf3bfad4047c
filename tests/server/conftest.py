from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kernel import Kernel

from .wsclient import open_test_kernel, running_server


@pytest.fixture
async def kernel(tmp_path: Path) -> AsyncIterator[Kernel]:
    async with open_test_kernel(tmp_path / "home") as k:
        yield k


@pytest.fixture
async def url(kernel: Kernel) -> AsyncIterator[str]:
    async with running_server(kernel) as u:
        yield u
