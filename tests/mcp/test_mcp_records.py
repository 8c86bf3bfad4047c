"""[mcp.servers.NAME] in tak.toml, tool names within the wire's limit, results as text."""

from __future__ import annotations

from typing import Any

import pytest
from mcp import types

from kernel.errors import UsageError
from kernel.home import Config, McpServerConfig
from kernel.messages import Attachment, ToolOutput
from kernel.tools import ToolFailure
from plugins._mcp import kernel_tool_name, observation_output

FILE = "/h/tak.toml"


def test_servers_read_from_tak_toml() -> None:
    config = Config.from_toml(
        {
            "mcp": {
                "servers": {
                    "docs": {"command": "docs-mcp", "args": ["--stdio"], "env": {"K": "v"}},
                    "search": {
                        "url": "https://search.example/mcp",
                        "headers": {"Authorization": "Bearer x"},
                        "tools": ["query"],
                        "timeout": 20,
                        "startup_timeout": 60,
                        "start": "eager",
                    },
                }
            }
        },
        source=FILE,
    )
    docs, search = config.mcp.servers["docs"], config.mcp.servers["search"]
    assert (docs.command, docs.args, docs.env, docs.start) == (
        "docs-mcp",
        ["--stdio"],
        {"K": "v"},
        "lazy",
    )
    assert (search.url, search.tools, search.timeout, search.start) == (
        "https://search.example/mcp", ["query"], 20.0, "eager",
    )  # fmt: skip
    assert Config.from_toml(config.to_toml()) == config


@pytest.mark.parametrize(
    ("server", "error"),
    [
        ({"command": "x", "args": "-v"}, "$.mcp.servers['s'].args: expected a list of strings, got \"-v\""),
        ({"command": "x", "timeout": 0}, "$.mcp.servers['s'].timeout: expected a positive number of seconds, got 0"),
        ({"command": "x", "timeout": True}, "$.mcp.servers['s'].timeout: expected a positive number of seconds, got true"),
        ({"command": "x", "start": "now"}, "$.mcp.servers['s'].start: expected \"lazy\" or \"eager\", got \"now\""),
        ({"command": "x", "env": {"A": 1}}, "$.mcp.servers['s'].env: expected a string, got 1"),
        ({}, "$.mcp.servers['s']: set exactly one of command (stdio) and url (streamable HTTP)"),
        ({"command": "x", "url": "http://h/mcp"}, "$.mcp.servers['s']: set exactly one of command (stdio) and url (streamable HTTP)"),
        ({"url": "ftp://h"}, "$.mcp.servers['s']: url: expected an http:// or https:// URL, got \"ftp://h\""),
        ({"command": "x", "cmd": "y"}, "$.mcp.servers['s']: unknown setting 'cmd' (known: command, args, env, cwd, url, headers, tools, timeout, startup_timeout, start, workspace, network, subprocess, read, memory_bytes, cpu_seconds, file_size_bytes, open_files, processes)"),
        ({"command": "x", "workspace": "rw"}, "$.mcp.servers['s'].workspace: expected \"read\", \"write\" or \"none\", got \"rw\""),
        ({"command": "x", "network": ["h:443", "h"]}, "$.mcp.servers['s'].network: [1]: expected 'host:port' (host may be '*'), got 'h'"),
        ({"command": "x", "network": "h:443"}, "$.mcp.servers['s'].network: expected a list of strings, got \"h:443\""),
        ({"command": "x", "subprocess": "yes"}, "$.mcp.servers['s'].subprocess: expected a boolean, got \"yes\""),
        ({"command": "x", "read": ["data"]}, "$.mcp.servers['s'].read: [0]: expected an absolute path, got \"data\""),
        ({"command": "x", "memory_bytes": 0}, "$.mcp.servers['s'].memory_bytes: expected a positive whole number, got 0"),
        ({"url": "http://h/mcp", "subprocess": True}, "$.mcp.servers['s']: subprocess: only for a stdio server (command), not with url"),
    ],
)  # fmt: skip
def test_a_wrong_server_setting_names_its_path(server: dict[str, Any], error: str) -> None:
    with pytest.raises(UsageError) as caught:
        Config.from_toml({"mcp": {"servers": {"s": server}}}, source=FILE)
    assert str(caught.value) == f"{FILE}: {error}"


