"""What tokens cost: a small built-in table, overridable by the caller."""

from __future__ import annotations

import re
from collections.abc import Mapping

import attrs

from ._base import Usage


@attrs.frozen
class Price:
    """USD per million tokens. A missing cache price falls back to the input price."""

    input: float
    output: float
    cache_read: float | None = None
    cache_write: float | None = None


# List prices as the providers published them in 2025 (standard tier, short
# prompts). They go stale: pass ``prices=`` to override or add models.
PRICES: Mapping[str, Price] = {
    "gpt-4.1": Price(2.00, 8.00, cache_read=0.50),
    "gpt-4.1-mini": Price(0.40, 1.60, cache_read=0.10),
    "gpt-4.1-nano": Price(0.10, 0.40, cache_read=0.025),
    "gpt-4o": Price(2.50, 10.00, cache_read=1.25),
    "gpt-4o-mini": Price(0.15, 0.60, cache_read=0.075),
    "claude-opus-4-1": Price(15.00, 75.00, cache_read=1.50, cache_write=18.75),
    "claude-sonnet-4-5": Price(3.00, 15.00, cache_read=0.30, cache_write=3.75),
    "claude-sonnet-4-0": Price(3.00, 15.00, cache_read=0.30, cache_write=3.75),
    "claude-haiku-4-5": Price(1.00, 5.00, cache_read=0.10, cache_write=1.25),
    "gemini-2.5-pro": Price(1.25, 10.00, cache_read=0.31),
    "gemini-2.5-flash": Price(0.30, 2.50, cache_read=0.075),
    "gemini-2.5-flash-lite": Price(0.10, 0.40, cache_read=0.025),
}

# A dated snapshot costs what its alias costs: "gpt-4.1-mini-2025-04-14",
# "claude-sonnet-4-5-20250929". Nothing looser: "gpt-4o" must not price
# "gpt-4o-audio-preview".
_SNAPSHOT_SUFFIX = re.compile(r"-\d{4}-?\d{2}-?\d{2}")


def find_price(model: str, prices: Mapping[str, Price] | None = None) -> Price | None:
    """The price of ``model`` (as the provider names it), or ``None`` if unknown.

    ``prices`` is looked up first, then the built-in table.
    """
    table = {**PRICES, **prices} if prices else PRICES
    if model in table:
        return table[model]
    match = _SNAPSHOT_SUFFIX.search(model)
    if match is not None and match.end() == len(model):
        return table.get(model[: match.start()])
    return None


def cost_of(usage: Usage, price: Price | None) -> float | None:
    """USD for ``usage`` at ``price``; ``None`` when the price is unknown."""
    if price is None:
        return None
    cache_read = price.input if price.cache_read is None else price.cache_read
    cache_write = price.input if price.cache_write is None else price.cache_write
    micro = (
        usage.input_tokens * price.input
        + usage.output_tokens * price.output
        + usage.cache_read_tokens * cache_read
        + usage.cache_write_tokens * cache_write
    )
    return micro / 1_000_000
