"""The pieces under the pool: the seccomp program, Landlock, the frame format, policies,
the public surface, and ``tak doctor``."""

from __future__ import annotations

import ast
import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs
import pytest

import sandbox
from kernel.errors import SandboxError, UsageError
from sandbox import Limits, Policy, _protocol, landlock, probe_isolation, seccomp

FULL = probe_isolation().level == "full"
needs_full = pytest.mark.skipif(not FULL, reason="needs Landlock ABI 6+ and seccomp")


def run_confined(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-I", "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


# -- seccomp ---------------------------------------------------------------


def test_the_filter_checks_the_architecture_first() -> None:
    program = seccomp.build_filter(seccomp.SeccompPolicy())
    first = [struct.unpack("=HBBI", program[i : i + 8]) for i in range(0, 24, 8)]
    assert first[0] == (0x20, 0, 0, 4)  # load seccomp_data.arch
    assert first[1] == (0x15, 1, 0, 0xC000003E)  # x86-64, else fall through to...
    assert first[2] == (0x06, 0, 0, seccomp.RET_KILL_PROCESS)  # ...kill


def test_the_filter_depends_on_the_policy() -> None:
    programs = {
        seccomp.build_filter(seccomp.SeccompPolicy(network=n, subprocess=s))
        for n in (False, True)
        for s in (False, True)
    }
    assert len(programs) == 4


@needs_full
def test_network_and_subprocess_policies_in_a_real_process() -> None:
    result = run_confined(
        """
        import json, os, socket
        from sandbox import _syscalls, seccomp
        _syscalls.prctl(_syscalls.PR_SET_NO_NEW_PRIVS, 1)
        seccomp.install(seccomp.SeccompPolicy(network=True, subprocess=True))
        def attempt(fn):
            try:
                fn()
                return "allowed"
            except OSError as exc:
                return exc.errno
        def fork():
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
        libc = __import__("ctypes").CDLL(None, use_errno=True)
        print(json.dumps({
            "inet": attempt(lambda: socket.socket().close()),
            "unix": attempt(lambda: socket.socket(socket.AF_UNIX).close()),
            "pair": attempt(lambda: [s.close() for s in socket.socketpair()]),
            "fork": attempt(fork),
            "setsid": attempt(os.setsid),
            "userns": libc.unshare(0x10000000),
        }))
        """
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "inet": "allowed",
        "unix": 1,  # EPERM: a pathname socket could reach outside the workspace
        "pair": "allowed",
        "fork": "allowed",
        "setsid": 1,
        "userns": -1,
    }


# -- Landlock --------------------------------------------------------------


def test_landlock_rights_per_abi() -> None:
    assert landlock.handled_fs_rights(0) == 0
    assert landlock.handled_fs_rights(1) == (1 << 13) - 1
    assert landlock.handled_fs_rights(3) & landlock.TRUNCATE
    assert not landlock.handled_fs_rights(4) & landlock.IOCTL_DEV
    assert landlock.handled_fs_rights(7) == (1 << 16) - 1
    # A workspace never gets device creation.
    assert not landlock.READ_WRITE & (landlock.MAKE_CHAR | landlock.MAKE_BLOCK)


@needs_full
def test_landlock_abi_here() -> None:
    assert landlock.abi_version() >= 6


def test_a_ruleset_that_is_not_enforced_is_not_reported(tmp_path: Path) -> None:
    # This process is not confined: the check must notice that the directory is readable.
    with pytest.raises(SandboxError, match="not enforced"):
        landlock._check_enforced(str(tmp_path))


@needs_full
def test_landlock_in_a_real_process(tmp_path: Path) -> None:
    (tmp_path / "inside").mkdir()
    (tmp_path / "outside.txt").write_text("secret")
    result = run_confined(
        """
        import sys
        from sandbox import _syscalls, landlock
        _syscalls.prctl(_syscalls.PR_SET_NO_NEW_PRIVS, 1)
        rules = [landlock.PathRule(p, landlock.READ) for p in
                 {sys.base_prefix, sys.prefix, "/usr/lib", "/lib", "/lib64"}]
        rules.append(landlock.PathRule(sys.argv[1] + "/inside", landlock.READ_WRITE))
        print(landlock.restrict_self(rules))
        open(sys.argv[1] + "/inside/new.txt", "w").write("ok")
        try:
            open(sys.argv[1] + "/outside.txt").read()
        except PermissionError:
            print("outside denied")
        """,
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    assert "outside denied" in result.stdout
    assert "network=True, scoped=True" in result.stdout
    assert (tmp_path / "inside" / "new.txt").read_text() == "ok"


# -- frames ----------------------------------------------------------------


def test_frames_round_trip_and_refuse_what_breaks_the_protocol() -> None:
    frame = _protocol.encode({"type": "call", "id": 1, "text": "héllo"})
    assert _protocol.body_length(frame[:4]) == len(frame) - 4
    assert _protocol.decode(frame[4:]) == {"type": "call", "id": 1, "text": "héllo"}
    with pytest.raises(_protocol.WorkerFrameError, match="limit"):
        _protocol.body_length(struct.pack("!I", _protocol.MAX_FRAME + 1))
    for body in (b"not json", b"[1, 2]", b'{"no": "type"}', b"\xff"):
        with pytest.raises(_protocol.WorkerFrameError):
            _protocol.decode(body)
    with pytest.raises(ValueError):
        _protocol.encode({"type": "x", "value": float("nan")})


def test_the_greeting_and_every_frame_round_trip_as_records() -> None:
    spec = _protocol.ToolSpec(
        name="read",
        description="Read a file.",
        parameters={"type": "object", "properties": {"path": {"type": "string"}}},
        is_async=True,
        timeout=2.5,
        exclusive=True,
        max_output=100,
    )
    frames: list[object] = [
        _protocol.ReadyFrame(
            pid=42,
            tools=[spec],
            confinement=sandbox.Confinement(
                landlock="ABI 6", unconfined=["seccomp is not available"]
            ),
            plugin={"name": "fs", "version": "1.0"},
        ),
        _protocol.FatalFrame(message="cannot load plugin x"),
        _protocol.ResultFrame(id=3, ok=True, value={"a": [1, "b", None]}),
        _protocol.ResultFrame(
            id=4, ok=False, error=_protocol.CallError(kind="denied", type="E", message="no")
        ),
        _protocol.LogFrame(level=20, message="hello"),
    ]
    for frame in frames:
        encoded = _protocol.encode_frame(frame, _protocol.FROM_WORKER)
        message = _protocol.decode(encoded[_protocol.HEADER.size :], _protocol.FROM_WORKER)
        assert _protocol.structure_frame(message, _protocol.FromWorker) == frame
    call = _protocol.CallFrame(id=1, tool="read", arguments={"path": "a"}, session="p/s")
    message = _protocol.decode(_protocol.encode_frame(call)[_protocol.HEADER.size :])
    assert message["type"] == "call"
    assert _protocol.structure_frame(message, _protocol.CallFrame) == call
    config = sandbox.WorkerConfig(plugin="pkg:plugin", workspace="/w", path=["/p"], limits={"a": 1})
    assert sandbox.WorkerConfig.from_json(config.to_json()) == config


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (
            {"type": "ready", "pid": 1, "confinement": {}, "tools": [{"name": 7}]},
            r"^malformed ready frame: \$\.tools\[0\]\.name: .*expected str",
        ),
        ({"type": "ready", "pid": "1", "tools": [], "confinement": {}}, r"\$\.pid: "),
        ({"type": "result", "id": True, "ok": True}, r"\$\.id: "),
        ({"type": "result", "id": 1, "ok": False}, "without an error object"),
        ({"type": "log", "level": 20, "message": "x", "pad": 1}, "extra fields found"),
        ({"type": "log", "level": 20}, r"\$\.message: required field missing"),
        ({"type": "call", "id": 1, "tool": "t", "arguments": {}}, r"\$\.type: unexpected"),
        ({"type": "shutdown"}, r"\$\.type: unexpected frame type 'shutdown'"),
    ],
)
def test_a_bad_frame_is_one_line_naming_the_field(message: dict[str, object], error: str) -> None:
    with pytest.raises(_protocol.WorkerFrameError, match=error) as info:
        _protocol.structure_frame(message, _protocol.FromWorker)
    assert "\n" not in str(info.value)


