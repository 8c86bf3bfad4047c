"""``tak run "PROMPT"``: one agent turn, streamed to the terminal."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING

from . import DEFAULT_PROJECT

if TYPE_CHECKING:
    from ..agent import AgentEvent, TurnFinished
    from ..executor import CallFinished
    from ..kernel import Kernel
    from ..session import Session

_SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("run", help="run one agent turn and stream it")
    p.add_argument("prompt", help="what to ask")
    p.add_argument(
        "--model", default="scripted:demo", help="provider:model (default scripted:demo)"
    )
    p.add_argument(
        "--fallback", action="append", default=[], help="model to try when the first fails"
    )
    p.add_argument("--session", help="session id to continue (default: a new session)")
    p.add_argument("--project", default=DEFAULT_PROJECT, help="project the session belongs to")
    p.add_argument("--workspace", help="workspace directory for tools")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--max-steps", type=int, default=25, help="model requests in the turn")
    p.add_argument("--wall-time", type=float, help="seconds the turn may take")
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    import trio

    from ..agent import RunLimits
    from ..errors import KernelError
    from ..kernel import open_kernel

    try:
        limits = RunLimits(max_steps=args.max_steps, wall_time=args.wall_time)
    except KernelError as exc:
        print(f"tak run: {exc}", file=sys.stderr)
        return 2

    async def main() -> int:
        async with open_kernel(
            home=args.home,
            workspace=args.workspace,
            model=args.model,
            fallbacks=args.fallback,
            extra_plugins=args.plugin,
            system=args.system,
            limits=limits,
        ) as k:
            session = k.session(args.session, project=args.project)
            finished = await stream_turn(k, session, args.prompt, sys.stdout)
            print_transcript_location(k, session, sys.stdout, home=args.home)
            return 0 if finished.reason == "final" else 1

    try:
        return trio.run(main)
    except KernelError as exc:
        print(f"tak run: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ntak run: interrupted; the transcript holds what finished", file=sys.stderr)
        return 130


async def stream_turn(
    k: Kernel,
    session: Session,
    prompt: str,
    out: IO[str],
    *,
    on_event: Callable[[AgentEvent], None] | None = None,
) -> TurnFinished:
    """Run one turn, printing model text, each call and the ending as they happen."""
    import trio

    from ..agent import ModelDelta, TurnFinished
    from ..executor import CallFinished, CallStarted

    view = _TurnView(out)
    finished: TurnFinished | None = None
    async with trio.open_nursery() as nursery:
        if view.tty:
            nursery.start_soon(view.spin)
        async with k.run(session, prompt) as events:
            async for event in events:
                if on_event is not None:
                    on_event(event)
                if isinstance(event, ModelDelta):
                    view.text(event.text)
                elif isinstance(event, CallStarted):
                    view.started(event.index, event.call.name, event.call.arguments)
                elif isinstance(event, CallFinished):
                    view.finished(event)
                elif isinstance(event, TurnFinished):
                    finished = event
        nursery.cancel_scope.cancel()
    assert finished is not None
    view.end(finished)
    return finished


def print_transcript_location(
    k: Kernel, session: Session, out: IO[str], *, home: str | None = None
) -> None:
    """Where the transcript is on disk, and the command that shows it."""
    key = session.key
    transcript = k.home.sessions / key.project / key.session_id / "transcript.jsonl"
    home_option = f" --home {home}" if home else ""
    print(f"\ntranscript: {transcript}", file=out)
    print(
        f"show it:    tak{home_option} sessions show {key.session_id} --project {key.project}",
        file=out,
    )


class _TurnView:
    """Prints a turn; on a terminal, a spinner line shows the calls still running."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.tty = out.isatty()
        self.running: dict[int, tuple[str, float]] = {}
        self.mid_line = False
        self.tick = 0

    def _color(self, code: str, text: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.tty else text

    def _clear_status(self) -> None:
        if self.tty and self.running:
            self.out.write("\r\x1b[2K")

    def _line(self, text: str) -> None:
        self._clear_status()
        if self.mid_line:
            self.out.write("\n")
            self.mid_line = False
        self.out.write(text + "\n")
        self._draw_status()

    def _draw_status(self) -> None:
        if self.tty and self.running:
            now = time.monotonic()
            names = ", ".join(f"{name} {now - start:.1f}s" for name, start in self.running.values())
            self.out.write(f"{_SPINNER[self.tick % len(_SPINNER)]} running: {names}")
        self.out.flush()

    def text(self, text: str) -> None:
        self._clear_status()
        self.out.write(text)
        self.mid_line = not text.endswith("\n")
        self.out.flush()

    def started(self, index: int, name: str, arguments: object) -> None:
        self.running[index] = (name, time.monotonic())
        shown = arguments if isinstance(arguments, str) else json.dumps(arguments)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        self._line(self._color("2", f"→ [{index}] {name} {shown}"))

    def finished(self, event: CallFinished) -> None:
        self.running.pop(event.index, None)
        o = event.observation
        content = o.content.replace("\n", " ")
        if len(content) > 100:
            content = content[:97] + "..."
        if o.error is not None:
            mark = self._color("31", f"✗ [{o.index}] {o.name} {o.error.kind}")
        else:
            mark = self._color("32", f"✓ [{o.index}] {o.name}")
        self._line(f"{mark} ({o.duration_s:.2f}s) {content}")

    async def spin(self) -> None:
        import trio

        while True:
            await trio.sleep(0.1)
            self.tick += 1
            if self.running:
                self._clear_status()
                self._draw_status()

    def end(self, finished: TurnFinished) -> None:
        self._line("")
        usage = finished.usage
        cost = f", ${finished.cost_usd:.4f}" if finished.cost_usd is not None else ""
        summary = (
            f"turn ended: {finished.reason} after {finished.steps} step(s), "
            f"{usage.total_input_tokens} in / {usage.output_tokens} out tokens{cost}"
        )
        if finished.error:
            summary += f"\nerror: {finished.error}"
        color = "32" if finished.reason == "final" else "33"
        self.out.write(self._color(color, summary) + "\n")
        self.out.flush()
