"""Where the kernel keeps its files (``TAK_HOME``, default ``~/.tak``) and its ``tak.toml``.

::

    $TAK_HOME/config/     tak.toml
    $TAK_HOME/data/       sessions and other state
    $TAK_HOME/workspace/  the default workspace for tools and plugins

Code never writes beside itself: everything goes under a ``TakHome``.

``tak.toml`` is read once, into a ``Config`` record (``TakHome.read_config``),
and checked as a whole: a wrong value or an unknown setting is refused at
start with one line that names the file and the setting's path in it::

    ~/.tak/config/tak.toml: $.sandbox.allow_unsandboxed: expected a boolean, got "yes"

The older readers (``TakHome.load_config``, ``workspace_max_bytes``, ``workspace_max_files``,
``store_url``, ``store_request_timeout_s``) work on the parsed TOML as a mapping, for
code that still takes one; they check it as ``Config`` does (one rule, one wording).
"""

from __future__ import annotations

import functools
import json
import math
import os
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

import attrs

from ._providers import HTTP_PROVIDERS
from .errors import UsageError
from .settings import ModelSettings

if TYPE_CHECKING:
    import cattrs

__all__ = [
    "BUDGET_PROVIDERS",
    "DEFAULT_PROJECT",
    "DEFAULT_STORE_REQUEST_TIMEOUT_S",
    "STORE_URL_ENV",
    "BudgetTable",
    "Config",
    "McpConfig",
    "McpServerConfig",
    "ModelConfig",
    "SandboxConfig",
    "StoreConfig",
    "TakHome",
    "WorkspaceConfig",
    "env_store_url",
    "store_request_timeout_s",
    "store_url",
    "workspace_max_bytes",
    "workspace_max_files",
]

STORE_URL_ENV = "TAK_STORE_URL"
#: ``[store] request_timeout_s`` when unset: the longest one call to a PostgreSQL
#: store (its retries included) may take.
DEFAULT_STORE_REQUEST_TIMEOUT_S: Final = 30.0

#: The project a session belongs to when none is named (``data/sessions/<project>/``):
#: the kernel, the CLI and the WebSocket protocol all default to it.
DEFAULT_PROJECT: Final = "default"


@attrs.frozen
class TakHome:
    root: Path

    @classmethod
    def locate(cls, override: str | os.PathLike[str] | None = None) -> TakHome:
        """``override`` (``--home``), else ``$TAK_HOME``, else ``~/.tak``."""
        if override is not None:
            return cls(Path(override).expanduser().absolute())
        env = os.environ.get("TAK_HOME")
        if env:
            return cls(Path(env).expanduser().absolute())
        return cls(Path.home() / ".tak")

    @property
    def config(self) -> Path:
        return self.root / "config"

    @property
    def config_file(self) -> Path:
        """``config/tak.toml``: ``[sandbox] allow_unsandboxed`` and ``[plugins.<name>]``."""
        return self.config / "tak.toml"

    def read_config(self) -> Config:
        """``tak.toml``, read and checked (the defaults when there is no file).

        Blocking file I/O: from Trio, call it in a thread.

        Raises:
            UsageError: the file is not valid TOML, or a setting is wrong or
                unknown: one line naming the file and the setting's ``$.path``.
        """
        data = self._read_toml()
        return Config() if data is None else Config.from_toml(data, source=self.config_file)

    def load_config(self) -> dict[str, Any]:
        """The parsed ``tak.toml`` as a mapping (empty when there is none).

        Kept for code that takes the mapping; ``read_config`` checks every
        setting and gives a ``Config``.

        Raises:
            UsageError: the file is not valid TOML (the message names it and the line),
                or a setting is wrong: checked as ``read_config`` checks it.
        """
        config = self._read_toml()
        if config is None:
            return {}
        Config.from_toml(config, source=self.config_file)  # refused here, at start, not later
        return config

    def _read_toml(self) -> dict[str, Any] | None:
        """The parsed file, ``None`` when there is none.

        Raises:
            UsageError: not valid TOML (the message names the file and the line).
        """
        try:
            with open(self.config_file, "rb") as f:
                return tomllib.load(f)
        except FileNotFoundError:
            return None
        except NotADirectoryError:
            self._refuse_a_file()
            raise
        except tomllib.TOMLDecodeError as exc:
            raise UsageError(f"{self.config_file}: {exc}") from None

    def _refuse_a_file(self) -> None:
        """Say what is wrong with a root that is a file (the system says "File exists" or
        "Not a directory" about a path below it)."""
        if self.root.exists() and not self.root.is_dir():
            raise UsageError(f"TAK_HOME {self.root} is a file, not a directory")

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def sessions(self) -> Path:
        return self.data / "sessions"

    @property
    def workspace(self) -> Path:
        return self.root / "workspace"

    def ensure(self) -> TakHome:
        """Create the directories (mode 0700 for the root) and return self.

        Raises:
            UsageError: the root is a file.
            OSError: a directory cannot be created.
        """
        self._refuse_a_file()
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        for d in (self.config, self.data, self.sessions, self.workspace):
            d.mkdir(parents=True, exist_ok=True)
        return self


