"""``ToolRegistry`` namespaces: a source registers only in the namespace it claimed."""

from __future__ import annotations

import pytest

from kernel.errors import UsageError
from kernel.tools import Tool, ToolRegistry, tool


def named(name: str) -> Tool:
    @tool(name=name)
    def fn() -> str:
        """A tool."""
        return name

    return fn


def test_a_source_registers_bare_names_and_its_own_namespace() -> None:
    registry = ToolRegistry()
    registry.claim("m3", "MCP server m3")
    registry.add(named("m3.echo"), owner="MCP server m3")
    registry.claim("weather", "plugin weather (built-in)")
    registry.add(named("forecast"), owner="plugin weather (built-in)")
    registry.add(named("weather.alerts"), owner="plugin weather (built-in)")
    assert registry.names() == ["m3.echo", "forecast", "weather.alerts"]
    assert registry.owner("m3") == "MCP server m3"


def test_a_name_in_another_sources_namespace_is_refused() -> None:
    registry = ToolRegistry()
    registry.claim("m3", "MCP server m3")
    registry.claim("evil", "plugin evil (.tak/plugins/evil.py)")
    with pytest.raises(UsageError, match="belongs to MCP server m3"):
        registry.add(named("m3.echo"), owner="plugin evil (.tak/plugins/evil.py)")
    with pytest.raises(UsageError, match="is not its own"):
        registry.add(named("other.x"), owner="plugin evil (.tak/plugins/evil.py)")
    with pytest.raises(UsageError, match="belongs to MCP server m3"):
        registry.add(named("m3.pid"))
    assert "m3.echo" not in registry and "m3.pid" not in registry


def test_two_claims_of_one_namespace_name_both() -> None:
    registry = ToolRegistry()
    registry.claim("m3", "plugin m3 (entry point m3)")
    registry.claim("m3", "plugin m3 (entry point m3)")  # the same source again: fine
    with pytest.raises(UsageError) as caught:
        registry.claim("m3", "MCP server m3")
    assert "plugin m3 (entry point m3) and MCP server m3" in str(caught.value)


def test_an_embedders_dotted_tool_keeps_its_namespace() -> None:
    registry = ToolRegistry([named("m3.local")])
    with pytest.raises(UsageError, match="the kernel's own tools and MCP server m3"):
        registry.claim("m3", "MCP server m3")


@pytest.mark.parametrize("namespace", ["m3.x", "", "m\x1b3", "m\u202e3", "3m", "m3\n"])
def test_a_namespace_is_a_plain_name(namespace: str) -> None:
    with pytest.raises(UsageError, match="not a valid namespace"):
        ToolRegistry().claim(namespace, "MCP server x")
