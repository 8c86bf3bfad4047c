"""Confined paths on the kernel side: ``Workspace`` resolves beneath one directory fd."""

from __future__ import annotations

import errno
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sandbox_kit import Canary

from kernel.errors import SandboxError
from sandbox import Entry, Workspace, openat2_available
from sandbox import _workspace as workspace_module
from sandbox._workspace import _WALK_EVERY

# Every behaviour is checked with openat2 and with the O_NOFOLLOW walk, and with a
# workspace opened on first use (``lazy``, what a worker's tools get).
RESOLVERS = [
    pytest.param((True, False), id="openat2"),
    pytest.param((False, False), id="walk"),
    pytest.param((True, True), id="openat2-lazy"),
]


@pytest.fixture(params=RESOLVERS)
def ws(request: pytest.FixtureRequest, workspace: Path) -> Iterator[Workspace]:
    use_openat2, lazy = request.param
    if use_openat2 and not openat2_available():
        pytest.skip("no openat2 here")
    with Workspace(workspace, use_openat2=use_openat2, lazy=lazy) as w:
        yield w


def test_openat2_is_used_here() -> None:
    # This machine (Linux 6.18) has openat2: the default resolver must be it.
    assert openat2_available()


def test_read_write_round_trip(ws: Workspace, workspace: Path) -> None:
    ws.mkdir("notes")
    ws.write_text("notes/a.txt", "one\ntwo\nthree\n")
    assert (workspace / "notes" / "a.txt").read_text() == "one\ntwo\nthree\n"
    assert ws.read_text("notes/a.txt") == "one\ntwo\nthree\n"
    assert ws.read_text("notes/a.txt", start_line=2, end_line=2) == "two\n"
    assert ws.read_text("notes/a.txt", start_line=3) == "three\n"
    assert ws.read_bytes("./notes//a.txt") == b"one\ntwo\nthree\n"


def test_write_replaces_atomically_and_keeps_the_mode(ws: Workspace, workspace: Path) -> None:
    ws.write_text("f.txt", "old")
    os.chmod(workspace / "f.txt", 0o600)
    inode = os.stat(workspace / "f.txt").st_ino
    ws.write_text("f.txt", "new")
    st = os.stat(workspace / "f.txt")
    assert (workspace / "f.txt").read_text() == "new"
    assert st.st_ino != inode  # a new file renamed over the old one
    assert st.st_mode & 0o777 == 0o600
    assert sorted(os.listdir(workspace)) == ["f.txt"]  # no temporary file left


def test_append_creates_then_appends(ws: Workspace, workspace: Path) -> None:
    ws.append("log.txt", "a")
    ws.append("log.txt", b"b")
    assert (workspace / "log.txt").read_text() == "ab"


def test_list_stat_mkdir_remove_rename(ws: Workspace, workspace: Path) -> None:
    ws.mkdir("d/e/f", parents=True)
    ws.mkdir("d", exist_ok=True)
    with pytest.raises(FileExistsError):
        ws.mkdir("d")
    ws.write_bytes("d/x.bin", b"12345")
    (workspace / "d" / "ln").symlink_to("x.bin")
    assert ws.list("d") == [
        Entry("e", "dir", ws.stat("d/e").st_size),
        Entry("ln", "symlink", len("x.bin")),
        Entry("x.bin", "file", 5),
    ]
    if ws.uses_openat2:
        assert ws.stat("d/ln").st_size == 5
    else:
        with pytest.raises(SandboxError, match="symbolic link"):
            ws.stat("d/ln")
    assert ws.stat("d/ln", follow_symlinks=False).st_size == len("x.bin")
    ws.rename("d/x.bin", "y.bin")
    assert (workspace / "y.bin").read_bytes() == b"12345"
    ws.write_bytes("z.bin", b"z")
    with pytest.raises(FileExistsError):
        ws.rename("y.bin", "z.bin")
    ws.rename("y.bin", "z.bin", overwrite=True)
    assert (workspace / "z.bin").read_bytes() == b"12345"
    ws.remove("d/ln")
    ws.remove("d/e/f")
    assert not (workspace / "d" / "e" / "f").exists()
    with pytest.raises(FileNotFoundError):
        ws.remove("nothing")
    assert not ws.exists("nothing")


