"""The ``fs`` built-in plugin: read, write, edit, list, glob and grep files in the workspace.

Every path goes through ``context().workspace`` (``sandbox.Workspace``), which
resolves it beneath the workspace's directory fd with ``openat2(RESOLVE_BENEATH)``:
``..`` that climbs out, absolute paths and symbolic links leading out are refused
by the operating system, not by string checks here. That is why this plugin runs
in the kernel's process (``in_process=True``): it has no side effect that the
``Workspace`` does not confine.

Refusals (``SandboxError``) become ``denied`` observations; a missing file, a
directory where a file was expected and the like become ``exception``
observations whose message names the workspace path.

Walking (``glob``, ``grep``) never follows symbolic links to directories (no loops,
no double counting) and does not descend into hidden directories (``.git``,
``.tak``, ``.venv``) unless the pattern or path names them explicitly.

Running in the kernel's process has a price: a tool here cannot be killed at its
deadline (its thread is abandoned, not stopped), and C code that holds the GIL
freezes every session. So every tool's cost is bounded by its input caps, not by
its deadline: ``edit_file`` counts lines once however often ``old`` occurs, and its
closest-match search compares a bounded number of candidates; walks and listings
stop after ``MAX_WALK_ENTRIES`` entries; glob patterns match in time linear in
pattern times path length. A walk lists each directory by its path from the
workspace root (the ``Workspace`` resolves it beneath the root again), so a
directory at depth d costs d lookups: walks do not enter directories more than
``MAX_WALK_DEPTH`` levels below the root, and ``glob`` and ``grep`` look at their
clock before listing each directory, stopping after ``GLOB_SECONDS`` or
``GREP_SECONDS`` with a marker. ``grep`` runs RE2 (linear time, no backtracking), but
linear is not fast: a pattern whose DFA blows up runs on RE2's NFA at a cost per
byte proportional to its program size (2 us/byte for ``[ab]*a[ab]{999}c``). So
``grep`` also has a clock: each RE2 call gets a window small enough for its
program (``GREP_WINDOW_COST``), and the search stops after ``GREP_SECONDS``, well
within its own deadline, and says how far it got.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import heapq
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from kernel.errors import SandboxError
from kernel.plugin import Plugin, context
from kernel.tools import ToolFailure

if TYPE_CHECKING:
    from sandbox import Entry, Workspace

__all__ = [
    "GLOB_SECONDS",
    "GLOB_TIMEOUT",
    "GREP_SECONDS",
    "GREP_TIMEOUT",
    "GREP_WINDOW_BYTES",
    "GREP_WINDOW_COST",
    "MAX_FILE_BYTES",
    "MAX_GREP_CHARS",
    "MAX_GREP_PROGRAM",
    "MAX_PATTERN_CHARS",
    "MAX_READ_LINES",
    "MAX_WALK_DEPTH",
    "MAX_WALK_ENTRIES",
    "edit_file",
    "glob",
    "grep",
    "list_dir",
    "plugin",
    "read_file",
    "write_file",
]

plugin = Plugin(
    "fs",
    version="0.1.0",
    description="Read, write, edit, list and search files in the workspace.",
    permissions={"workspace": "write"},
    in_process=True,
)

#: Largest file ``read_file``, ``edit_file`` and ``grep`` will load.
MAX_FILE_BYTES = 8 * 1024 * 1024
#: Lines and characters ``read_file`` shows at once; the rest is announced with a marker.
MAX_READ_LINES = 2000
MAX_READ_CHARS = 60_000
#: Longest line shown as is by ``read_file`` and ``grep``.
MAX_LINE_CHARS = 2000
MAX_GREP_LINE_CHARS = 400
#: Output caps of ``grep`` (characters) and of ``glob``/``list_dir`` (entries).
MAX_GREP_CHARS = 40_000
MAX_ENTRIES = 1000
#: Directory entries a walk visits before it stops, so a huge tree cannot stall a call.
MAX_WALK_ENTRIES = 200_000
#: Levels below the workspace root a walk enters. Each directory is listed by its path
#: from the root, resolved again, so 1 900 levels of 50 directories cost 90 million
#: lookups (seconds); 256 levels cost at most 256 per listing.
MAX_WALK_DEPTH = 256
#: How many leading bytes decide whether a file is binary.
BINARY_SNIFF_BYTES = 8192
#: Longest ``grep`` regex and glob pattern accepted, in characters.
MAX_PATTERN_CHARS = 1000
#: ``grep`` hands RE2 at most this many bytes per call (whole lines, or a window of a
#: longer line), so no single call into C runs for long.
GREP_WINDOW_BYTES = 256 * 1024
#: ... and at most this many bytes times instructions of the compiled program: RE2's
#: NFA costs up to ~3 ns per instruction per byte, so one call stays under ~0.1 s.
#: ``TODO`` compiles to 8 instructions (full windows), ``[ab]*a[ab]{999}c`` to 1006.
GREP_WINDOW_COST = 32 * 1024 * 1024
#: Largest compiled program ``grep`` runs: windows stay at least 1 KiB.
MAX_GREP_PROGRAM = 32 * 1024


def _working_seconds(timeout: float) -> float:
    """How long a tool with this deadline works before it stops and says so: the rest is
    the margin for the last step (an RE2 call, a directory listing) and the output."""
    return min(timeout - 1.0, timeout * 0.8)


#: ``grep``'s and ``glob``'s deadlines, and how long each works before it stops.
GREP_TIMEOUT = 4.0
GREP_SECONDS = _working_seconds(GREP_TIMEOUT)
GLOB_TIMEOUT = 4.0
GLOB_SECONDS = _working_seconds(GLOB_TIMEOUT)
#: ``grep`` stops after reading this many bytes in all, or counting this many matches.
MAX_GREP_BYTES = 256 * 1024 * 1024
MAX_GREP_MATCHES = 100_000
#: ``edit_file``'s closest-match search: longest ``old`` (lines, characters) it tries,
#: how many candidate regions it compares closely, and how much of each.
MAX_CLOSEST_LINES = 400
MAX_CLOSEST_CHARS = 20_000
CLOSEST_CANDIDATES = 5
CLOSEST_COMPARE_CHARS = 1500
#: Occurrences whose line ``edit_file`` names when ``old`` is not unique.
MAX_OCCURRENCES_SHOWN = 50

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _workspace() -> Workspace:
    return context().workspace


def _refusals_denied(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """A ``SandboxError`` becomes a ``denied`` observation; OS errors name the path plainly."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return fn(*args, **kwargs)
        except SandboxError as exc:
            raise ToolFailure("denied", str(exc), type="SandboxError") from exc
        except OSError as exc:
            if exc.filename is None or not exc.errno:
                raise
            # "[Errno 2] openat2: No such file or directory: 'a.txt'" reads worse than this.
            raise type(exc)(f"{exc.filename}: {os.strerror(exc.errno).lower()}") from None

    return wrapper


