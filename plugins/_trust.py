"""Which third-party plugins the user approved: ``$TAK_HOME/config/trusted-plugins.json``.

A *discovered* plugin (a ``tak.plugins`` entry point, a ``<workspace>/.tak/plugins``
file) is code nobody chose at the command line: a package pulled in as a
dependency, or a file a tool wrote into the workspace. It loads only once the
user ran ``tak plugins trust``, which records three things:

1. the source's identity (``key``): the real path of a workspace file, or the
   entry point's name;
2. the SHA-256 of its source: the file's bytes, or for an entry point every file
   of its top-level package (``__pycache__`` left out), at most ``MAX_FILES``
   files and ``MAX_BYTES`` bytes;
3. the name, permissions and tool names the plugin declared, learnt from a
   least-privileged probe worker (the kernel never imports it).

On every start the host hashes the source again; a different hash ("changed")
or different declared permissions or tools (wider *or* narrower: any change is
a new decision) skip the plugin until it is approved again. The tool names an
approval grants lie in the plugin's own namespace (``plugins._host``, "Names"). A plugin explicitly
named by the user (``tak --plugin PATH``, ``open_plugin_host(plugins=[...])``)
is the user's own choice and needs no record; it still runs only in a worker.

The bytes of a workspace file are read once, hashed, and copied to
``$TAK_HOME/data/plugins/<sha256>/``; the worker imports that copy, never the
workspace file, so a tool that rewrites the file between the hash and the
import changes nothing (the copy lies outside every workspace: the host
refuses a workspace overlapping ``$TAK_HOME/data``). An entry point is
imported from the installed environment, which tools cannot write for the
same reason; one whose files lie inside the workspace is refused.

The trust file lives under ``$TAK_HOME/config``: a file of that name inside a
workspace means nothing. A file that cannot be read as a trust file is an
error that names it; nothing is trusted from it, and ``tak plugins trust``
refuses to overwrite it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import attrs
import cattrs

from kernel.errors import SandboxError, UsageError
from kernel.messages import converter as _messages_converter
from kernel.messages import describe_structure_error
from kernel.plugin import Permissions

from ._discovery import PluginSource
from ._loading import MAX_BYTES as MAX_BYTES
from ._loading import MAX_FILES as MAX_FILES
from ._loading import package_digest, package_files, walk_package

#: The trust file's name, under ``$TAK_HOME/config``.
TRUST_FILE = "trusted-plugins.json"
#: The approvals of stdio MCP servers, under ``$TAK_HOME/config`` (``tak mcp trust``).
MCP_TRUST_FILE = "trusted-mcp-servers.json"
#: The approved copies of workspace plugins, under ``$TAK_HOME/data``.
APPROVED_DIR = "plugins"
#: A workspace plugin file larger than this is not hashed (nor loaded).
MAX_FILE_BYTES = 4 * 1024 * 1024
TRUST_VERSION = 1


class TrustError(UsageError):
    """A plugin cannot be hashed, or the trust file cannot be read or written."""


@attrs.frozen
class TrustedPlugin:
    """One approval.

    Attributes:
        key: ``workspace:<real path>`` or ``entry_point:<name>`` (see ``source_key``).
        name: the plugin's own name, as its probe reported it.
        sha256: the digest of its source when it was approved.
        permissions: what it declared when it was approved.
        tools: the names of its tools when it was approved (as it names them; the
            host registers them bare or as ``NAME.tool``, in its own namespace
            only). ``None`` in an approval recorded before tools were.
    """

    key: str
    name: str
    sha256: str
    permissions: Permissions
    tools: tuple[str, ...] | None = None


@attrs.frozen
class _TrustFile:
    version: int
    plugins: tuple[TrustedPlugin, ...]


@attrs.frozen
class McpPermissions:
    """What a stdio MCP server may do (``McpServerConfig``), as it was approved."""

    workspace: str
    network: tuple[str, ...]
    subprocess: bool
    read: tuple[str, ...]

    def describe(self) -> str:
        parts = [f"workspace {self.workspace}"]
        parts.append("network " + ", ".join(self.network) if self.network else "no network")
        parts.append("subprocess" if self.subprocess else "no subprocess")
        if self.read:
            parts.append("read " + ", ".join(self.read))
        return "; ".join(parts)


@attrs.frozen
class TrustedMcpServer:
    """One approved stdio MCP server (``tak mcp trust NAME``).

    Attributes:
        name: its name in tak.toml.
        command: its program as found on ``PATH`` (absolute).
        executables: the real files that run: the program and its ``#!`` interpreters.
        sha256: the digest of those, of the files its arguments name
            (``sandbox.exec.ProgramFiles.digest``) and of the code it runs from
            elsewhere (``server_code``: a directory, the packages a Python script
            imports, ``LD_PRELOAD``).
        args, cwd: how it is started.
        env_sha256: the digest of its ``env`` (the values may be secrets: not stored).
        permissions: what it may do.
    """

    name: str
    command: str
    executables: tuple[str, ...]
    sha256: str
    args: tuple[str, ...]
    cwd: str | None
    env_sha256: str
    permissions: McpPermissions

    def changes(self, now: TrustedMcpServer) -> list[str]:
        """What differs in ``now`` from this approval, in words ("its program changed")."""
        said = {
            "command": "its command",
            "executables": "its program",
            "sha256": "its program's files",
            "args": "its arguments",
            "cwd": "its cwd",
            "env_sha256": "its env",
            "permissions": "its permissions",
        }
        return [
            f"{words} changed"
            for field, words in said.items()
            if getattr(self, field) != getattr(now, field)
        ]


@attrs.frozen
class _McpTrustFile:
    version: int
    servers: tuple[TrustedMcpServer, ...]


@attrs.frozen
class Digest:
    """A source as hashed now: its key, digest, and (for a file) the bytes hashed."""

    key: str
    sha256: str
    content: bytes | None = None


def _make_converter() -> cattrs.Converter:
    conv = _messages_converter.copy()

    def structure_permissions(value: object, _: type) -> Permissions:
        if not isinstance(value, dict):
            raise TypeError(f"expected an object, got {type(value).__name__}")
        return Permissions.from_mapping(value)

    def unstructure_permissions(value: Permissions) -> dict[str, object]:
        return {
            "workspace": value.workspace,
            "network": list(value.network),
            "subprocess": value.subprocess,
        }

    conv.register_structure_hook(Permissions, structure_permissions)
    conv.register_unstructure_hook(Permissions, unstructure_permissions)
    return conv


_converter = _make_converter()


R = TypeVar("R")


class ApprovalStore(Generic[R]):
    """Approvals of one kind, by key, in one JSON file under ``$TAK_HOME/config``.

    The file is ``{"version": 1, FIELD: [record, ...]}``, read whole and replaced
    atomically under a lock (``approve``, ``revoke``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        file_type: type[Any],
        field: str,
        key: Callable[[R], str],
        what: str,
    ) -> None:
        self.path = Path(path)
        self._file_type = file_type
        self._field = field
        self._key = key
        self._what = what

    def load(self) -> dict[str, R]:
        """Every approval by key (empty when the file does not exist).

        Raises:
            TrustError: the file is unreadable, not JSON, or not a trust file
                (one line naming the file and where it is wrong).
        """
        nothing = f"no {self._what} is trusted"
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise TrustError(f"{self.path}: {exc.strerror}; {nothing}") from None
        try:
            data = _converter.structure(json.loads(raw), self._file_type)
        except Exception as exc:  # not JSON, or JSON of another shape: both mean "damaged"
            why = (
                describe_structure_error(exc)
                if isinstance(exc, cattrs.BaseValidationError)
                else str(exc).splitlines()[0]
            )
            raise TrustError(
                f"{self.path}: not a trust file ({why}); {nothing} until it is fixed or removed"
            ) from None
        if data.version != TRUST_VERSION:
            raise TrustError(
                f"{self.path}: unknown version {data.version} (expected {TRUST_VERSION}); {nothing}"
            )
        return {self._key(r): r for r in getattr(data, self._field)}

    def _save(self, records: dict[str, R]) -> None:
        """Replace the file atomically: temp file, fsync, rename, fsync the directory."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = self._file_type(TRUST_VERSION, tuple(records[k] for k in sorted(records)))
        data = json.dumps(_converter.unstructure(record), indent=2).encode() + b"\n"
        _write_atomically(self.path, data)

    def approve(self, record: R) -> None:
        """Record ``record``, replacing an earlier approval of the same key.

        Raises:
            TrustError: the existing file is unreadable (it is left as it is).
        """
        with self._locked():
            records = self.load()
            records[self._key(record)] = record
            self._save(records)

    def revoke(self, key: str) -> R | None:
        """Forget the approval of ``key``; the one removed, or ``None``.

        Raises:
            TrustError: the existing file is unreadable (it is left as it is).
        """
        with self._locked():
            records = self.load()
            removed = records.pop(key, None)
            if removed is not None:
                self._save(records)
            return removed

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """An exclusive ``flock`` on ``<file>.lock`` around read-change-replace.

        The file itself cannot carry the lock (it is replaced by rename), and two
        ``tak plugins trust``/``untrust`` runs at once must not undo each other.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = self.path.with_name(self.path.name + ".lock")
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


