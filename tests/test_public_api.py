"""The public surface is what was meant, and `import kernel` stays cheap."""

from __future__ import annotations

import importlib
import subprocess
import sys

import kernel
from tests.modules_kit import is_public, module_names

#: Packages whose modules are not held to ``__all__`` yet (none: every one is).
NOT_YET: tuple[str, ...] = ()

EXPECTED = {
    "ToolCall", "Observation", "ToolError", "Message", "Text", "converter", "ERROR_KINDS",
    "ToolOutput", "Attachment",
    "Tool", "tool", "ToolRegistry", "ToolFailure",
    "run_tool_calls", "CallLimits", "BatchHandle", "CallStarted", "CallFinished", "CallEvent",
    "ordered_observations",
    "Plugin", "Permissions", "ToolContext", "context",
    "Kernel", "open_kernel", "IdleSessions", "Agent", "RunLimits", "TurnFinished", "Session",
    "open_client",
    "KernelError", "UsageError", "TurnRunning", "StoreError", "CorruptTranscript", "SandboxError",
    "ModelAPIError", "ProtocolError",
    "__version__",
}  # fmt: skip


def test_public_names() -> None:
    assert set(kernel.__all__) == EXPECTED
    for name in EXPECTED:
        assert getattr(kernel, name) is not None


def test_the_version_is_the_projects() -> None:
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    assert kernel.__version__ == tomllib.loads(pyproject.read_text())["project"]["version"]


def test_every_public_module_lists_its_public_names() -> None:
    """A public module says what of it is public (``__all__``), and each name is there."""
    checked = [
        name
        for name in module_names()
        if is_public(name) and not any(name == p or name.startswith(p + ".") for p in NOT_YET)
    ]
    assert "kernel.executor" in checked and "sandbox.pool" in checked and "plugins.fs" in checked
    without, missing = [], []
    for name in checked:
        names = getattr(importlib.import_module(name), "__all__", None)
        if names is None:
            without.append(name)
            continue
        missing += [f"{name}.{n}" for n in names if not hasattr(sys.modules[name], n)]
    assert not without, f"no __all__: {', '.join(without)}"
    assert not missing, f"in __all__ but not there: {', '.join(missing)}"


def test_error_kinds_are_exactly_the_designed_ones() -> None:
    assert set(kernel.ERROR_KINDS) == {
        "invalid_call", "unknown_tool", "bad_arguments", "exception", "timeout",
        "cancelled", "crashed", "denied", "output_too_large",
    }  # fmt: skip


def test_import_kernel_is_cheap() -> None:
    code = "import sys, kernel; print(sorted(m for m in ('httpx', 'trio_websocket', 'cattrs', 'trio') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_documented_one_liner_imports() -> None:
    code = "from kernel import run_tool_calls, tool, ToolCall, Observation, CallLimits"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_import_kernel_and_plugins_does_not_import_mcp() -> None:
    # The MCP SDK (tak[mcp]) costs a second or two to import: only a kernel with
    # MCP servers configured loads it, when one starts (plugins/_mcp.py).
    code = (
        "import sys, kernel, plugins, kernel.kernel, kernel.home, kernel.cli; "
        "kernel.open_kernel; plugins.open_plugin_host; plugins.open_mcp_servers; "
        "print(sorted(m for m in sys.modules if m == 'mcp' or m.startswith('mcp.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