def test_missing_file_names_the_workspace_path(ws: Workspace) -> None:
    with pytest.raises(FileNotFoundError) as info:
        ws.read_text("no/such.txt")
    assert info.value.filename == "no/such.txt"


@pytest.mark.parametrize(
    "path",
    [
        "../canary.txt",
        "a/../../canary.txt",
        "/etc/passwd",
        "CANARY_ABSOLUTE",
    ],
)
def test_paths_that_leave_are_refused(ws: Workspace, canary: Canary, path: str) -> None:
    (ws.path / "a").mkdir()
    path = str(canary.path) if path == "CANARY_ABSOLUTE" else path
    for attempt in (
        lambda: ws.read_text(path),
        lambda: ws.write_text(path, "pwned"),
        lambda: ws.append(path, "pwned"),
        lambda: ws.stat(path),
        lambda: ws.remove(path),
    ):
        with pytest.raises(SandboxError):
            attempt()
    canary.assert_untouched()


def test_symlinks_that_leave_are_refused(ws: Workspace, canary: Canary, tmp_path: Path) -> None:
    (ws.path / "out").symlink_to(canary.path)
    (ws.path / "dir").symlink_to(tmp_path)
    (ws.path / "proc").symlink_to("/proc/self/root")
    for path in ("out", "dir/canary.txt", f"proc{canary.path}"):
        with pytest.raises(SandboxError, match="refused"):
            ws.read_text(path)
        with pytest.raises(SandboxError, match="refused"):
            ws.append(path, "pwned")
        with pytest.raises(SandboxError, match="refused"):
            ws.write_text(path + "2" if path != "out" else "dir/new.txt", "pwned")
    with pytest.raises(SandboxError):
        ws.rename("out", "dir/stolen")
    assert not (tmp_path / "new.txt").exists()
    canary.assert_untouched()


def test_write_over_a_planted_symlink_replaces_the_link(ws: Workspace, canary: Canary) -> None:
    (ws.path / "out").symlink_to(canary.path)
    ws.write_text("out", "mine")
    assert not (ws.path / "out").is_symlink()
    assert (ws.path / "out").read_text() == "mine"
    canary.assert_untouched()


def test_symlinks_inside_are_followed_with_openat2(workspace: Path) -> None:
    (workspace / "real.txt").write_text("inside")
    (workspace / "alias.txt").symlink_to("real.txt")
    with Workspace(workspace, use_openat2=True) as ws:
        assert ws.read_text("alias.txt") == "inside"
    with Workspace(workspace, use_openat2=False) as ws, pytest.raises(SandboxError):
        ws.read_text("alias.txt")  # the walk refuses every link


def test_fifo_does_not_hang(ws: Workspace) -> None:
    os.mkfifo(ws.path / "pipe")
    with pytest.raises(SandboxError, match="FIFO"):
        ws.read_bytes("pipe")
    with pytest.raises(SandboxError, match="FIFO"):
        ws.append("pipe", "x")
    with pytest.raises(SandboxError, match="FIFO"):
        ws.write_text("pipe", "x")


def test_devices_and_directories_are_not_files(ws: Workspace) -> None:
    (ws.path / "null").symlink_to("/dev/null")
    with pytest.raises(SandboxError):
        ws.read_bytes("null")  # outside, and a device
    ws.mkdir("d")
    with pytest.raises(IsADirectoryError):
        ws.read_bytes("d")


def test_home_and_tilde_mean_nothing(
    ws: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "secret").write_text("home secret")
    monkeypatch.setenv("HOME", str(home))
    for path in ("~/secret", "$HOME/secret", "${HOME}/secret"):
        with pytest.raises(FileNotFoundError):
            ws.read_text(path)
    ws.mkdir("~")
    ws.write_text("~/secret", "inside")
    assert (ws.path / "~" / "secret").read_text() == "inside"
    assert (home / "secret").read_text() == "home secret"


def test_sibling_with_the_workspace_name_as_prefix(ws: Workspace, tmp_path: Path) -> None:
    evil = tmp_path / "ws-evil"
    evil.mkdir()
    (evil / "secret.txt").write_text("evil")
    for path in ("../ws-evil/secret.txt", str(evil / "secret.txt")):
        with pytest.raises(SandboxError):
            ws.read_text(path)
    (ws.path / "sib").symlink_to(evil)
    with pytest.raises(SandboxError):
        ws.read_text("sib/secret.txt")