def _looks_binary(data: bytes) -> bool:
    return b"\x00" in data[:BINARY_SNIFF_BYTES]


def _binary_message(path: str, data: bytes) -> str:
    preview = data[:32].hex(" ")
    return (
        f"{path} looks binary (NUL bytes in its first {BINARY_SNIFF_BYTES} bytes; "
        f"{len(data)} bytes in all); only text files can be shown. First bytes: {preview}"
    )


def _read_text_file(ws: Workspace, path: str) -> str:
    """The text of a file, refused when it is binary or larger than ``MAX_FILE_BYTES``."""
    data = ws.read_bytes(path, max_bytes=MAX_FILE_BYTES)
    if _looks_binary(data):
        raise ValueError(_binary_message(path, data))
    return data.decode("utf-8", errors="replace")


def _clip_line(line: str, limit: int) -> str:
    if len(line) <= limit:
        return line
    return f"{line[:limit]}… [line cut: {len(line) - limit} more characters]"


def _numbered(lines: list[str], first: int) -> str:
    return "\n".join(
        f"{number:>6}\t{_clip_line(line, MAX_LINE_CHARS)}"
        for number, line in enumerate(lines, start=first)
    )


@plugin.tool
@_refusals_denied
def read_file(path: str, start_line: int | None = None, end_line: int | None = None) -> str:
    """Read a text file from the workspace, with line numbers.

    Shows at most 2000 lines or 60 000 characters at once; a marker at the end
    says which line to continue from. Binary files are refused.

    Args:
        path: File path relative to the workspace.
        start_line: First line to show (1-based). Default: the first line.
        end_line: Last line to show (inclusive). Default: the last line.
    """
    if start_line is not None and start_line < 1:
        raise ValueError(f"start_line must be 1 or more, got {start_line}")
    if end_line is not None and end_line < 1:
        raise ValueError(f"end_line must be 1 or more, got {end_line}")
    if start_line is not None and end_line is not None and end_line < start_line:
        raise ValueError(f"end_line {end_line} is before start_line {start_line}")
    lines = _read_text_file(_workspace(), path).splitlines()
    total = len(lines)
    if total == 0:
        return f"({path} is empty)"
    first = start_line or 1
    if first > total:
        raise ValueError(f"start_line {first} is past the end of {path} ({total} lines)")
    last = min(end_line or total, total)
    shown: list[str] = []
    size = 0
    for line in lines[first - 1 : last]:
        size += min(len(line), MAX_LINE_CHARS) + 8
        if len(shown) >= MAX_READ_LINES or (shown and size > MAX_READ_CHARS):
            break
        shown.append(line)
    out = _numbered(shown, first)
    shown_last = first + len(shown) - 1
    if shown_last < last:
        out += (
            f"\n[showed lines {first}-{shown_last} of {total}; "
            f"continue with start_line={shown_last + 1}]"
        )
    return out


