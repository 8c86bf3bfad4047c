"""A plugin worker: ``python -I -m sandbox.worker FD``.

``FD`` is this process's end of the pool's socket pair. The worker confines
itself (see ``sandbox._confine`` for the steps, in order), only then imports
the plugin, says which tools it serves, and answers calls concurrently: each
call runs in its own thread (an ``async`` tool gets its own ``trio.run``
there), and replies go back in completion order, tagged with the call's id.

It exits when the kernel closes the channel, and takes its process group
(any programs its tools started) with it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from kernel.errors import SandboxError
from kernel.messages import converter
from kernel.tools import ArgumentError, Tool, ToolFailure

from . import _protocol
from ._confine import IPC_FD, WorkerConfig, close_stray_fds, confine


class _Channel:
    """Blocking frames over the IPC socket; sends from many threads are serialized."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._send_lock = threading.Lock()

    def receive(self) -> dict[str, Any]:
        """The next message.

        Raises:
            EOFError: the kernel closed the channel.
            FrameError: the frame broke the protocol.
        """
        length = _protocol.body_length(self._exactly(_protocol.HEADER.size))
        return _protocol.decode(self._exactly(length))

    def _exactly(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self._sock.recv(min(n - len(buf), 1 << 20))
            if not chunk:
                raise EOFError
            buf += chunk
        return bytes(buf)

    def send_frame(self, frame: bytes) -> None:
        with self._send_lock:
            self._sock.sendall(frame)

    def send(self, message: dict[str, Any]) -> None:
        self.send_frame(_protocol.encode(message))


def _import_plugin(plugin: str) -> ModuleType:
    if plugin.endswith(".py") or os.sep in plugin:
        path = os.path.abspath(plugin)
        stem = os.path.splitext(os.path.basename(path.rstrip(os.sep)))[0]
        name = f"tak_plugin_{stem}"
        if os.path.isdir(path):
            spec = importlib.util.spec_from_file_location(
                name, os.path.join(path, "__init__.py"), submodule_search_locations=[path]
            )
        else:
            spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load a plugin from {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(plugin)


def load_tools(plugin: str) -> list[Tool]:
    """The tools a plugin module offers: its ``TOOLS`` list, else its ``Tool`` attributes.

    Raises:
        SandboxError: no tools, something in ``TOOLS`` that is not a Tool, or two
            tools with one name.
    """
    module = _import_plugin(plugin)
    found: Sequence[Any] | None = getattr(module, "TOOLS", None)
    if found is None:
        found = [value for value in vars(module).values() if isinstance(value, Tool)]
    tools: list[Tool] = []
    names: set[str] = set()
    for item in found:
        if not isinstance(item, Tool):
            raise SandboxError(f"plugin {plugin}: TOOLS holds {item!r}, which is not a Tool")
        if item.name in names:
            raise SandboxError(f"plugin {plugin}: two tools are named {item.name!r}")
        if item.fn is None:
            raise SandboxError(f"plugin {plugin}: tool {item.name!r} has no function")
        names.add(item.name)
        tools.append(item)
    if not tools:
        raise SandboxError(f"plugin {plugin} defines no tools")
    return tools


def tool_spec(tool: Tool) -> dict[str, Any]:
    return {
        "name": tool.name,
        "description": tool.description,
        "parameters": tool.parameters,
        "is_async": tool.is_async,
        "timeout": tool.timeout,
        "exclusive": tool.exclusive,
        "max_output": tool.max_output,
    }


def _describe(exc: BaseException) -> str:
    """As the executor words it: one line per leaf of an exception group."""
    if isinstance(exc, BaseExceptionGroup):
        leaves = [f"{type(e).__name__}: {_describe(e)}" for e in exc.exceptions]
        return f"{exc.message} ({len(exc.exceptions)} sub-exceptions): " + "; ".join(leaves)
    return str(exc) or type(exc).__name__


def _error(call_id: Any, kind: str, type_: str, message: str) -> dict[str, Any]:
    return {
        "type": "result",
        "id": call_id,
        "ok": False,
        "error": {"kind": kind, "type": type_, "message": message},
    }


def _run_async(fn: Any, kwargs: dict[str, Any]) -> Any:
    import trio  # only plugins with async tools pay for it

    return trio.run(functools.partial(fn, **kwargs))


def _result_frame(tools: dict[str, Tool], message: dict[str, Any]) -> bytes:
    call_id = message.get("id")
    name = message.get("tool")
    tool = tools.get(name) if isinstance(name, str) else None
    if tool is None:
        reply = _error(call_id, "unknown_tool", "UnknownTool", f"no tool named {name!r}")
        return _protocol.encode(reply)
    try:
        arguments = message.get("arguments")
        if not isinstance(arguments, dict):
            raise ArgumentError("$: arguments must be a JSON object")
        kwargs = tool.validate(arguments)
        assert tool.fn is not None
        result = _run_async(tool.fn, kwargs) if tool.is_async else tool.fn(**kwargs)
    except ToolFailure as exc:
        return _protocol.encode(_error(call_id, exc.kind, exc.type, exc.message))
    except ArgumentError as exc:
        return _protocol.encode(_error(call_id, "bad_arguments", "ArgumentError", str(exc)))
    except BaseException as exc:  # a tool's SystemExit ends its call, not the worker
        return _protocol.encode(_error(call_id, "exception", type(exc).__name__, _describe(exc)))
    try:
        if isinstance(result, bytes):
            value: Any = result.decode("utf-8", errors="replace")
        elif isinstance(result, str):
            value = result
        else:
            value = converter.unstructure(result)
        return _protocol.encode({"type": "result", "id": call_id, "ok": True, "value": value})
    except _protocol.FrameError as exc:
        return _protocol.encode(
            _error(call_id, "output_too_large", "OutputTooLarge", f"{tool.name}: {exc}")
        )
    except (TypeError, ValueError, RecursionError) as exc:
        return _protocol.encode(
            _error(
                call_id,
                "exception",
                type(exc).__name__,
                f"{tool.name} returned a {type(result).__name__} that cannot be "
                f"serialized to JSON: {exc}",
            )
        )


def _serve_call(channel: _Channel, tools: dict[str, Tool], message: dict[str, Any]) -> None:
    frame = _result_frame(tools, message)
    try:
        channel.send_frame(frame)
    except OSError:
        pass  # the kernel is gone; the main thread will notice


def serve(channel: _Channel, tools: dict[str, Tool]) -> None:
    """Answer calls until the kernel closes the channel."""
    while True:
        try:
            message = channel.receive()
        except (EOFError, OSError, _protocol.FrameError):
            return
        if message["type"] != "call":
            continue
        try:
            threading.Thread(
                target=_serve_call,
                args=(channel, tools, message),
                name=f"call-{message.get('id')}",
                daemon=True,
            ).start()
        except RuntimeError as exc:  # out of tasks (its process limit) or memory
            reply = _error(
                message.get("id"), "exception", "RuntimeError", f"the worker is exhausted: {exc}"
            )
            try:
                channel.send(reply)
            except OSError:
                return


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or not args[0].isdigit():
        print("usage: python -I -m sandbox.worker FD", file=sys.stderr)
        return 2
    close_stray_fds(int(args[0]))
    channel = _Channel(socket.socket(fileno=IPC_FD))
    try:
        first = channel.receive()
        config = WorkerConfig.from_json(first)
    except (EOFError, OSError, _protocol.FrameError, TypeError) as exc:
        print(f"sandbox.worker: no usable configuration: {exc!r}", file=sys.stderr)
        return 2
    try:
        report = confine(config)
    except (SandboxError, OSError) as exc:
        channel.send({"type": "fatal", "message": str(exc)})
        return 1
    try:
        tools = load_tools(config.plugin)
    except BaseException as exc:
        traceback.print_exc()
        channel.send(
            {
                "type": "fatal",
                "message": f"cannot load plugin {config.plugin}: {type(exc).__name__}: "
                f"{_describe(exc)}",
            }
        )
        return 1
    channel.send(
        {
            "type": "ready",
            "pid": os.getpid(),
            "tools": [tool_spec(t) for t in tools],
            "confinement": report.to_json(),
        }
    )
    serve(channel, {t.name: t for t in tools})
    # The kernel closed the channel: end every program the tools started, and this one.
    sys.stderr.flush()
    os.kill(0, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