def test_a_bad_config_frame_names_the_field() -> None:
    config = sandbox.WorkerConfig(plugin="p", workspace="/w").to_json()
    with pytest.raises(_protocol.WorkerFrameError, match=r"\$\.tcp_ports\[0\]: "):
        sandbox.WorkerConfig.from_json({**config, "tcp_ports": ["443"]})
    with pytest.raises(_protocol.WorkerFrameError, match=r"\$\.type: expected a config frame"):
        sandbox.WorkerConfig.from_json({**config, "type": "call"})


# -- policies --------------------------------------------------------------


def test_policy_validation() -> None:
    assert Policy(network=["example.org:443", "*:80", "a:443"]).tcp_ports == (80, 443)
    for bad in (["example.org"], ["x:0"], ["x:70000"], [":80"]):
        with pytest.raises(UsageError, match="host:port"):
            Policy(network=bad)
    with pytest.raises(UsageError, match="'read' or 'write'"):
        Policy(workspace="everything")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="positive"):
        Limits(memory_bytes=0)


def test_missing_isolation_is_explained() -> None:
    support = attrs.evolve(probe_isolation(), landlock_abi=0, seccomp=False, process_limit="none")
    assert support.level == "none"
    reasons = support.missing(Policy(subprocess=True))
    assert [r.split()[0] for r in reasons] == ["Landlock", "seccomp", "no"]
    assert support.missing(Policy()) == reasons[:2]
    partial = attrs.evolve(probe_isolation(), landlock_abi=3, seccomp=True, openat2=True)
    assert partial.level == "partial"
    assert any("signals" in gap for gap in partial.gaps())