@plugin.tool
@_refusals_denied
def write_file(path: str, content: str) -> str:
    """Create or replace a text file in the workspace (atomically).

    Missing parent directories are created.

    Args:
        path: File path relative to the workspace.
        content: The whole new content of the file.
    """
    ws = _workspace()
    parent = path.rstrip("/").rpartition("/")[0]
    if parent and not ws.exists(parent):
        # Checked first: ``exists`` resolves the parent, so a parent that leads out of
        # the workspace is refused as such rather than reported as "file exists".
        ws.mkdir(parent, parents=True, exist_ok=True)
    existed = ws.exists(path)
    data = content.encode("utf-8")
    ws.write_bytes(path, data)
    lines = content.count("\n") + (0 if content.endswith("\n") or not content else 1)
    verb = "replaced" if existed else "created"
    return f"{verb} {path}: {len(data)} bytes, {lines} lines"


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _occurrence_lines(text: str, old: str, limit: int) -> list[int]:
    """The line of each of the first ``limit`` occurrences of ``old``, in one pass.

    Newlines are counted from the previous occurrence, not from the start: counting
    from the start for each of 400 000 occurrences takes minutes.
    """
    lines: list[int] = []
    line, counted = 1, 0
    offset = text.find(old)
    while offset != -1 and len(lines) < limit:
        line += text.count("\n", counted, offset)
        counted = offset
        lines.append(line)
        offset = text.find(old, offset + len(old))
    return lines


_WORD = re.compile(r"\w+")


