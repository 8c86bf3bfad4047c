"""The one rule for a positive setting, as an ``attrs`` validator.

Every record of limits (``RunLimits``, ``CallLimits``, ``TaskLimits``,
``ServerLimits``, a tool's ``timeout`` and ``max_output``) checks its numbers here,
so that all refuse the same things the same way: ``True`` is no number (``bool`` is
an ``int`` in Python), ``"3"`` is no number either, and infinity or NaN is no limit
(a worker reports its tools' limits as JSON, which allows ``Infinity``, and an
endless deadline would let one plugin hold a turn forever). The refusal is a
``UsageError`` whose one line names the record and the field::

    RunLimits.max_steps must be a positive integer, got True
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs

from .errors import UsageError

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def positive(*, integer: bool = False, optional: bool = False) -> Validator:
    """A validator for a finite number above 0 (``integer``: an ``int`` of 1 or more);
    ``optional`` lets ``None`` (no limit) through."""
    kind = "integer" if integer else "number"

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, int | float):
            good = False
        elif integer and not isinstance(value, int):
            good = False
        else:
            good = 0 < value < math.inf  # NaN fails it too
        if not good:
            raise UsageError(
                f"{type(instance).__name__}.{attribute.name} must be a positive {kind}"
                f"{' or None' if optional else ''}, got {value!r}"
            )

    return check