# -- the public surface and its cost ----------------------------------------


def test_public_surface() -> None:
    assert sorted(sandbox.__all__) == sorted(
        [
            "Workspace",
            "Entry",
            "openat2_available",
            "DEFAULT_MAX_BYTES",
            "DEFAULT_MAX_FILES",
            "DiskWatch",
            "measure_budget",
            "check_workspace_overlap",
            "escape_log_text",
            "Policy",
            "Limits",
            "WorkspaceAccess",
            "check_workspace_access",
            "check_network",
            "IsolationSupport",
            "probe_isolation",
            "selftest",
            "open_worker_pool",
            "WorkerPool",
            "Worker",
            "WorkerCallError",
            "ToolSpec",
            "CallFrame",
            "CallError",
            "ResultFrame",
            "ReadyFrame",
            "FatalFrame",
            "LogFrame",
            "WorkerFrameError",
            "WorkerConfig",
            "Confinement",
        ]
    )
    for name in sandbox.__all__:
        assert getattr(sandbox, name) is not None


def test_the_sandbox_imports_nothing_of_the_project_but_kernel_errors_terminal_checks() -> None:
    # The mechanism floor: no plugin, tool or record of the kernel's (docs/sandbox.md);
    # kernel.terminal (floor 0, imports nothing) holds the escape table the log text shares,
    # kernel._checks (floor 0, imports only kernel.errors) the one rule for a positive count.
    root = Path(sandbox.__file__).parent
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.partition(".")[0]
                assert top not in ("plugins", "kernel") or name in (
                    "kernel.errors",
                    "kernel.terminal",
                    "kernel._checks",
                ), f"{path.name} imports {name}"


def test_importing_sandbox_and_the_worker_stays_light() -> None:
    result = run_confined(
        """
        import sys
        import sandbox, sandbox.worker, plugins._worker
        heavy = sorted(m for m in ("trio", "httpx", "kernel.agent", "kernel.wire",
                                   "kernel.executor") if m in sys.modules)
        print(heavy)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_worker_needs_its_channel() -> None:
    result = subprocess.run(
        [sys.executable, "-I", "-m", "plugins._worker"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "usage: python -I -m plugins._worker FD" in result.stderr


# -- tak doctor -------------------------------------------------------------


def run_doctor(*argv: str) -> int:
    from kernel.cli import build_parser  # tak's own options (--home) with the command's

    args = build_parser().parse_args(["doctor", *argv])
    code: int = args.func(args)
    return code


@needs_full
def test_doctor_reports_full_isolation_here(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_doctor() == 0
    out = capsys.readouterr().out
    assert f"ABI {landlock.abi_version()}" in out
    assert "isolation      full" in out
    assert "read /etc/passwd          denied" in out
    assert "create a setuid file      denied" in out
    assert "write in .tak/            denied" in out  # CI runs as root: a mount namespace
    assert "openat2        available" in out


def test_doctor_fails_without_landlock(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = attrs.evolve(probe_isolation(), landlock_abi=0)
    monkeypatch.setattr(sandbox, "probe_isolation", lambda: missing)
    assert run_doctor("--json") == 1
    data = json.loads(capsys.readouterr().out)
    assert data["level"] == "none"
    assert data["refused_because"] == ["Landlock is not available in this kernel"]
    assert "selftest" not in data
