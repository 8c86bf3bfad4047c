"""``Tool`` and the ``@tool`` decorator that makes one from a typed function."""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Awaitable, Callable
from typing import Any, overload

import attrs

from .._checks import positive
from ..errors import UsageError
from ._docstrings import parse_docstring
from ._remote import SchemaValidator
from ._runners import (
    AsyncFunctionRunner,
    RemoteRunner,
    SyncFunctionRunner,
    ToolRunner,
    _NothingToRun,
)
from ._schema import parameters_of
from ._strict import converter, kwargs_structurer

TOOL_NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
"""What a tool name must match (in full).

OpenAI and Anthropic accept ``[a-zA-Z0-9_-]{1,64}``; Gemini accepts
letters, digits, ``_ . : -`` up to 64 characters, starting with a letter or
an underscore. This is the strictest rule they share, except that ``.`` is
allowed for namespacing (``fs.read``): OpenAI and Anthropic reject it, so an
adapter for them must map ``.`` to something they accept, and back.
"""


def _check_name(instance: Any, attribute: Any, name: str) -> None:
    if not isinstance(name, str) or not TOOL_NAME_PATTERN.fullmatch(name):
        raise UsageError(
            f"invalid tool name {name!r}: a name starts with a letter or '_' and has at "
            "most 64 letters, digits, '_', '.' or '-'"
        )


