"""`tak run` end to end: a real subprocess against a local OpenAI-compatible server."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kernel import cli
from tests.cli_kit import tak


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


@contextlib.contextmanager
def serve_openai(*turns: list[dict[str, Any]]) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A local OpenAI-compatible server streaming ``turns[i]`` to request ``i``; the base URL
    and the request bodies it received."""
    requests: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            assert self.path == "/v1/chat/completions"
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requests.append(body)
            chunks = turns[min(len(requests), len(turns)) - 1]
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


@pytest.fixture
def openai_server() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    with serve_openai(FIRST_TURN, SECOND_TURN) as served:
        yield served


def test_tak_run_against_a_local_openai_compatible_server(
    tmp_path: Path, openai_server: tuple[str, list[dict[str, Any]]]
) -> None:
    base_url, requests = openai_server
    result = tak(
        "run",
        "--model",
        "openai:gpt-4.1-mini",
        "--session",
        "wire",
        "add 2 and 40, and divide 1 by 0",
        env={"OPENAI_BASE_URL": base_url},
        home=tmp_path,
        demo=True,
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
    result = tak("run", prompt, home=tmp_path, demo=True)
    assert result.returncode == 0, result.stderr
    assert "✓ [0] add" in result.stdout
    assert "✗ [2] nope unknown_tool" in result.stdout
    assert "turn ended: final" in result.stdout


def test_tak_run_missing_key_is_a_clear_error(tmp_path: Path) -> None:
    result = tak("run", "--model", "openai:gpt-4.1-mini", "hi", home=tmp_path, demo=True)
    assert result.returncode == 2
    assert "OPENAI_API_KEY" in result.stderr


def test_tak_run_on_a_damaged_transcript_says_so_in_one_line(tmp_path: Path) -> None:
    session = tmp_path / "data/sessions/default/broken"
    session.mkdir(parents=True)
    (session / "transcript.jsonl").write_text('not json at all\n{"type": "user"}\n')
    result = tak("run", "--session", "broken", "hello", home=tmp_path, demo=True)
    # failed (a StoreError), not bad input: the command was right, the store damaged
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("tak run: ") and "transcript.jsonl:1" in result.stderr


# --- model settings and tool selection (issue 14, items 1 and 2) ------------------------

LIST_DIR_CALL = [
    chunk({"role": "assistant", "content": None,
           **call_delta(0, id="call_ls", name="list_dir", args='{"path": "."}')}),
    chunk({}, "tool_calls"),
]  # fmt: skip
ANSWER = [chunk({"role": "assistant", "content": "One file: notes.txt."}), chunk({}, "stop")]


def test_tak_run_forces_a_tool_call_with_only_the_chosen_tool(tmp_path: Path) -> None:
    # The acceptance of issue 14: settings and tools from the command line reach the wire.
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "notes.txt").write_text("hello\n")
    with serve_openai(LIST_DIR_CALL, ANSWER) as (base_url, requests):
        result = tak(
            "run",
            "list the files",
            "--model",
            "openai:local",
            "--tool-choice",
            "required",
            "--tools",
            "list_dir",
            "--max-tokens",
            "64",
            "--session",
            "forced",
            env={"OPENAI_BASE_URL": base_url},
            home=tmp_path,
            demo=True,
        )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "✓ [0] list_dir" in result.stdout and "notes.txt" in result.stdout
    assert "One file: notes.txt." in result.stdout
    assert len(requests) == 2
    # A forced choice is met once; the next request lets the model answer.
    assert [body["tool_choice"] for body in requests] == ["required", "auto"]
    for body in requests:
        assert body["max_tokens"] == 64  # a server other than api.openai.com
        assert [t["function"]["name"] for t in body["tools"]] == ["list_dir"]
    # the next request carries the call and its observation
    assistant = next(m for m in requests[1]["messages"] if m["role"] == "assistant")
    assert assistant["tool_calls"][0]["function"]["name"] == "list_dir"
    observation = next(m for m in requests[1]["messages"] if m["role"] == "tool")
    assert observation["tool_call_id"] == "call_ls" and "notes.txt" in observation["content"]
    transcript = tmp_path / "data/sessions/default/forced/transcript.jsonl"
    types = [json.loads(line)["type"] for line in transcript.read_text().splitlines()]
    assert types == ["user", "assistant", "tool", "assistant"]


