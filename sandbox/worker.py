"""A plugin worker: ``python -I -m sandbox.worker FD``.

``FD`` is this process's end of the pool's socket pair. The worker confines
itself (see ``sandbox._confine`` for the steps, in order), only then imports
the plugin, says which tools it serves, and answers calls concurrently: each
call runs in its own thread (an ``async`` tool gets its own ``trio.run``
there), and replies go back in completion order, tagged with the call's id.

The plugin is a module name, a ``.py`` path or a package directory, with an
optional ``:attribute`` (the entry-point form ``module:plugin``). The worker
serves that attribute's ``Plugin``, else the module's ``plugin``, else its only
``Plugin``; modules without one keep the older forms (``TOOLS``, or every
``Tool`` attribute).

Each call runs inside ``kernel.context()``: the workspace (a confined
``Workspace``), the session key and the plugin's config, both sent by the
kernel in the call frame, and a logger whose records travel to the kernel's
log as ``log`` frames. A tool that fails with ``EPERM``/``EACCES`` gets a
``denied`` result naming the permission its plugin lacks; the worker tells
which from the last sensitive operation the tool's thread attempted (Python
audit events: sockets, programs, file writes).

A plugin with network permission resolves names and connects through the
kernel (``sandbox._netbroker``, installed before the plugin is imported): the
worker itself has no resolver files and may not call ``connect``.

It exits when the kernel closes the channel, and takes its process group
(any programs its tools started) with it.
"""

from __future__ import annotations

import errno
import functools
import importlib
import importlib.util
import logging
import os
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kernel.errors import SandboxError
from kernel.messages import converter
from kernel.plugin import Plugin, ToolContext, use_context
from kernel.tools import ArgumentError, Tool, ToolFailure, describe_exception

from . import _netbroker, _protocol
from ._confine import IPC_FD, WorkerConfig, close_stray_fds, confine

if TYPE_CHECKING:
    from ._workspace import Workspace

#: Directories the kernel asks the worker to append to ``sys.path`` (``:``-separated):
#: where a plugin given as a module object lives when it is not installed.
PLUGIN_PATH_ENV = "TAK_PLUGIN_PATH"


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
        self.send_frame(_protocol.encode(message, _protocol.FROM_WORKER))


def split_target(target: str) -> tuple[str, str | None]:
    """``"pkg.mod:plugin"`` -> ``("pkg.mod", "plugin")``; no attribute -> ``(target, None)``."""
    module, sep, attribute = target.rpartition(":")
    if sep and module and attribute.isidentifier():
        return module, attribute
    return target, None


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


def find_plugin(module: ModuleType, attribute: str | None, label: str) -> Plugin | None:
    """The module's ``Plugin``: ``attribute``, else ``plugin``, else the only one.

    Raises:
        SandboxError: ``attribute`` is missing or not a ``Plugin``, or the module
            holds several plugins and none is named ``plugin``.
    """
    if attribute is not None:
        found = getattr(module, attribute, None)
        if not isinstance(found, Plugin):
            raise SandboxError(f"plugin {label}: {attribute!r} is {found!r}, not a Plugin")
        return found
    named = getattr(module, "plugin", None)
    if isinstance(named, Plugin):
        return named
    plugins = [v for v in vars(module).values() if isinstance(v, Plugin)]
    if len(plugins) > 1:
        names = ", ".join(p.name for p in plugins)
        raise SandboxError(
            f"plugin {label} holds several plugins ({names}); name one as 'module:attribute'"
        )
    return plugins[0] if plugins else None


def load_plugin(target: str) -> tuple[Plugin | None, list[Tool]]:
    """The plugin a target names and the tools to serve.

    A module with a ``Plugin`` serves ``plugin.tools``; one without serves its
    ``TOOLS`` list, else its ``Tool`` attributes (and the plugin is ``None``).

    Raises:
        SandboxError: no tools, something in ``TOOLS`` that is not a Tool, or two
            tools with one name.
    """
    name, attribute = split_target(target)
    module = _import_plugin(name)
    plugin = find_plugin(module, attribute, target)
    found: Sequence[Any] | None
    if plugin is not None:
        found = plugin.tools
    else:
        found = getattr(module, "TOOLS", None)
        if found is None:
            found = [value for value in vars(module).values() if isinstance(value, Tool)]
    tools: list[Tool] = []
    names: set[str] = set()
    for item in found:
        if not isinstance(item, Tool):
            raise SandboxError(f"plugin {target}: TOOLS holds {item!r}, which is not a Tool")
        if item.name in names:
            raise SandboxError(f"plugin {target}: two tools are named {item.name!r}")
        if item.fn is None:
            raise SandboxError(f"plugin {target}: tool {item.name!r} has no function")
        names.add(item.name)
        tools.append(item)
    if not tools:
        raise SandboxError(f"plugin {target} defines no tools")
    return plugin, tools