@attrs.frozen
class Tool:
    """A function a model may call, with the JSON Schema of its arguments.

    ``fn`` is the original function (``None`` for a tool that runs
    elsewhere, such as a sandbox worker, which sets ``invoke`` instead).
    ``timeout`` is in seconds, ``max_output`` in bytes; an ``exclusive``
    tool runs alone. ``runner`` replaces how the tool runs (see
    ``ToolRunner``); by default it follows from ``invoke`` or ``fn``.

    A ``Tool`` may be built from a JSON Schema alone (``parameters``): it
    then validates arguments against that schema and returns JSON values.

    Raises:
        UsageError: the name breaks ``TOOL_NAME_PATTERN``, ``timeout`` or
            ``max_output`` is not positive, or ``parameters`` is not an object
            schema this module can validate.
    """

    name: str = attrs.field(validator=_check_name)
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any] | None
    is_async: bool
    timeout: float | None = attrs.field(default=None, validator=positive(optional=True))
    exclusive: bool = False
    max_output: int | None = attrs.field(
        default=None, validator=positive(integer=True, optional=True)
    )
    invoke: Callable[[dict[str, Any]], Awaitable[Any]] | None = None
    runner: ToolRunner | None = attrs.field(default=None, eq=False, repr=False)
    # The attrs class arguments are structured into, made from the function's
    # signature by @tool; None for a tool known by its schema alone.
    _arguments_class: type | None = attrs.field(
        default=None, eq=False, repr=False, alias="arguments_class"
    )

    # Worked out once: validation and the runner are on the executor's hot path.
    _structure: Callable[[Any], dict[str, Any]] | None = attrs.field(
        init=False, eq=False, repr=False, default=None
    )
    _schema_validator: SchemaValidator | None = attrs.field(
        init=False, eq=False, repr=False, default=None
    )
    _active_runner: ToolRunner = attrs.field(init=False, eq=False, repr=False, default=None)
    # What prepare() does for this tool, chosen once: one call per tool call.
    _prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = attrs.field(
        init=False, eq=False, repr=False, default=None
    )

    def __attrs_post_init__(self) -> None:
        cls: Any = self._arguments_class
        if cls is None:
            validator = SchemaValidator(self.parameters, f"tool {self.name!r}")
            object.__setattr__(self, "_schema_validator", validator)
        else:
            # cattrs generates the structuring code on first use; do it now so
            # that a definition it cannot handle fails here, not at the first call.
            object.__setattr__(self, "_structure", kwargs_structurer(cls))
        runner: ToolRunner
        if self.runner is not None:
            runner = self.runner
        elif self.invoke is not None:
            runner = RemoteRunner(self.invoke)
        elif self.fn is None:
            runner = _NothingToRun(self.name)
        elif self.is_async:
            runner = AsyncFunctionRunner(self.fn)
        else:
            runner = SyncFunctionRunner(self.fn)
        object.__setattr__(self, "_active_runner", runner)
        # Only a function runner wants Python values; the others send JSON on.
        takes_json = not isinstance(runner, AsyncFunctionRunner | SyncFunctionRunner)
        prepare: Callable[[dict[str, Any]], dict[str, Any]] | None
        if self._schema_validator is not None:
            prepare = self._schema_validator  # validate and validate_json alike
        elif not takes_json:
            prepare = self._structure  # validate, without the method around it
        else:
            prepare = None  # validate_json (a bound method here would be a cycle)
        object.__setattr__(self, "_prepare", prepare)

    @property
    def active_runner(self) -> ToolRunner:
        """The runner the executor calls: ``runner``, or the one ``invoke`` or ``fn`` gives."""
        return self._active_runner

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Check JSON arguments and return the keyword arguments for ``fn(**kwargs)``.

        Values become what the function declared (attrs instances, Enum
        members, tuples) and defaults are filled in. A tool built from a JSON
        Schema alone returns JSON values, as ``validate_json`` does.

        Raises:
            ArgumentError: the message names each failing path and why.
        """
        if self._schema_validator is not None:
            return self._schema_validator(arguments)
        assert self._structure is not None
        return self._structure(arguments)

    def validate_json(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Check JSON arguments and return them as JSON, defaults filled in.

        This is what ``invoke`` (a worker in another process) should receive.

        Raises:
            ArgumentError: the message names each failing path and why.
        """
        if self._schema_validator is not None:
            return self._schema_validator(arguments)
        result: dict[str, Any] = converter.unstructure(self.validate(arguments))
        return result

    def prepare(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Validate once, into what ``active_runner`` takes: keyword arguments for a
        function, the JSON object for anything else.

        Raises:
            ArgumentError: the message names each failing path and why.
        """
        if self._prepare is not None:
            return self._prepare(arguments)
        return self.validate_json(arguments)


def _make_tool(
    fn: Callable[..., Any],
    *,
    name: str | None,
    timeout: float | None,
    exclusive: bool,
    max_output: int | None,
) -> Tool:
    if not callable(fn):
        raise UsageError(f"@tool needs a function, got {fn!r}")
    tool_name = name if name is not None else getattr(fn, "__name__", None)
    if tool_name is None:
        raise UsageError(f"@tool: {fn!r} has no __name__; pass name=")
    parameters, arguments_class = parameters_of(fn, tool_name)
    description, _ = parse_docstring(inspect.getdoc(fn))
    return Tool(
        name=tool_name,
        description=description,
        parameters=parameters,
        fn=fn,
        is_async=inspect.iscoroutinefunction(fn),
        timeout=timeout,
        exclusive=exclusive,
        max_output=max_output,
        arguments_class=arguments_class,
    )


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...


@overload
def tool(
    *,
    name: str | None = None,
    timeout: float | None = None,
    exclusive: bool = False,
    max_output: int | None = None,
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    timeout: float | None = None,
    exclusive: bool = False,
    max_output: int | None = None,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Turn a typed function (sync or async) into a ``Tool``.

    Use bare (``@tool``) or with options (``@tool(timeout=5, exclusive=True)``).
    The docstring gives the description; its Google-style ``Args:`` section
    gives each parameter's description. Parameters with defaults are not
    required.

    Args:
        fn: the function, when used bare.
        name: the tool's name; the function's name by default.
        timeout: seconds a call may run.
        exclusive: run alone, never beside another call.
        max_output: bytes of output kept; the rest is cut with a marker.

    Raises:
        UsageError: ``*args``/``**kwargs``, a parameter without a type hint or
            with an unsupported one, or an invalid name.
    """
    options: dict[str, Any] = dict(
        name=name, timeout=timeout, exclusive=exclusive, max_output=max_output
    )
    if fn is not None:
        return _make_tool(fn, **options)
    return functools.partial(_make_tool, **options)