def test_permissions_default_to_least_privilege_and_are_checked_in_code() -> None:
    server = McpServerConfig(command="x")
    assert (server.workspace, server.network, server.subprocess, server.read) == (
        "read",
        [],
        False,
        [],
    )
    with pytest.raises(UsageError, match=r"^McpServerConfig.network: \[0\]: expected 'host:port'"):
        McpServerConfig(command="x", network=["nohost"])
    with pytest.raises(UsageError, match=r"^McpServerConfig: network: only for a stdio server"):
        McpServerConfig(url="http://h/mcp", network=["h:1"])


def test_a_server_name_must_be_a_namespace() -> None:
    with pytest.raises(UsageError, match=r"\$\.mcp\.servers\['a\.b'\]: server name \"a\.b\""):
        Config.from_toml({"mcp": {"servers": {"a.b": {"command": "x"}}}}, source=FILE)


def test_a_record_made_in_code_is_checked_too() -> None:
    with pytest.raises(UsageError, match="set exactly one of command"):
        McpServerConfig()
    with pytest.raises(UsageError, match="timeout"):
        McpServerConfig(command="x", timeout=-1)


def test_tool_names_fit_the_wire() -> None:
    assert kernel_tool_name("docs", "search") == "docs.search"
    odd = kernel_tool_name("docs", "search/v2 beta")
    assert odd.startswith("docs.search_v2_beta-")
    long = kernel_tool_name("s" * 31, "x" * 100)
    other = kernel_tool_name("s" * 31, "x" * 99 + "y")
    for name in (odd, long, other):
        assert len(name.replace(".", "__")) <= 64
    assert long != other


def result(*content: Any, structured: Any = None, is_error: bool = False) -> types.CallToolResult:
    return types.CallToolResult(
        content=list(content), structured_content=structured, is_error=is_error
    )


def test_results_as_text_and_attachments() -> None:
    text = types.TextContent(type="text", text="found 2")
    image = types.ImageContent(type="image", data="aGVsbG8=", mime_type="image/png")
    blob = types.EmbeddedResource(
        type="resource",
        resource=types.BlobResourceContents(uri="file:///a.bin", blob="AAAA", mime_type=None),
    )
    doc = types.EmbeddedResource(
        type="resource", resource=types.TextResourceContents(uri="file:///a.txt", text="hello")
    )
    link = types.ResourceLink(type="resource_link", name="a", uri="file:///b", mime_type="text/csv")
    assert observation_output(result(text, image, blob, doc, link, structured={"n": 2})) == (
        ToolOutput(
            "found 2\n[resource: file:///a.txt]\nhello\n[resource link: file:///b, text/csv]\n"
            '{"n": 2}',
            [
                Attachment("image", "image/png", "aGVsbG8="),
                Attachment("resource", "application/octet-stream", "AAAA", uri="file:///a.bin"),
            ],
        )
    )
    # Structured content a text part already says is not said twice.
    assert observation_output(result(text, structured={"result": "found 2"})) == "found 2"
    said = types.TextContent(type="text", text='{"n": 2}')
    assert observation_output(result(said, structured={"n": 2})) == '{"n": 2}'


def test_media_that_is_not_base64_is_a_line_of_text() -> None:
    bad = types.ImageContent(type="image", data="not base64!", mime_type="image/png")
    audio = types.AudioContent(type="audio", data="UklGRg==", mime_type="audio/wav")
    assert observation_output(result(bad, audio)) == ToolOutput(
        "[image: image/png, not kept: data: not base64 (Only base64 data is allowed)]",
        [Attachment("audio", "audio/wav", "UklGRg==")],
    )


def test_an_error_result_with_media_names_it_in_the_failure() -> None:
    image = types.ImageContent(type="image", data="aGVsbG8=", mime_type="image/png")
    with pytest.raises(ToolFailure) as caught:
        observation_output(
            result(types.TextContent(type="text", text="bad page"), image, is_error=True)
        )
    assert caught.value.message == "bad page\n[image: image/png, 5 bytes]"


def test_is_error_is_an_exception_observation() -> None:
    with pytest.raises(ToolFailure) as caught:
        observation_output(
            result(types.TextContent(type="text", text="no such page"), is_error=True)
        )
    assert (caught.value.kind, caught.value.message) == ("exception", "no such page")


@pytest.mark.parametrize("name", ["m3_", "a__b", "_", "x" * 32])
def test_a_server_name_the_registry_would_refuse_is_refused_in_tak_toml(name: str) -> None:
    # The namespace rule (kernel.tools.NAMESPACE_PATTERN): refused when tak.toml is read,
    # not only when the servers start (m3_ and a__b share wire forms with other names).
    with pytest.raises(UsageError, match=r"server name .*no '__' and no '_' at the end"):
        Config.from_toml({"mcp": {"servers": {name: {"command": "x"}}}}, source=FILE)