def load_tools(plugin: str) -> list[Tool]:
    """The tools a plugin target offers (see ``load_plugin``)."""
    return load_plugin(plugin)[1]


def plugin_info(plugin: Plugin) -> dict[str, Any]:
    """What the kernel learns about a plugin from its worker's greeting."""
    return {
        "name": plugin.name,
        "version": plugin.version,
        "description": plugin.description,
        "permissions": {
            "workspace": plugin.permissions.workspace,
            "network": list(plugin.permissions.network),
            "subprocess": plugin.permissions.subprocess,
        },
        "in_process": plugin.in_process,
    }


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


#: The longest error message a result carries (an exception's text can be anything).
_MAX_ERROR_TEXT = 64 * 1024


def _error(call_id: Any, kind: str, type_: str, message: str) -> dict[str, Any]:
    if len(message) > _MAX_ERROR_TEXT:
        message = f"{message[:_MAX_ERROR_TEXT]} [... cut at {_MAX_ERROR_TEXT} characters]"
    return {
        "type": "result",
        "id": call_id,
        "ok": False,
        "error": {"kind": kind, "type": type_[:200], "message": message},
    }


def _reply(message: dict[str, Any]) -> bytes:
    """A frame the kernel accepts (``FROM_WORKER``).

    Raises:
        FrameError: too large or too complex for the kernel.
    """
    return _protocol.encode(message, _protocol.FROM_WORKER)


def _run_async(fn: Any, kwargs: dict[str, Any]) -> Any:
    import trio  # only plugins with async tools pay for it

    return trio.run(functools.partial(fn, **kwargs))


# --- denials -----------------------------------------------------------------------

_NETWORK_EVENTS = frozenset(
    {"socket.__new__", "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"}
)
_SUBPROCESS_EVENTS = frozenset(
    {
        "subprocess.Popen",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "os.system",
        "pty.spawn",
    }
)
_WRITE_EVENTS = frozenset(
    {
        "os.remove",
        "os.rename",
        "os.mkdir",
        "os.rmdir",
        "os.truncate",
        "os.symlink",
        "os.link",
        "shutil.rmtree",
        "shutil.move",
    }
)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_DENIED_ERRNOS = frozenset({errno.EPERM, errno.EACCES})


class _Attempts:
    """The last sensitive operation each thread attempted, from Python audit events.

    Only consulted after a tool failed with EPERM/EACCES, to say which permission
    it lacked; the sandbox itself (seccomp, Landlock) is what refuses.
    """

    def __init__(self) -> None:
        self._local = threading.local()
        self.latest: tuple[str, str] | None = None

    def install(self) -> None:
        sys.addaudithook(self._hook)

    def clear(self) -> None:
        self._local.last = None

    def last(self) -> tuple[str, str] | None:
        mine: tuple[str, str] | None = getattr(self._local, "last", None)
        # An async tool's blocking work may run in one of trio's threads.
        return mine if mine is not None else self.latest

    def _hook(self, event: str, args: tuple[Any, ...]) -> None:
        attempt: tuple[str, str] | None = None
        if event in _NETWORK_EVENTS:
            target = args[1] if len(args) > 1 and event != "socket.__new__" else None
            attempt = ("network", f"{event.partition('.')[2]} {target!r}" if target else event)
        elif event in _SUBPROCESS_EVENTS:
            program = args[0] if args else ""
            if isinstance(program, (list, tuple)):
                program = program[0] if program else ""
            attempt = ("subprocess", f"running {os.fsdecode(program) if program else 'a program'}")
        elif event in _WRITE_EVENTS:
            path = args[0] if args else ""
            attempt = ("write", _path_text(path))
        elif event == "open" and len(args) >= 3:
            path, mode, flags = args[0], args[1], args[2]
            if isinstance(path, int):
                return
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                mode is None and isinstance(flags, int) and flags & _WRITE_FLAGS
            )
            attempt = ("write" if writes else "read", _path_text(path))
        if attempt is not None:
            self._local.last = attempt
            self.latest = attempt


def _path_text(path: Any) -> str:
    try:
        return os.fsdecode(path)
    except TypeError:
        return repr(path)