def workspace_max_bytes(
    config: Mapping[str, Any], source: str | os.PathLike[str] = "tak.toml"
) -> int | None:
    """``[workspace] max_bytes``: the workspace's disk budget, ``None`` when unset.

    Raises:
        UsageError: checked as ``Config`` checks it (one line naming ``source`` and
            ``$.workspace.max_bytes``).
    """
    return _section(config, "workspace", source).workspace.max_bytes


def workspace_max_files(
    config: Mapping[str, Any], source: str | os.PathLike[str] = "tak.toml"
) -> int | None:
    """``[workspace] max_files``: how many names the workspace may hold, ``None`` when unset.

    Raises:
        UsageError: checked as ``Config`` checks it.
    """
    return _section(config, "workspace", source).workspace.max_files


def store_url(config: Mapping[str, Any], source: str | os.PathLike[str] = "tak.toml") -> str | None:
    """Where sessions live: ``$TAK_STORE_URL``, else ``[store] url``, else ``None`` (files).

    Only the shape is checked here; the store checks the rest of the URL when
    it is created.

    Raises:
        UsageError: ``[store]`` checked as ``Config`` checks it, or
            ``$TAK_STORE_URL`` is not a ``postgresql://`` URL (one line naming it).
    """
    url = _section(config, "store", source).store.url
    return env_store_url() or url


def env_store_url() -> str | None:
    """``$TAK_STORE_URL`` (which wins over ``[store] url``), ``None`` when unset or empty.

    Raises:
        UsageError: not a ``postgresql://`` URL (one line naming the variable).
    """
    env = os.environ.get(STORE_URL_ENV)
    if not env:
        return None
    try:
        _check_url(env)
    except _BadValue as exc:
        raise UsageError(f"${STORE_URL_ENV}: {exc}") from None
    return env


def store_request_timeout_s(
    config: Mapping[str, Any], source: str | os.PathLike[str] = "tak.toml"
) -> float:
    """``[store] request_timeout_s``: the longest one store call may take (seconds).

    Raises:
        UsageError: checked as ``Config`` checks it.
    """
    return _section(config, "store", source).store.request_timeout_s


def _section(config: Mapping[str, Any], name: str, source: str | os.PathLike[str]) -> Config:
    """A ``Config`` of ``config``'s section ``name`` alone, checked (the older readers
    take the whole mapping and look at one section: the others are not theirs)."""
    return Config.from_toml({name: config[name]} if name in config else {}, source=source)


# -- tak.toml as a record ------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SandboxConfig:
    """``[sandbox]``.

    Attributes:
        allow_unsandboxed: run plugins that need isolation where Landlock or
            seccomp is missing (the default refuses them: fail closed).
    """

    allow_unsandboxed: bool = False


def _check_url(value: str | None) -> None:
    if value is not None and not value.startswith(("postgresql://", "postgres://")):
        raise _BadValue(f"expected a postgresql:// URL, got {_shown(_shown_url(value))}")


def _check_bytes(value: int | None) -> None:
    if value is not None and value <= 0:
        raise _BadValue(f"expected a positive whole number of bytes, got {_shown(value)}")


def _check_files(value: int | None) -> None:
    if value is not None and value <= 0:
        raise _BadValue(f"expected a positive whole number of files, got {_shown(value)}")