def _closest_region(text: str, old: str) -> tuple[int, list[str], float] | None:
    """The run of lines of ``text`` most like ``old``: (first line number, lines, ratio).

    Bounded work, whatever the input: every window of ``old``'s line count is scored
    in one linear pass by the words its lines share with ``old``; only the
    ``CLOSEST_CANDIDATES`` best get the (quadratic) ``difflib`` ratio, on at most
    ``CLOSEST_COMPARE_CHARS`` characters each.
    """
    lines = text.splitlines()
    wanted = old.strip("\n").splitlines() or [old]
    width = len(wanted)
    if not lines or width > MAX_CLOSEST_LINES or len(old) > MAX_CLOSEST_CHARS:
        return None
    words = set(_WORD.findall(old))
    hits = [len(words.intersection(_WORD.findall(line))) for line in lines]
    # Sliding sums: the score of the window starting at each line.
    starts = max(1, len(lines) - width + 1)
    score = sum(hits[:width])
    scores = [score]
    for start in range(1, starts):
        score += hits[start + width - 1] - hits[start - 1]
        scores.append(score)
    candidates = heapq.nlargest(CLOSEST_CANDIDATES, range(starts), key=lambda i: (scores[i], -i))
    target = "\n".join(wanted)[:CLOSEST_COMPARE_CHARS]
    matcher = difflib.SequenceMatcher(autojunk=False)
    matcher.set_seq2(target)
    best: tuple[int, list[str], float] | None = None
    for start in sorted(candidates):
        window = lines[start : start + width]
        matcher.set_seq1("\n".join(window)[:CLOSEST_COMPARE_CHARS])
        floor = best[2] if best else 0.0
        if matcher.real_quick_ratio() <= floor or matcher.quick_ratio() <= floor:
            continue
        ratio = matcher.ratio()
        if ratio > floor:
            best = (start + 1, window, ratio)
    return best


def _missing_message(path: str, text: str, old: str) -> str:
    message = f"old text not found in {path}"
    if len(text) > 2_000_000:
        return message + " (file too large to look for a close match)"
    if len(old) > MAX_CLOSEST_CHARS or old.count("\n") >= MAX_CLOSEST_LINES:
        return message + " (old text too long to look for a close match)"
    closest = _closest_region(text, old)
    if closest is None or closest[2] < 0.3:
        return message + "; nothing in the file resembles it"
    first, lines, ratio = closest
    return (
        f"{message}. The closest region ({ratio:.0%} similar) is lines "
        f"{first}-{first + len(lines) - 1}:\n{_numbered(lines, first)}\n"
        "Copy the text exactly as it is in the file (whitespace included)."
    )


@plugin.tool
@_refusals_denied
def edit_file(path: str, old: str, new: str) -> str:
    """Replace one exact occurrence of ``old`` with ``new`` in a file.

    Fails when ``old`` is not in the file (the error shows the closest region)
    or occurs more than once (the error gives the line of each occurrence:
    include more surrounding text to make it unique).

    Args:
        path: File path relative to the workspace.
        old: The exact text to replace, whitespace included.
        new: The replacement text.
    """
    if not old:
        raise ValueError("old is empty; give the exact text to replace (use write_file to create)")
    if old == new:
        raise ValueError("old and new are the same; nothing to change")
    ws = _workspace()
    text = _read_text_file(ws, path)
    count = text.count(old)
    if count == 0:
        raise ValueError(_missing_message(path, text, old))
    if count > 1:
        starts = _occurrence_lines(text, old, MAX_OCCURRENCES_SHOWN)
        shown = ", ".join(str(n) for n in starts)
        more = f" and {count - len(starts)} more" if count > len(starts) else ""
        raise ValueError(
            f"old text occurs {count} times in {path}, starting at lines {shown}{more}; "
            "include more surrounding text so that it matches exactly once"
        )
    offset = text.index(old)
    ws.write_text(path, text[:offset] + new + text[offset + len(old) :])
    first = _line_of(text, offset)
    last = first + max(new.count("\n") - (1 if new.endswith("\n") else 0), 0)
    return f"edited {path}: replaced 1 occurrence; the new text is at lines {first}-{last}"


_KIND_SUFFIX = {"dir": "/", "symlink": "@", "other": "?", "file": ""}