def _permission_error(exc: BaseException) -> OSError | None:
    """The EPERM/EACCES behind ``exc``: itself, its cause or context, or a group leaf."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _DENIED_ERRNOS:
            return current
        if isinstance(current, BaseExceptionGroup):
            todo.extend(current.exceptions)
        for linked in (current.__cause__, current.__context__):
            if linked is not None:
                todo.append(linked)
    return None


def _inside(workspace: str, path: str) -> bool:
    # Relative paths are inside: the worker's cwd is the workspace.
    full = os.path.normpath(os.path.join(workspace, path))
    return full == workspace or full.startswith(workspace.rstrip(os.sep) + os.sep)


def denial_message(config: WorkerConfig, attempt: tuple[str, str] | None, error: OSError) -> str:
    """Why the sandbox refused, naming the permission the plugin would need."""
    reason = error.strerror or str(error)
    declared = "declare it in Plugin(permissions=...)"
    if attempt is None:
        return f"the sandbox refused an operation ({reason}); the plugin may lack a permission"
    category, what = attempt
    if category == "network":
        if not config.network:
            return f"{what}: needs permission network ({declared}, e.g. ['host:443'])"
        ports = ", ".join(str(p) for p in config.tcp_ports)
        return (
            f"{what}: refused ({reason}); the plugin may connect only to the declared "
            f"network ports ({ports}): add the host:port to its network permission"
        )
    if category == "subprocess":
        if not config.subprocess:
            return f"{what}: needs permission subprocess ({declared}, subprocess=True)"
        return (
            f"{what}: refused ({reason}); programs may run only from the system's bin directories"
        )
    if not _inside(config.workspace, what):
        return (
            f"{'writing' if category == 'write' else 'reading'} {what}: refused ({reason}); "
            "it is outside the workspace, which no permission grants"
        )
    if category == "write" and config.workspace_access != "write":
        return f"writing {what}: needs permission workspace: write ({declared})"
    return f"{what}: refused by the sandbox ({reason})"


# --- calls -------------------------------------------------------------------------


class _LogFrames(logging.Handler):
    """Sends a plugin's log records to the kernel, which logs them as ``tak.plugin.<name>``."""

    def __init__(self, channel: _Channel) -> None:
        super().__init__(logging.DEBUG)
        self._channel = channel

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            self._channel.send_frame(_protocol.encode_log(record.levelno, text))
        except Exception:
            self.handleError(record)


def _workspace_on_demand(path: str) -> Workspace:
    """A ``Workspace`` that opens its directory on first use.

    A worker whose tools never touch ``context().workspace`` holds no descriptor
    beyond stdio and its channel (the sandbox tests check exactly that).
    """
    from pathlib import Path

    from ._workspace import Workspace, openat2_available

    class OnDemandWorkspace(Workspace):
        def __init__(self) -> None:  # the parent's __init__ would open the directory now
            self.path = Path(os.path.abspath(path))
            self.max_read = 16 * 1024 * 1024
            self.max_write = 64 * 1024 * 1024
            self._lock = threading.Lock()
            self._opened: int | None = None

        @property
        def _fd(self) -> int:
            with self._lock:
                if self._opened is None:
                    try:
                        self._opened = os.open(
                            self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
                        )
                    except OSError as exc:
                        raise SandboxError(
                            f"cannot open workspace {self.path}: {exc.strerror}"
                        ) from exc
                return self._opened

        @_fd.setter
        def _fd(self, value: int) -> None:
            self._opened = value

        @property
        def _openat2(self) -> bool:
            return openat2_available()

        @_openat2.setter
        def _openat2(self, value: bool) -> None:
            raise AttributeError("decided by the machine")

    return OnDemandWorkspace()


class _Server:
    """What every call shares: the tools, the channel, the context's parts."""

    def __init__(
        self,
        channel: _Channel,
        config: WorkerConfig,
        tools: dict[str, Tool],
        plugin_name: str,
        attempts: _Attempts,
    ) -> None:
        self.channel = channel
        self.config = config
        self.tools = tools
        self.attempts = attempts
        self.logger = logging.getLogger(f"tak.plugin.{plugin_name}")
        self.logger.setLevel(logging.DEBUG)
        self.logger.propagate = False
        self.logger.addHandler(_LogFrames(channel))
        self.workspace = _workspace_on_demand(config.workspace)

    def context(self, message: Mapping[str, Any]) -> ToolContext:
        session = message.get("session")
        config = message.get("config")
        return ToolContext(
            workspace=self.workspace,
            session=session if isinstance(session, str) else None,
            logger=self.logger,
            config=config if isinstance(config, dict) else {},
        )

    def result_frame(self, message: dict[str, Any]) -> bytes:
        call_id = message.get("id")
        name = message.get("tool")
        tool = self.tools.get(name) if isinstance(name, str) else None
        if tool is None:
            reply = _error(call_id, "unknown_tool", "UnknownTool", f"no tool named {name!r}")
            return _reply(reply)
        self.attempts.clear()
        try:
            arguments = message.get("arguments")
            if not isinstance(arguments, dict):
                raise ArgumentError("$: arguments must be a JSON object")
            kwargs = tool.validate(arguments)
            assert tool.fn is not None
            with use_context(self.context(message)):
                result = _run_async(tool.fn, kwargs) if tool.is_async else tool.fn(**kwargs)
        except ToolFailure as exc:
            return _reply(_error(call_id, exc.kind, exc.type, exc.message))
        except ArgumentError as exc:
            return _reply(_error(call_id, "bad_arguments", "ArgumentError", str(exc)))
        except BaseException as exc:  # a tool's SystemExit ends its call, not the worker
            denied = _permission_error(exc)
            if denied is not None:
                text = denial_message(self.config, self.attempts.last(), denied)
                return _reply(_error(call_id, "denied", type(denied).__name__, text))
            text = describe_exception(exc)
            if isinstance(exc, OSError) and exc.errno == errno.EFBIG:
                # RLIMIT_FSIZE: Python ignores SIGXFSZ, so the write fails and we live.
                size = self.config.limits.get("file_size_bytes")
                text += f" (the worker's file size limit is {size} bytes)"
            return _reply(_error(call_id, "exception", type(exc).__name__, text))
        return _value_frame(call_id, tool, result)