def _validator(check: Callable[[Any], None]) -> Callable[[object, attrs.Attribute[Any], Any], None]:
    """``check`` as an attrs validator (a record made in code is checked like one read)."""

    def validate(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        try:
            check(value)
        except _BadValue as exc:
            raise UsageError(f"{type(instance).__name__}.{attribute.name}: {exc}") from None

    return validate


@attrs.frozen(kw_only=True)
class StoreConfig:
    """``[store]``.

    Attributes:
        url: a ``postgresql://`` URL: sessions live in PostgreSQL (``$TAK_STORE_URL``
            wins over it); ``None``: files under ``data/sessions``. Only the shape is
            checked here; the store checks the rest when it is made.
        request_timeout_s: the longest one call to a PostgreSQL store may take,
            its retries included, before it fails with ``StoreError`` (seconds).
    """

    url: str | None = attrs.field(default=None, validator=_validator(_check_url))
    # (a lambda: _check_seconds is defined further down)
    request_timeout_s: float = attrs.field(
        default=DEFAULT_STORE_REQUEST_TIMEOUT_S,
        validator=_validator(lambda value: _check_seconds(value)),
    )


@attrs.frozen(kw_only=True)
class WorkspaceConfig:
    """``[workspace]``.

    Attributes:
        max_bytes: the workspace's disk budget (``None``: the plugin host's default).
        max_files: how many names (files, directories, links) it may hold (``None``:
            the plugin host's default, ``sandbox.DEFAULT_MAX_FILES``).
    """

    max_bytes: int | None = attrs.field(default=None, validator=_validator(_check_bytes))
    max_files: int | None = attrs.field(default=None, validator=_validator(_check_files))


@attrs.frozen(kw_only=True)
class ModelConfig:
    """``[model]``.

    Attributes:
        settings: ``[model.settings]``: what every request asks of the model
            (``kernel.settings.ModelSettings``: ``temperature``, ``max_tokens``,
            ``tool_choice``, ...); a run's own settings are merged over them.
        tools: ``[model] tools``: the tools a run offers when it names none
            (names or patterns, ``fs.*`` for a plugin's); ``None``: all of them.
    """

    settings: ModelSettings | None = None
    tools: list[str] | None = None


def _check_seconds(value: float | None) -> None:
    # bool is an int in Python: refuse it; an endless wait is no limit at all.
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf
    ):
        raise _BadValue(f"expected a positive number of seconds, got {_shown(value)}")


def _check_start(value: str) -> None:
    if value not in ("lazy", "eager"):
        raise _BadValue(f'expected "lazy" or "eager", got {_shown(value)}')


def _check_mcp_workspace(value: str) -> None:
    if value not in ("read", "write", "none"):
        raise _BadValue(f'expected "read", "write" or "none", got {_shown(value)}')


def _check_host_ports(value: list[str]) -> None:
    from sandbox._policy import check_network

    try:
        check_network(value, "")
    except UsageError as exc:  # "[2]: expected 'host:port' ...", after the setting's path
        raise _BadValue(str(exc).lstrip(": ")) from None


def _check_read_paths(value: list[str]) -> None:
    for position, path in enumerate(value):
        if not os.path.isabs(os.path.expanduser(path)):
            raise _BadValue(f"[{position}]: expected an absolute path, got {_shown(path)}")


def _check_count(value: int | None) -> None:
    if value is not None and (type(value) is not int or value <= 0):
        raise _BadValue(f"expected a positive whole number, got {_shown(value)}")


#: The settings that confine a stdio server (``sandbox.exec``), refused on an HTTP one.
_STDIO_ONLY: Final = (
    "command",
    "args",
    "env",
    "cwd",
    "workspace",
    "network",
    "subprocess",
    "read",
    "memory_bytes",
    "cpu_seconds",
    "file_size_bytes",
    "open_files",
    "processes",
)


