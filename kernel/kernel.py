"""The embedding API: one ``Kernel`` owns the nursery, the store, the tools and the model.

::

    async with open_kernel(model="scripted:demo", tools=[search]) as k:
        session = k.session("demo")
        observations = await k.call_tools(session, calls)
        result = await k.run_turn(session, "summarize what you found")

Everything a kernel starts (compaction after a turn, plugin workers) runs in
its own nursery and is gone when the ``async with`` block ends.

``k.tools`` holds the embedder's ``tools`` and every plugin's (see
``plugins._host``: built-ins and discovered plugins unless ``plugins=`` says
which), and the tools of the MCP servers of ``[mcp.servers]`` and
``mcp_servers=`` as ``NAME.tool`` (``plugins._mcp``: listed before a turn or a
call that needs them; ``k.mcp.info()`` says how each server is; docs/mcp.md). ``call_tools``, ``run_turn`` and ``run`` run tools inside
``kernel.context()`` for their session: in-process tools read it, and workers
receive the session key with each call.

A job that needs a workspace of its own (each task of ``kernel.batch``) opens
one with ``k.open_workspace(path)`` and passes it as ``workspace=``: its
in-process tools work there, and its plugin tools in workers confined there,
started for it and killed when the block ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import attrs
import trio

from ._checks import positive
from .agent import (
    Agent,
    AgentEvent,
    AgentEventCallback,
    RunLimits,
    TurnFinished,
    run_calls_recorded,
)
from .errors import UsageError
from .executor import CallLimits
from .history import HistoryCache
from .home import DEFAULT_PROJECT as DEFAULT_PROJECT
from .home import Config, McpServerConfig, TakHome
from .messages import Message, Observation, ToolCall
from .models import Model, ModelBudget, open_http_client, resolve_model
from .plugin import ToolContext, use_context
from .session import Session
from .settings import ModelSettings, merge
from .store import FileStore, SessionKey, SessionStore, open_store
from .tools import Tool, ToolRegistry

if TYPE_CHECKING:
    import httpx

    from plugins import McpServers, PluginHost, PluginSpec
    from sandbox import Workspace


@attrs.frozen(kw_only=True)
class IdleSessions:
    """When a kernel lets go of the sessions nobody is using (``open_kernel(idle_sessions=)``).

    A long-running kernel (``tak serve``) sees sessions come and go: what it
    keeps of each (the transcript's descriptors a ``FileStore`` holds open for
    appending — the file, its directory and its lock file — and the cached
    history, ``Kernel.history``) is given back once the session is idle: when
    more than ``keep`` idle sessions hold theirs (the least recently used goes
    first), and when one has not been used for ``after_s`` seconds (released
    within ``after_s * 1.25``, or ``after_s + 0.1`` when that is later). A session in use (an append in flight, a turn
    holding it) is never released; using a released one reads it back from the
    store, which is all it costs.

    Attributes:
        keep: idle sessions that keep theirs (at least 0).
        after_s: seconds after its last use that a session is released (positive).

    Raises:
        UsageError: ``keep`` is not an integer of at least 0, or ``after_s`` not a
            positive number.
    """

    keep: int = attrs.field(default=16)
    after_s: float = attrs.field(default=300.0, validator=positive())

    @keep.validator
    def _check_keep(self, attribute: attrs.Attribute[int], value: object) -> None:
        # bool is an int in Python: refuse it, as any non-integer.
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UsageError(f"IdleSessions.keep must be an integer of at least 0, got {value!r}")


#: The shortest time between two of the idle-session releaser's timed rounds.
MIN_RELEASE_PERIOD_S = 0.1

#: How many other-model agents ``Kernel.agent_for`` keeps (least recently used goes first):
#: a client choosing a model per request must not grow the kernel without bound.
MAX_MODEL_AGENTS = 16

logger = logging.getLogger("tak.kernel")


class Kernel:
    """What ``open_kernel`` yields; see the module docstring."""

    def __init__(
        self,
        *,
        home: TakHome,
        workspace: Path,
        store: SessionStore,
        tools: ToolRegistry,
        model: Model,
        agent: Agent,
        nursery: trio.Nursery,
        plugins: PluginHost,
        http_client: httpx.AsyncClient | None = None,
        config: Config | None = None,
        mcp: McpServers | None = None,
        allowed_tools: Sequence[str] | None = None,
        budget: ModelBudget | None = None,
        idle_sessions: IdleSessions = IdleSessions(),
    ) -> None:
        #: When idle sessions' descriptors and cached history are given back.
        self.idle_sessions = idle_sessions
        self._session_left = trio.Event()  # a call or a turn ended: look at the counts
        # Main transcripts' names (SessionKey.name) with a call or a turn running: kept.
        self._busy: dict[str, int] = {}
        self._releasing = trio.Lock()  # one release_idle_sessions at a time
        #: The limits every model of this kernel shares (``open_kernel(budget=)``):
        #: ``budget.snapshot()`` shows each provider's requests in flight and waiting.
        self.budget = budget
        #: The tools a run offers when it names none (``None``: all).
        self.allowed_tools = list(allowed_tools) if allowed_tools is not None else None
        self.home = home
        #: ``tak.toml`` as this kernel read it, with ``open_kernel``'s overrides
        #: (``plugin_config``, ``allow_unsandboxed``): the settings in force.
        self.config = config if config is not None else Config()
        self.workspace = workspace
        self.store = store
        self.tools = tools
        self.model = model
        self.agent = agent
        self.plugins = plugins
        #: The MCP servers whose tools join ``tools`` (``mcp.info()``: each one's
        #: state and tools; ``None`` when none is configured).
        self.mcp = mcp
        self._http_client = http_client
        self._agents: OrderedDict[str, Agent] = OrderedDict()  # by model string, LRU first
        self._nursery = nursery
        # Every session of this kernel folds its history once and extends it as it grows.
        self.history = HistoryCache()
        self._compacting: set[str] = set()
        self._compact_again: set[str] = set()  # asked for while one was running

    async def release_idle_sessions(self) -> None:
        """Give back what idle sessions hold, as ``idle_sessions`` says (see
        ``IdleSessions``). ``open_kernel`` runs it in the kernel's nursery after
        each call and turn that leaves more than ``keep`` idle, and every
        ``after_s / 4`` seconds (0.1 s at the least); a call waits for the one running to finish.
        Closing is best effort (a summary not written is rebuilt at the next open).
        """
        async with self._releasing:
            idle = self.idle_sessions
            used_before = trio.current_time() - idle.after_s
            busy = self._busy.keys()
            self.history.release_idle(keep=idle.keep, used_before=used_before, busy=busy)
            if isinstance(self.store, FileStore):
                await self.store.close_idle(keep=idle.keep, used_before=used_before, busy=busy)

    async def _release_idle_sessions_forever(self) -> None:
        """The kernel's releaser: never raises (see ``open_kernel``'s nursery)."""
        # A floor: a period below the clock's resolution (after_s=1e-9) made
        # now + period == now, and the loop never slept again.
        period = max(self.idle_sessions.after_s / 4, MIN_RELEASE_PERIOD_S)
        next_round = trio.current_time() + period
        while True:
            with trio.move_on_at(next_round):
                await self._session_left.wait()
            now = trio.current_time()
            if now >= next_round:
                next_round = now + period
            self._session_left = trio.Event()
            try:
                await self.release_idle_sessions()
            except Exception:
                # A bug here must not end the kernel (its nursery would re-raise it).
                logger.exception("releasing idle sessions failed; trying again later")

    @contextlib.contextmanager
    def _in_use(self, session: Session) -> Iterator[None]:
        """``session`` is in use for the block (never released meanwhile); after
        it, the releaser is woken if idle sessions may be more than ``keep``."""
        name = session.key.main.name
        self._busy[name] = self._busy.get(name, 0) + 1
        try:
            yield
        finally:
            if self._busy[name] == 1:
                del self._busy[name]
            else:
                self._busy[name] -= 1
            keep = self.idle_sessions.keep + len(self._busy)
            if len(self.history) > keep or (
                isinstance(self.store, FileStore) and self.store.open_files > keep
            ):
                self._session_left.set()

    @contextlib.contextmanager
    def tool_context(
        self, session: Session, workspace: Workspace | None = None
    ) -> Iterator[ToolContext]:
        """``kernel.context()`` for tools run on behalf of ``session`` (tasks inherit it),
        in ``workspace`` (one ``open_workspace`` lent) or the kernel's own."""
        with use_context(self.plugins.context(str(session.key), workspace)) as ctx:
            yield ctx

    @contextlib.asynccontextmanager
    async def open_workspace(self, path: str | os.PathLike[str]) -> AsyncIterator[Workspace]:
        """A workspace of its own for one job's tools, until the block ends.

        Pass it as ``workspace=`` to ``run_turn``, ``resume_turn``, ``run`` or
        ``call_tools``: in-process tools work in it, plugin tools in workers
        confined to it (started on the job's first call, killed at the end of
        the block). Jobs in different workspaces never see each other's files.

        Raises:
            SandboxError: ``path`` cannot be opened or overlaps what a workspace
                may not (the Python environment, the kernel's code, ``$TAK_HOME``).
        """
        async with self.plugins.open_workspace(path) as workspace:
            yield workspace

    def session(self, session_id: str | None = None, *, project: str = DEFAULT_PROJECT) -> Session:
        """A session by id (a new random id when ``None``); nothing is written until used.

        Raises:
            UsageError: the id or project is not a valid name.
        """
        key = SessionKey(project, session_id or uuid.uuid4().hex[:16])
        return Session(self.store, key, cache=self.history)

    async def call_tools(
        self,
        session: Session,
        calls: Sequence[ToolCall],
        *,
        limits: CallLimits | None = None,
        on_event: AgentEventCallback | None = None,
        workspace: Workspace | None = None,
    ) -> list[Observation]:
        """Run ``calls`` (as if a model had declared them) and record them in ``session``.

        The calls and their results are appended as one assistant message and its
        tool message, also when the batch is cancelled. ``workspace``: see
        ``open_workspace``.
        """
        if self.mcp is not None:
            # A lazy MCP server starts when a call names one of its tools.
            await self.mcp.list_tools_for([c.name for c in calls])
        with self._in_use(session), self.tool_context(session, workspace):
            return await run_calls_recorded(
                session,
                Message("assistant", list(calls)),
                self.tools,
                limits=limits or self.agent.call_limits,
                on_event=on_event,
            )

    def agent_for(self, model: str | None = None) -> Agent:
        """The kernel's agent, or the same agent on another model (``provider:model``).

        Raises:
            UsageError: a bad model string or a missing API key.
        """
        if model is None or model == self.model.name:
            return self.agent
        agent = self._agents.get(model)
        if agent is not None:
            self._agents.move_to_end(model)
            return agent
        agent = self._agents[model] = self.agent.with_model(
            resolve_model(model, client=self._http_client, budget=self.budget)
        )
        while len(self._agents) > MAX_MODEL_AGENTS:
            self._agents.popitem(last=False)
        return agent

    async def run_turn(
        self,
        session: Session,
        prompt: str,
        *,
        on_event: AgentEventCallback | None = None,
        model: str | None = None,
        settings: ModelSettings | None = None,
        tools: Sequence[str] | None = None,
        limits: RunLimits | None = None,
        workspace: Workspace | None = None,
    ) -> TurnFinished:
        """One agent turn (see ``Agent.run_turn``), on ``model`` when given; compaction
        may follow in the background.

        ``settings`` are merged over the kernel's (``open_kernel(settings=)``,
        over ``[model.settings]`` of ``tak.toml``); ``tools`` selects the tools
        offered (names or patterns such as ``fs.*``); ``limits`` replace the
        kernel's (``open_kernel(limits=)``) for this turn; the tools work in
        ``workspace`` (see ``open_workspace``; default: the kernel's).

        Raises:
            UsageError: ``model`` is a bad model string or lacks its API key; a
                pattern in ``tools`` matches no tool; a ``tool_choice`` the
                selected tools cannot meet.
        """
        agent = _with_limits(self.agent_for(model), limits)
        tools = self._plugin_patterns(tools if tools is not None else self.allowed_tools)
        if workspace is None:  # a lent workspace's workers get processes of their own
            self.plugins.prime()  # a worker's start is ready by the time calls come
        await self._list_mcp_tools(tools)
        with self._in_use(session), self.tool_context(session, workspace):
            result = await agent.run_turn(
                session, prompt, on_event=on_event, settings=settings, tools=tools
            )
        self._compact_later(session)
        return result

    async def check_workspace(self, path: str | os.PathLike[str]) -> None:
        """Refuse ``path`` (or a directory to be made below it) as a workspace, as
        ``open_workspace`` would, before any job is started there.

        Raises:
            SandboxError: it overlaps the Python environment, the kernel's code or
                ``$TAK_HOME``'s config and data.
        """
        await self.plugins.check_workspace(path)

    async def check_run(
        self,
        *,
        model: str | None = None,
        settings: ModelSettings | None = None,
        tools: Sequence[str] | None = None,
    ) -> None:
        """Refuse what ``run_turn`` would refuse of these options, before anything runs
        (a batch checks once, not in every task).

        Raises:
            UsageError: as for ``run_turn``.
        """
        agent = self.agent_for(model)
        patterns = self._plugin_patterns(tools if tools is not None else self.allowed_tools)
        await self._list_mcp_tools(patterns)
        agent._prepare(settings, patterns)

    async def resume_turn(
        self,
        session: Session,
        *,
        on_event: AgentEventCallback | None = None,
        model: str | None = None,
        settings: ModelSettings | None = None,
        tools: Sequence[str] | None = None,
        limits: RunLimits | None = None,
        workspace: Workspace | None = None,
    ) -> TurnFinished:
        """Continue the turn a crash or a cancel left without a final answer (see
        ``Agent.resume_turn``: calls recorded without results are answered as
        interrupted, never run again; a transcript that ends with a final answer
        returns it without a model request). The arguments are ``run_turn``'s.

        Raises:
            UsageError: the session has no message to resume; a turn of it runs in this
                process, or another resume answered its interrupted calls first; as for
                ``run_turn``.
        """
        agent = _with_limits(self.agent_for(model), limits)
        tools = self._plugin_patterns(tools if tools is not None else self.allowed_tools)
        if workspace is None:  # a lent workspace's workers get processes of their own
            self.plugins.prime()  # a worker's start is ready by the time calls come
        await self._list_mcp_tools(tools)
        with self._in_use(session), self.tool_context(session, workspace):
            result = await agent.resume_turn(
                session, on_event=on_event, settings=settings, tools=tools
            )
        self._compact_later(session)
        return result

    @contextlib.asynccontextmanager
    async def run(
        self,
        session: Session,
        prompt: str,
        *,
        model: str | None = None,
        settings: ModelSettings | None = None,
        tools: Sequence[str] | None = None,
        limits: RunLimits | None = None,
        workspace: Workspace | None = None,
    ) -> AsyncIterator[trio.MemoryReceiveChannel[AgentEvent]]:
        """One agent turn as a stream of events (see ``Agent.run``, and ``run_turn``
        for the arguments)."""
        agent = _with_limits(self.agent_for(model), limits)
        tools = self._plugin_patterns(tools if tools is not None else self.allowed_tools)
        if workspace is None:
            self.plugins.prime()
        await self._list_mcp_tools(tools)
        # The agent's tasks start inside this block, so they inherit the context.
        with self._in_use(session), self.tool_context(session, workspace):
            async with agent.run(session, prompt, settings=settings, tools=tools) as events:
                yield events
        self._compact_later(session)

    async def _list_mcp_tools(self, tools: Sequence[str] | None) -> None:
        """Before a turn: the tools of the MCP servers it may offer, listed (lazy
        servers start here) unless cached. A server that fails is left out, with
        its error in ``mcp.info()``."""
        if self.mcp is None:
            return
        if tools is None:
            await self.mcp.list_tools()
        else:
            await self.mcp.list_tools_for([t for t in tools if isinstance(t, str)])

    def _plugin_patterns(self, tools: Sequence[str] | None) -> Sequence[str] | None:
        """``tools`` with each ``PLUGIN.*`` (a loaded plugin's name) replaced by
        that plugin's tools; other names and patterns go on to the agent as they are."""
        if tools is None:
            return tools
        by_plugin = {p.name: list(p.tools) for p in self.plugins.plugins}
        out: list[str] = []
        for pattern in tools:
            if isinstance(pattern, str) and pattern.endswith(".*"):
                names = by_plugin.get(pattern[:-2])
                if names is not None:
                    if not names:
                        raise UsageError(f"tools: plugin {pattern[:-2]!r} has no tools")
                    out.extend(names)
                    continue
            out.append(pattern)
        return out

    def _compact_later(self, session: Session) -> None:
        # One compaction per session at a time: two would both write a summary.
        # A turn that ends while one runs asks for another after it: the running
        # one looked at the transcript before this turn's entries (a turn that
        # ended meanwhile was otherwise never compacted for).
        name = session.key.name
        if self.agent.compact_after_tokens is None:
            return
        if name in self._compacting:
            self._compact_again.add(name)
            return
        self._compacting.add(name)
        self._nursery.start_soon(self._compact_quietly, session, name=f"compact:{session.key}")

    async def _compact_quietly(self, session: Session) -> None:
        """Compaction is an optimization: a failure is logged, never raised into the kernel."""
        name = session.key.name
        try:
            while True:
                self._compact_again.discard(name)
                try:
                    await self.agent.compact(session)
                except Exception:
                    logger.exception(
                        "compaction of %s failed; the session is unchanged", session.key
                    )
                if name not in self._compact_again:
                    break
        finally:
            self._compacting.discard(name)
            self._compact_again.discard(name)


