"""The records of a batch run: a task, its limits, its result, and their converter.

A task file (``tasks.jsonl``) holds one ``BatchTask`` per line; ``results.jsonl``
one ``TaskResult`` per line. Both go through ``converter``: unknown keys are
refused, and a bad line is reported as ``FILE:LINE: $.path: what was wrong``.
"""

from __future__ import annotations

import re
import secrets
from typing import Any, Literal, TypeAlias

import attrs
import cattrs

from kernel._checks import positive
from kernel.errors import UsageError
from kernel.messages import Message
from kernel.messages import converter as message_converter

#: How a task ended. The agent's own turn endings (``kernel.agent.TurnEnd``),
#: plus ``"error"`` (the task raised outside the model and tools: a bad seed,
#: a store failure) and ``"cancelled"`` (the run was stopped; resumable).
TaskReason: TypeAlias = Literal[
    "final",
    "max_steps",
    "max_tokens",
    "max_cost",
    "wall_time",
    "model_error",
    "cancelled",
    "error",
]
#: Reasons after which a task is not run again on resume.
FINISHED_REASONS: frozenset[str] = frozenset(
    {"final", "max_steps", "max_tokens", "max_cost", "wall_time", "model_error", "error"}
)

_TASK_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_task_id(value: Any, where: str = "id") -> None:
    """Raises UsageError unless ``value`` can name a session and a directory."""
    if not isinstance(value, str) or not _TASK_ID.fullmatch(value) or ".." in value:
        raise UsageError(
            f"{where}: expected 1-128 of A-Z a-z 0-9 . _ - (not starting with . _ -, "
            f"no '..'), got {value!r}"
        )


#: Hex digits of a run's nonce (``new_run_nonce``).
NONCE_HEX = 8
#: The longest run id: its sessions' project, ``batch.<run id>.<nonce>``, must
#: be a store name (at most 128 characters).
MAX_RUN_ID = 128 - len("batch.") - 1 - NONCE_HEX


def check_run_id(value: Any, where: str = "run_id") -> None:
    """Raises UsageError unless ``value`` can name a run (a task id of at most
    ``MAX_RUN_ID`` characters, so that its sessions' project is a store name)."""
    check_task_id(value, where)
    if len(value) > MAX_RUN_ID:
        raise UsageError(
            f"{where}: at most {MAX_RUN_ID} characters (it names the run's sessions, "
            f"batch.<run id>.<nonce>), got {len(value)}"
        )


def new_run_nonce() -> str:
    """What tells this run's sessions from those of an earlier run of the same id:
    made once, when the run is created, and kept with it (manifest, run row)."""
    return secrets.token_hex(NONCE_HEX // 2)


def session_project(run_id: str, nonce: str | None) -> str:
    """The store project of a run's task sessions: ``batch.<run id>.<nonce>``
    (``batch.<run id>`` for a run made before runs had a nonce)."""
    return f"batch.{run_id}" if nonce is None else f"batch.{run_id}.{nonce}"


def _task_id(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    check_task_id(value, f"BatchTask.{attribute.name}")


@attrs.frozen(kw_only=True)
class TaskLimits:
    """When one task stops: per-task ``RunLimits`` (``kernel.agent``) plus its
    wall time, which bounds each attempt whole (seeding, the turn or its
    resume, and the scorer).

    A field left ``None`` takes the run's value (``run_batch(limits=)``).
    """

    max_steps: int | None = attrs.field(
        default=None, validator=positive(integer=True, optional=True)
    )
    max_tokens: int | None = attrs.field(
        default=None, validator=positive(integer=True, optional=True)
    )
    max_cost: float | None = attrs.field(default=None, validator=positive(optional=True))
    wall_time: float | None = attrs.field(default=None, validator=positive(optional=True))


@attrs.frozen(kw_only=True)
class BatchTask:
    """One task of a batch: a prompt (or messages) run as its own session.

    Attributes:
        id: unique in the run; names the session (``<id>`` in project
            ``batch.<run-id>.<nonce>``) and the task's workspace directory.
        prompt: the user's message; or ``messages``: a conversation whose last
            message is the user's (exactly one of the two).
        workspace: a directory copied as the task's workspace before it runs.
        files: files written into the task's workspace (relative path -> text).
        metadata: anything; copied into the result.
        expected: what the scorer compares the answer with.
        limits: this task's own limits, over the run's.
    """

    id: str = attrs.field(validator=_task_id)
    prompt: str | None = None
    messages: tuple[Message, ...] | None = None
    workspace: str | None = None
    files: dict[str, str] = attrs.field(factory=dict)
    metadata: dict[str, Any] = attrs.field(factory=dict)
    expected: Any = None
    limits: TaskLimits | None = None

    def __attrs_post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise UsageError(f"task {self.id!r}: set exactly one of prompt and messages")
        if self.messages is not None and (not self.messages or self.messages[-1].role != "user"):
            raise UsageError(f"task {self.id!r}: messages must end with the user's message")


@attrs.frozen(kw_only=True)
class TaskResult:
    """How one task ended: one line of ``results.jsonl``.

    ``score`` is ``None`` without a scorer, or when the scorer failed (its
    error is in ``error`` then, prefixed ``scorer:``). ``attempt`` counts runs
    of the task (a resume after a crash or a lost lease is the next attempt).
    """

    id: str
    reason: TaskReason
    score: float | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float | None = None
    wall_seconds: float = 0.0
    error: str | None = None
    text: str = ""
    steps: int = 0
    attempt: int = 1
    worker: str | None = None
    finished_at: float = 0.0  # Unix time
    metadata: dict[str, Any] = attrs.field(factory=dict)

    @property
    def finished(self) -> bool:
        """True unless the task was cancelled (a resume runs it again)."""
        return self.reason in FINISHED_REASONS


def _make_converter() -> cattrs.Converter:
    # A copy of the kernel's: messages inside tasks read as transcripts do, unknown
    # keys are refused, and scalars are strict (a prompt of 3 is not "3").
    return message_converter.copy(forbid_extra_keys=True)


converter: cattrs.Converter = _make_converter()