@attrs.frozen(kw_only=True)
class McpServerConfig:
    """``[mcp.servers.NAME]``: one MCP server whose tools the kernel offers as ``NAME.tool``.

    Exactly one of ``command`` (a local server over stdio) and ``url`` (streamable
    HTTP) is set.

    Attributes:
        command: the program to run (stdio), with ``args``, in ``cwd``.
        env: variables the program gets, beside a few safe ones (``PATH``,
            ``HOME``, ...): it never inherits the kernel's whole environment.
        url: the server's endpoint (``http://host:port/mcp``), sent ``headers``.
        tools: the server's tool names to offer (``None``: all of them).
        timeout: seconds a call may take (``None``: the kernel's per-call limit).
        startup_timeout: seconds to start and greet the server (and list its tools).
        start: ``"lazy"`` (on first need: a turn or a call) or ``"eager"`` (when
            the kernel opens).

    A stdio server runs confined like a plugin worker (``sandbox.exec``), with
    these permissions, and only once approved (``tak mcp trust NAME``):

    Attributes:
        workspace: ``"read"`` (the default), ``"write"`` or ``"none"``: how it may
            reach the kernel's workspace.
        network: ``"host:port"`` entries: TCP connections to these ports (the host
            is not enforced for a program: docs/mcp.md); empty: no network.
        subprocess: may start programs (from the system's binary directories).
        read: more absolute paths it may read (its data, its configuration).
        memory_bytes, cpu_seconds, file_size_bytes, open_files, processes: its limits
            (the memory of its whole process tree when cgroups are available; CPU time
            3600 s and files of 1 GiB by default, as a plugin worker's; ``None``: no
            limit).
    """

    command: str | None = None
    args: list[str] = attrs.field(factory=list)
    env: dict[str, str] = attrs.field(factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] = attrs.field(factory=dict)
    tools: list[str] | None = None
    timeout: float | None = attrs.field(default=None, validator=_validator(_check_seconds))
    startup_timeout: float = attrs.field(default=30.0, validator=_validator(_check_seconds))
    start: str = attrs.field(default="lazy", validator=_validator(_check_start))
    workspace: str = attrs.field(default="read", validator=_validator(_check_mcp_workspace))
    network: list[str] = attrs.field(factory=list, validator=_validator(_check_host_ports))
    subprocess: bool = False
    read: list[str] = attrs.field(factory=list, validator=_validator(_check_read_paths))
    memory_bytes: int | None = attrs.field(default=4 * 1024**3, validator=_validator(_check_count))
    cpu_seconds: int | None = attrs.field(default=3600, validator=_validator(_check_count))
    file_size_bytes: int | None = attrs.field(default=1024**3, validator=_validator(_check_count))
    open_files: int = attrs.field(default=1024, validator=_validator(_check_count))
    processes: int = attrs.field(default=128, validator=_validator(_check_count))

    def __attrs_post_init__(self) -> None:
        try:
            _check_server(self)
        except _BadValue as exc:
            raise UsageError(f"McpServerConfig: {exc}") from None


def _check_server(server: McpServerConfig) -> None:
    if (server.command is None) == (server.url is None):
        raise _BadValue("set exactly one of command (stdio) and url (streamable HTTP)")
    if server.url is not None and not server.url.startswith(("http://", "https://")):
        raise _BadValue(f"url: expected an http:// or https:// URL, got {_shown(server.url)}")
    if server.url is not None:
        defaults = McpServerConfig(command="x")
        _check_stdio_only(n for n in _STDIO_ONLY[1:] if getattr(server, n) != getattr(defaults, n))


def _check_stdio_only(names: Any) -> None:
    """An HTTP server runs elsewhere: nothing here confines it (it is reached at its url)."""
    found = [n for n in names if n in _STDIO_ONLY]
    if found:
        raise _BadValue(f"{found[0]}: only for a stdio server (command), not with url")


def _check_server_name(name: str) -> None:
    # A server's name is its tools' namespace (``m3.echo``): the registry's rule, so
    # a name it would refuse at start (``m3_``, ``a__b``) is refused here, in tak.toml.
    # (Imported here: kernel.tools costs ``tak --help`` what this module saves it.)
    from .tools import NAMESPACE_PATTERN, NAMESPACE_RULE

    if len(name) > 31 or not NAMESPACE_PATTERN.fullmatch(name):
        raise _BadValue(
            f"server name {_shown(name)}: expected at most 31 characters, {NAMESPACE_RULE}"
        )


@attrs.frozen(kw_only=True)
class McpConfig:
    """``[mcp]``.

    Attributes:
        servers: ``[mcp.servers.NAME]``, by name (see ``McpServerConfig``).
    """

    servers: dict[str, McpServerConfig] = attrs.field(factory=dict)


#: The providers ``[budget]`` may name: ``kernel.models.resolve_model``'s but
#: ``scripted``, which sends nothing (a misspelt one would never apply).
#: tests/test_config.py checks that the two agree.
BUDGET_PROVIDERS: Final = HTTP_PROVIDERS
#: The limits of one ``[budget.<provider>]`` table, each an integer >= 1.
BUDGET_LIMITS: Final = ("max_connections", "requests_per_minute", "tokens_per_minute")
_BUDGET_SECONDS: Final = ("backoff", "max_pause")


