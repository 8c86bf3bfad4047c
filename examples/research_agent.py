"""A research agent, offline: one turn that reads notes, fetches two pages, computes, runs a
command, fails once — all in parallel — then writes a report file.

Run it with the scripted model (no API key; what ``make demo`` does)::

    python examples/research_agent.py

or on a real model, same tools, same task::

    OPENAI_API_KEY=... python examples/research_agent.py --model openai:gpt-4.1-mini

The pages come from a small HTTP server on 127.0.0.1 that this script starts.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import trio

from kernel import CallFinished, CallStarted, open_kernel
from kernel.agent import AgentEvent, ModelDelta
from kernel.cli.run import print_transcript_location, stream_turn
from kernel.demo import format_table
from kernel.home import TakHome
from kernel.models import ModelRequest, ModelResponse, ScriptedModel

PAGES = {
    "/trio": (
        "<html><head><title>Trio</title></head><body><h1>Trio</h1>"
        "<p>Trio is a library for async concurrency and I/O in Python. Its nurseries give "
        "<b>structured concurrency</b>: a task never outlives the block that started it.</p>"
        "<script>tracking()</script></body></html>"
    ),
    "/landlock": (
        "<html><body><h1>Landlock</h1><p>Landlock lets an unprivileged process restrict "
        "its own access to the file system and to TCP ports. ABI 7 adds audit "
        "controls.</p></body></html>"
    ),
}

NOTES = """# Research notes

- Question: why do agent kernels need structured concurrency and OS confinement?
- Sources to read: the Trio page and the Landlock page.
- Compute: how many tool calls per second a 3.7 µs task overhead allows.
"""

SYSTEM = (
    "You are a research agent. Work in parallel: declare every independent tool call in "
    "one turn. Read notes.md, fetch the pages it names, compute what it asks, then write "
    "report.md with write_file and answer with a two-line summary."
)

TASK = "Research the question in notes.md and write report.md."


@contextmanager
def page_server() -> Iterator[str]:
    """Serve PAGES on 127.0.0.1 in a thread; yield the base URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            page = PAGES.get(self.path)
            body = (page or "<h1>not found</h1>").encode()
            self.send_response(200 if page else 404)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def scripted_researcher(base_url: str) -> ScriptedModel:
    """What a good model does with this task, as a script: three steps."""

    def step(request: ModelRequest) -> ModelResponse | str:
        last = request.messages[-1]
        if last.role == "user":
            return ScriptedModel.reply(
                "Reading the notes, fetching both sources and computing, all at once.",
                calls=[
                    ("read_file", {"path": "notes.md"}),
                    ("fetch_url", {"url": f"{base_url}/trio"}),
                    ("fetch_url", {"url": f"{base_url}/landlock"}),
                    ("run_python", {"code": "rate = 1 / 3.7e-6\nround(rate)"}),
                    ("run_command", {"command": "wc -w notes.md"}),
                    ("read_file", {"path": "sources/extra.md"}),
                ],
            )
        observations = last.observations
        if observations and observations[0].name == "read_file" and len(observations) == 6:
            _notes, trio_page, landlock_page, rate, words, missing = observations
            report = "\n".join(
                [
                    "# Report: structured concurrency and confinement",
                    "",
                    "## Trio",
                    trio_page.content[:400],
                    "",
                    "## Landlock",
                    landlock_page.content[:400],
                    "",
                    "## Throughput",
                    f"At 3.7 µs per task: {rate.content.rpartition('value:')[2].strip()} "
                    "tool calls per second.",
                    "",
                    "## The notes",
                    words.content.strip(),
                    "",
                    "## Not found",
                    missing.content,
                ]
            )
            return ScriptedModel.reply(
                "Writing the report.",
                calls=[("write_file", {"path": "report.md", "content": report})],
            )
        return (
            "Structured concurrency keeps every tool call inside its turn; OS confinement "
            "keeps plugins inside the workspace.\nThe report is in report.md."
        )

    return ScriptedModel(step, name="scripted:researcher")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", help="provider:model (default: the scripted researcher)")
    parser.add_argument("--home", help="TAK_HOME (default: $TAK_HOME or ~/.tak)")
    args = parser.parse_args(argv)
    home = TakHome.locate(args.home).ensure()
    workspace = home.workspace / "research-demo"
    (workspace / "sources").mkdir(parents=True, exist_ok=True)
    (workspace / "notes.md").write_text(NOTES)
    (workspace / "report.md").unlink(missing_ok=True)
    return trio.run(run, args.model, home, workspace, args.home)


async def run(model_spec: str | None, home: TakHome, workspace: Path, home_arg: str | None) -> int:
    batches: dict[int, list[float]] = {}  # step -> [first start, last finish]
    step = 0

    def timing(event: AgentEvent) -> None:
        nonlocal step
        now = time.perf_counter()
        if isinstance(event, ModelDelta):
            step = event.step
        elif isinstance(event, CallStarted):
            batches.setdefault(step, [now, now])
        elif isinstance(event, CallFinished):
            batches.setdefault(step, [now, now])[1] = now

    with page_server() as base_url:
        async with open_kernel(
            home=home,
            workspace=workspace,
            # Only these four plugins and no tools of our own: no name is namespaced.
            model=model_spec or scripted_researcher(base_url),
            plugins=["fs", "web", "python", "shell"],
            plugin_config={"web": {"allow_hosts": [base_url.removeprefix("http://")]}},
            system=SYSTEM,
        ) as k:
            session = k.session(datetime.now(UTC).strftime("research-%Y%m%d-%H%M%S"))
            await session.set_title("research agent demo")
            finished = await stream_turn(k, session, TASK, sys.stdout, on_event=timing)
            messages = await session.messages()
            parallel = next(
                (m for m in messages if m.role == "tool" and len(m.observations) > 1), None
            )
            if parallel is not None:
                observations = list(parallel.observations)
                first = min(batches)
                wall = batches[first][1] - batches[first][0]
                print("\nThe parallel step, in declared order:\n")
                print(format_table(observations))
                total = sum(o.duration_s for o in observations)
                print(f"\nwall time {wall:.3f} s   vs   sum of call durations {total:.3f} s")
            report = workspace / "report.md"
            print(f"\nreport:     {report}" if report.exists() else "\nno report was written")
            print_transcript_location(k, session, sys.stdout, home=home_arg)
    return 0 if finished.reason == "final" else 1


if __name__ == "__main__":
    sys.exit(main())
