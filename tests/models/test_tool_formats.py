"""``tak tools --format X`` prints exactly the ``tools`` adapter X sends (names mapped included).

Each adapter owns its provider's tool format, made from the registry's neutral
``ToolDefinition`` records; the CLI calls the same function. Here the CLI's own
output is compared with the request body a fake provider receives at the wire.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import pytest
import trio

from kernel.cli import _common as cli_common
from kernel.cli.tools import cmd_tools
from kernel.models import AnthropicModel, GeminiModel, ModelRequest, OpenAIModel
from kernel.tools import ToolDefinition, ToolRegistry, tool

from .wire import NO_RETRY, TOOLS, FakeServer, json_response, user


@tool
def tag(labels: dict[str, str], mode: Literal["a", "b"] | None = None) -> None:
    """Label things."""


REGISTRY = ToolRegistry([*TOOLS, tag])

REPLIES: dict[str, Any] = {
    "openai": {
        "choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1},
    },
    "anthropic": {
        "content": [{"type": "text", "text": "ok"}],
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 1, "output_tokens": 1},
    },
    "gemini": {
        "candidates": [{"content": {"parts": [{"text": "ok"}]}, "finishReason": "STOP"}],
        "usageMetadata": {"promptTokenCount": 1, "candidatesTokenCount": 1},
    },
}
MODELS = {"openai": OpenAIModel, "anthropic": AnthropicModel, "gemini": GeminiModel}


def sent_tools(provider: str) -> Any:
    """The ``tools`` of the body that adapter sends for a request with REGISTRY's tools."""
    server = FakeServer(json_response(200, REPLIES[provider]))

    async def main() -> None:
        async with server.client() as client:
            model = MODELS[provider]("m", client=client, api_key="k", retry=NO_RETRY)
            await model.complete(ModelRequest(messages=(user("hi"),), tools=REGISTRY))

    trio.run(main)
    return server.body()["tools"]


def printed_tools(
    provider: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> Any:
    """What ``tak tools --format <provider>`` prints, for a host holding REGISTRY's tools."""

    @contextlib.asynccontextmanager
    async def fake_tools(*args: Any) -> AsyncIterator[Any]:
        yield argparse.Namespace(tools=REGISTRY), None  # the host, no MCP servers

    monkeypatch.setattr(cli_common, "open_cli_tools", fake_tools)
    args = argparse.Namespace(home=None, workspace=tmp_path, plugin=[], format=provider)
    assert cmd_tools(args) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("provider", ["openai", "anthropic", "gemini"])
def test_cli_prints_what_the_adapter_sends(
    provider: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    printed = printed_tools(provider, tmp_path, monkeypatch, capsys)
    assert printed == sent_tools(provider)


def test_openai_and_anthropic_names_are_the_wire_names() -> None:
    openai = [s["function"]["name"] for s in sent_tools("openai")]
    anthropic = [s["name"] for s in sent_tools("anthropic")]
    assert openai == anthropic == ["fs__read", "web__fetch", "calc", "tag"]
    [gemini] = sent_tools("gemini")
    assert [d["name"] for d in gemini["functionDeclarations"]] == REGISTRY.names()


def test_a_tool_definition_is_a_frozen_neutral_record() -> None:
    [first, *_] = REGISTRY.definitions()
    assert first == ToolDefinition("fs.read", "The fs.read tool.", TOOLS[0].parameters)
    with pytest.raises(AttributeError):
        first.name = "other"  # type: ignore[misc]