@attrs.frozen(kw_only=True)
class BudgetTable:
    """``[budget]`` checked (``kernel.models.ModelBudget.from_table`` builds from it).

    Attributes:
        default: ``[budget.default]``'s limits, ``None`` when not given.
        providers: ``[budget.<provider>]``'s limits, by provider.
        models: ``[budget."provider:model"]``'s limits, by ``provider:model``.
        seconds: ``backoff`` and ``max_pause``, those given.
    """

    default: dict[str, int] | None = None
    providers: dict[str, dict[str, int]] = attrs.field(factory=dict)
    models: dict[str, dict[str, int]] = attrs.field(factory=dict)
    seconds: dict[str, float] = attrs.field(factory=dict)

    @classmethod
    def from_table(cls, table: object, *, where: str = "$.budget") -> BudgetTable:
        """``table`` (a parsed ``[budget]``) checked.

        Raises:
            UsageError: ``{where}.key: reason`` for the first thing wrong.
        """
        if not isinstance(table, Mapping):
            raise UsageError(f"{where}: expected a table, got {_shown(table)}")
        default: dict[str, int] | None = None
        providers: dict[str, dict[str, int]] = {}
        models: dict[str, dict[str, int]] = {}
        seconds: dict[str, float] = {}
        for key, value in table.items():
            if not isinstance(key, str):
                raise UsageError(f"{where}: expected a provider name as key, got {key!r}")
            if key in _BUDGET_SECONDS:
                number = value
                if isinstance(number, bool) or not isinstance(number, int | float):
                    raise UsageError(f"{where}.{key}: expected seconds >= 0, got {_shown(value)}")
                if not 0 <= number < math.inf:
                    raise UsageError(f"{where}.{key}: expected seconds >= 0, got {_shown(value)}")
                seconds[key] = float(number)
                continue
            inner = f"{where}.{key}" if ":" not in key else f'{where}."{key}"'
            limits = _budget_limits(value, inner)
            provider, colon, name = key.partition(":")
            if key == "default":
                default = limits
                continue
            if colon and not (provider and name):
                raise UsageError(f"{inner}: expected provider:model")
            if provider not in BUDGET_PROVIDERS:
                raise UsageError(
                    f"{inner}: unknown provider {_shown(provider)} "
                    f"(known: default, {', '.join(BUDGET_PROVIDERS)})"
                )
            (models if colon else providers)[key] = limits
        return cls(default=default, providers=providers, models=models, seconds=seconds)


def _budget_limits(value: object, where: str) -> dict[str, int]:
    if not isinstance(value, Mapping):
        raise UsageError(f"{where}: expected a table of limits, got {_shown(value)}")
    for key in value:
        if key not in BUDGET_LIMITS:
            raise UsageError(
                f"{where}: unknown setting {key!r} (known: {', '.join(BUDGET_LIMITS)})"
            )
    for key, limit in value.items():
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise UsageError(
                f"{where}.{key}: expected an integer >= 1, got {_shown(limit)}; "
                "leave the key out for no limit"
            )
    return dict(value)


