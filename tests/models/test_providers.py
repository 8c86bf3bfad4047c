"""One list of HTTP providers (``kernel._providers``), read by every part that names
them, and the "Where to add" table of docs/architecture.md checked against the code."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kernel._providers import HTTP_PROVIDERS
from kernel.tools import ToolRegistry, tool

ROOT = Path(__file__).resolve().parents[2]


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def test_every_part_reads_the_one_list() -> None:
    from kernel.cli.tools import PROVIDER_FORMATS, provider_tools
    from kernel.home import BUDGET_PROVIDERS
    from kernel.models import PROVIDERS, anthropic_tools, gemini_tools, openai_tools
    from kernel.models._resolve import ADAPTERS

    assert tuple(ADAPTERS) == HTTP_PROVIDERS  # each name has its adapter, in order
    assert PROVIDERS == (*HTTP_PROVIDERS, "scripted")
    assert BUDGET_PROVIDERS == HTTP_PROVIDERS == PROVIDER_FORMATS
    registry = ToolRegistry([add])
    own = {"openai": openai_tools, "anthropic": anthropic_tools, "gemini": gemini_tools}
    for provider in HTTP_PROVIDERS:
        # what `tak tools --format` prints is what the adapter sends
        assert provider_tools(registry, provider) == own[provider](registry.definitions())
        assert ADAPTERS[provider].provider == provider


def test_an_unknown_provider_is_refused_by_each_reader() -> None:
    from kernel.errors import UsageError
    from kernel.home import Config
    from kernel.models import resolve_model

    with pytest.raises(UsageError, match="known providers: openai, anthropic, gemini, scripted"):
        resolve_model("mistral:large")
    with pytest.raises(UsageError, match="known: default, openai, anthropic, gemini"):
        Config.from_toml({"budget": {"mistral": {"max_connections": 1}}})


def test_each_provider_has_its_adapter_and_tool_specs_agree_on_class_and_instance() -> None:
    from kernel._providers import HTTP_PROVIDERS
    from kernel.cli.tools import provider_tools
    from kernel.models._resolve import ADAPTERS

    assert tuple(ADAPTERS) == HTTP_PROVIDERS
    registry = ToolRegistry([add])
    for name, adapter in ADAPTERS.items():
        specs = adapter.tool_specs(registry.definitions())
        assert specs == provider_tools(registry, name)
        assert adapter.__dict__["tool_specs"].__class__ is staticmethod, name
        assert json.dumps(specs)  # what tak tools --format prints


#: "`NAME` (`path`)" or "`NAME` of `path`": a name the table says lives in a file.
_NAMED_IN = re.compile(r"`([A-Za-z_][\w.]*)`(?:\s+\(|\s+of\s+)`([\w/.]+\.py)`")
_PATH = re.compile(r"`((?:kernel|plugins|sandbox|tests)/[\w/.]*)`")


def where_to_add() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Where to add", 1)[1]
    return section.split("\n## ", 1)[0]


def test_the_where_to_add_table_names_what_is_there() -> None:
    table = where_to_add()
    paths = _PATH.findall(table)
    named = _NAMED_IN.findall(table)
    assert len(paths) >= 10 and len(named) >= 5  # the patterns still read the table
    missing = [p for p in paths if "<" not in p and not (ROOT / p).exists()]
    assert not missing, f"docs/architecture.md names files that are not there: {missing}"
    absent = [
        f"{name} in {path}"
        for name, path in named
        if not re.search(rf"\b{re.escape(name.rpartition('.')[2])}\b", (ROOT / path).read_text())
    ]
    assert not absent, f"docs/architecture.md names what its file does not hold: {absent}"