@plugin.tool
@_refusals_denied
def list_dir(path: str = ".") -> str:
    """List a directory of the workspace: directories end in ``/``, symbolic links in ``@``.

    Args:
        path: Directory path relative to the workspace.
    """
    entries = _workspace().list(path, limit=MAX_WALK_ENTRIES + 1)
    if not entries:
        return f"({path} is empty)"
    lines = []
    for entry in entries[:MAX_ENTRIES]:
        name = entry.name + _KIND_SUFFIX[entry.kind]
        lines.append(f"{name}  {entry.size} bytes" if entry.kind == "file" else name)
    if len(entries) > MAX_WALK_ENTRIES:
        lines.append(
            f"[showed {MAX_ENTRIES} entries, sorted among the first {MAX_WALK_ENTRIES} read; "
            f"{path} has more: use glob to narrow]"
        )
    elif len(entries) > MAX_ENTRIES:
        lines.append(f"[showed {MAX_ENTRIES} of {len(entries)} entries]")
    return "\n".join(lines)


# --- walking ----------------------------------------------------------------------


class _WalkBudget:
    """What a walk may spend: ``MAX_WALK_ENTRIES`` entries, time until ``deadline``.

    A walk that runs out stops (its tool says why); a directory more than
    ``MAX_WALK_DEPTH`` levels below the workspace root is not entered (and the tool
    says so too).
    """

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.visited = 0
        self.exhausted = False
        self.out_of_time = False
        self.too_deep = False

    def entries_of(self, ws: Workspace, path: str) -> list[Entry] | None:
        """The entries of directory ``path``, or ``None`` when the walk must stop.

        A directory that vanished, cannot be read or is too deep has no entries: not
        worth failing a search for.
        """
        # Per directory, not per file: a tree of directories only (or a filter that
        # matches nothing) would otherwise never look at the clock.
        if time.monotonic() > self.deadline:
            self.out_of_time = True
            return None
        if sum(1 for name in path.split("/") if name not in ("", ".")) > MAX_WALK_DEPTH:
            self.too_deep = True
            return []
        try:
            entries = ws.list(path, limit=max(MAX_WALK_ENTRIES - self.visited, 0) + 1)
        except (OSError, SandboxError):
            return []
        self.visited += len(entries)
        if self.visited > MAX_WALK_ENTRIES:
            self.exhausted = True
            return None
        return entries

    def notes(self, narrow: str) -> list[str]:
        """Markers for what the walk left out (not the time: each tool words its own)."""
        notes = []
        if self.too_deep:
            notes.append(
                f"[did not enter directories more than {MAX_WALK_DEPTH} levels below the "
                "workspace root]"
            )
        if self.exhausted:
            notes.append(
                f"[stopped after visiting {MAX_WALK_ENTRIES} entries; narrow the {narrow}]"
            )
        return notes


def _join(base: str, name: str) -> str:
    return name if base in ("", ".") else f"{base}/{name}"


def _walk_files(ws: Workspace, top: str, budget: _WalkBudget) -> Iterator[str]:
    """Regular files under ``top`` (workspace-relative), depth first, sorted by name."""
    stack = [top]
    while stack:
        current = stack.pop()
        entries = budget.entries_of(ws, current)
        if entries is None:
            return
        subdirs = []
        for entry in entries:
            path = _join(current, entry.name)
            if entry.kind == "file":
                yield path
            elif entry.kind == "dir" and not entry.name.startswith("."):
                subdirs.append(path)
        stack.extend(reversed(subdirs))