def _value_frame(call_id: Any, tool: Tool, result: Any) -> bytes:
    try:
        if isinstance(result, bytes):
            value: Any = result.decode("utf-8", errors="replace")
        elif isinstance(result, str):
            value = result
        else:
            value = converter.unstructure(result)
        return _reply({"type": "result", "id": call_id, "ok": True, "value": value})
    except _protocol.FrameError as exc:
        return _reply(_error(call_id, "output_too_large", "OutputTooLarge", f"{tool.name}: {exc}"))
    except (TypeError, ValueError, RecursionError) as exc:
        return _reply(
            _error(
                call_id,
                "exception",
                type(exc).__name__,
                f"{tool.name} returned a {type(result).__name__} that cannot be "
                f"serialized to JSON: {exc}",
            )
        )


def _serve_call(server: _Server, message: dict[str, Any]) -> None:
    frame = server.result_frame(message)
    try:
        server.channel.send_frame(frame)
    except OSError:
        pass  # the kernel is gone; the main thread will notice


def serve(server: _Server) -> None:
    """Answer calls until the kernel closes the channel."""
    channel = server.channel
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
                args=(server, message),
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


def _extend_path(config: WorkerConfig) -> None:
    # Appended, not prepended: an installed module of the same name still wins,
    # and nothing in the directory can shadow the standard library.
    for entry in config.env.get(PLUGIN_PATH_ENV, "").split(os.pathsep):
        if entry and entry not in sys.path:
            sys.path.append(entry)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or not args[0].isdigit():
        print("usage: python -I -m sandbox.worker FD", file=sys.stderr)
        return 2
    close_stray_fds(int(args[0]))
    ipc = socket.socket(fileno=IPC_FD)
    channel = _Channel(ipc)
    try:
        first = channel.receive()
        config = WorkerConfig.from_json(first)
        # With network, the kernel sends the broker channel right after the configuration.
        broker = _netbroker.receive_channel(ipc) if config.network else None
    except (EOFError, OSError, _protocol.FrameError, TypeError) as exc:
        print(f"sandbox.worker: no usable configuration: {exc!r}", file=sys.stderr)
        return 2
    _extend_path(config)
    module_target, _ = split_target(config.plugin)
    try:
        # Confinement finds the plugin's code by module or path, without the attribute.
        confinement_config = WorkerConfig.from_json({**config.to_json(), "plugin": module_target})
        report = confine(confinement_config)
    except (SandboxError, OSError) as exc:
        channel.send({"type": "fatal", "message": str(exc)})
        return 1
    if broker is not None:
        _netbroker.install(broker)  # before any plugin code: it never resolves or connects
    try:
        plugin, tools = load_plugin(config.plugin)
    except BaseException as exc:
        traceback.print_exc()
        channel.send(
            {
                "type": "fatal",
                "message": f"cannot load plugin {config.plugin}: {type(exc).__name__}: "
                f"{describe_exception(exc)}",
            }
        )
        return 1
    attempts = _Attempts()
    attempts.install()  # after the import: the plugin's own imports are not audited
    label = plugin.name if plugin is not None else split_target(config.plugin)[0]
    channel.send(
        {
            "type": "ready",
            "pid": os.getpid(),
            "tools": [tool_spec(t) for t in tools],
            "plugin": plugin_info(plugin) if plugin is not None else None,
            "confinement": report.to_json(),
        }
    )
    serve(_Server(channel, config, {t.name: t for t in tools}, label, attempts))
    # The kernel closed the channel: end every program the tools started, and this one.
    sys.stderr.flush()
    os.kill(0, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
