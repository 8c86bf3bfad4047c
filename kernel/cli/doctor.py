"""``tak doctor``: what isolation plugins get on this machine.

Prints the Landlock ABI, openat2, seccomp, the capability state, how a
worker's memory is capped (a memory cgroup for its whole process tree, or
``RLIMIT_AS`` per process), how subprocess plugins are held to their process
limit, whether this CPU architecture has a seccomp table, and the isolation level;
then confines a throwaway process for real and shows what it could not do;
then the discovered plugins (entry points, the workspace's ``.tak/plugins``) that
will not load until approved, each with the command that approves it (the one
place besides ``tak plugins ls`` that says so: other commands stay quiet about it).
Exits 1 when plugins that need isolation would be refused here.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..terminal import escape_terminal
from ._common import pasteable, trust_command
from ._exit import one_line_errors


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("doctor", help="report the sandbox isolation plugins get here")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--no-selftest", action="store_true", help="skip confining a test process for real"
    )
    p.add_argument(
        "--workspace", type=Path, help="whose .tak/plugins to check (default: <home>/workspace)"
    )
    p.set_defaults(func=cmd_doctor)


_LANDLOCK_FEATURES = (
    (1, "filesystem"),
    (2, "rename/link across directories"),
    (3, "truncate"),
    (4, "TCP bind/connect"),
    (5, "device ioctl"),
    (6, "signal and abstract-socket scopes"),
)


def report(*, selftest: bool = True) -> dict[str, Any]:
    """The doctor's findings as data (what ``--json`` prints)."""
    from sandbox import Policy, probe_isolation
    from sandbox import selftest as run_selftest

    support = probe_isolation()
    data: dict[str, Any] = {
        "kernel": f"{platform.system()} {platform.release()} {support.arch}",
        "landlock_abi": support.landlock_abi,
        "landlock_features": [
            name for abi, name in _LANDLOCK_FEATURES if support.landlock_abi >= abi
        ],
        "seccomp": support.seccomp,
        "openat2": support.openat2,
        "uid": support.uid,
        "capabilities": support.capabilities,
        "process_limit": support.process_limit,
        "process_limit_mechanism": support.process_mechanism(),
        "memory_limit": support.memory_limit,
        "memory_limit_mechanism": support.memory_mechanism(),
        "cgroup_version": support.cgroup_version,
        "syscall_table": support.syscall_table,
        "level": support.level,
        "gaps": support.gaps(),
        "refused_because": support.missing(Policy()),
    }
    if selftest and support.level != "none":
        data["selftest"] = run_selftest()
    return data


def plugin_approvals(home: str | None, workspace: Path | None) -> list[dict[str, str]]:
    """The discovered plugins that will not load for want of an approval (hashes only:
    nothing is imported), each with the command that approves it; a trust file that
    cannot be read is one entry saying so (then no discovered plugin loads).
    """
    from plugins import TRUST_FILE, TrustError, approval_states, discover_plugins

    from ..home import TakHome

    tak_home = TakHome.locate(home)
    where = str((workspace if workspace is not None else tak_home.workspace).absolute())
    trust_file = tak_home.config / TRUST_FILE
    try:
        states = approval_states(discover_plugins(where), trust_file, where)
    except TrustError as exc:
        return [
            {
                "source": str(trust_file),
                "state": "unreadable",
                "reason": str(exc),
                "trust_command": "",
            }
        ]
    return [
        {
            "source": s.source.label,
            "state": s.state,
            "reason": s.reason,
            "trust_command": trust_command(home, s.approve),
        }
        for s in states
        if s.state != "trusted"
    ]


def _yes(flag: bool, detail: str = "") -> str:
    return ("available" + (f" ({detail})" if detail else "")) if flag else "MISSING"


@one_line_errors("tak doctor")
def cmd_doctor(args: argparse.Namespace) -> int:
    workspace: Path | None = getattr(args, "workspace", None)
    if workspace is not None and not workspace.is_dir():
        raise UsageError(f"--workspace {workspace}: not a directory")
    data = report(selftest=not args.no_selftest)
    selftest: dict[str, str] = data.get("selftest", {})
    escaped = [
        name
        for name, outcome in selftest.items()
        if outcome != "denied" and not outcome.startswith("allowed")
    ]
    code = 1 if data["refused_because"] or escaped or data["level"] == "none" else 0
    data["untrusted_plugins"] = plugin_approvals(args.home, workspace)
    if args.json:
        print(json.dumps(data, indent=2))
        return code
    abi = data["landlock_abi"]
    caps = data["capabilities"]
    who = f"uid {data['uid']}" + (" (root)" if data["uid"] == 0 else "")
    rows = [
        ("kernel", data["kernel"]),
        (
            "landlock",
            f"ABI {abi}: " + ", ".join(data["landlock_features"]) if abi else "MISSING",
        ),
        ("seccomp", _yes(data["seccomp"], "filter built in-process, no library")),
        ("openat2", _yes(data["openat2"], "RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS")),
        (
            "capabilities",
            f"kernel runs as {who} with {caps} capabilities; workers drop every one "
            "(bounding set too) and set no_new_privs",
        ),
        ("memory", data["memory_limit_mechanism"]),
        ("process limit", data["process_limit_mechanism"]),
        (
            "architecture",
            f"{data['kernel'].rpartition(' ')[2]}: seccomp system call table known"
            if data["syscall_table"]
            else f"{data['kernel'].rpartition(' ')[2]}: no seccomp system call table, "
            "workers are refused",
        ),
        ("isolation", data["level"]),
    ]
    width = max(len(name) for name, _ in rows)
    print("tak doctor: sandbox isolation for plugin workers")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    for gap in data["gaps"]:
        print(f"  note: {gap}")
    for reason in data["refused_because"]:
        print(f"  REFUSED: {reason}")
    if selftest:
        print("  self-test (a confined process tried):")
        for name, value in selftest.items():
            print(f"    {name:<24}  {value}")
    for plugin in data["untrusted_plugins"]:
        state = plugin["reason"] or plugin["state"]
        print(escape_terminal(f"  plugin not loaded: {plugin['source']} ({state})"))
        if plugin["state"] != "unreadable":
            print(f"    to trust it: {pasteable(plugin['trust_command'])}")
    if code:
        print("Plugins that need isolation will not run here (unless allow_unsandboxed is set).")
    else:
        print(f"Plugins run confined to their workspace ({data['level']} isolation).")
    return code


__all__ = ["add_commands", "cmd_doctor", "plugin_approvals", "report"]
