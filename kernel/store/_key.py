"""Session keys: which transcript an operation is about.

Every part of a key becomes a file or directory name in ``FileStore``, so
validation here is a security boundary: a bad key never reaches the disk.
"""

from __future__ import annotations

import re

import attrs

from ..errors import UsageError

_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


def check_name(field: str, value: object) -> str:
    """Return ``value`` if it is a valid id or path segment.

    Raises:
        UsageError: naming ``field``, when ``value`` is not a string of 1 to 128
            characters from ``[A-Za-z0-9._-]``, or is ``.`` or ``..``.
    """
    if not isinstance(value, str):
        raise UsageError(f"{field}: expected a string, got {type(value).__name__}")
    if _NAME.fullmatch(value) is None:
        raise UsageError(f"{field}: {value!r} is not 1 to 128 characters from [A-Za-z0-9._-]")
    if value in (".", ".."):
        raise UsageError(f"{field}: {value!r} is not allowed")
    return value


def _check_project(instance: SessionKey, attribute: attrs.Attribute[str], value: str) -> None:
    check_name("project", value)


def _check_session_id(instance: SessionKey, attribute: attrs.Attribute[str], value: str) -> None:
    check_name("session_id", value)


def _check_subpath(
    instance: SessionKey, attribute: attrs.Attribute[str | None], value: str | None
) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise UsageError(f"subpath: expected a string or None, got {type(value).__name__}")
    if value == "":
        raise UsageError("subpath: must not be empty (use None for the main transcript)")
    for i, segment in enumerate(value.split("/")):
        check_name(f"subpath segment {i}", segment)
        # FileStore keeps subpath "a" in sub/a.jsonl and "a/b" in sub/a/b.jsonl:
        # a segment named "x.jsonl" would make a directory collide with a file.
        if segment.endswith(".jsonl"):
            raise UsageError(f"subpath segment {i}: {segment!r} must not end in '.jsonl'")


@attrs.frozen(cache_hash=True)
class SessionKey:
    """One transcript: a session's main transcript, or a child one under it.

    ``subpath`` names a child transcript (a subagent: ``"subagents/<id>"``),
    ``None`` the main one. Construction validates every part.

    Raises:
        UsageError: naming the field when ``project``, ``session_id`` or a
            ``subpath`` segment is not 1 to 128 characters from
            ``[A-Za-z0-9._-]``, is ``.``/``..``, or ``subpath`` is ``""``.
    """

    project: str = attrs.field(validator=_check_project)
    session_id: str = attrs.field(validator=_check_session_id)
    subpath: str | None = attrs.field(default=None, validator=_check_subpath)
    name: str = attrs.field(init=False, eq=False, repr=False)
    """The key as one string, ``project/session_id`` or ``project/session_id:subpath``.

    Unique per key (no part may contain ``/`` or ``:`` where it would be
    ambiguous); stores use it to index their tables, since a string hashes
    faster than a record."""

    def __attrs_post_init__(self) -> None:
        base = f"{self.project}/{self.session_id}"
        name = base if self.subpath is None else f"{base}:{self.subpath}"
        object.__setattr__(self, "name", name)

    @property
    def is_main(self) -> bool:
        """True for a session's main transcript."""
        return self.subpath is None

    @property
    def main(self) -> SessionKey:
        """The main transcript of this key's session."""
        if self.subpath is None:
            return self
        return SessionKey(self.project, self.session_id)

    def child(self, subpath: str) -> SessionKey:
        """A child transcript of this key's session, below this key's own subpath."""
        full = subpath if self.subpath is None else f"{self.subpath}/{subpath}"
        return SessionKey(self.project, self.session_id, full)

    def __str__(self) -> str:
        return self.name
