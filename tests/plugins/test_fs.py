"""The ``fs`` built-in plugin against real files in a temporary workspace."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from builtin_kit import run_calls, tool_context

from kernel.tools import ToolFailure
from plugins import fs


@pytest.fixture
def ws(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "ws"
    root.mkdir()
    with tool_context(root):
        yield root


# --- read_file ---------------------------------------------------------------------


def test_read_file_numbers_lines_and_picks_ranges(ws: Path) -> None:
    (ws / "a.txt").write_text("".join(f"line {n}\n" for n in range(1, 11)))
    assert fs.read_file.fn("a.txt").splitlines()[0] == "     1\tline 1"
    assert fs.read_file.fn("a.txt", start_line=3, end_line=4) == "     3\tline 3\n     4\tline 4"
    assert fs.read_file.fn("a.txt", start_line=9).splitlines() == [
        "     9\tline 9",
        "    10\tline 10",
    ]
    with pytest.raises(ValueError, match=r"start_line 11 is past the end of a.txt \(10 lines\)"):
        fs.read_file.fn("a.txt", start_line=11)
    with pytest.raises(ValueError, match="end_line 2 is before start_line 5"):
        fs.read_file.fn("a.txt", start_line=5, end_line=2)
    (ws / "empty.txt").write_text("")
    assert fs.read_file.fn("empty.txt") == "(empty.txt is empty)"


def test_read_file_caps_what_it_shows_and_says_where_to_continue(ws: Path) -> None:
    (ws / "big.txt").write_text("".join(f"{n}\n" for n in range(1, 5001)))
    out = fs.read_file.fn("big.txt")
    assert out.count("\n") == fs.MAX_READ_LINES
    assert out.endswith("[showed lines 1-2000 of 5000; continue with start_line=2001]")
    (ws / "long.txt").write_text("x" * 5000 + "\n")
    assert "[line cut: 3000 more characters]" in fs.read_file.fn("long.txt")


def test_read_file_refuses_binary_with_a_preview(ws: Path) -> None:
    (ws / "blob.bin").write_bytes(b"\x89PNG\x00\x01\x02" * 10)
    with pytest.raises(ValueError, match=r"blob.bin looks binary .* First bytes: 89 50 4e 47 00"):
        fs.read_file.fn("blob.bin")


def test_read_file_names_a_missing_file(ws: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"^nope.txt: no such file or directory$"):
        fs.read_file.fn("nope.txt")


# --- escapes -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("../secret.txt", "resolves outside the workspace"),
        ("/etc/passwd", "absolute paths are refused"),
        ("link/secret.txt", "resolves outside the workspace"),
        ("file-link", "resolves outside the workspace"),
    ],
)
def test_escapes_are_denied(ws: Path, path: str, message: str) -> None:
    outside = ws.parent / "secret.txt"
    outside.write_text("top secret\n")
    (ws / "link").symlink_to(ws.parent)
    (ws / "file-link").symlink_to(outside)
    for call in (
        lambda: fs.read_file.fn(path),
        lambda: fs.write_file.fn(path + "/x" if path == "link" else path, "pwned"),
        lambda: fs.edit_file.fn(path, "top", "pwned"),
        lambda: fs.grep.fn("secret", path),
    ):
        with pytest.raises(ToolFailure, match=message) as info:
            call()
        assert info.value.kind == "denied"
    assert outside.read_text() == "top secret\n"


def test_write_file_through_a_symlinked_directory_is_denied(ws: Path) -> None:
    (ws / "out").symlink_to(ws.parent)
    with pytest.raises(ToolFailure, match="resolves outside the workspace"):
        fs.write_file.fn("out/planted.txt", "x")
    assert not (ws.parent / "planted.txt").exists()


def test_list_dir_outside_is_denied(ws: Path) -> None:
    with pytest.raises(ToolFailure, match="resolves outside"):
        fs.list_dir.fn("..")
    with pytest.raises(ValueError, match=r"contains '..'"):
        fs.glob.fn("../*")
    with pytest.raises(ValueError, match="is absolute"):
        fs.glob.fn("/etc/*")


# --- write_file and edit_file ------------------------------------------------------


def test_write_file_creates_parents_and_replaces(ws: Path) -> None:
    assert fs.write_file.fn("a/b/c.txt", "one\ntwo\n") == "created a/b/c.txt: 8 bytes, 2 lines"
    assert (ws / "a/b/c.txt").read_text() == "one\ntwo\n"
    assert fs.write_file.fn("a/b/c.txt", "x") == "replaced a/b/c.txt: 1 bytes, 1 lines"
    assert (ws / "a/b/c.txt").read_text() == "x"
    with pytest.raises(IsADirectoryError, match=r"^a: is a directory$"):
        fs.write_file.fn("a", "x")


def test_edit_file_replaces_one_exact_occurrence(ws: Path) -> None:
    (ws / "m.py").write_text("def f():\n    return 1\n\ndef g():\n    return 2\n")
    out = fs.edit_file.fn("m.py", "    return 2\n", "    return 3\n    # done\n")
    assert out == "edited m.py: replaced 1 occurrence; the new text is at lines 5-6"
    assert (
        ws / "m.py"
    ).read_text() == "def f():\n    return 1\n\ndef g():\n    return 3\n    # done\n"


def test_edit_file_not_unique_gives_each_line(ws: Path) -> None:
    (ws / "m.py").write_text("x = 1\ny = 2\nx = 1\n\nx = 1\n")
    with pytest.raises(ValueError, match=r"occurs 3 times in m.py, starting at lines 1, 3, 5"):
        fs.edit_file.fn("m.py", "x = 1", "x = 9")
    assert (ws / "m.py").read_text() == "x = 1\ny = 2\nx = 1\n\nx = 1\n"


def test_edit_file_not_unique_names_the_first_lines_and_counts_the_rest(ws: Path) -> None:
    (ws / "m.txt").write_text("x\n\n" * 60 + "xx")
    with pytest.raises(ValueError) as info:
        fs.edit_file.fn("m.txt", "x", "y")
    lines = ", ".join(str(n) for n in range(1, 100, 2))
    assert str(info.value).startswith(
        f"old text occurs 62 times in m.txt, starting at lines {lines} and 12 more;"
    )


def test_edit_file_missing_shows_the_closest_region(ws: Path) -> None:
    body = "import os\n\n\ndef main():\n    print('hello world')\n    return 0\n\n\nx = 1\n"
    (ws / "m.py").write_text(body)
    with pytest.raises(ValueError) as info:
        fs.edit_file.fn("m.py", "def main():\n  print('hello world')\n", "")
    message = str(info.value)
    assert message.startswith("old text not found in m.py. The closest region")
    assert "lines 4-5:\n     4\tdef main():\n     5\t    print('hello world')" in message
    with pytest.raises(ValueError, match="nothing in the file resembles it"):
        fs.edit_file.fn("m.py", "zzzzqqqq", "")
    with pytest.raises(ValueError, match="old is empty"):
        fs.edit_file.fn("m.py", "", "x")


# --- list_dir, glob, grep ----------------------------------------------------------


def _tree(ws: Path) -> None:
    for path, text in {
        "README.md": "hello\n",
        "src/app.py": "import os\nTODO = 1\n",
        "src/pkg/util.py": "def todo():\n    pass  # TODO later\n",
        "src/pkg/data.json": '{"todo": true}\n',
        ".git/config": "TODO hidden\n",
        "docs/guide.md": "# Guide\nTODO: write\n",
    }.items():
        (ws / path).parent.mkdir(parents=True, exist_ok=True)
        (ws / path).write_text(text)
    (ws / "src/blob.bin").write_bytes(b"TODO\x00\x00")


def test_list_dir_marks_kinds(ws: Path) -> None:
    _tree(ws)
    (ws / "ln").symlink_to("README.md")
    assert fs.list_dir.fn() == ".git/\nREADME.md  6 bytes\ndocs/\nln@\nsrc/"
    assert fs.list_dir.fn("src/pkg") == "data.json  15 bytes\nutil.py  35 bytes"
    (ws / "empty").mkdir()
    assert fs.list_dir.fn("empty") == "(empty is empty)"
    with pytest.raises(NotADirectoryError, match=r"README.md: not a directory"):
        fs.list_dir.fn("README.md")


def test_glob_with_double_star_and_hidden_directories(ws: Path) -> None:
    _tree(ws)
    assert fs.glob.fn("**/*.py") == "src/app.py\nsrc/pkg/util.py"
    assert fs.glob.fn("src/*") == "src/app.py\nsrc/blob.bin\nsrc/pkg"
    assert fs.glob.fn("src/**") == (
        "src/app.py\nsrc/blob.bin\nsrc/pkg\nsrc/pkg/data.json\nsrc/pkg/util.py"
    )
    assert fs.glob.fn("*") == "README.md\ndocs\nsrc"
    assert fs.glob.fn(".git/*") == ".git/config"
    assert fs.glob.fn("**/*.rs") == "no paths match '**/*.rs'"


def test_glob_does_not_walk_out_through_a_symlink(ws: Path) -> None:
    (ws.parent / "outside.py").write_text("x\n")
    (ws / "up").symlink_to(ws.parent)
    (ws / "in.py").write_text("x\n")
    assert fs.glob.fn("**/*.py") == "in.py"
    assert fs.glob.fn("up/*.py") == "no paths match 'up/*.py'"


def test_grep_regex_with_glob_and_skips(ws: Path) -> None:
    _tree(ws)
    assert fs.grep.fn("TODO") == (
        "docs/guide.md:2: TODO: write\nsrc/app.py:2: TODO = 1\nsrc/pkg/util.py:2:     pass  # TODO later"
    )
    assert fs.grep.fn("(?i)todo", glob="*.json") == 'src/pkg/data.json:1: {"todo": true}'
    assert fs.grep.fn(r"^def \w+", path="src/pkg/util.py") == "src/pkg/util.py:1: def todo():"
    assert fs.grep.fn("TODO", path=".git") == ".git/config:1: TODO hidden"
    assert fs.grep.fn("TODO", glob="src/**/*.py") == (
        "src/app.py:2: TODO = 1\nsrc/pkg/util.py:2:     pass  # TODO later"
    )
    assert fs.grep.fn("nothing here") == "no matches for 'nothing here' in ."
    with pytest.raises(ValueError, match="invalid regular expression '\\(': missing \\)"):
        fs.grep.fn("(")


def test_grep_caps_its_output_with_a_marker(ws: Path) -> None:
    (ws / "many.txt").write_text("match " + "x" * 90 + "\n" * 1 + ("match\n" * 20_000))
    out = fs.grep.fn("match")
    assert len(out) < fs.MAX_GREP_CHARS + 200
    assert out.endswith("of 20001 matching lines; narrow the pattern, path or glob]")


def test_grep_reports_a_line_longer_than_its_window_once(
    ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fs, "GREP_WINDOW_BYTES", 8)
    # Line 1 matches in its first and second window; nothing of line 4 may be skipped.
    (ws / "long.txt").write_text("ab345678ab345678\n\n\nab\nzzzzzzzzzzzzzzzzzzab")
    assert fs.grep.fn("ab", path="long.txt") == (
        "long.txt:1: ab345678\nlong.txt:4: ab\nlong.txt:5: zzab"
    )
    (ws / "edge.txt").write_text("1234567x" + "abcdefgh\nx")
    assert fs.grep.fn("x|a", path="edge.txt") == "edge.txt:1: 1234567x\nedge.txt:2: x"


def test_grep_shrinks_its_window_for_a_big_program() -> None:
    assert fs._grep_window(fs._compile_grep("TODO")) == fs.GREP_WINDOW_BYTES
    slow = fs._compile_grep(r"[ab]*a[ab]{999}c")
    assert 1000 < fs._grep_window(slow) * slow.programsize <= fs.GREP_WINDOW_COST
    with pytest.raises(ValueError, match=r"is too complex: it compiles to \d+ instructions"):
        fs.grep.fn("|".join(rf"(?i)\w*[a-z]\w{{{999 - i}}}\d" for i in range(40)))


def test_grep_stops_at_its_time_budget_and_says_how_far_it_got(
    ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert 0 < fs.GREP_SECONDS < fs.GREP_TIMEOUT
    [grep] = [t for t in fs.plugin.tools if t.name == "grep"]
    assert grep.timeout == fs.GREP_TIMEOUT
    monkeypatch.setattr(fs, "GREP_SECONDS", 0.2)
    (ws / "a.txt").write_text("needle\n")
    # On random a/b lines the DFA of this pattern blows up: RE2's NFA takes ~2 us a byte.
    rng = random.Random(0)
    (ws / "b.txt").write_text(
        "".join("".join(rng.choices("ab", k=1000)) + "\n" for _ in range(1000))
    )
    out = fs.grep.fn(r"[ab]*a[ab]{999}c|needle")
    first, last = out.splitlines()
    assert first == "a.txt:1: needle"
    assert last.startswith("[stopped after 0.2 s: searched 1 file and b.txt up to line ")
    assert last.endswith("; narrow the pattern, path or glob]")
    monkeypatch.setattr(fs, "GREP_SECONDS", 0.0)
    assert fs.grep.fn("needle") == (
        "no matches for 'needle' in .\n"
        "[stopped after 0 s: searched 0 files; narrow the pattern, path or glob]"
    )


def _chain(root: Path, depth: int, leaf: str) -> None:
    here = root
    for _ in range(depth):
        here = here / "d"
        (here / "empty").mkdir(parents=True)
    (here / leaf).write_text("needle\n")


def test_walks_do_not_enter_directories_too_deep_and_say_so(
    ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fs, "MAX_WALK_DEPTH", 3)
    _chain(ws, 3, "in.py")
    _chain(ws / "d" / "d" / "d", 1, "out.py")
    marker = "[did not enter directories more than 3 levels below the workspace root]"
    assert fs.glob.fn("**/*.py") == f"d/d/d/in.py\n{marker}"
    assert fs.grep.fn("needle") == f"d/d/d/in.py:1: needle\n{marker}"
    # Counted from the workspace root, not from where the walk starts.
    assert fs.grep.fn("needle", path="d/d") == f"d/d/d/in.py:1: needle\n{marker}"
    assert fs.grep.fn("needle", path="d/d/d/d/out.py") == "d/d/d/d/out.py:1: needle"


class _SlowClock:
    """``fs``'s ``time``: every reading is a second later than the one before."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 1.0
        return self.now


