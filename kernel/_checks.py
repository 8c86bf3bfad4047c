"""The one rule for a positive setting: ``check_positive`` for an argument, ``positive``
as an ``attrs`` validator.

Every record of limits (``RunLimits``, ``CallLimits``, ``TaskLimits``,
``ServerLimits``, a tool's ``timeout`` and ``max_output``) checks its numbers here,
so that all refuse the same things the same way: ``True`` is no number (``bool`` is
an ``int`` in Python), ``"3"`` is no number either, and infinity or NaN is no limit
(a worker reports its tools' limits as JSON, which allows ``Infinity``, and an
endless deadline would let one plugin hold a turn forever). The refusal is a
``UsageError`` whose one line names the record and the field (or the argument)::

    RunLimits.max_steps must be a positive integer, got True

Floor 0: it imports only ``kernel.errors``, so the sandbox's records use it too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs

from .errors import UsageError

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def check_positive(value: Any, name: str, *, integer: bool = False, optional: bool = False) -> None:
    """Refuse ``value`` unless it is a finite number above 0 (``integer``: an ``int`` of
    1 or more; ``optional``: or ``None``, no limit).

    Raises:
        UsageError: ``{name} must be a positive integer, got True``.
    """
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        good = False
    elif integer and not isinstance(value, int):
        good = False
    else:
        good = 0 < value < math.inf  # NaN fails it too
    if not good:
        kind = "integer" if integer else "number"
        raise UsageError(
            f"{name} must be a positive {kind}{' or None' if optional else ''}, got {value!r}"
        )


def positive(*, integer: bool = False, optional: bool = False) -> Validator:
    """``check_positive`` as an ``attrs`` validator, naming ``Record.field``."""

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        name = f"{type(instance).__name__}.{attribute.name}"
        check_positive(value, name, integer=integer, optional=optional)

    return check


__all__ = ["Validator", "check_positive", "positive"]
