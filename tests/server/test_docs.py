"""docs/protocol.md's examples are what the server does: each block is replayed."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from plugins.demo import plugin as demo_plugin

from .wsclient import connect, open_test_kernel, running_server

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
BLOCK = re.compile(r"```replay\n(.*?)```", re.S)
ANY = "..."


def frames(block: str) -> list[tuple[str, str]]:
    """``(">" or "<", text)`` for each frame; a frame goes on over indented lines."""
    out: list[tuple[str, str]] = []
    for line in block.splitlines():
        if line.startswith(("> ", "< ")):
            out.append((line[0], line[2:]))
        elif line.strip():
            assert line.startswith(" ") and out, f"stray line in a replay block: {line!r}"
            out[-1] = (out[-1][0], out[-1][1] + "\n" + line)
    return out


def matches(expected: Any, actual: Any) -> bool:
    if expected == ANY:
        return True
    if isinstance(expected, dict):
        return (
            isinstance(actual, dict)
            and expected.keys() == actual.keys()
            and all(matches(v, actual[k]) for k, v in expected.items())
        )
    if isinstance(expected, list):
        return (
            isinstance(actual, list)
            and len(expected) == len(actual)
            and all(matches(e, a) for e, a in zip(expected, actual, strict=True))
        )
    return bool(expected == actual and type(expected) is type(actual))


def check_group(expected: list[dict[str, Any]], received: list[dict[str, Any]]) -> None:
    """Replies and errors in order, seq included; events in any order (calls run concurrently)."""
    assert [f["seq"] for f in received] == sorted(f["seq"] for f in received)
    final = [f for f in expected if f["type"] != "event"]
    got_final = [f for f in received if f["type"] != "event"]
    assert len(final) == len(got_final), (final, got_final)
    for e, a in zip(final, got_final, strict=True):
        assert matches(e, a), f"\nexpected {e}\nreceived {a}"
    unmatched = [{**f, "seq": ANY} for f in received if f["type"] == "event"]
    for e in (f for f in expected if f["type"] == "event"):
        found = next((a for a in unmatched if matches({**e, "seq": ANY}, a)), None)
        assert found is not None, f"\nexpected {e}\namong {unmatched}"
        unmatched.remove(found)
    # no event of a request after its reply
    replied = {f["re"]: f["seq"] for f in got_final if f["type"] == "reply"}
    for f in received:
        if f["type"] == "event" and f["re"] in replied:
            assert f["seq"] < replied[f["re"]]


def test_the_doc_has_examples_of_every_request() -> None:
    text = "\n".join(BLOCK.findall(DOC.read_text()))
    for kind in ("hello", "call_tools", "run", "cancel", "sessions", "history", "tools"):
        assert f'"type":"{kind}"' in text


async def test_the_examples_in_docs_protocol_md_replay(tmp_path: Path) -> None:
    blocks = BLOCK.findall(DOC.read_text())
    assert len(blocks) >= 5
    async with open_test_kernel(tmp_path, model="scripted:demo", tools=demo_plugin.tools) as kernel:
        async with running_server(kernel) as url:
            for block in blocks:
                script = frames(block)
                async with connect(url) as client:
                    position = 0
                    while position < len(script):
                        direction, text = script[position]
                        assert direction == ">", (
                            f"a block starts with what the client sends: {text}"
                        )
                        await client.send(text)
                        position += 1
                        expected = []
                        while position < len(script) and script[position][0] == "<":
                            expected.append(json.loads(script[position][1]))
                            position += 1
                        received = [await client.recv() for _ in expected]
                        try:
                            check_group(expected, received)
                        except AssertionError as exc:
                            pytest.fail(f"in the example starting {script[0][1][:60]}: {exc}")