def test_bad_path_strings(ws: Workspace) -> None:
    with pytest.raises(SandboxError, match="NUL"):
        ws.read_text("a\x00b")
    with pytest.raises(SandboxError, match="longer than"):
        ws.read_text("a/" * 3000)
    with pytest.raises(SandboxError, match="longer than 255"):
        ws.read_text("x" * 300)
    with pytest.raises(SandboxError, match="strings"):
        ws.read_text(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(SandboxError, match="does not name"):
        ws.remove("..")


def test_size_caps(workspace: Path) -> None:
    with Workspace(workspace, max_read=10, max_write=10) as ws:
        ws.write_bytes("ten", b"0123456789")
        assert ws.read_bytes("ten") == b"0123456789"
        with pytest.raises(SandboxError, match="cap"):
            ws.write_bytes("eleven", b"0" * 11)
        with pytest.raises(SandboxError, match="cap"):
            ws.append("ten", b"!")
        (workspace / "big").write_bytes(b"0" * 11)
        with pytest.raises(SandboxError, match="11 bytes"):
            ws.read_bytes("big")
        assert ws.read_bytes("big", max_bytes=11) == b"0" * 11


def test_a_missing_workspace_is_a_sandbox_error(tmp_path: Path) -> None:
    with pytest.raises(SandboxError, match="cannot open workspace"):
        Workspace(tmp_path / "missing")
    lazy = Workspace(tmp_path / "missing", lazy=True)  # nothing opened yet
    with pytest.raises(SandboxError, match="cannot open workspace"):
        lazy.read_text("a")


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_lazy_workspace_opens_on_first_use_and_behaves_like_the_eager_one(
    workspace: Path,
) -> None:
    before = _open_fds()
    lazy = Workspace(workspace, lazy=True, protected=(".tak",), max_bytes=1 << 20)
    assert _open_fds() == before  # no descriptor until a method needs one
    assert not (workspace / ".tak").exists()
    lazy.write_text("a.txt", "hello")
    assert len(_open_fds() - before) == 1
    with Workspace(workspace, protected=(".tak",), max_bytes=1 << 20) as eager:
        for w in (lazy, eager):
            assert w.read_text("a.txt") == "hello"
            assert [e.name for e in w.list(".") if e.name == "a.txt"] == ["a.txt"]
            with pytest.raises(SandboxError, match="read-only to tools"):
                w.write_text(".tak/x", "no")
            with pytest.raises(SandboxError):
                w.read_text("../outside")
        assert lazy.usage() == eager.usage()
    lazy.close()
    assert _open_fds() == before
    Workspace(workspace, lazy=True).close()  # closing one never opened opens nothing
    assert _open_fds() == before


def test_symlink_swapped_between_check_and_use(ws: Workspace, canary: Canary, stress: bool) -> None:
    """A thread flips a name between a file inside and a link to the canary, as fast as it can."""
    name = ws.path / "flip"
    staging = ws.path / "flip.tmp"
    stop = threading.Event()

    def flipper() -> None:
        while not stop.is_set():
            staging.write_text("inside")
            os.replace(staging, name)  # atomic: the name always exists
            staging.symlink_to(canary.path)
            os.replace(staging, name)

    name.write_text("inside")
    thread = threading.Thread(target=flipper)
    thread.start()
    outcomes = {"inside": 0, "refused": 0}
    rounds = 20_000 if stress else 2_000
    deadline = time.monotonic() + 20
    try:
        # At least `rounds` reads, and on until both outcomes were seen: the race is on.
        while rounds > 0 or 0 in outcomes.values():
            rounds -= 1
            assert time.monotonic() < deadline, outcomes
            try:
                text = ws.read_text("flip")
            except SandboxError:
                outcomes["refused"] += 1
            else:
                assert text == "inside"
                outcomes["inside"] += 1
            try:
                ws.append("flip", "")
            except SandboxError:
                pass
    finally:
        stop.set()
        thread.join()
    canary.assert_untouched()


def _count_walks(monkeypatch: pytest.MonkeyPatch, ws: Workspace, free: list[int]) -> list[int]:
    """Count ``ws``'s walks (in the list's one item) and make ``free[0]`` its file
    system's free space, as the test says (other processes share /tmp)."""
    walks = [0]
    measure = ws._measure

    def counted() -> tuple[int, int]:
        walks[0] += 1
        return measure()

    monkeypatch.setattr(ws, "_measure", counted)
    monkeypatch.setattr(ws, "free_bytes", lambda: free[0])
    return walks


def test_settling_usage_walks_only_when_the_budget_could_be_passed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A workspace whose walk is dear (every walk counts as slower than CHEAP_WALK_S)."""
    monkeypatch.setattr(workspace_module, "CHEAP_WALK_S", 1e-12)
    (tmp_path / "a").write_bytes(b"x" * 10_000)
    # The file system's free space, as the test says (other processes share /tmp).
    free = [10_000_000_000]
    with Workspace(tmp_path, max_bytes=1_000_000) as ws:
        walks = _count_walks(monkeypatch, ws, free)
        first = ws.usage()
        assert walks == [1]
        # Someone else (a worker) writes a little: the free-space bound settles it.
        free[0] -= 8192
        assert ws.settle_usage() == first + 8192
        assert walks == [1]
        # A write that could pass the budget is measured for real, even when it
        # happened between calls rather than during one.
        (tmp_path / "c").write_bytes(b"z" * 2_000_000)
        free[0] -= 2_000_000
        ws.settle_usage()
        assert walks == [2]
        assert ws.usage() > 1_000_000
        (tmp_path / "c").unlink()
        free[0] += 2_000_000
        ws.refresh_usage()
        # However small the writes, the tree is walked again every _WALK_EVERY settles.
        for _ in range(_WALK_EVERY):
            free[0] -= 1
            ws.settle_usage()
        assert walks == [4]


def test_growth_hidden_by_space_freed_elsewhere_is_found_at_the_next_settle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The flake a loaded machine showed: a worker's call wrote past the budget while
    another process freed as much on the same file system, so the free-space bound
    saw nothing. A cheap walk is made at every settle once the file system changed."""
    # Every walk counts as cheap: on a loaded machine even this one's CPU time passed
    # CHEAP_WALK_S, which spaces walks out (test_settling_usage_walks_only_... covers that).
    monkeypatch.setattr(workspace_module, "CHEAP_WALK_S", 60.0)
    (tmp_path / "a").write_bytes(b"x" * 10_000)
    free = [10_000_000_000]
    with Workspace(tmp_path, max_bytes=100_000) as ws:
        walks = _count_walks(monkeypatch, ws, free)
        ws.usage()
        assert walks == [1]
        # Nothing changed on the file system: the warm path makes no walk.
        ws.settle_usage()
        assert walks == [1]
        # 300 kB written in the workspace, 400 kB freed elsewhere at the same time.
        (tmp_path / "big").write_bytes(b"x" * 300_000)
        free[0] += 100_000
        assert ws.settle_usage() > 100_000
        assert walks == [2]
        assert ws.over_budget() is not None


def test_a_directory_moving_during_the_usage_walk_is_not_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a" / "hidden").mkdir(parents=True)
    (tmp_path / "a" / "hidden" / "data").write_bytes(b"x" * 100_000)
    with Workspace(tmp_path, max_bytes=1_000_000) as ws:
        real_open = os.open

        def moving_open(path: str, flags: int, *args: object, **kwargs: object) -> int:
            if path == "hidden":  # it was listed; now it is elsewhere
                raise FileNotFoundError(2, "No such file or directory", path)
            return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "open", moving_open)
        with pytest.raises(SandboxError, match="kept changing"):
            ws.refresh_usage()


def test_a_write_that_fills_the_disk_leaves_the_old_file_and_no_leftovers(
    tmp_path: Path,
) -> None:
    """A really full disk (a 128 KiB tmpfs): the atomic replace fails, nothing is damaged."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "small"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(disk)], check=True)
    try:
        with Workspace(disk) as ws:
            ws.write_text("notes.md", "kept\n")
            with pytest.raises(OSError) as refused:
                ws.write_bytes("notes.md", b"x" * 400_000)
            assert refused.value.errno == errno.ENOSPC
            assert ws.read_text("notes.md") == "kept\n"
            assert sorted(os.listdir(disk)) == ["notes.md"]  # no temporary file left
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def test_a_lazy_workspace_protects_from_its_first_write(workspace: Path) -> None:
    with Workspace(workspace, lazy=True, protected=(".tak",)) as lazy:
        with pytest.raises(SandboxError, match="read-only to tools"):
            lazy.write_text(".tak/first", "no")
    assert not (workspace / ".tak" / "first").exists()