class TrustStore(ApprovalStore[TrustedPlugin]):
    """The approvals in one ``trusted-plugins.json``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(
            path, file_type=_TrustFile, field="plugins", key=lambda p: p.key, what="plugin"
        )


class McpTrustStore(ApprovalStore["TrustedMcpServer"]):
    """The approvals in one ``trusted-mcp-servers.json``, by server name."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(
            path,
            file_type=_McpTrustFile,
            field="servers",
            key=lambda s: s.name,
            what="MCP server",
        )


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


# -- identity and digests ----------------------------------------------------------


def needs_trust(source: PluginSource) -> bool:
    """Discovered plugins need an approval; built-ins and explicit choices do not."""
    return source.kind in ("workspace", "entry_point")


def source_key(source: PluginSource) -> str:
    """What an approval is recorded under.

    A workspace file by its real directory and name (the approval is for that file
    in that project, not for a file of that name anywhere); an entry point by name.
    """
    if source.kind == "entry_point":
        return f"entry_point:{source.name}"
    folder, name = os.path.split(source.target)
    return f"workspace:{os.path.join(os.path.realpath(folder), name)}"


def read_plugin_file(path: str | os.PathLike[str]) -> bytes:
    """A plugin file's bytes, read once through one descriptor; never through a
    symbolic link, never more than ``MAX_FILE_BYTES``.

    Raises:
        TrustError: a link, not a regular file, too big, or unreadable.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise TrustError(f"{path}: cannot read it ({_why(exc)})") from None
    try:
        st = os.fstat(fd)
        if not (st.st_mode & 0o170000 == 0o100000):
            raise TrustError(f"{path}: not a regular file")
        if st.st_size > MAX_FILE_BYTES:
            raise TrustError(f"{path}: {st.st_size} bytes, more than {MAX_FILE_BYTES}")
        chunks = []
        total = 0
        while chunk := os.read(fd, 1 << 20):
            total += len(chunk)
            if total > MAX_FILE_BYTES:
                raise TrustError(f"{path}: more than {MAX_FILE_BYTES} bytes")
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _why(exc: OSError) -> str:
    import errno

    if exc.errno == errno.ELOOP:
        return "it is a symbolic link"
    return exc.strerror or str(exc)


def digest_source(source: PluginSource, workspace: str | os.PathLike[str] | None) -> Digest:
    """Hash a discovered plugin's source as it is now (blocking: run it in a thread).

    Raises:
        TrustError: it cannot be read or hashed, it is too big, or an entry point's
            files lie inside ``workspace`` (where tools could rewrite them).
    """
    key = source_key(source)
    if source.kind != "entry_point":
        return file_digest(source, read_plugin_file(source.target))
    files = _package_files(source.target)
    if workspace is not None:
        ws = os.path.realpath(workspace)
        inside = next(
            (f for _, f in files if os.path.commonpath([ws, os.path.realpath(f)]) == ws), None
        )
        if inside is not None:
            raise TrustError(
                f"{source.label}: its file {inside} lies inside the workspace, where tools "
                "can rewrite it; install it elsewhere"
            )
    try:
        sha256, _ = package_digest(files, source.label)
    except SandboxError as exc:
        raise TrustError(str(exc)) from None
    return Digest(key, sha256)


def file_digest(source: PluginSource, content: bytes) -> Digest:
    """The digest of a plugin file whose bytes were read once, by the caller."""
    return Digest(source_key(source), hashlib.sha256(content).hexdigest(), content)


def _package_files(target: str) -> list[tuple[str, str]]:
    """``(relative name, path)`` of every file of the entry point's top-level package
    (``plugins._loading.package_files``: the worker walks it the same way)."""
    try:
        return package_files(target.partition(":")[0].partition(".")[0])
    except SandboxError as exc:
        raise TrustError(f"entry point {target}: {exc}") from None


def _walk(root: str) -> Iterator[tuple[str, str]]:
    return walk_package(root)


# -- the code an MCP server runs ---------------------------------------------------------

#: Options of ``python`` that take the next argument as their value.
_PYTHON_VALUE_OPTIONS = ("-W", "-X", "--check-hash-based-pycs")
#: Variables whose values name code the program loads.
_CODE_ENV = ("LD_PRELOAD", "PYTHONPATH")


def _is_python(path: str) -> bool:
    name = os.path.basename(path)
    return name.startswith(("python", "pypy")) and name.rstrip("0123456789.").endswith(
        ("python", "pypy")
    )


def server_code(
    argv: Sequence[str],
    executables: Sequence[str],
    prefixes: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: str | None,
) -> list[tuple[str, str]]:
    """``(name, path)`` of the code a stdio server runs beyond its executables and the
    files its arguments name, found without running it:

    - a directory ``python DIR`` runs, every file of it;
    - what a Python script (``python FILE``, ``python DIR``'s ``__main__.py``, a
      console script whose ``#!`` runs Python) imports at top level, and the
      package ``python -m MODULE`` runs: looked up on the script's directory (or
      ``cwd`` for ``-m``), ``PYTHONPATH``, the directories the script adds to
      ``sys.path`` as literals, and the ``site-packages`` of the installation
      prefixes. A package a distribution installed counts as its ``RECORD`` (the
      digest of each of its files, and its version); any other, as all its files;
    - the libraries ``LD_PRELOAD`` names.

    Modules found nowhere there (the standard library, editable installs behind
    a ``.pth`` file) are not followed, nor are imports of imports.

    Raises:
        TrustError: more than ``MAX_FILES`` files.
    """
    base = os.path.abspath(cwd or os.getcwd())
    found: dict[str, str] = {}

    def add(name: str, path: str) -> None:
        found.setdefault(name, path)
        if len(found) > MAX_FILES:
            raise TrustError(
                f"{argv[0]}: more than {MAX_FILES} files of code to hash (its imports)"
            )

    for library in env.get("LD_PRELOAD", "").replace(":", " ").split():
        if os.path.isfile(library):
            add(f"preload:{library}", os.path.realpath(library))
    script: str | None = None
    module: str | None = None
    if executables and _is_python(executables[0]):
        script, module = _python_target(argv[1:])
    elif any(_is_python(e) for e in executables[1:]):
        script = executables[0]  # a console script: `#!.../python`
    if script is None and module is None:
        return sorted(found.items())
    search = [os.path.join(base, p) for p in env.get("PYTHONPATH", "").split(":") if p]
    tops: list[str] = []
    if module is not None:
        search.insert(0, base)
        tops.append(module.partition(".")[0])
    if script is not None:
        script = os.path.realpath(os.path.join(base, script))
        main = script
        if os.path.isdir(script):
            for rel, path in _walk(script):
                add(f"dir:{rel}", path)
            main = os.path.join(script, "__main__.py")
        search.insert(0, script if os.path.isdir(script) else os.path.dirname(script))
        top, added = _script_imports(main)
        tops += top
        search += [os.path.join(os.path.dirname(main), p) for p in added]
    search += [d for prefix in prefixes for d in _site_dirs(prefix)]
    owners: dict[str, dict[str, list[str]]] = {}
    for name in dict.fromkeys(tops):
        for folder in search:
            hit = _find_module(folder, name)
            if hit is None:
                continue
            if folder not in owners:
                owners[folder] = _distributions(folder)
            records = owners[folder].get(name)
            if records:
                for record in records:
                    add(f"record:{record}", record)
            elif os.path.isdir(hit):
                for rel, path in _walk(hit):
                    add(f"module:{name}/{rel}", path)
            else:
                add(f"module:{name}", hit)
            break
    return sorted(found.items())


def _python_target(args: Sequence[str]) -> tuple[str | None, str | None]:
    """``(script, module)`` of python's arguments (``-c``: neither)."""
    position = 0
    while position < len(args):
        arg = args[position]
        if arg in _PYTHON_VALUE_OPTIONS:
            position += 2
            continue
        if arg.startswith(("-W", "-X")):  # its value joined
            position += 1
            continue
        if arg == "-c" or (arg.startswith("-") and not arg.startswith("--") and "c" in arg):
            return None, None
        if arg == "-m":
            return None, args[position + 1] if position + 1 < len(args) else None
        if arg.startswith("-m"):
            return None, arg[2:]
        if not arg.startswith("-"):
            return arg, None
        position += 1
    return None, None