def _with_limits(agent: Agent, limits: RunLimits | None) -> Agent:
    """``agent``, or the same agent under other limits (a per-turn copy: cheap)."""
    if limits is None or limits == agent.limits:
        return agent
    copy = agent.with_model(agent.model)
    copy.limits = limits
    return copy


def _prepare_dirs(
    home: str | os.PathLike[str] | TakHome | None, workspace: str | os.PathLike[str] | None
) -> tuple[TakHome, Path]:
    tak_home = home if isinstance(home, TakHome) else TakHome.locate(home)
    tak_home.ensure()
    work = Path(workspace).expanduser().absolute() if workspace is not None else tak_home.workspace
    if not work.is_dir():
        raise UsageError(f"workspace {str(work)!r} is not a directory")
    return tak_home, work


@contextlib.asynccontextmanager
async def _open_mcp(
    config: Config,
    registry: ToolRegistry,
    home: TakHome,
    workspace: Path,
    vouched: Collection[str],
) -> AsyncIterator[McpServers | None]:
    """The configured MCP servers (``None`` when there are none: ``mcp`` is not imported).

    Stdio servers run confined in ``workspace``; those of tak.toml only once approved
    (``tak mcp trust``), those named in code (``vouched``) without.
    """
    if not config.mcp.servers:
        yield None
        return
    from plugins import open_mcp_servers

    async with open_mcp_servers(
        config.mcp.servers,
        registry,
        log_dir=home.data / "mcp",
        workspace=workspace,
        home=home,
        vouched=vouched,
        allow_unsandboxed=config.sandbox.allow_unsandboxed,
    ) as servers:
        yield servers


