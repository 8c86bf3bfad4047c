"""The plugin host: load plugins, run them in sandbox workers or in process, one registry.

::

    async with open_plugin_host(workspace) as host:
        observations = await run_tool_calls(calls, host.tools)
        host.plugins   # what loaded: name, version, source, tools, isolation
        host.errors    # what did not, and why

Loading, per source (see ``plugins._discovery``):

- **Trusted** sources (built-ins, ``Plugin`` or module objects the embedder
  passes) are imported in the kernel's process. Their tools run in process when
  the plugin says ``in_process=True``; otherwise in a worker that starts on the
  first call (start-up stays fast: no process per plugin until it is used).
- **Third-party** sources (entry points, ``.tak/plugins/*.py``, paths and module
  names) are never imported by the kernel: a worker with the least permissions
  (read the workspace, nothing else) imports the plugin and reports its name,
  permissions and tool schemas. When the plugin declares more, that worker is
  closed and one with the declared permissions starts on the first call. An
  ``in_process`` flag from such a plugin is ignored.

A plugin that fails (import error, two tools with one name, a schema that
cannot be generated, a name already loaded, isolation missing and
``allow_unsandboxed`` off) is recorded in ``errors`` and skipped, and reported in
one log line that names the command showing the details (``tak --debug plugins
check``); what its probe worker printed while failing (a traceback) is held back,
so a broken plugin costs every command one line, not its traceback. A discovered
plugin skipped for want of an approval is logged at debug level only: it is
the user's decision, told where it matters (``tak plugins ls``, ``tak doctor``).

Names: a plugin owns the namespace of its name (``ToolRegistry.claim``), as an
MCP server does. Its tools are bare names, or names in its own namespace
(``weather.forecast`` for plugin ``weather``); a tool named in another namespace
(``m3.echo`` from plugin ``evil``) skips the plugin, and two sources of one name
(two plugins, a plugin and an MCP server) are a start error naming both. A bare
name goes to the first tool that claims it, in this order: the kernel's own
``tools``, built-ins, entry points, workspace plugins (each group sorted); a
later tool whose name is taken is registered as ``<plugin>.<tool>``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import shlex
import shutil
import site
import sys
import tempfile
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import attrs
import cattrs
import trio

from kernel.errors import KernelError, SandboxError, UsageError, WorkspaceRefused
from kernel.home import Config, TakHome
from kernel.messages import converter, describe_structure_error
from kernel.plugin import Permissions, Plugin, ToolContext, context, use_context
from kernel.tools import (
    NAMESPACE_PATTERN,
    NAMESPACE_RULE,
    TOOL_NAME_PATTERN,
    Tool,
    ToolFailure,
    ToolRegistry,
    namespace_of,
    wire_form,
)
from sandbox import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_FILES,
    IsolationSupport,
    Policy,
    ToolSpec,
    Worker,
    WorkerPool,
    Workspace,
    check_workspace_overlap,
    escape_log_text,
    measure_budget,
    open_worker_pool,
)

from ._discovery import PluginSource, builtin_sources, discover_plugins, source_for
from ._loading import PluginInfo, find_plugin, pin, tool_spec, unpin
from ._remote import policy_for, remote_tool
from ._trust import (
    MAX_FILE_BYTES,
    TRUST_FILE,
    TrustedPlugin,
    TrustError,
    TrustStore,
    approved_copy,
    digest_source,
    file_digest,
    needs_trust,
    read_plugin_file,
)

logger = logging.getLogger("tak.plugins")
#: Where ``sandbox.pool`` logs each line a worker prints, as ``"[NAME pid N] text"``.
worker_logger = logging.getLogger("sandbox.worker")

SkipReport = Literal["line", "silent", "output"]
"""How ``open_plugin_host`` reports a skipped plugin: ``line``, one log line (and
what its worker printed while failing is held back); ``silent``, nothing (the caller
reports ``host.errors``); ``output``, no line, but the worker's output as it comes
(``tak plugins check`` shows a failed import's traceback)."""


def tak_command(*words: str) -> str:
    """``tak WORDS...`` as a person can paste it into a shell here.

    ``tak`` when that is what ``PATH`` finds; else the script this process was started
    as (``.venv/bin/tak`` below the current directory, else its absolute path): after
    ``make demo``, ``tak`` is not on ``PATH`` and a hint naming it would not run.
    """
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if script is None or script.name != "tak" or not script.is_file():
        # Not started as the script (`make demo`'s example, python -m, embedded):
        # the script beside this interpreter is this environment's tak.
        script = Path(sys.executable).with_name("tak")
        if not script.is_file():
            return shlex.join(["tak", *words])
    return shlex.join([_runnable(script), *words])


def python_command(*words: str) -> str:
    """``python WORDS...`` with this interpreter (its environment has ``tak``), runnable here."""
    return shlex.join([_runnable(Path(sys.executable)), *words])


def _runnable(program: Path) -> str:
    """How a shell in the current directory runs ``program``: its name when ``PATH``
    finds it, else its path (relative below the current directory)."""
    found = shutil.which(program.name)
    with contextlib.suppress(OSError):
        if found is not None and os.path.samefile(found, program):
            return program.name
    absolute = program.absolute()
    try:
        relative = absolute.relative_to(Path.cwd())
    except (ValueError, OSError):
        return str(absolute)
    return str(relative) if len(relative.parts) > 1 else f"./{relative}"


#: What a third-party plugin is imported with, before its permissions are known.
PROBE_POLICY = Policy(workspace="read")

PluginSpec = str | ModuleType | Plugin | PluginSource
"""What ``open_plugin_host(plugins=...)`` takes: a name, path or module, or objects."""


@attrs.frozen
class LoadedPlugin:
    """A plugin the host serves.

    Attributes:
        tools: the registered name of each tool (``weather.forecast`` when its own
            name was taken) mapped to the plugin's name for it.
        isolation: ``in process``, or the worker's confinement level.
    """

    name: str
    version: str
    description: str
    permissions: Permissions
    source: PluginSource
    isolation: str
    tools: Mapping[str, str]


@attrs.frozen
class PluginLoadError:
    """A plugin that was skipped, and why.

    Attributes:
        approve: set when it was skipped for want of an approval (never approved,
            changed, or declaring other permissions): what ``tak plugins trust``
            takes to approve it.
    """

    source: PluginSource
    reason: str
    approve: str | None = None


class _NotApproved(KernelError):
    """A discovered plugin without a matching approval (see ``plugins._trust``)."""

    def __init__(self, message: str, approve: str) -> None:
        super().__init__(message)
        self.approve = approve


@attrs.define
class _TaskWorkspace:
    """A workspace ``open_workspace`` lent to one job, and the workers started for it."""

    workspace: Workspace
    workers: dict[int, Worker] = attrs.Factory(dict)  # by id() of the plugin's own worker
    invokers: dict[tuple[int, str], Callable[[dict[str, Any]], Awaitable[Any]]] = attrs.Factory(
        dict
    )


@attrs.frozen
class _Candidate:
    """A plugin whose tools are known, before its names are registered."""

    source: PluginSource
    name: str
    version: str
    description: str
    permissions: Permissions
    isolation: str
    tools: list[Tool]  # named as the plugin names them; invoke/fn ready to run


class PluginHost:
    """Loaded plugins and the registry of every tool; made by ``open_plugin_host``.

    Attributes:
        tools: the kernel's own tools and every plugin tool, namespaced on collision.
        plugins: what loaded, in registration order.
        errors: what was skipped, and why.
        workspace: the confined workspace in-process tools use.
        pool: the sandbox workers of the other plugins.
    """

    def __init__(
        self,
        *,
        workspace: Workspace,
        pool: WorkerPool,
        config: Config,
        tools: ToolRegistry,
        home: TakHome | None = None,
    ) -> None:
        self.workspace = workspace
        self.pool = pool
        self.config = config
        self.tools = tools
        self.home = home if home is not None else TakHome.locate()
        self.plugins: list[LoadedPlugin] = []
        self.errors: list[PluginLoadError] = []
        self.report: SkipReport = "line"
        self.load_output = _LoadOutput()
        self._declared: dict[str, tuple[Permissions, Worker]] = {}
        self._lent: dict[int, _TaskWorkspace] = {}  # by id() of the workspace
        self._approvals: dict[str, TrustedPlugin] | TrustError | None = None

    def prime(self) -> None:
        """Workers are about to be wanted (a turn begins): have the pool's spare process
        started now, while the model thinks (``WorkerPool.prime``)."""
        if self._declared:
            self.pool.prime()

    def plugin_config(self, name: str) -> dict[str, Any]:
        """``[plugins.<name>]`` of ``tak.toml``: what ``context().config`` holds."""
        return dict(self.config.plugins.get(name, {}))

    def context(
        self, session: str | None = None, workspace: Workspace | None = None
    ) -> ToolContext:
        """The kernel-side context: the workspace and a session key for a batch of calls.

        Set it with ``kernel.plugin.use_context`` around ``run_tool_calls``: in-process
        tools see it (with their own logger and config) and workers receive the
        session key with each call. ``workspace`` is one ``open_workspace`` lent
        (default: the host's own): the calls work there.
        """
        return ToolContext(
            workspace=workspace if workspace is not None else self.workspace,
            session=session,
            logger=logging.getLogger("tak.tools"),
        )

    @contextlib.asynccontextmanager
    async def open_workspace(self, path: str | os.PathLike[str]) -> AsyncIterator[Workspace]:
        """Another workspace for the tools of one job (a batch task), until the block ends.

        Calls made in ``context(workspace=...)`` of the workspace yielded work in
        ``path``: in-process tools through it, plugin tools in workers confined
        to ``path`` (Landlock), started on the job's first call of each plugin and
        killed when the block ends. The directory gets the checks and the disk
        budget of the host's own workspace; ``.tak/`` in it is read-only to tools.
        Many may be open at once; none sees another's files.

        Raises:
            SandboxError: the directory cannot be opened, or it overlaps the Python
                environment, the kernel's code or ``$TAK_HOME`` (see ``guarded_paths``).
        """
        await self.check_workspace(path)
        budget = self.workspace.max_bytes, self.workspace.max_files
        ws = await trio.to_thread.run_sync(_open_lent, path, *budget)
        lent = _TaskWorkspace(ws)
        self._lent[id(ws)] = lent
        try:
            async with self.pool.watch_budget(ws):
                try:
                    yield ws
                finally:
                    del self._lent[id(ws)]
                    with trio.CancelScope(shield=True):
                        for worker in lent.workers.values():
                            await self.pool.close_worker(worker)
        finally:
            self._lent.pop(id(ws), None)
            ws.close()

    async def check_workspace(self, path: str | os.PathLike[str]) -> None:
        """Refuse ``path`` as a workspace, as ``open_workspace`` would, without opening it.

        Raises:
            SandboxError: it overlaps the Python environment, the kernel's code or
                ``$TAK_HOME`` (see ``guarded_paths``).
        """
        await trio.to_thread.run_sync(_check_overlap, path, self.home)

    def _remote_tool(self, spec: ToolSpec, worker: Worker, permissions: Permissions) -> Tool:
        """``remote_tool`` of the plugin's worker, routed by the caller's workspace: a
        call in a workspace ``open_workspace`` lent runs in that workspace's worker."""
        base = remote_tool(spec, worker, self._budget_check(permissions))
        run_here = base.invoke
        assert run_here is not None

        async def invoke(arguments: dict[str, Any]) -> Any:
            workspace = _workspace_of_caller()
            if workspace is None or workspace is self.workspace:
                return await run_here(arguments)
            return await self._lent_invoker(workspace, spec, worker, permissions)(arguments)

        return attrs.evolve(base, invoke=invoke)

    def _lent_invoker(
        self, workspace: Workspace, spec: ToolSpec, worker: Worker, permissions: Permissions
    ) -> Callable[[dict[str, Any]], Awaitable[Any]]:
        """Raises: ToolFailure: the workspace was not lent by this host (or is closed)."""
        lent = self._lent.get(id(workspace))
        if lent is None or lent.workspace is not workspace:
            raise ToolFailure(
                "denied",
                "this call's workspace was not opened by the plugin host (open_workspace), "
                "or its job has ended: no worker may run there",
            )
        key = (id(worker), spec.name)
        invoker = lent.invokers.get(key)
        if invoker is None:
            copy = lent.workers.get(id(worker))
            if copy is None:
                copy = lent.workers[id(worker)] = self.pool.worker(
                    worker.plugin,
                    policy=worker.policy,
                    name=worker.name,
                    path=worker.path,
                    config=worker.config,
                    workspace=workspace.path,
                )
            tool = remote_tool(spec, copy, self._budget_check(permissions, workspace))
            assert tool.invoke is not None
            invoker = lent.invokers[key] = tool.invoke
        return invoker

    # -- loading --------------------------------------------------------------

    async def load(self, sources: Sequence[PluginSource | Plugin | ModuleType]) -> None:
        """Load every source; failures go to ``errors``. Registration follows ``sources``."""
        results: list[_Candidate | PluginLoadError | None] = [None] * len(sources)

        async def load_one(index: int, item: PluginSource | Plugin | ModuleType) -> None:
            try:
                results[index] = await self._candidate(item)
            except _NotApproved as exc:
                results[index] = PluginLoadError(_source_of(item), str(exc), exc.approve)
            except (KernelError, ImportError, OSError) as exc:
                results[index] = PluginLoadError(_source_of(item), _reason(exc))
            except Exception as exc:  # a crashing import of trusted code is still one plugin
                results[index] = PluginLoadError(_source_of(item), _reason(exc))

        async with trio.open_nursery() as nursery:
            for index, item in enumerate(sources):
                nursery.start_soon(load_one, index, item)
        for result in results:
            assert result is not None
            if isinstance(result, PluginLoadError):
                self._skip(result)
            else:
                self._register(result)

    def _skip(self, error: PluginLoadError) -> None:
        self.errors.append(error)
        if self.report != "line":
            return
        # The reason can quote plugin code (an import error): one escaped log line.
        label, reason = escape_log_text(error.source.label), escape_log_text(error.reason)
        # A plugin awaiting approval is the user's to decide, told where it matters
        # (`tak plugins ls`, `tak doctor`): a warning on every command is noise.
        level = logging.DEBUG if error.approve is not None else logging.WARNING
        logger.log(
            level,
            "plugin from %s skipped: %s; %s",
            label,
            reason,
            escape_log_text(skip_hint(error)),
        )

    def _register(self, candidate: _Candidate) -> None:
        """Register a candidate's tools in its own namespace (see the module's "Names").

        Raises:
            UsageError: another source holds the plugin's namespace (a plugin of
                that name, or a tool of the embedder's in it): a start error that
                names both.
        """
        name = candidate.name
        if not NAMESPACE_PATTERN.fullmatch(name):
            reason = (
                f"its name {name!r} is not a plugin name ({NAMESPACE_RULE}): it is its "
                "tools' namespace"
            )
            self._skip(PluginLoadError(candidate.source, reason))
            return
        owner = plugin_owner(name, candidate.source)
        taken = next((p for p in self.plugins if p.name.casefold() == name.casefold()), None)
        if taken is not None:
            raise UsageError(
                f"two tool sources claim the namespace {name!r}: "
                f"{plugin_owner(name, taken.source)} and {owner}; rename or remove one"
            )
        names: dict[str, str] = {}
        wires: set[str] = set()
        for t in candidate.tools:
            # ``m3__echo`` is ``m3.echo`` on the wire (``kernel.tools.wire_form``): its
            # namespace is m3's, whatever the plugin calls it.
            namespace = namespace_of(t.name)
            if namespace is not None and namespace != name:
                reason = (
                    f"tool {t.name!r} lies in the namespace {namespace!r}, not its own: "
                    f"a plugin's tools are bare names (no '__') or {name}.NAME"
                )
                self._skip(PluginLoadError(candidate.source, reason))
                return
            free = self.tools.taken(t.name) is None and wire_form(t.name) not in wires
            final = t.name if namespace is not None or free else f"{name}.{t.name}"
            if self.tools.taken(final) is not None or wire_form(final) in wires:
                reason = f"tool {t.name!r}: both {t.name!r} and {final!r} are taken"
                self._skip(PluginLoadError(candidate.source, reason))
                return
            if not TOOL_NAME_PATTERN.fullmatch(final):
                reason = (
                    f"tool {t.name!r} is taken, and its namespaced name {final!r} is not "
                    "a valid tool name (at most 64 letters, digits, '_', '.' or '-')"
                )
                self._skip(PluginLoadError(candidate.source, reason))
                return
            names[final] = t.name
            wires.add(wire_form(final))
        self.tools.claim(name, owner)
        for final, t in zip(names, candidate.tools, strict=True):
            self.tools.add(t if final == t.name else attrs.evolve(t, name=final), owner=owner)
        self.plugins.append(
            LoadedPlugin(
                name=candidate.name,
                version=candidate.version,
                description=candidate.description,
                permissions=candidate.permissions,
                source=candidate.source,
                isolation=candidate.isolation,
                tools=names,
            )
        )

    async def _candidate(self, item: PluginSource | Plugin | ModuleType) -> _Candidate:
        if isinstance(item, Plugin):
            return self._trusted(item, _object_source(item))
        if isinstance(item, ModuleType):
            found = find_plugin(item, None, item.__name__)
            if found is None:
                raise UsageError(f"module {item.__name__} has no `plugin = Plugin(...)`")
            return self._trusted(found, _object_source(found, item))
        if item.trusted:
            module_name, _, attribute = item.target.partition(":")
            # An import reads files and runs module code: keep it off the Trio thread.
            module = await trio.to_thread.run_sync(importlib.import_module, module_name)
            found = find_plugin(module, attribute or None, item.target)
            if found is None:
                raise UsageError(f"{item.target} has no `plugin = Plugin(...)`")
            return self._trusted(found, item)
        if needs_trust(item):
            imported, approval = await self._approved(item)
            return await self._probed(item, imported, approval)
        return await self._probed(item)

    async def _approved(self, source: PluginSource) -> tuple[PluginSource, TrustedPlugin]:
        """The approval of a discovered plugin, and the source a worker imports.

        For a workspace file that is a copy of the bytes hashed here, in a directory
        of the kernel's (``plugins._trust``): the file in the workspace may change
        after the hash, the copy does not.

        Raises:
            _NotApproved: never approved, or changed since.
            TrustError: the trust file is unreadable, or the source cannot be hashed.
        """
        if self._approvals is None:
            store = TrustStore(self.home.config / TRUST_FILE)
            try:
                self._approvals = await trio.to_thread.run_sync(store.load)
            except TrustError as exc:
                self._approvals = exc
        if isinstance(self._approvals, TrustError):
            raise self._approvals
        approve = _approve_argument(source)
        if source.kind == "workspace":
            content = await trio.to_thread.run_sync(_read_in, self.workspace, source.target)
            digest = file_digest(source, content)
        else:
            digest = await trio.to_thread.run_sync(digest_source, source, str(self.workspace.path))
        approval = self._approvals.get(digest.key)
        if approval is None:
            raise _NotApproved(
                f"not trusted: never approved (sha256 {digest.sha256[:16]})",
                approve,
            )
        if approval.sha256 != digest.sha256:
            raise _NotApproved(
                f"not trusted: changed since it was approved (sha256 {digest.sha256[:16]}, "
                f"approved {approval.sha256[:16]})",
                approve,
            )
        if digest.content is None:
            # The worker hashes the package again and compiles what it hashed: a file
            # changed after this hash, before a worker (re)starts, never runs.
            return attrs.evolve(source, target=pin(source.target, approval.sha256)), approval
        name = os.path.basename(source.target)
        copy = await trio.to_thread.run_sync(approved_copy, self.home.data, digest, name)
        imported = attrs.evolve(source, target=str(copy), path=(str(copy.parent),))
        return imported, approval

    def _trusted(self, plugin: Plugin, source: PluginSource) -> _Candidate:
        """A plugin imported here: in process if it asks, else a worker started on demand."""
        if plugin.in_process:
            tools = [self._in_process(t, plugin) for t in plugin.tools]
            isolation = "in process"
        else:
            worker = self._worker(source, plugin.name, plugin.permissions)
            tools = [
                self._remote_tool(tool_spec(t), worker, plugin.permissions) for t in plugin.tools
            ]
            isolation = self._isolation(plugin.permissions)
        if not tools:
            raise UsageError(f"plugin {plugin.name} defines no tools")
        return _Candidate(
            source,
            plugin.name,
            plugin.version,
            plugin.description,
            plugin.permissions,
            isolation,
            tools,
        )

    async def _probed(
        self,
        source: PluginSource,
        imported: PluginSource | None = None,
        approval: TrustedPlugin | None = None,
    ) -> _Candidate:
        """A third-party plugin: imported in a least-privileged worker, never here.

        ``imported`` is what the worker imports when it is not ``source`` itself (the
        approved copy of a workspace file); with ``approval``, a plugin whose name or
        permissions differ from the approved ones is refused before it gets them.
        """
        target = imported if imported is not None else source
        with self.load_output.holding(_stem(source)):
            probe = await self.pool.start(
                target.target, policy=PROBE_POLICY, name=_stem(source), path=target.path
            )
        if probe.plugin_info is None:
            await probe.aclose()
            raise UsageError(f"{source.target} has no `plugin = Plugin(...)` (see docs/plugins.md)")
        try:
            info = _plugin_info(probe.plugin_info)
            permissions = Permissions.from_mapping(info.permissions)
        except KernelError:
            await probe.aclose()
            raise
        name = info.name
        probe.name = name
        if approval is not None and (approval.name, approval.permissions) != (name, permissions):
            await probe.aclose()
            approve = _approve_argument(source)
            raise _NotApproved(
                f"not trusted: declares {name} with {permissions.describe()}, approved as "
                f"{approval.name} with {approval.permissions.describe()}",
                approve,
            )
        declared = tuple(spec.name for spec in probe.specs)
        if approval is not None and approval.tools is not None and approval.tools != declared:
            await probe.aclose()
            raise _NotApproved(
                f"not trusted: declares the tools {', '.join(declared)}, approved with "
                f"{', '.join(approval.tools) or 'none'}",
                _approve_argument(source),
            )
        if policy_for(permissions) == PROBE_POLICY:
            worker = probe  # it already runs with what the plugin declared
            worker.config = self.plugin_config(name)
        else:
            await probe.aclose()
            worker = self._worker(target, name, permissions)
        # Built once, here, from the probe's greeting: the pool builds no tools.
        tools = [self._remote_tool(spec, worker, permissions) for spec in probe.specs]
        if info.in_process:
            logger.info(
                "plugin %s asks to run in process; third-party plugins never do",
                escape_log_text(name),
            )
        return _Candidate(
            source,
            name,
            info.version,
            info.description,
            permissions,
            self._isolation(permissions),
            tools,
        )

    def _worker(self, source: PluginSource, name: str, permissions: Permissions) -> Worker:
        worker = self.pool.worker(
            source.target,
            policy=policy_for(self.granted(name, permissions)),
            name=name,
            path=source.path,
            config=self.plugin_config(name),
        )
        self._declared[name] = (permissions, worker)
        return worker

    def granted(self, name: str, permissions: Permissions) -> Permissions:
        """What a plugin's worker may do: what it declared, plus the ``host:port`` entries
        of its config's ``allow_hosts`` when it declared network access at all.

        A plugin cannot know at import time which local ports its user allows (the
        web plugin's ``allow_hosts = ["127.0.0.1:8080"]``): the user's config says it,
        and Landlock needs the port.
        """
        if not permissions.network:
            return permissions
        extra = [e for e in self.plugin_config(name).get("allow_hosts", []) if _has_port(e)]
        network = tuple(dict.fromkeys([*permissions.network, *extra]))
        return attrs.evolve(permissions, network=network)

    def configure_plugin(self, name: str, config: Mapping[str, Any]) -> None:
        """Replace ``[plugins.<name>]``: what its tools see, and its worker's grants.

        A worker already running keeps its grants until it restarts.
        """
        self.config = self.config.with_plugin_settings({name: config})
        declared = self._declared.get(name)
        if declared is not None:
            permissions, worker = declared
            worker.config = dict(config)
            worker.policy = policy_for(self.granted(name, permissions))

    def _budget_check(
        self, permissions: Permissions, workspace: Workspace | None = None
    ) -> Callable[[], Awaitable[None]] | None:
        """After each call of a plugin that may write the workspace: measure it again.

        A worker's writes do not go through ``self.workspace``: its usage is bounded
        by the file system's free space and free inodes (``Workspace.bounded_usage``),
        and the tree is walked, in a thread and with every worker frozen
        (``sandbox._diskwatch.measure``), only when that bound could pass the budget.
        fs tools then refuse writes past the budget, and the call that took the
        workspace over it (bytes or files) fails and says so; so does a call after
        which the usage could not be measured (fail closed: a worker that keeps the
        tree changing must not escape the budget). While the call runs, and after it
        for whatever it left running, the pool's watchdog (``WorkerPool.watch_budget``)
        holds the same budget.
        """
        ws = workspace if workspace is not None else self.workspace
        if permissions.workspace != "write" or ws.max_bytes is None:
            return None
        return functools.partial(self._check_budget, ws)

    async def _check_budget(self, workspace: Workspace | None = None) -> None:
        """Raises: ToolFailure: the workspace is over its disk budget, or unmeasurable."""
        ws = workspace if workspace is not None else self.workspace
        try:
            used = await trio.to_thread.run_sync(ws.bounded_usage)
            # A walk: with every worker stopped, so that none (nor a program it left
            # running) can move what it wrote out of the walk's way.
            over = ws.over_budget() if used is not None else await measure_budget(self.pool, ws)
        except KernelError as exc:
            raise ToolFailure(
                "denied",
                f"the workspace's disk usage could not be measured after this call ({exc}); "
                "its budget cannot be checked, so the call is refused",
            ) from None
        if over is not None:
            raise ToolFailure(
                "denied",
                f"workspace over its budget: {over}; what this call wrote stays, and "
                "further writes are refused until files are removed",
            )

    def _isolation(self, permissions: Permissions) -> str:
        support = self.pool.isolation
        missing = support.missing(policy_for(permissions))
        if missing:
            return "worker, unconfined (allow_unsandboxed): " + "; ".join(missing)
        return f"worker ({support.level} isolation)"

    def _in_process(self, t: Tool, plugin: Plugin) -> Tool:
        """The tool, run inside a context with the plugin's logger and config."""
        fn = t.fn
        assert fn is not None
        plugin_logger = logging.getLogger(f"tak.plugin.{plugin.name}")

        def tool_context() -> ToolContext:
            try:
                current: ToolContext | None = context()
            except UsageError:
                current = None
            return ToolContext(
                workspace=current.workspace if current is not None else self.workspace,
                session=current.session if current is not None else None,
                logger=plugin_logger,
                config=self.plugin_config(plugin.name),
            )

        run: Callable[..., Any]
        if t.is_async:

            async def run_async(**kwargs: Any) -> Any:
                with use_context(tool_context()):
                    return await fn(**kwargs)

            run = run_async
        else:

            def run_sync(**kwargs: Any) -> Any:
                with use_context(tool_context()):
                    return fn(**kwargs)

            run = run_sync
        functools.update_wrapper(run, fn)
        return attrs.evolve(t, fn=run)


def _plugin_info(value: dict[str, Any]) -> PluginInfo:
    """The ``plugin`` of a worker's greeting, checked field by field.

    Raises:
        SandboxError: a field is missing or of the wrong type (named by its path).
    """
    try:
        info: PluginInfo = converter.structure(value, PluginInfo)
    except (cattrs.BaseValidationError, TypeError, ValueError) as exc:
        raise SandboxError(
            "the worker's greeting describes its plugin badly: "
            + describe_structure_error(exc, "$.plugin")
        ) from None
    return info


def plugin_owner(name: str, source: PluginSource) -> str:
    """How a plugin is named as the owner of its namespace: ``plugin weather (built-in)``."""
    return f"plugin {name} ({source.label})"


def skip_hint(error: PluginLoadError) -> str:
    """The command that helps with a skipped plugin: trust it, or see why it failed."""
    if error.approve is not None:
        return "to trust it: " + tak_command("plugins", "trust", error.approve)
    target = error.source.target.partition(":")[0]
    return "details: " + tak_command("--debug", "plugins", "check", target)


class _LoadOutput(logging.Filter):
    """Holds what a probe worker prints while its plugin loads (``sandbox.worker``).

    When the plugin loads, the lines are logged then; when it fails (a traceback),
    they are dropped with every later line of that worker: ``_skip`` reports it in
    one line. Installed on ``worker_logger`` while a host reports skips as ``line``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[str, list[logging.LogRecord]] = {}
        self.failed: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        prefix = str(args[0]) if isinstance(args, tuple) and args else ""
        name = prefix.removeprefix("[").rpartition(" pid ")[0]
        if name in self.failed:
            return False
        held = self.held.get(name)
        if held is None:
            return True
        held.append(record)
        return False

    @contextlib.contextmanager
    def holding(self, name: str) -> Iterator[None]:
        self.held[name] = []
        try:
            yield
        except BaseException:
            self.failed.add(name)
            self.held.pop(name, None)
            raise
        for record in self.held.pop(name, []):
            worker_logger.handle(record)


def _reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, (KernelError,)) or text.startswith(type(exc).__name__):
        return text
    return f"{type(exc).__name__}: {text}"


def _workspace_of_caller() -> Workspace | None:
    """The workspace of the ``kernel.context()`` a call runs in, if any."""
    try:
        return context().workspace
    except UsageError:
        return None


@contextlib.asynccontextmanager
async def _watched_workspace(
    pool: WorkerPool, *, max_bytes: int, max_files: int
) -> AsyncIterator[Workspace]:
    """The host's own workspace (``.tak/`` protected), its budget held by the pool's
    disk watchdog while the block runs."""
    with Workspace(
        pool.workspace, protected=(".tak",), max_bytes=max_bytes, max_files=max_files
    ) as ws:
        async with pool.watch_budget(ws):
            yield ws


def _open_lent(
    path: str | os.PathLike[str], max_bytes: int | None, max_files: int | None
) -> Workspace:
    """A lent workspace, opened as the host's own is (``.tak/`` protected, the budget)."""
    with Workspace(path) as ws:
        ws.mkdir(".tak/tmp", parents=True, exist_ok=True)  # a worker's TMPDIR
    return Workspace(path, protected=(".tak",), max_bytes=max_bytes, max_files=max_files)


def _read_in(workspace: Workspace, path: str) -> bytes:
    """A workspace plugin's bytes, read through the confined workspace: no link that
    leads out of it, regular files only, at most ``MAX_FILE_BYTES``."""
    rel = os.path.relpath(os.path.abspath(path), workspace.path)
    return workspace.read_bytes(rel, max_bytes=MAX_FILE_BYTES)


def _approve_argument(source: PluginSource) -> str:
    """What ``tak plugins trust`` takes for ``source``: an entry point's name, a file's path.

    A path works from any directory and needs no ``--workspace``. Not quoted: the
    command that shows it quotes it once (``tak_command``).
    """
    if source.kind == "entry_point":
        return source.name
    return source.target


def _stem(source: PluginSource) -> str:
    target = unpin(source.target)[0]
    target = target.partition(":")[0] if source.kind != "path" else target
    return os.path.splitext(os.path.basename(target.rstrip("/")))[0].rpartition(".")[2]


def _source_of(item: PluginSource | Plugin | ModuleType) -> PluginSource:
    if isinstance(item, PluginSource):
        return item
    if isinstance(item, Plugin):
        return PluginSource("object", item.name, f"Plugin object {item.name}")
    return PluginSource("object", item.__name__, f"module {item.__name__}")


def _object_source(plugin: Plugin, module: ModuleType | None = None) -> PluginSource:
    """Where a worker finds a plugin the embedder holds: its module, by name or by file.

    Raises:
        UsageError: the plugin's module cannot be imported by another process.
    """
    if module is None:
        names = {t.fn.__module__ for t in plugin.tools if t.fn is not None}
        module = sys.modules.get(next(iter(names))) if len(names) == 1 else None
    if module is None or getattr(module, "__file__", None) is None:
        if plugin.in_process:
            return PluginSource("object", plugin.name, f"Plugin object {plugin.name}")
        raise UsageError(
            f"plugin {plugin.name}: its tools must live in one module a worker can import "
            "(or the plugin must be in_process)"
        )
    file = os.path.abspath(str(module.__file__))
    attribute = next((k for k, v in vars(module).items() if v is plugin), None)
    if module.__name__ == "__main__" or module.__spec__ is None:
        target = file if attribute is None else f"{file}:{attribute}"
        return PluginSource("object", target, file)
    depth = module.__name__.count(".") + (1 if Path(file).name == "__init__.py" else 0)
    root = Path(file).parent
    for _ in range(depth):
        root = root.parent
    target = module.__name__ if attribute is None else f"{module.__name__}:{attribute}"
    return PluginSource("object", target, f"module {module.__name__}", (str(root),))


def _config_of(config: Config | Mapping[str, Any] | None) -> Config:
    if isinstance(config, Config):
        return config
    return Config() if config is None else Config.from_toml(config)


@contextlib.asynccontextmanager
async def open_plugin_host(
    workspace: str | os.PathLike[str],
    *,
    plugins: Iterable[PluginSpec] | None = None,
    extra_plugins: Iterable[PluginSpec] = (),
    tools: Iterable[Tool] = (),
    config: Config | Mapping[str, Any] | None = None,
    allow_unsandboxed: bool = False,
    isolation: IsolationSupport | None = None,
    home: TakHome | str | os.PathLike[str] | None = None,
    report: SkipReport = "line",
) -> AsyncIterator[PluginHost]:
    """Load plugins for ``workspace`` and serve their tools until the block ends.

    Args:
        workspace: the directory every tool is confined to.
        plugins: ``None`` for the built-ins and every discovered plugin (entry points,
            ``<workspace>/.tak/plugins/*.py``); else exactly these: built-in names
            (``"fs"``), module names (``"pkg.mod"`` or ``"pkg.mod:plugin"``), paths,
            modules or ``Plugin`` objects.
        tools: tools of the embedder's own; they keep their names.
        config: the home's ``Config`` (``home.read_config()``): ``[plugins.<name>]``
            goes to each plugin, ``[workspace]`` bounds the workspace. The parsed
            ``tak.toml`` as a mapping, the form this took before, is checked into a
            ``Config`` first (``UsageError`` naming the ``$.path``).
        allow_unsandboxed: run plugins even where isolation is missing (marked).
        isolation: replaces the probe of this machine (tests).
        home: the ``TAK_HOME`` whose ``config/trusted-plugins.json`` says which
            discovered plugins the user approved (default: ``TakHome.locate()``).
        report: how a skipped plugin is reported (``SkipReport``): one log line
            naming the command that shows why (the default), nothing, or its
            worker's output.

    Raises:
        SandboxError: the workspace cannot be opened, or it overlaps the Python
            environment, the kernel's own code or ``$TAK_HOME`` (see ``guarded_paths``).
        UsageError: two of ``tools`` share a name.
    """
    tak_home = home if isinstance(home, TakHome) else TakHome.locate(home)
    checked = _config_of(config)
    # Before anything is written into the workspace (the pool creates .tak/tmp).
    await trio.to_thread.run_sync(_check_overlap, workspace, tak_home)
    registry = ToolRegistry(tools)
    if plugins is None:
        items: list[PluginSource | Plugin | ModuleType] = [
            *builtin_sources(),
            *discover_plugins(workspace),
        ]
    else:
        items = [source_for(p) if isinstance(p, str) else p for p in plugins]
    items += [source_for(p) if isinstance(p, str) else p for p in extra_plugins]
    async with open_worker_pool(
        workspace, allow_unsandboxed=allow_unsandboxed, isolation=isolation
    ) as pool:
        budget, files = checked.workspace.max_bytes, checked.workspace.max_files
        async with _watched_workspace(
            pool,
            max_bytes=DEFAULT_MAX_BYTES if budget is None else budget,
            max_files=DEFAULT_MAX_FILES if files is None else files,
        ) as ws:
            host = PluginHost(
                workspace=ws, pool=pool, config=checked, tools=registry, home=tak_home
            )
            host.report = report
            if report == "output":
                await host.load(items)
                yield host
                return
            worker_logger.addFilter(host.load_output)
            try:
                await host.load(items)
                yield host
            finally:
                worker_logger.removeFilter(host.load_output)


async def trust_plugin(
    source: PluginSource, *, home: TakHome, workspace: str | os.PathLike[str]
) -> tuple[TrustedPlugin, LoadedPlugin]:
    """Approve a discovered plugin as it is now: what ``tak plugins trust`` does.

    The source is hashed; its name and permissions come from a least-privileged
    probe worker in an empty scratch workspace (the kernel never imports it); the
    approval records exactly those. A workspace file is read once: those bytes are
    hashed and copied under ``$TAK_HOME/data/plugins``, and the probe imports the
    copy, so what was approved is what ran.

    Raises:
        TrustError: the trust file is damaged (it is left as it is), or the source
            cannot be hashed.
        UsageError: the plugin did not load in its probe.
    """
    store = TrustStore(home.config / TRUST_FILE)
    await trio.to_thread.run_sync(store.load)  # a damaged file is reported, not replaced
    if source.kind == "workspace":
        digest = await trio.to_thread.run_sync(
            lambda: file_digest(source, read_plugin_file(source.target))
        )
        name = os.path.basename(source.target)
        copy = await trio.to_thread.run_sync(approved_copy, home.data, digest, name)
        imported = PluginSource("path", str(copy), source.label, (str(copy.parent),))
    else:
        digest = await trio.to_thread.run_sync(digest_source, source, workspace)
        # Pinned: the probe runs the bytes hashed here, or refuses (see ``_approved``).
        target = pin(source.target, digest.sha256)
        imported = PluginSource("module", target, source.label, source.path)
    scratch = await trio.to_thread.run_sync(lambda: tempfile.mkdtemp(prefix="tak-trust-"))
    try:
        async with open_plugin_host(
            scratch, plugins=[imported], home=home, report="silent"
        ) as host:
            if host.errors:
                raise UsageError(f"{source.label}: {host.errors[0].reason}")
            loaded = attrs.evolve(host.plugins[0], source=source)
    finally:
        await trio.to_thread.run_sync(lambda: shutil.rmtree(scratch, ignore_errors=True))
    approval = TrustedPlugin(
        digest.key, loaded.name, digest.sha256, loaded.permissions, tuple(loaded.tools.values())
    )
    await trio.to_thread.run_sync(store.approve, approval)
    return approval, loaded


__all__ = [
    "PROBE_POLICY",
    "LoadedPlugin",
    "PluginHost",
    "PluginLoadError",
    "PluginSpec",
    "SkipReport",
    "open_plugin_host",
    "python_command",
    "skip_hint",
    "tak_command",
    "trust_plugin",
]


def guarded_paths(home: TakHome) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """What a workspace may not overlap: ``(disjoint, not_inside)`` for
    ``sandbox.check_workspace_overlap``.

    Disjoint (the workspace may neither contain nor lie inside them): the
    interpreter's prefixes, site-packages and the user site (a ``.pth`` file there
    runs at every start; a directory there is a package), the directories the
    ``kernel``, ``plugins`` and ``sandbox`` packages are imported from (the source
    tree of an editable install), ``$TAK_HOME/config`` (trust, settings) and
    ``$TAK_HOME/data`` (sessions, approved plugin copies). Not contained (the
    workspace may lie inside them): every other ``sys.path`` entry, and
    ``$TAK_HOME`` itself, whose ``workspace/`` is the default workspace. An entry
    that only a path hook serves (an editable install's ``__path_hook__`` name) is
    not a path and does not count.
    """
    disjoint = [
        ("sys.prefix", sys.prefix),
        ("sys.base_prefix", sys.base_prefix),
        ("sys.exec_prefix", sys.exec_prefix),
    ]
    # Any sys.path directory (the script's own, PYTHONPATH): the workspace may not
    # contain one, or a tool could plant a module the next start imports. Lying
    # inside one (a workspace under /tmp when a script in /tmp runs) is harmless:
    # nothing imports the workspace's directories as packages, unlike site-packages.
    not_inside = [("$TAK_HOME", str(home.root))]
    for entry in sys.path:
        path = entry or os.getcwd()  # "" is the current directory
        if _is_path_hook_entry(path):
            continue
        # Whether or not it exists yet, and whatever it is (a directory, a zip, an egg):
        # a tool could create or rewrite it, and the next start would import from it.
        not_inside.append(("an entry of sys.path", path))
        if os.path.basename(path) in ("site-packages", "dist-packages"):
            disjoint.append(("site-packages", path))
    disjoint += [("site-packages", p) for p in site.getsitepackages()]
    disjoint.append(("the user site-packages", site.getusersitepackages()))
    for package in ("kernel", "plugins", "sandbox"):
        module = sys.modules.get(package)
        file = getattr(module, "__file__", None)
        if file is not None:
            disjoint.append((f"the directory of the {package} package", _parent_of(file)))
    disjoint += [("$TAK_HOME/config", str(home.config)), ("$TAK_HOME/data", str(home.data))]
    return disjoint, not_inside


def _is_path_hook_entry(entry: str) -> bool:
    """Whether a ``sys.path`` entry is a name a path hook serves, not a file or directory.

    An editable install (``pip install -e``, setuptools) appends
    ``__editable__.NAME.finder.__path_hook__``: no file of that name exists, and its
    own hook answers for it. Read as a path it would be a name in the current
    directory, refusing every ``--workspace .``. Such an entry names nothing a tool
    could write; should a tool create a directory of that name, it is a real
    directory again and counts (the next start refuses the workspace).
    """
    if os.path.lexists(entry) or os.path.isabs(entry):
        return False
    for hook in sys.path_hooks:
        try:
            hook(entry)
        except Exception:  # ImportError is the usual "not mine"; a hook may raise anything
            continue
        return True  # the file system's hooks refuse a path that does not exist
    return False


def _parent_of(package_init: str) -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(package_init)))


def _check_overlap(workspace: str | os.PathLike[str], home: TakHome) -> None:
    disjoint, not_inside = guarded_paths(home)
    check_workspace_overlap(workspace, disjoint=disjoint, not_inside=not_inside)
    # A worker's current directory is its workspace, where a relative entry (an
    # editable install's path hook name) is a directory again: the file system's
    # hook comes before the one that owns the name, and a `sitecustomize.py` there
    # would run at the worker's interpreter start, before it is confined.
    for entry in sys.path:
        if entry and not os.path.isabs(entry) and os.path.lexists(os.path.join(workspace, entry)):
            raise WorkspaceRefused(
                f"workspace {os.fspath(workspace)} holds {entry}, a relative entry of "
                "sys.path: a worker, which starts in its workspace, would import from it; "
                "remove it"
            )


def _has_port(entry: object) -> bool:
    """``host:port`` or ``[v6]:port``, as the network permission takes them."""
    host, sep, port = str(entry).rpartition(":")
    return bool(sep and host and not host.endswith(":") and port.isdigit())