def test_tak_run_sends_every_setting_flag(tmp_path: Path) -> None:
    with serve_openai(ANSWER) as (base_url, requests):
        result = tak(
            "run",
            "hi",
            "--model",
            "openai:local",
            *("--temperature", "0.2", "--top-p", "0.9", "--seed", "7"),
            *("--stop", "END", "--stop", "STOP", "--no-parallel-tool-calls"),
            *("--tool-choice", "add", "--tools", "add,div*"),
            *("--set", "max_tokens=32", "--set", "extra.cache_prompt=true"),
            *("--set", "temperature=1.5"),  # a named flag wins over --set
            env={"OPENAI_BASE_URL": base_url},
            home=tmp_path,
            demo=True,
        )
    assert result.returncode == 0, result.stdout + result.stderr
    [body] = requests
    assert (body["temperature"], body["top_p"], body["seed"]) == (0.2, 0.9, 7)
    assert body["stop"] == ["END", "STOP"] and body["max_tokens"] == 32
    assert body["parallel_tool_calls"] is False and body["cache_prompt"] is True
    assert body["tool_choice"] == {"type": "function", "function": {"name": "add"}}
    assert sorted(t["function"]["name"] for t in body["tools"]) == ["add", "divide"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--temperature", "7"], "tak run: --temperature: expected a number from 0 to 2, got 7"),
        (["--temperature", "warm"], "tak run: --temperature: expected a number from 0 to 2"),
        (["--max-tokens", "0"], "tak run: --max-tokens: expected a whole number of at least 1"),
        (["--seed", "1.5"], "tak run: --seed: expected a whole number"),
        (["--reasoning-effort", "max"], "tak run: --reasoning-effort: expected one of"),
        (["--set", "temperature"], "tak run: --set: expected KEY=VALUE, got 'temperature'"),
        (["--set", "warmth=1"], "tak run: --set warmth: unknown model setting (known: "),
        (["--set", "top_p=2"], "tak run: --set top_p: expected a number above 0"),
        (["--tools", "nope"], "tak run: tools: no tool matches 'nope'"),
        (["--tool-choice", "required", "--tools", ""], "tak run: tool_choice 'required'"),
        (["--tool-choice", "add", "--tools", "echo"], "tak run: tool_choice 'add'"),
    ],
)
def test_tak_run_bad_settings_are_one_line(tmp_path: Path, flags: list[str], message: str) -> None:
    result = tak("run", "hello", "--session", "s", *flags, home=tmp_path, demo=True)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith(message), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    # refused before anything was recorded
    assert not (tmp_path / "data/sessions/default/s/transcript.jsonl").exists()


def test_run_interrupted_says_where_its_transcript_is(tmp_path: Path) -> None:
    prompt = '/call sleep {"seconds": 60}\n/call echo {"text": "x"}'
    argv = [sys.executable, "-m", "kernel.cli", "--home", str(tmp_path / "home")]
    argv += ["--plugin", "demo", "run", prompt, "--model", "scripted:demo"]
    run = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as on a terminal
    )
    try:
        assert run.stdout is not None
        for line in run.stdout:
            if line.startswith("✓ [1] echo"):  # the sleep runs on
                break
        run.send_signal(signal.SIGINT)
        out, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 130
    assert "sessions show" in out + err, err


def test_tak_run_set_stop_to_a_number_is_one_line_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["--home", str(tmp_path / "home"), "run", "hi", "--set", "stop=5"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("tak run: --set stop: ") and "internal error" not in err


@pytest.mark.parametrize(
    ("argv", "start"),
    [
        (["--set", "temperature"], "tak run: --set: expected KEY=VALUE, got 'temperature'"),
        (["--set", "=1"], "tak run: --set: expected KEY=VALUE, got '=1'"),
        (["--set", "extra.=1"], "tak run: --set extra.: "),
        (["--set", "bogus=1"], "tak run: --set bogus: unknown model setting"),
        (["--temperature", "NaN"], "tak run: --temperature: expected a number from 0 to 2"),
        (["--temperature", "Infinity"], "tak run: --temperature: expected a number"),
        (["--max-tokens", "true"], "tak run: --max-tokens: expected a whole number"),
        (["--max-tokens", "1e400"], "tak run: --max-tokens: expected a whole number"),
        (["--seed", "1.5"], "tak run: --seed: expected a whole number"),
        (["--tools", "["], "tak run: tools: no tool matches '['"),
        (["--tools", "", "--tool-choice", "required"], "tak run: tool_choice 'required'"),
    ],
)
def test_odd_flags_are_one_line_with_exit_2_and_nothing_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], start: str
) -> None:
    code = cli.main(["--home", str(tmp_path / "home"), "run", "hi", *argv])
    out, err = capsys.readouterr()
    assert code == 2
    assert err.startswith(start), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "transcript:" not in out


def test_set_extra_with_a_dotted_key_is_one_flat_body_key(tmp_path: Path) -> None:
    # --set extra.x.y=1 is documented as extra.KEY: the key is "x.y", not {"x": {"y": 1}}.
    from kernel.cli.run import model_settings

    parser = cli.build_parser()
    args = parser.parse_args(["run", "hi", "--set", "extra.x.y=1", "--set", 'extra.z={"a":1}'])
    settings = model_settings(args)
    assert settings is not None and settings.extra == {"x.y": 1, "z": {"a": 1}}


def test_tools_empty_string_offers_no_tools(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `--tools ""` (an empty shell variable) is an empty allow-list: the turn runs with
    # no tool schemas at all, as tools=[] does.
    code = cli.main(["--home", str(tmp_path / "home"), "run", "list the files", "--tools", ""])
    assert code == 0
    assert "→" not in capsys.readouterr().out  # no call was made