@attrs.frozen(kw_only=True)
class Config:
    """``tak.toml``: what ``TakHome.read_config`` gives.

    Attributes:
        sandbox: ``[sandbox]``.
        store: ``[store]``.
        workspace: ``[workspace]``.
        model: ``[model]``.
        mcp: ``[mcp]``: the MCP servers whose tools the kernel offers.
        plugins: ``[plugins.<name>]``: each plugin's own settings (what its
            tools see as ``context().config``), checked by the plugin.
        budget: ``[budget]``: the model budget every session of a kernel shares,
            checked here (``BudgetTable``) and built by
            ``kernel.models.ModelBudget.from_table`` when a kernel opens
            (docs/models.md).
    """

    sandbox: SandboxConfig = SandboxConfig()
    store: StoreConfig = StoreConfig()
    workspace: WorkspaceConfig = WorkspaceConfig()
    model: ModelConfig = ModelConfig()
    mcp: McpConfig = McpConfig()
    plugins: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    budget: dict[str, Any] = attrs.field(factory=dict)

    @classmethod
    def from_toml(
        cls, data: Mapping[str, Any], *, source: str | os.PathLike[str] = "tak.toml"
    ) -> Config:
        """``data`` (parsed TOML) checked into a ``Config``.

        Raises:
            UsageError: ``{source}: $.path: reason`` for the first thing wrong
                (every one, joined by ``; ``, when there are several).
        """
        from .messages import structure_error_paths

        try:
            config: Config = _config_converter().structure(dict(data), cls)
        except Exception as exc:
            problems = structure_error_paths(exc, "$", _format_problem)
            detail = "; ".join(f"{path}: {reason}" for path, reason in problems)
            raise UsageError(f"{source}: {detail}") from None
        try:
            BudgetTable.from_table(config.budget)
        except UsageError as exc:
            raise UsageError(f"{source}: {exc}") from None
        return config

    def to_toml(self) -> dict[str, Any]:
        """The mapping ``tak.toml`` would parse to (settings left at their default left out).

        For code that takes the parsed TOML (``kernel.store.open_store``,
        ``plugins.open_plugin_host``).
        """
        data: dict[str, Any] = _config_converter().unstructure(self)
        return data

    def with_plugin_settings(self, settings: Mapping[str, Mapping[str, Any]]) -> Config:
        """This config with ``settings`` replacing the same plugins' ``[plugins.<name>]``."""
        return attrs.evolve(
            self, plugins={**self.plugins, **{name: dict(v) for name, v in settings.items()}}
        )


class _BadValue(ValueError):
    """A config value refused, with the reason as a person reads it."""


_NAMES = {bool: "a boolean", int: "a whole number", str: "a string", float: "a number"}


def _shown(value: object) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):  # a TOML date or time
        return str(value)


def _shown_url(url: str) -> str:
    # A URL may carry a password: show its scheme only.
    return url.split("://", 1)[0] + "://..." if "://" in url else url


def _format_problem(exc: BaseException, expected: type | None) -> str:
    import cattrs
    import cattrs.v

    if isinstance(exc, _BadValue):
        return str(exc)
    if isinstance(exc, cattrs.ForbiddenExtraKeysError):
        known = ", ".join(a.name for a in attrs.fields(exc.cl)) if exc.cl else ""
        unknown = ", ".join(repr(k) for k in sorted(exc.extra_fields))
        return f"unknown setting {unknown} (known: {known})"
    if isinstance(exc, KeyError):
        return "required setting missing"
    if isinstance(exc, AttributeError) and str(exc).endswith("no attribute 'items'"):
        return "expected a table"  # cattrs read a table's items from something else
    return cattrs.v.format_exception(exc, expected)


_T = TypeVar("_T")