def _script_imports(path: str) -> tuple[list[str], list[str]]:
    """The top-level names a Python file imports (absolute imports anywhere in it),
    and the string literals it passes to ``sys.path.insert``/``append``."""
    import ast

    try:
        with open(path, "rb") as f:
            source = f.read(MAX_FILE_BYTES + 1)
        if len(source) > MAX_FILE_BYTES:
            return [], []
        tree = ast.parse(source)
    except (OSError, SyntaxError, ValueError):
        return [], []
    names: list[str] = []
    added: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name.partition(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module.partition(".")[0])
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("insert", "append")
            and ast.unparse(node.func.value) == "sys.path"
        ):
            added += [
                a.value
                for a in node.args
                if isinstance(a, ast.Constant) and isinstance(a.value, str)
            ]
    return names, added


def _site_dirs(prefix: str) -> list[str]:
    import glob

    patterns = ("lib/python3*/site-packages", "lib/python3/dist-packages", "lib/site-packages")
    return sorted(d for p in patterns for d in glob.glob(os.path.join(glob.escape(prefix), p)))


def _find_module(folder: str, name: str) -> str | None:
    package = os.path.join(folder, name)
    if os.path.isdir(package):
        return package
    if os.path.isfile(package + ".py"):
        return package + ".py"
    try:
        entries = os.listdir(folder)
    except OSError:
        return None
    for entry in sorted(entries):  # an extension module: NAME.cpython-311-x86_64-linux-gnu.so
        if entry.startswith(name + ".") and entry.endswith(".so"):
            return os.path.join(folder, entry)
    return None


