"""Model settings (floor 2, records): what a run asks of the model besides its messages.

``ModelSettings`` is one frozen record of optional fields. It can be given at
every level — the kernel, an agent, a turn, one model of a fallback chain,
``[model.settings]`` in ``tak.toml``, ``tak run`` flags, the WebSocket ``run``
request — and the levels are merged field by field, the nearer one winning
(``merge``). Each model adapter maps every field to its provider's wire name
and refuses, before anything is sent, a field its provider cannot express
(docs/models.md has the table). ``extra`` is merged into the request body
last, as it is: provider-specific keys nothing else knows.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal, TypeAlias, get_args

import attrs

from .errors import UsageError

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "REASONING_EFFORTS",
    "TOOL_CHOICES",
    "ModelSettings",
    "ReasoningEffort",
    "check_tool_choice",
    "merge",
    "settings_from_mapping",
]

ReasoningEffort: TypeAlias = Literal["minimal", "low", "medium", "high"]
REASONING_EFFORTS: Final = get_args(ReasoningEffort)
TOOL_CHOICES: Final = ("auto", "required", "none")

#: Sent when no level sets ``max_tokens``: a reply never runs to the context limit.
DEFAULT_MAX_TOKENS: Final = 4096

_MAX_STOP = 16


def _check_temperature(_: object, __: attrs.Attribute[Any], value: float | None) -> None:
    if value is not None and not (_is_number(value) and 0 <= value <= 2):
        raise UsageError(f"temperature: expected a number from 0 to 2, got {value!r}")


def _check_top_p(_: object, __: attrs.Attribute[Any], value: float | None) -> None:
    if value is not None and not (_is_number(value) and 0 < value <= 1):
        raise UsageError(f"top_p: expected a number above 0 and at most 1, got {value!r}")


def _check_max_tokens(_: object, __: attrs.Attribute[Any], value: int | None) -> None:
    if value is not None and not (type(value) is int and value >= 1):
        raise UsageError(f"max_tokens: expected a whole number of at least 1, got {value!r}")


def _check_seed(_: object, __: attrs.Attribute[Any], value: int | None) -> None:
    if value is not None and not (type(value) is int and -(2**63) <= value < 2**63):
        raise UsageError(f"seed: expected a whole number (64-bit), got {value!r}")


def _check_tool_choice(_: object, __: attrs.Attribute[Any], value: str | None) -> None:
    if value is not None and not (isinstance(value, str) and value.strip() == value and value):
        raise UsageError(
            f"tool_choice: expected 'auto', 'required', 'none' or a tool's name, got {value!r}"
        )


def _check_parallel(_: object, __: attrs.Attribute[Any], value: bool | None) -> None:
    if value is not None and type(value) is not bool:
        raise UsageError(f"parallel_tool_calls: expected true or false, got {value!r}")


def _check_effort(_: object, __: attrs.Attribute[Any], value: str | None) -> None:
    if value is not None and value not in REASONING_EFFORTS:
        raise UsageError(
            f"reasoning_effort: expected one of {', '.join(REASONING_EFFORTS)}, got {value!r}"
        )


def _stop_tuple(value: str | Sequence[str] | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (str, list, tuple)):  # a mapping would give its keys
        raise UsageError(f"stop: expected a string or a list of strings, got {value!r}")
    stops = (value,) if isinstance(value, str) else tuple(value)
    if not stops or len(stops) > _MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise UsageError(f"stop: expected 1 to {_MAX_STOP} non-empty strings, got {value!r}")
    return stops


# Keys an adapter builds from the request itself: ``extra`` may not replace them
# (the model would see what the transcript does not record). Gemini's
# ``generationConfig`` in ``extra`` adds keys to the one the adapter builds.
OWNED_KEYS: Final = frozenset(
    {
        "model", "messages", "tools", "tool_choice", "stream", "stream_options",
        "system", "contents", "systemInstruction", "toolConfig",
        "max_tokens", "max_completion_tokens",
    }
)  # fmt: skip


def _extra_dict(value: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and k for k in value):
        raise UsageError(f"extra: expected a mapping of request-body keys, got {value!r}")
    owned = sorted(k for k in value if k in OWNED_KEYS)
    if owned:
        raise UsageError(
            f"extra: {', '.join(owned)} is built from the request (use the setting or "
            "the request itself, not extra)"
        )
    try:  # it goes on the wire as JSON: no NaN, no Infinity, nothing JSON cannot say
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"extra: not sendable as JSON: {exc}") from None
    return dict(value)


def _is_number(value: object) -> bool:
    return type(value) in (int, float) and math.isfinite(value)  # type: ignore[arg-type]


@attrs.frozen(kw_only=True)
class ModelSettings:
    """What to ask of the model; every field optional (``None``: not set here).

    Raises:
        UsageError: a field out of its range, naming it.
    """

    temperature: float | None = attrs.field(default=None, validator=_check_temperature)
    top_p: float | None = attrs.field(default=None, validator=_check_top_p)
    max_tokens: int | None = attrs.field(default=None, validator=_check_max_tokens)
    stop: tuple[str, ...] | None = attrs.field(default=None, converter=_stop_tuple)
    seed: int | None = attrs.field(default=None, validator=_check_seed)
    #: ``auto``, ``required`` (some tool must be called), ``none``, or a tool's name.
    tool_choice: str | None = attrs.field(default=None, validator=_check_tool_choice)
    parallel_tool_calls: bool | None = attrs.field(default=None, validator=_check_parallel)
    reasoning_effort: ReasoningEffort | None = attrs.field(default=None, validator=_check_effort)
    #: Merged into the provider's request body last (its own keys, as it spells them).
    extra: Mapping[str, Any] | None = attrs.field(default=None, converter=_extra_dict)

    def set_fields(self) -> dict[str, Any]:
        """The fields set here (not ``None``), by name."""
        return {
            f.name: getattr(self, f.name)
            for f in attrs.fields(ModelSettings)
            if getattr(self, f.name) is not None
        }


def merge(*levels: ModelSettings | None) -> ModelSettings:
    """The levels merged field by field, a later (nearer) level winning; ``extra``
    mappings are merged key by key the same way."""
    fields: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for level in levels:
        if level is None:
            continue
        for name, value in level.set_fields().items():
            if name == "extra":
                extra.update(value)
            else:
                fields[name] = value
    return ModelSettings(**fields, extra=extra or None)


def settings_from_mapping(value: Any, where: str = "$") -> ModelSettings:
    """A ``ModelSettings`` from parsed JSON or TOML, with errors naming ``where``.

    Raises:
        UsageError: not a mapping, an unknown key, or a bad value
            (``$.settings.temperature: expected a number from 0 to 2, got 7``).
    """
    if not isinstance(value, Mapping):
        raise UsageError(f"{where}: expected an object of model settings, got {value!r}")
    names = {f.name for f in attrs.fields(ModelSettings)}
    for key in value:
        if key not in names:
            raise UsageError(
                f"{where}.{key}: unknown model setting (known: {', '.join(sorted(names))})"
            )
    try:
        return ModelSettings(**value)
    except UsageError as exc:
        raise UsageError(f"{where}.{exc}") from None
    except TypeError as exc:  # a value of a type no converter takes
        raise UsageError(f"{where}: {exc}") from None


def check_tool_choice(settings: ModelSettings, tool_names: Sequence[str]) -> None:
    """Refuse a ``tool_choice`` the request's tools cannot satisfy.

    Raises:
        UsageError: ``required`` or a name with no tools, or a name not among them.
    """
    choice = settings.tool_choice
    if choice is None or choice in ("auto", "none"):
        return
    if not tool_names:
        raise UsageError(f"tool_choice {choice!r}: the request has no tools")
    if choice != "required" and choice not in tool_names:
        raise UsageError(
            f"tool_choice {choice!r}: no such tool in the request "
            f"(tools: {', '.join(sorted(tool_names))})"
        )
