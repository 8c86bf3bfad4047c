"""What a run was started with (``RunSettings``), kept by its ledger so that every
later start (``tak batch resume``, each ``tak batch worker``) opens the same kernel
and runs the same way.

The ledger keeps them as JSON (a directory's ``manifest.json``, a PostgreSQL run's
row): ``RunSettings.to_json`` writes them, ``RunSettings.of_ledger`` reads them back
and refuses a run whose settings are not a ``RunSettings`` (a run ``run_batch``
started from a program keeps its own).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from kernel.errors import UsageError

from ._records import TaskLimits, converter

if TYPE_CHECKING:
    from kernel.settings import ModelSettings

    from ._ledger import Ledger


@attrs.frozen(kw_only=True)
class TasksFile:
    """The tasks file a run was started with: another file's tasks are not added to it."""

    path: str  # resolved
    sha256: str  # of its bytes then

    @classmethod
    def of(cls, path: Path) -> TasksFile:
        """Blocking I/O (the file is read once more, to hash it)."""
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        return cls(path=str(path.resolve()), sha256=digest)

    def is_the_file_of(self, other: TasksFile) -> bool:
        """The same file (its tasks may have grown since), or a copy of the run's first."""
        return self.path == other.path or self.sha256 == other.sha256


@attrs.frozen(kw_only=True)
class RunSettings:
    """A run's model, tools, limits, settings, plugins and concurrency.

    ``concurrency`` is the first start's; a later start may give its own.
    ``tasks_file`` is ``None`` for a run made before it was kept.
    """

    model: str
    fallbacks: tuple[str, ...] = ()
    system: str | None = None
    plugins: tuple[str, ...] = ()
    tools: tuple[str, ...] | None = None
    settings: dict[str, Any] | None = None  # ModelSettings, as [model.settings] spells them
    limits: TaskLimits = attrs.field(factory=TaskLimits)  # a field not given: None
    concurrency: int = 10
    tasks_file: TasksFile | None = None

    @staticmethod
    def settings_json(settings: ModelSettings | None) -> dict[str, Any] | None:
        """``settings`` as ``[model.settings]`` spells them (the fields that are set):
        the form ``RunSettings.settings`` keeps."""
        if settings is None:
            return None
        out: dict[str, Any] = {}
        for name, value in settings.set_fields().items():
            out[name] = list(value) if isinstance(value, tuple) else value
        if "extra" in out:
            out["extra"] = dict(out["extra"])
        return out

    def model_settings(self) -> ModelSettings | None:
        from kernel.settings import settings_from_mapping

        return None if self.settings is None else settings_from_mapping(self.settings)

    def to_json(self) -> dict[str, Any]:
        """What the ledger keeps (``open_run_dir(settings=)``, ``open_postgres_ledger``):
        of the limits, those given."""
        data: dict[str, Any] = converter.unstructure(self)
        data["limits"] = {name: v for name, v in data["limits"].items() if v is not None}
        checked: dict[str, Any] = json.loads(json.dumps(data, allow_nan=False))
        return checked

    @classmethod
    def of_ledger(cls, ledger: Ledger) -> RunSettings:
        """The settings ``ledger``'s run was started with.

        Raises:
            UsageError: the run was not started by ``tak batch run`` (by ``run_batch``
                in a program, say): its settings say nothing of a model; or they do,
                and a field is wrong (a hand-edited manifest): ``$.path: reason``.
        """
        from ._directory import _structure

        settings = ledger.settings
        if not (isinstance(settings, dict) and isinstance(settings.get("model"), str)):
            raise UsageError(
                f"run {ledger.run_id!r} was not started by `tak batch run` (its settings "
                "name no model and tools); resume it from the program that started it"
            )
        # A hand-edited manifest: the record's own words, or the $.path that is wrong.
        run_settings: RunSettings = _structure(
            settings, cls, f"run {ledger.run_id!r}: its settings"
        )
        return run_settings

    def differences(self, other: RunSettings) -> list[str]:
        """The fields (concurrency and the tasks file aside) where ``other`` differs."""
        own = ("concurrency", "tasks_file")
        return [
            f.name
            for f in attrs.fields(RunSettings)
            if f.name not in own and getattr(self, f.name) != getattr(other, f.name)
        ]


__all__ = ["RunSettings", "TasksFile"]