def _distributions(folder: str) -> dict[str, list[str]]:
    """Top-level name -> the ``RECORD`` files of the distributions in ``folder`` that
    installed it."""
    owners: dict[str, list[str]] = {}
    try:
        infos = sorted(e for e in os.listdir(folder) if e.endswith(".dist-info"))
    except OSError:
        return owners
    for info in infos:
        record = os.path.join(folder, info, "RECORD")
        try:
            with open(record, encoding="utf-8", errors="replace") as f:
                lines = f.read(MAX_FILE_BYTES).splitlines()
        except OSError:
            continue
        tops = set()
        for line in lines:
            first = line.partition(",")[0].partition("/")[0]
            if first and not first.endswith((".dist-info", ".data")) and first != "..":
                tops.add(first[:-3] if first.endswith(".py") else first.partition(".")[0])
        for top in tops:
            owners.setdefault(top, []).append(record)
    return owners


@attrs.frozen
class ApprovalState:
    """Whether a discovered plugin is approved as it is now (``tak doctor``).

    Attributes:
        state: ``trusted`` (its source hashes as approved: its declarations are
            checked when it loads), ``never approved``, ``changed`` (since it was
            approved), or ``unreadable`` (``reason`` says why).
        approve: what ``tak plugins trust`` takes for it.
    """

    source: PluginSource
    state: Literal["trusted", "never approved", "changed", "unreadable"]
    approve: str
    reason: str = ""