@functools.cache
def _config_converter() -> cattrs.Converter:
    """The converter for ``Config``, made on first use.

    ``import kernel.home`` stays cheap: every ``tak`` command imports it, and
    cattrs loads only when a config is read.
    """
    import cattrs
    from cattrs.errors import IterableValidationNote
    from cattrs.gen import make_dict_structure_fn, override

    from .messages import converter

    # Its own copy: config hooks (TOML tables, error wording) are not message hooks.
    conv = converter.copy(omit_if_default=True)

    def strict(expected: type, check: Callable[[Any], None] | None = None) -> Any:
        def hook(value: Any, _: Any) -> Any:
            # bool is an int in Python, and cattrs would turn "3" into 3: refuse both.
            if type(value) is not expected:
                raise _BadValue(f"expected {_NAMES[expected]}, got {_shown(value)}")
            if check is not None:
                check(value)  # here, so that the error's path names the setting
            return value

        return hook

    for t in (str, int, bool):
        conv.register_structure_hook(t, strict(t))

    def table(value: Any, _: Any) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise _BadValue(f"expected a table, got {_shown(value)}")
        return dict(value)

    # [plugins.<name>]: each a table, its contents the plugin's to check. (A
    # generic alias is not a class: registered by predicate, before the records'
    # hooks are made, since they look their fields' hooks up when made.)
    conv.register_structure_hook_func(lambda t: t == dict[str, Any], table)

    def section(cls: type[_T], **fields: Any) -> Callable[[Any, Any], _T]:
        structure = make_dict_structure_fn(cls, conv, **fields)

        def hook(value: Any, _: Any) -> _T:
            return structure(table(value, None), cls)

        return hook

    conv.register_structure_hook(SandboxConfig, section(SandboxConfig))
    conv.register_structure_hook(
        WorkspaceConfig,
        section(
            WorkspaceConfig,
            max_bytes=override(struct_hook=strict(int, _check_bytes)),
            max_files=override(struct_hook=strict(int, _check_files)),
        ),
    )

    def model_settings(value: Any, _: Any) -> ModelSettings:
        from .settings import settings_from_mapping

        try:
            return settings_from_mapping(table(value, None), "")
        except UsageError as exc:  # ".temperature: ...", after the table's path
            raise _BadValue(str(exc).lstrip(".")) from None

    conv.register_structure_hook(ModelSettings, model_settings)
    conv.register_unstructure_hook(
        ModelSettings,
        lambda s: {k: list(v) if isinstance(v, tuple) else v for k, v in s.set_fields().items()},
    )

    def strings(value: Any, _: Any) -> list[str]:
        # A bare string would be read as a list of its characters: refuse it.
        if type(value) is not list:
            raise _BadValue(f"expected a list of strings, got {_shown(value)}")
        return [conv.structure(v, str) for v in value]

    def string_table(value: Any, _: Any) -> dict[str, str]:
        return {k: conv.structure(v, str) for k, v in table(value, None).items()}

    def checked_strings(check: Callable[[list[str]], None]) -> Callable[[Any, Any], list[str]]:
        def hook(value: Any, _: Any) -> list[str]:
            out = strings(value, None)
            check(out)
            return out

        return hook

    def seconds(value: Any, _: Any) -> float:
        _check_seconds(value)
        return float(value)

    conv.register_structure_hook(
        StoreConfig,
        section(
            StoreConfig,
            url=override(struct_hook=strict(str, _check_url)),
            request_timeout_s=override(struct_hook=seconds),
        ),
    )

    conv.register_structure_hook_func(lambda t: t == list[str], strings)
    conv.register_structure_hook_func(lambda t: t == dict[str, str], string_table)
    # After the list hook: a record's structuring code looks its fields' hooks up when made.
    conv.register_structure_hook(ModelConfig, section(ModelConfig))
    server_fields = section(
        McpServerConfig,
        timeout=override(struct_hook=seconds),
        startup_timeout=override(struct_hook=seconds),
        start=override(struct_hook=strict(str, _check_start)),
        workspace=override(struct_hook=strict(str, _check_mcp_workspace)),
        network=override(struct_hook=checked_strings(_check_host_ports)),
        read=override(struct_hook=checked_strings(_check_read_paths)),
        memory_bytes=override(struct_hook=strict(int, _check_count)),
        cpu_seconds=override(struct_hook=strict(int, _check_count)),
        file_size_bytes=override(struct_hook=strict(int, _check_count)),
        open_files=override(struct_hook=strict(int, _check_count)),
        processes=override(struct_hook=strict(int, _check_count)),
    )

    def server(value: Any, _: Any) -> McpServerConfig:
        raw = table(value, None)
        # The record's own check across its fields (_check_server), on the table,
        # so that its error names the server's path like any other.
        if ("command" in raw) == ("url" in raw):
            raise _BadValue("set exactly one of command (stdio) and url (streamable HTTP)")
        url = raw.get("url")
        if isinstance(url, str) and not url.startswith(("http://", "https://")):
            raise _BadValue(f"url: expected an http:// or https:// URL, got {_shown(url)}")
        if "url" in raw:
            _check_stdio_only(raw)
        return server_fields(raw, None)

    def servers(value: Any, _: Any) -> dict[str, McpServerConfig]:
        out: dict[str, McpServerConfig] = {}
        errors: list[Exception] = []
        for name, item in table(value, None).items():
            try:
                _check_server_name(name)
                out[name] = server(item, None)
            except Exception as exc:
                note = f"Structuring mapping value @ key {name!r}"
                exc.__notes__ = [IterableValidationNote(note, name, McpServerConfig)]
                errors.append(exc)
        if errors:
            raise cattrs.IterableValidationError("bad servers", errors, dict)
        return out

    conv.register_structure_hook_func(lambda t: t == dict[str, McpServerConfig], servers)
    conv.register_structure_hook(McpConfig, section(McpConfig))
    conv.register_structure_hook(Config, section(Config))
    return conv
