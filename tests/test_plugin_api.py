"""The plugin authoring API: Plugin, permissions, context()."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kernel import Permissions, Plugin, ToolContext, UsageError, context
from kernel.plugin import use_context
from plugins import policy_for
from sandbox import Workspace


def test_tools_register_on_the_plugin() -> None:
    plugin = Plugin("weather", version="0.1.0", permissions={"network": ["api.example.org:443"]})

    @plugin.tool(timeout=10)
    async def forecast(city: str, days: int = 3) -> str:
        """Forecast for a city.

        Args:
            city: City name.
            days: How many days, 1 to 7.
        """
        return city

    @plugin.tool
    def today() -> str:
        """Today's weather."""
        return "sun"

    assert [t.name for t in plugin.tools] == ["forecast", "today"]
    assert plugin.tools[0].timeout == 10
    assert (
        plugin.tools[0].parameters["properties"]["days"]["description"] == "How many days, 1 to 7."
    )
    assert plugin.permissions == Permissions(network=("api.example.org:443",))
    assert plugin.qualified("forecast") == "weather.forecast"
    policy = policy_for(plugin.permissions)  # the host's mapping onto the sandbox
    assert (policy.workspace, policy.network, policy.subprocess) == (
        "read",
        ("api.example.org:443",),
        False,
    )


def test_two_tools_with_one_name_are_refused() -> None:
    plugin = Plugin("p")

    @plugin.tool
    def a() -> str:
        """A."""
        return ""

    with pytest.raises(UsageError, match="two tools are named 'a'"):
        plugin.tool(name="a")(lambda: "")


@pytest.mark.parametrize(
    ("permissions", "message"),
    [
        ({"workspace": "admin"}, "permissions.workspace"),
        ({"network": "example.org:443"}, "permissions.network: expected a list"),
        ({"network": ["example.org"]}, r"permissions.network\[0\]"),
        ({"network": ["a:1", "b:99999"]}, r"permissions.network\[1\]"),
        ({"subprocess": "yes"}, "permissions.subprocess"),
        ({"root": True}, "unknown key"),
    ],
)
def test_bad_permissions_say_where(permissions: dict[str, object], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        Plugin("p", permissions=permissions)


def test_bad_plugin_name() -> None:
    with pytest.raises(UsageError, match="plugin name"):
        Plugin("no spaces")


def test_context_inside_and_outside_a_call(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="only available"):
        context()
    ctx = ToolContext(Workspace(tmp_path), "p/s", logging.getLogger("t"))
    with use_context(ctx):
        assert context() is ctx
    with pytest.raises(UsageError):
        context()


def test_permissions_and_the_sandbox_policy_share_their_validators() -> None:
    from sandbox import Policy

    for field, bad, where in (
        ("network", ["example.org"], r"\.network\[0\]: expected 'host:port'"),
        ("workspace", "admin", r"\.workspace: expected 'read' or 'write'"),
    ):
        with pytest.raises(UsageError, match=f"permissions{where}"):
            Permissions(**{field: bad})
        with pytest.raises(UsageError, match=f"Policy{where}"):
            Policy(**{field: bad})