@contextlib.asynccontextmanager
async def open_kernel(
    *,
    home: str | os.PathLike[str] | TakHome | None = None,
    workspace: str | os.PathLike[str] | None = None,
    model: str | Model = "scripted:echo",
    fallbacks: Sequence[str] = (),
    tools: Sequence[Tool] | ToolRegistry = (),
    store: SessionStore | None = None,
    durability: Literal["flush", "fsync"] = "flush",
    system: str | None = None,
    limits: RunLimits = RunLimits(),
    call_limits: CallLimits = CallLimits(),
    subagents: bool = True,
    compact_after_tokens: int | None = None,
    plugins: Sequence[PluginSpec] | None = None,
    extra_plugins: Sequence[PluginSpec] = (),
    plugin_config: Mapping[str, Mapping[str, Any]] | None = None,
    allow_unsandboxed: bool | None = None,
    settings: ModelSettings | None = None,
    allowed_tools: Sequence[str] | None = None,
    mcp_servers: Mapping[str, McpServerConfig] | None = None,
    budget: ModelBudget | None = None,
    idle_sessions: IdleSessions = IdleSessions(),
) -> AsyncIterator[Kernel]:
    """Open a kernel: its home, store, model, tools and plugins, and a nursery for its tasks.

    Args:
        home: ``TAK_HOME`` (default: ``$TAK_HOME`` or ``~/.tak``); created if missing.
        workspace: the directory tools work in (default: ``<home>/workspace``).
        model: a ``provider:model`` string (see ``kernel.models.resolve_model``) or a model.
        tools: tools of your own; they keep their names.
        store: where sessions live (default: ``open_store``: a ``PostgresStore`` when
            ``$TAK_STORE_URL`` or ``[store] url`` of ``tak.toml`` is set, else a
            ``FileStore`` under ``<home>/data/sessions``).
        plugins: ``None`` (default) for the built-in plugins and every discovered one;
            else exactly these (names, modules, ``Plugin`` objects; ``[]`` for none).
        extra_plugins: loaded after those (``["demo"]`` adds the toy tools).
        plugin_config: per-plugin settings (``{"web": {"allow_hosts": [...]}}``) that
            replace the same plugins' ``[plugins.<name>]`` sections of ``tak.toml``.
        allow_unsandboxed: run plugins where isolation is missing (default:
            ``[sandbox] allow_unsandboxed`` of ``tak.toml``, else ``False``).
        settings: what every request asks of the model (``kernel.settings``),
            merged over ``[model.settings]`` of ``tak.toml``; a turn's own
            settings are merged over these.
        allowed_tools: the tools a run offers when it names none (names or
            patterns, ``PLUGIN.*`` for a plugin's; default ``[model] tools`` of
            ``tak.toml``, else all); a run's own ``tools=`` replaces it.
        mcp_servers: MCP servers by name, whose tools join the kernel's as
            ``NAME.tool``; they replace the same names of ``[mcp.servers]`` in
            ``tak.toml`` (docs/mcp.md). Named here, a stdio server needs no
            approval (``tak mcp trust``); it still runs confined.
        budget: connections, requests and tokens per minute per provider and
            model, shared by every session and model of the kernel (a model
            string's; a ``Model`` object passed in is used as it is); default:
            ``[budget]`` of ``tak.toml``, else no limits (a provider's
            ``Retry-After`` is still shared).
        idle_sessions: when the descriptors and cached history of sessions
            nobody uses are given back (``IdleSessions``: by default beyond 16
            idle sessions, and after 5 minutes).

    Raises:
        UsageError: a bad model string, a missing API key, a workspace that is
            not a directory, an unreadable ``tak.toml``, a wrong or unknown setting
            in it (``kernel.home.Config``) or a bad store URL.
    """
    from plugins import open_plugin_host

    tak_home, work = await trio.to_thread.run_sync(_prepare_dirs, home, workspace)
    config = await trio.to_thread.run_sync(tak_home.read_config)
    if plugin_config:
        config = config.with_plugin_settings(plugin_config)
    if allow_unsandboxed is not None:
        sandbox = attrs.evolve(config.sandbox, allow_unsandboxed=allow_unsandboxed)
        config = attrs.evolve(config, sandbox=sandbox)
    if mcp_servers:
        servers = {**config.mcp.servers, **mcp_servers}
        config = attrs.evolve(config, mcp=attrs.evolve(config.mcp, servers=servers))
    model_settings = merge(config.model.settings, settings)
    # Always a budget: even without limits, a provider's Retry-After pauses every
    # session of the kernel, not only the one that was refused.
    the_budget = (
        budget
        if budget is not None
        else ModelBudget.from_table(config.budget, where=f"{tak_home.config_file}: [budget]")
    )
    owned_store = store is None
    the_store: SessionStore = (
        store if store is not None else open_store(tak_home, config.store, durability=durability)
    )
    try:
        async with (
            open_plugin_host(
                work,
                plugins=plugins,
                extra_plugins=extra_plugins,
                tools=tools,
                config=config,
                allow_unsandboxed=config.sandbox.allow_unsandboxed,
                home=tak_home,
            ) as host,
            open_http_client() as client,
            _open_mcp(config, host.tools, tak_home, work, list(mcp_servers or ())) as mcp,
        ):
            registry = host.tools
            the_model = (
                resolve_model(model, client=client, fallbacks=fallbacks, budget=the_budget)
                if isinstance(model, str)
                else model
            )
            agent = Agent(
                the_model,
                registry,
                system=system,
                limits=limits,
                call_limits=call_limits,
                subagents=subagents,
                compact_after_tokens=compact_after_tokens,
                settings=model_settings if model_settings.set_fields() else None,
            )
            try:
                async with trio.open_nursery() as nursery:
                    k = Kernel(
                        home=tak_home,
                        workspace=work,
                        store=the_store,
                        tools=registry,
                        model=the_model,
                        agent=agent,
                        nursery=nursery,
                        plugins=host,
                        http_client=client,
                        config=config,
                        allowed_tools=(
                            allowed_tools if allowed_tools is not None else config.model.tools
                        ),
                        mcp=mcp,
                        budget=the_budget,
                        idle_sessions=idle_sessions,
                    )
                    nursery.start_soon(
                        k._release_idle_sessions_forever, name="release idle sessions"
                    )
                    yield k
                    # Background work (compaction) is optional: don't hold the exit for it.
                    nursery.cancel_scope.cancel()
            except BaseExceptionGroup as group:
                # Background tasks never raise (see _compact_quietly), so a lone
                # exception is the caller's own, from the body: give it back as it was.
                if len(group.exceptions) == 1:
                    raise group.exceptions[0] from None
                raise
    finally:
        if owned_store:
            # Closing writes summaries; appends are on disk already, so a store that
            # hangs is given up on after a while rather than hanging the exit.
            with trio.CancelScope(shield=True) as closing:
                closing.deadline = trio.current_time() + 30
                await the_store.aclose()


__all__ = ["DEFAULT_PROJECT", "IdleSessions", "Kernel", "open_kernel"]
