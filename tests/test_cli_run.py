"""`tak run` end to end: a real subprocess against a local OpenAI-compatible server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-local",
        "object": "chat.completion.chunk",
        "created": 1_760_000_000,
        "model": "gpt-4.1-mini",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def call_delta(
    index: int, *, id: str | None = None, name: str | None = None, args: str = ""
) -> dict[str, Any]:
    call: dict[str, Any] = {"index": index, "function": {"arguments": args}}
    if id is not None:
        call.update(id=id, type="function")
        call["function"]["name"] = name
    return {"tool_calls": [call]}


FIRST_TURN = [
    chunk({"role": "assistant", "content": None, **call_delta(0, id="call_add", name="add")}),
    chunk(call_delta(1, id="call_div", name="divide")),
    chunk(call_delta(0, args='{"a": 2,')),
    chunk(call_delta(1, args='{"a": 1, "b"')),
    chunk(call_delta(0, args=' "b": 40}')),
    chunk(call_delta(1, args=": 0}")),
    chunk({}, "tool_calls"),
    {"id": "chatcmpl-local", "object": "chat.completion.chunk", "created": 1_760_000_000,
     "model": "gpt-4.1-mini", "choices": [],
     "usage": {"prompt_tokens": 120, "completion_tokens": 30, "total_tokens": 150}},
]  # fmt: skip
SECOND_TURN = [
    chunk({"role": "assistant", "content": "The sum is 42; "}),
    chunk({"content": "dividing by zero failed."}),
    chunk({}, "stop"),
    {"id": "chatcmpl-local", "object": "chat.completion.chunk", "created": 1_760_000_001,
     "model": "gpt-4.1-mini", "choices": [],
     "usage": {"prompt_tokens": 200, "completion_tokens": 12, "total_tokens": 212}},
]  # fmt: skip


@pytest.fixture
def openai_server() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    requests: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            assert self.path == "/v1/chat/completions"
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requests.append(body)
            chunks = FIRST_TURN if len(requests) == 1 else SECOND_TURN
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for c in chunks:
                self.wfile.write(f"data: {json.dumps(c)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", requests
    finally:
        server.shutdown()
        server.server_close()


def tak(
    home: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    environment.update(env or {})
    return subprocess.run(
        # the fake model calls the toy tools (add, divide, sleep) of the demo plugin
        [sys.executable, "-m", "kernel.cli", "--home", str(home), "--plugin", "demo", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=environment,
    )


def test_tak_run_against_a_local_openai_compatible_server(
    tmp_path: Path, openai_server: tuple[str, list[dict[str, Any]]]
) -> None:
    base_url, requests = openai_server
    result = tak(
        tmp_path,
        "run",
        "--model",
        "openai:gpt-4.1-mini",
        "--session",
        "wire",
        "add 2 and 40, and divide 1 by 0",
        env={"OPENAI_BASE_URL": base_url},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "✓ [0] add" in result.stdout and "42" in result.stdout
    assert "✗ [1] divide exception" in result.stdout
    assert "The sum is 42; dividing by zero failed." in result.stdout
    assert "turn ended: final after 2 step(s), 320 in / 42 out tokens" in result.stdout
    assert f"tak --home {tmp_path} sessions show wire --project default" in result.stdout
    # the follow-up request carried both results, in declared order, ids matched
    assert len(requests) == 2
    tool_messages = [m for m in requests[1]["messages"] if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_messages] == ["call_add", "call_div"]
    assert tool_messages[0]["content"] == "42"
    assert "division by zero" in tool_messages[1]["content"]
    transcript = tmp_path / "data/sessions/default/wire/transcript.jsonl"
    types = [json.loads(line)["type"] for line in transcript.read_text().splitlines()]
    assert types == ["user", "assistant", "tool", "assistant"]


def test_tak_run_scripted_demo_offline(tmp_path: Path) -> None:
    prompt = '/call add {"a": 1, "b": 2}\n/call sleep {"seconds": 0.2}\n/call nope {}'
    result = tak(tmp_path, "run", prompt)
    assert result.returncode == 0, result.stderr
    assert "✓ [0] add" in result.stdout
    assert "✗ [2] nope unknown_tool" in result.stdout
    assert "turn ended: final" in result.stdout


def test_tak_run_missing_key_is_a_clear_error(tmp_path: Path) -> None:
    result = tak(tmp_path, "run", "--model", "openai:gpt-4.1-mini", "hi")
    assert result.returncode == 2
    assert "OPENAI_API_KEY" in result.stderr


def test_tak_run_on_a_damaged_transcript_says_so_in_one_line(tmp_path: Path) -> None:
    session = tmp_path / "data/sessions/default/broken"
    session.mkdir(parents=True)
    (session / "transcript.jsonl").write_text('not json at all\n{"type": "user"}\n')
    result = tak(tmp_path, "run", "--session", "broken", "hello")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("tak run: ") and "transcript.jsonl:1" in result.stderr
