"""Types shared by the tool tests."""

from __future__ import annotations

import enum

import attrs


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


@attrs.frozen
class Item:
    name: str
    qty: int = 1


@attrs.frozen
class Order:
    items: list[Item]
    note: str | None = None
    tags: list[str] = attrs.field(factory=list)