def _split_pattern(pattern: str, what: str) -> list[str]:
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"{what} is {len(pattern)} characters, more than {MAX_PATTERN_CHARS}")
    if pattern.startswith("/"):
        raise ValueError(f"{what} {pattern!r} is absolute; patterns are relative to the workspace")
    parts = [p for p in pattern.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ValueError(f"{what} {pattern!r} contains '..'; patterns stay inside the workspace")
    if not parts:
        raise ValueError(f"{what} {pattern!r} matches nothing; try '**/*'")
    # ``**/**`` means what ``**`` means; collapsed, it cannot multiply the work.
    return [p for i, p in enumerate(parts) if not (p == "**" and i and parts[i - 1] == "**")]


def _segment_matches(segment: str, name: str) -> bool:
    # As in a shell: a wildcard does not match a leading dot unless the segment has one.
    if name.startswith(".") and not segment.startswith("."):
        return False
    return fnmatch.fnmatchcase(name, segment)


def _glob(ws: Workspace, parts: list[str], budget: _WalkBudget) -> Iterator[str]:
    """Paths matching the segments; ``**`` is zero or more directories."""
    # (directory, index of the next segment to match); a set avoids revisiting
    # a directory that several ``**`` expansions reach.
    seen: set[tuple[str, int]] = set()
    stack: list[tuple[str, int]] = [(".", 0)]
    while stack:
        current, index = stack.pop()
        if (current, index) in seen:
            continue
        seen.add((current, index))
        segment = parts[index]
        last = index == len(parts) - 1
        if segment == "**":
            stack.append((current, index + 1))
        entries = budget.entries_of(ws, current)
        if entries is None:
            return
        for entry in entries:
            path = _join(current, entry.name)
            if segment == "**":
                if entry.kind == "dir" and not entry.name.startswith("."):
                    stack.append((path, index))
                continue
            if not _segment_matches(segment, entry.name):
                continue
            if last:
                yield path
            elif entry.kind == "dir" or (entry.kind == "symlink" and _is_dir(ws, path)):
                stack.append((path, index + 1))


def _is_dir(ws: Workspace, path: str) -> bool:
    try:
        return stat.S_ISDIR(ws.stat(path).st_mode)
    except (OSError, SandboxError):
        return False


@plugin.tool(timeout=GLOB_TIMEOUT)
@_refusals_denied
def glob(pattern: str) -> str:
    """Find workspace paths matching a glob pattern, one per line, sorted.

    ``*`` and ``?`` match within one name, ``**`` matches any number of
    directories (``src/**/*.py``). Wildcards do not match names that start
    with ``.``, and ``**`` does not enter hidden directories, unless the
    pattern spells the dot (``.github/**/*.yml``). The walk stops after 3
    seconds, and does not go more than 256 directories deep; a marker says so.

    Args:
        pattern: Glob pattern relative to the workspace.
    """
    budget = _WalkBudget(time.monotonic() + GLOB_SECONDS)
    ws = _workspace()
    parts = _split_pattern(pattern, "pattern")
    if parts[-1] == "**":
        parts.append("*")  # a trailing ``**`` means everything below, as ``**/*`` does
    found = sorted(set(_glob(ws, parts, budget)))
    notes = budget.notes("pattern")
    if budget.out_of_time:
        notes.append(
            f"[stopped after {GLOB_SECONDS:g} s: visited {budget.visited} entries; "
            "narrow the pattern]"
        )
    if not found:
        return "\n".join([f"no paths match {pattern!r}", *notes])
    lines = found[:MAX_ENTRIES]
    if len(found) > MAX_ENTRIES:
        notes.append(f"[showed {MAX_ENTRIES} of {len(found)} matches; narrow the pattern]")
    return "\n".join(lines + notes)


def _path_filter(pattern: str | None) -> Callable[[str], bool]:
    """``*.py`` matches a file name anywhere; a pattern with ``/`` matches the whole path."""
    if pattern is None:
        return lambda path: True
    parts = _split_pattern(pattern, "glob")
    if len(parts) == 1:
        return lambda path: _segment_matches(parts[0], path.rpartition("/")[2])
    return lambda path: _parts_match(parts, path.split("/"))


def _parts_match(parts: list[str], names: list[str]) -> bool:
    """Whether the path ``names`` matches ``parts``: a table, linear in both lengths.

    (Trying every split at each ``**`` is exponential in the number of ``**``.)
    """
    # ok[j]: parts[i:] matches names[j:], for the current i, from the end backwards.
    ok = [False] * len(names) + [True]
    for part in reversed(parts):
        nxt = [False] * (len(names) + 1)
        for j in range(len(names), -1, -1):
            if part == "**":
                nxt[j] = ok[j] or (j < len(names) and nxt[j + 1])
            else:
                nxt[j] = j < len(names) and ok[j + 1] and _segment_matches(part, names[j])
        ok = nxt
    return ok[0]


def _compile_grep(pattern: str) -> Any:
    """The pattern as a compiled RE2 regex over UTF-8 bytes, each match within one line.

    RE2 runs in time linear in the text, whatever the pattern: no backtracking, so
    ``(a+)+$`` cannot hold the GIL for minutes. It has no backreferences or
    lookaround; a pattern that only Python's ``re`` accepts gets a message saying so.
    """
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(
            f"regular expression is {len(pattern)} characters, more than {MAX_PATTERN_CHARS}"
        )
    import re2  # type: ignore[import-untyped]  # here: ``import plugins`` stays cheap

    options = re2.Options()
    options.log_errors = False  # the error goes to the model, not to the kernel's stderr
    options.never_nl = True  # a match never spans lines, as with line-by-line search
    options.never_capture = True  # only where the match is; groups would cost per call
    try:
        regex = re2.compile(b"(?m)" + pattern.encode("utf-8", "surrogatepass"), options)
    except re2.error as exc:
        reason = exc.args[0] if exc.args else exc
        reason = reason.decode("utf-8", "replace") if isinstance(reason, bytes) else str(reason)
    else:
        if regex.programsize > MAX_GREP_PROGRAM:
            raise ValueError(
                f"regular expression {pattern!r} is too complex: it compiles to "
                f"{regex.programsize} instructions, more than {MAX_GREP_PROGRAM}; "
                "use fewer or smaller repetition counts"
            )
        return regex
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError):
        raise ValueError(f"invalid regular expression {pattern!r}: {reason}") from None
    raise ValueError(
        f"regular expression {pattern!r} uses Python-only syntax that grep does not run "
        f"(backreferences, lookaround, atomic groups, possessive quantifiers): {reason}; "
        "grep uses RE2 syntax, which runs in linear time"
    )