def test_walks_look_at_their_clock_for_each_directory(
    ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tools = {t.name: t for t in fs.plugin.tools}
    assert tools["glob"].timeout == fs.GLOB_TIMEOUT
    assert 0 < fs.GLOB_SECONDS < fs.GLOB_TIMEOUT
    _chain(ws, 5, "a.txt")
    monkeypatch.setattr(fs, "GLOB_SECONDS", 2.5)
    monkeypatch.setattr(fs, "GREP_SECONDS", 2.5)
    # Directories only, or a filter nothing matches: no file is read, yet the walk
    # reads the clock before each directory (the start, then ".", "d", "d/d": stop).
    monkeypatch.setattr(fs, "time", _SlowClock())
    assert fs.glob.fn("**/*.py") == (
        "no paths match '**/*.py'\n[stopped after 2.5 s: visited 3 entries; narrow the pattern]"
    )
    monkeypatch.setattr(fs, "time", _SlowClock())
    assert fs.grep.fn("needle", glob="*.py") == (
        "no matches for 'needle' in .\n"
        "[stopped after 2.5 s: searched 0 files; narrow the pattern, path or glob]"
    )


# --- through the executor ----------------------------------------------------------


async def test_fs_tools_through_the_executor(ws: Path) -> None:
    (ws / "a.txt").write_text("alpha\nbeta\n")
    (ws.parent / "outside.txt").write_text("secret\n")
    observations = await run_calls(
        fs.plugin,
        [
            ("read_file", {"path": "a.txt", "start_line": 2}),
            ("write_file", {"path": "new/b.txt", "content": "gamma\n"}),
            ("read_file", {"path": "../outside.txt"}),
            ("edit_file", {"path": "a.txt", "old": "delta", "new": "x"}),
            ("grep", {"pattern": "^b", "path": "a.txt"}),
            ("read_file", {"path": "a.txt", "start_line": "2"}),
        ],
    )
    read, write, escape, edit, grep, bad = observations
    assert read.content == "     2\tbeta"
    assert write.content == "created new/b.txt: 6 bytes, 1 lines"
    assert escape.error is not None and escape.error.kind == "denied"
    assert escape.content == (
        "Error (denied): '../outside.txt' resolves outside the workspace; refused"
    )
    assert edit.error is not None and edit.error.kind == "exception"
    assert edit.content.startswith("Error (exception): old text not found in a.txt.")
    assert grep.content == "a.txt:2: beta"
    assert bad.error is not None and bad.error.kind == "bad_arguments"
    [listing] = await run_calls(fs.plugin, [("list_dir", {})])
    assert listing.content == "a.txt  11 bytes\nnew/"


def test_fs_runs_in_process_with_write_access() -> None:
    assert fs.plugin.in_process
    assert fs.plugin.permissions.workspace == "write"
    assert [t.name for t in fs.plugin.tools] == [
        "read_file",
        "write_file",
        "edit_file",
        "list_dir",
        "glob",
        "grep",
    ]
    assert os.path.basename(fs.__file__) == "fs.py"
