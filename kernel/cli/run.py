"""``tak run "PROMPT"``: one agent turn, streamed to the terminal."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, TYPE_CHECKING

from ..terminal import escape_terminal
from . import DEFAULT_PROJECT
from ._common import ensure_home, home_option, tak_command
from ._exit import FAILED, INTERRUPTED, OK, report, single_leaf

if TYPE_CHECKING:
    from ..agent import AgentEvent, TurnFinished
    from ..executor import CallFinished
    from ..kernel import Kernel
    from ..session import Session
    from ..settings import ModelSettings

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
    p.add_argument(
        "--tools",
        action="append",
        metavar="NAME[,NAME...]",
        help="offer only these tools (names or patterns such as 'read_*'; repeatable)",
    )
    model = p.add_argument_group(
        "model settings",
        "what each model request asks for (docs/models.md, Settings); a flag wins over --set",
    )
    # Values are read by cmd_run (JSON when they parse, else a string), so that a bad
    # one is one line naming the flag, not argparse's usage text.
    model.add_argument("--temperature", metavar="F", help="sampling temperature, 0 to 2")
    model.add_argument("--top-p", metavar="F", help="nucleus sampling, above 0 and at most 1")
    model.add_argument("--max-tokens", metavar="N", help="tokens the model may write per reply")
    model.add_argument("--stop", action="append", metavar="S", help="stop sequence (repeatable)")
    model.add_argument("--seed", metavar="N", help="sampling seed")
    model.add_argument(
        "--tool-choice", metavar="{auto,required,none,NAME}", help="whether (or which) tool to call"
    )
    model.add_argument(
        "--parallel-tool-calls",
        action=argparse.BooleanOptionalAction,
        help="let the model call several tools in one reply",
    )
    model.add_argument("--reasoning-effort", metavar="E", help="minimal, low, medium or high")
    model.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any setting (VALUE as JSON, else a string); extra.KEY for a provider's own "
        "request-body key (repeatable)",
    )
    p.set_defaults(func=cmd_run)


#: The model-settings flags: (flag, its ``ModelSettings`` field, parse VALUE as JSON?).
_SETTING_FLAGS = (
    ("--temperature", "temperature", True),
    ("--top-p", "top_p", True),
    ("--max-tokens", "max_tokens", True),
    ("--stop", "stop", False),
    ("--seed", "seed", True),
    ("--tool-choice", "tool_choice", False),
    ("--parallel-tool-calls", "parallel_tool_calls", False),
    ("--reasoning-effort", "reasoning_effort", False),
)


def _flag_value(text: str) -> object:
    """A flag's VALUE: its JSON when it parses (``7``, ``true``, ``["a"]``), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def model_settings(args: argparse.Namespace) -> ModelSettings | None:
    """One ``ModelSettings`` from the flags, ``None`` when none is given.

    Raises:
        UsageError: a bad value or key, naming the flag
            (``--temperature: expected a number from 0 to 2, got 7``).
    """
    import attrs

    from ..errors import UsageError
    from ..settings import ModelSettings, merge

    def level(flag: str, name: str, value: object) -> ModelSettings:
        # One record per flag, so that an error names the flag the value came from.
        try:
            return ModelSettings(**{name: value})  # type: ignore[arg-type]
        except UsageError as exc:
            raise UsageError(f"{flag}: {str(exc).removeprefix(f'{name}: ')}") from None

    names = sorted(f.name for f in attrs.fields(ModelSettings))
    levels: list[ModelSettings] = []
    for item in args.set:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--set: expected KEY=VALUE, got {item!r}")
        value = _flag_value(text)
        if key.startswith("extra."):
            levels.append(level(f"--set {key}", "extra", {key.removeprefix("extra."): value}))
        elif key in names:
            levels.append(level(f"--set {key}", key, value))
        else:
            raise UsageError(
                f"--set {key}: unknown model setting (known: {', '.join(names)}; "
                "or extra.KEY for a key of the provider's own request body)"
            )
    # The named flags come last: merge lets the later level win.
    for flag, name, as_json in _SETTING_FLAGS:
        given = getattr(args, name)
        if given is not None:
            levels.append(level(flag, name, _flag_value(given) if as_json else given))
    return merge(*levels) if levels else None


def tool_patterns(args: argparse.Namespace) -> list[str] | None:
    """``--tools`` as one list of names or patterns (commas split them), ``None`` if not given."""
    if args.tools is None:
        return None
    return [name.strip() for given in args.tools for name in given.split(",") if name.strip()]