class _OutOfTime(Exception):
    """``grep``'s time ran out in the middle of a file, at this line."""

    def __init__(self, line: int) -> None:
        super().__init__(line)
        self.line = line


def _grep_window(regex: Any) -> int:
    """Bytes per RE2 call for this pattern: fewer for a bigger program (``GREP_WINDOW_COST``)."""
    program: int = max(regex.programsize, 1)
    return min(GREP_WINDOW_COST // program, GREP_WINDOW_BYTES)


def _matching_lines(regex: Any, data: bytes, deadline: float) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of each line of ``data`` with a match, in order.

    RE2 is given whole lines, ``_grep_window(regex)`` bytes at most per call; a longer
    line is searched in windows of that size (a match across a window edge is missed)
    and shown from the window where it matched.

    Raises:
        _OutOfTime: ``time.monotonic()`` passed ``deadline`` (checked between windows).
    """
    window = _grep_window(regex)
    size = len(data)
    pos = 0
    number = 1  # the line number at offset ``counted``
    counted = 0
    scanned = 0  # no newline in ``data[counted:scanned]``: each byte is looked at once
    line_start = 0
    while pos < size:
        if time.monotonic() > deadline:
            raise _OutOfTime(number + data.count(b"\n", counted, pos))
        end = min(pos + window, size)
        if end < size:
            newline = data.rfind(b"\n", pos, end)
            if newline >= pos:
                end = newline + 1
        while pos < end:
            match = regex.search(data, pos, end)
            if match is None:
                pos = end
                break
            found = match.start()
            newline = data.rfind(b"\n", scanned, found)
            if newline != -1:
                number += data.count(b"\n", counted, newline + 1)
                counted = line_start = newline + 1
            scanned = found
            line_end = data.find(b"\n", found, end)
            shown = data[max(line_start, pos) : end if line_end == -1 else line_end]
            yield number, shown.rstrip(b"\r")
            if line_end == -1:  # one report per line: skip the rest of a long one
                line_end = data.find(b"\n", end)
            pos = size if line_end == -1 else line_end + 1


def _out_of_time(searched: int, partly: str | None) -> str:
    files = f"{searched} file{'' if searched == 1 else 's'}"
    also = f" and {partly}" if partly else ""
    return (
        f"[stopped after {GREP_SECONDS:g} s: searched {files}{also}; "
        "narrow the pattern, path or glob]"
    )


@plugin.tool(timeout=GREP_TIMEOUT)
@_refusals_denied
def grep(pattern: str, path: str = ".", glob: str | None = None) -> str:
    """Search file contents with a regular expression (RE2 syntax, close to Python's).

    Prints ``file:line: text`` for each matching line. Binary files, files over
    8 MiB and hidden directories are skipped. Use ``(?i)`` for case-insensitive
    matching. Backreferences and lookaround are not supported (RE2 runs in
    linear time). Output is capped, the search stops after 3 seconds and
    does not go more than 256 directories deep; a marker says when matches
    were left out or files not searched.

    Args:
        pattern: Regular expression to look for.
        path: File or directory (searched recursively) relative to the workspace.
        glob: Only search files matching this glob (``*.py`` matches names,
            ``src/**/*.py`` whole paths).
    """
    deadline = time.monotonic() + GREP_SECONDS
    regex = _compile_grep(pattern)
    ws = _workspace()
    wanted = _path_filter(glob)
    budget = _WalkBudget(deadline)
    st = ws.stat(path)
    files = _walk_files(ws, path, budget) if stat.S_ISDIR(st.st_mode) else iter([path])
    out: list[str] = []
    size = 0
    matches = 0
    read = 0
    skipped: list[str] = []
    searched = 0
    truncated = False
    stopped = ""
    for file in files:
        if time.monotonic() > deadline:  # before the filter: it costs path times pattern
            stopped = _out_of_time(searched, None)
            break
        if not wanted(file):
            continue
        if read >= MAX_GREP_BYTES:
            stopped = f"[stopped after reading {MAX_GREP_BYTES} bytes; narrow the path or glob]"
            break
        try:
            data = ws.read_bytes(file, max_bytes=MAX_FILE_BYTES)
        except SandboxError:
            skipped.append(file)
            continue
        except OSError:
            continue
        read += len(data)
        if _looks_binary(data):
            continue
        try:
            for number, raw in _matching_lines(regex, data, deadline):
                matches += 1
                if matches >= MAX_GREP_MATCHES:
                    stopped = f"[stopped counting at {MAX_GREP_MATCHES} matching lines]"
                    break
                if truncated:
                    continue
                line = raw.decode("utf-8", errors="replace")
                entry = f"{file}:{number}: {_clip_line(line, MAX_GREP_LINE_CHARS)}"
                if size + len(entry) + 1 > MAX_GREP_CHARS:
                    truncated = True
                    continue
                out.append(entry)
                size += len(entry) + 1
        except _OutOfTime as exc:
            stopped = _out_of_time(searched, f"{file} up to line {exc.line}")
        if stopped:
            break
        searched += 1
    if budget.out_of_time and not stopped:
        stopped = _out_of_time(searched, None)
    if truncated:
        of = f"at least {matches}" if stopped else str(matches)
        out.append(
            f"[output truncated: showed {len(out)} of {of} matching lines; "
            "narrow the pattern, path or glob]"
        )
    if skipped:
        out.append(f"[skipped {len(skipped)} files over {MAX_FILE_BYTES} bytes: {skipped[:5]}]")
    out.extend(budget.notes("path"))
    if stopped:
        out.append(stopped)
    if matches == 0:
        out.insert(0, f"no matches for {pattern!r} in {path}")
    return "\n".join(out)
