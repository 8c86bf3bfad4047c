"""The arena itself: an attempt that gets through is reported as allowed."""

from __future__ import annotations

import pytest
from kit import Arena

pytestmark = pytest.mark.usefixtures("confined")


async def test_reading_the_canary_is_refused(arena: Arena) -> None:
    result = await arena.attack(f"result = open({str(arena.canary)!r}).read()")
    arena.assert_refused(result)


async def test_kit_reports_an_allowed_attempt(arena: Arena) -> None:
    result = await arena.attack("open('inside.txt', 'w').write('x'); result = 'wrote'")
    assert result == "ALLOWED: 'wrote'"