def cmd_run(args: argparse.Namespace) -> int:
    import trio

    from ..agent import RunLimits
    from ..errors import KernelError
    from ..kernel import open_kernel

    try:
        limits = RunLimits(max_steps=args.max_steps, wall_time=args.wall_time)
        settings = model_settings(args)
    except KernelError as exc:
        return report("tak run", exc)

    opened: list[tuple[Kernel, Session]] = []  # for Ctrl-C's message: where the transcript is

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
            opened.append((k, session))
            finished = await stream_turn(
                k,
                session,
                args.prompt,
                sys.stdout,
                settings=settings,
                tools=tool_patterns(args),
            )
            print_transcript_location(k, session, sys.stdout, home=args.home)
            return OK if finished.reason == "final" else FAILED

    try:
        ensure_home(args.home)  # one line naming TAK_HOME when it cannot be used
        return trio.run(main)
    except BaseException as exc:
        # Ctrl-C comes out of the kernel's nurseries in groups of one: this message,
        # not tak's generic "interrupted", since it can say where the transcript is.
        leaf = single_leaf(exc)
        if isinstance(leaf, KernelError):
            return report("tak run", leaf)
        if not isinstance(leaf, KeyboardInterrupt):
            raise
        print("\ntak run: interrupted; the transcript holds what finished", file=sys.stderr)
        if opened:
            print_transcript_location(*opened[0], sys.stderr, home=args.home)
        return INTERRUPTED


async def stream_turn(
    k: Kernel,
    session: Session,
    prompt: str,
    out: IO[str],
    *,
    on_event: Callable[[AgentEvent], None] | None = None,
    settings: ModelSettings | None = None,
    tools: Sequence[str] | None = None,
) -> TurnFinished:
    """Run one turn, printing model text, each call and the ending as they happen.

    Raises:
        UsageError: ``tools`` selects no tool, or ``settings`` ask what they cannot
            have (``Kernel.run``); nothing is recorded then.
    """
    import trio

    from ..agent import ModelDelta, TurnFinished
    from ..executor import CallFinished, CallStarted

    view = _TurnView(out)
    finished: TurnFinished | None = None
    async with trio.open_nursery() as nursery:
        if view.tty:
            nursery.start_soon(view.spin)
        async with k.run(session, prompt, settings=settings, tools=tools) as events:
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
    print(f"\ntranscript: {transcript}", file=out)
    show = tak_command(
        *home_option(home), "sessions", "show", key.session_id, "--project", key.project
    )
    print(f"show it:    {show}", file=out)  # runnable as printed, tak on PATH or not


class _TurnView:
    """Prints a turn; on a terminal, a spinner line shows the calls still running.

    What the model wrote (its text, the names and arguments of its calls) and what
    the tools returned is escaped for the terminal: only this view's own colours
    and redraws are controls.
    """

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
        # Streamed in pieces: an escape sequence split across two deltas is escaped
        # piece by piece all the same (every control is a single character).
        self.out.write(escape_terminal(text, keep_newlines=True))
        self.mid_line = not text.endswith("\n")
        self.out.flush()

    def started(self, index: int, name: str, arguments: object) -> None:
        name = escape_terminal(name)
        self.running[index] = (name, time.monotonic())
        shown = arguments if isinstance(arguments, str) else json.dumps(arguments)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        self._line(self._color("2", f"→ [{index}] {name} {escape_terminal(shown)}"))

    def finished(self, event: CallFinished) -> None:
        self.running.pop(event.index, None)
        o = event.observation
        content = o.content.replace("\n", " ")
        if len(content) > 100:
            content = content[:97] + "..."
        content, name = escape_terminal(content), escape_terminal(o.name)
        if o.error is not None:
            mark = self._color("31", f"✗ [{o.index}] {name} {o.error.kind}")
        else:
            mark = self._color("32", f"✓ [{o.index}] {name}")
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
        if finished.error:  # a provider's error quotes its reply
            summary += f"\nerror: {escape_terminal(finished.error)}"
        color = "32" if finished.reason == "final" else "33"
        self.out.write(self._color(color, summary) + "\n")
        self.out.flush()


__all__ = [
    "add_commands",
    "cmd_run",
    "model_settings",
    "print_transcript_location",
    "stream_turn",
    "tool_patterns",
]
