"""One rule for a positive setting (``kernel._checks.positive``), held by every record
of limits: the same values refused the same way, in one line naming record and field."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernel._checks import positive
from kernel.agent import RunLimits
from kernel.batch import TaskLimits
from kernel.errors import UsageError
from kernel.executor import CallLimits
from kernel.kernel import IdleSessions
from kernel.models import BudgetLimits
from kernel.wire._limits import ServerLimits
from sandbox import Limits

RECORDS = [RunLimits, TaskLimits, CallLimits, ServerLimits, IdleSessions, BudgetLimits, Limits]
#: What no positive setting takes: the issue's ``True`` and ``"3"`` among them.
NEVER: list[Any] = [True, False, "3", 0, -1, -0.5, math.nan, math.inf, -math.inf, [1], b"1"]


def _fields() -> list[tuple[type, str]]:
    return [
        (record, field.name)
        for record in RECORDS
        for field in attrs.fields(record)
        if field.name != "keep"  # IdleSessions.keep: 0 is allowed (an integer >= 0)
    ]


@pytest.mark.parametrize(("record", "name"), _fields(), ids=lambda x: getattr(x, "__name__", x))
@pytest.mark.parametrize("value", NEVER, ids=repr)
def test_every_limit_refuses_what_is_no_positive_number(
    record: type, name: str, value: Any
) -> None:
    with pytest.raises(UsageError) as caught:
        record(**{name: value})
    message = str(caught.value)
    assert message.startswith(f"{record.__name__}.{name} must be a positive ")
    assert message.endswith(f"got {value!r}") and "\n" not in message


def _make(record: type, name: str, value: Any) -> Any:
    # ServerLimits.hard_frame_limit must also be at least max_frame_bytes.
    extra = {"max_frame_bytes": 1} if name == "hard_frame_limit" else {}
    return record(**{name: value}, **extra)


@given(st.integers(min_value=1, max_value=10**30))
def test_a_positive_integer_passes_every_field(value: int) -> None:
    for record, name in _fields():
        assert getattr(_make(record, name, value), name) == value


@given(st.floats(min_value=1e-9, max_value=1e30, allow_nan=False, allow_infinity=False))
def test_a_positive_fraction_passes_number_fields_and_not_integer_ones(value: float) -> None:
    @attrs.frozen
    class Both:
        number: float = attrs.field(validator=positive())
        integer: int = attrs.field(default=1, validator=positive(integer=True))

    assert Both(value).number == value
    if not value.is_integer():
        with pytest.raises(UsageError, match=r"^Both\.integer must be a positive integer, got "):
            Both(1.0, value)  # type: ignore[arg-type]


def test_none_is_no_limit_only_where_the_field_is_optional() -> None:
    assert RunLimits(max_tokens=None).max_tokens is None
    with pytest.raises(UsageError, match=r"^RunLimits\.max_steps must be a positive integer, "):
        RunLimits(max_steps=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", NEVER, ids=repr)
async def test_arguments_are_held_to_the_same_rule(value: Any, tmp_path: Any) -> None:
    """``check_positive``: what a function's own count takes (a ledger's claim, a
    retry policy's attempts, the history cache's bounds), refused as a record's."""
    from kernel._checks import check_positive
    from kernel.batch import open_run_dir
    from kernel.history import HistoryCache
    from kernel.models import RetryPolicy

    with pytest.raises(UsageError, match=r"^n must be a positive integer, got "):
        check_positive(value, "n", integer=True)
    async with open_run_dir(tmp_path / "r") as ledger:
        with pytest.raises(UsageError, match=r"^claim: limit must be a positive integer, got "):
            await ledger.claim("w", value)
    with pytest.raises(UsageError, match=r"^HistoryCache: max_sessions must be a positive "):
        HistoryCache(max_sessions=value)
    with pytest.raises(UsageError, match=r"^RetryPolicy\.max_attempts must be a positive "):
        RetryPolicy(max_attempts=value)