def approval_states(
    sources: Sequence[PluginSource], trust_file: str | os.PathLike[str], workspace: str
) -> list[ApprovalState]:
    """Each discovered source's approval, from its hash alone: nothing is imported
    (blocking: run it in a thread).

    Raises:
        TrustError: the trust file cannot be read.
    """
    approvals = TrustStore(trust_file).load()
    states = []
    for source in sources:
        approve = source.name if source.kind == "entry_point" else source.target
        try:
            digest = digest_source(source, workspace)
        except TrustError as exc:
            states.append(ApprovalState(source, "unreadable", approve, str(exc)))
            continue
        approval = approvals.get(digest.key)
        state: Literal["trusted", "never approved", "changed"] = (
            "never approved"
            if approval is None
            else "trusted"
            if approval.sha256 == digest.sha256
            else "changed"
        )
        states.append(ApprovalState(source, state, approve))
    return states


def approved_copy(data_dir: str | os.PathLike[str], digest: Digest, file_name: str) -> Path:
    """The approved bytes of a workspace plugin, in a kernel-owned directory.

    ``<data_dir>/plugins/<sha256>/<file_name>``, written (atomically) when missing or
    different; the worker imports this copy, not the workspace file.
    """
    assert digest.content is not None
    folder = Path(data_dir) / APPROVED_DIR / digest.sha256
    path = folder / file_name
    try:
        if hashlib.sha256(read_plugin_file(path)).hexdigest() == digest.sha256:
            return path
    except TrustError:
        pass
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    _write_atomically(path, digest.content)
    return path


__all__ = [
    "MCP_TRUST_FILE",
    "TRUST_FILE",
    "ApprovalState",
    "ApprovalStore",
    "Digest",
    "McpPermissions",
    "McpTrustStore",
    "TrustError",
    "TrustStore",
    "TrustedMcpServer",
    "TrustedPlugin",
    "approval_states",
    "approved_copy",
    "digest_source",
    "file_digest",
    "needs_trust",
    "read_plugin_file",
    "source_key",
]
