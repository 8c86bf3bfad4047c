"""Tools (floor 2, records: no I/O, no Trio at import): ``@tool`` turns a typed
function into a ``Tool``; ``ToolRegistry`` holds them.

A tool's parameters are described twice from one source, the type hints: as
a JSON Schema for the model (``Tool.parameters``) and as a private attrs
class that the tools' strict cattrs converter structures the model's
arguments into (``Tool.validate``). Validation is strict JSON typing: ``"3"``
is not an int, ``true`` is not an int, ``3`` is a float, unknown keys are
refused. A tool known by its schema alone (a sandbox worker's) validates the
JSON object against that schema and sends it on as JSON.

How a tool runs is its ``ToolRunner`` (``Tool.active_runner``): the one seam
the executor calls. Providers' tool formats are not here: each model
adapter turns ``ToolDefinition`` records into its own (kernel.models).

Modules: ``_tool`` (Tool, @tool), ``_docstrings``, ``_schema`` (hints → JSON
Schema), ``_strict`` (the converter), ``_remote`` (JSON Schema → validator),
``_runners`` (the runner seam), ``_registry`` (ToolRegistry, ToolDefinition),
``_failures`` (ArgumentError, ToolFailure).
"""

from ._failures import ArgumentError as ArgumentError
from ._failures import ToolFailure as ToolFailure
from ._failures import describe_exception as describe_exception
from ._hints import JSONSchema as JSONSchema
from ._registry import NAMESPACE_PATTERN as NAMESPACE_PATTERN
from ._registry import NAMESPACE_RULE as NAMESPACE_RULE
from ._registry import ToolDefinition as ToolDefinition
from ._registry import ToolRegistry as ToolRegistry
from ._registry import namespace_of as namespace_of
from ._registry import select_tools as select_tools
from ._registry import wire_form as wire_form
from ._runners import AsyncFunctionRunner as AsyncFunctionRunner
from ._runners import RemoteRunner as RemoteRunner
from ._runners import RunContext as RunContext
from ._runners import SyncFunctionRunner as SyncFunctionRunner
from ._runners import ToolRunner as ToolRunner
from ._tool import TOOL_NAME_PATTERN as TOOL_NAME_PATTERN
from ._tool import Tool as Tool
from ._tool import tool as tool

__all__ = [
    "NAMESPACE_PATTERN",
    "NAMESPACE_RULE",
    "TOOL_NAME_PATTERN",
    "ArgumentError",
    "AsyncFunctionRunner",
    "JSONSchema",
    "RemoteRunner",
    "RunContext",
    "SyncFunctionRunner",
    "Tool",
    "ToolDefinition",
    "ToolFailure",
    "ToolRegistry",
    "ToolRunner",
    "describe_exception",
    "namespace_of",
    "select_tools",
    "tool",
    "wire_form",
]
