"""``MemoryStore``: the store for tests and for embedding without a disk."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import trio

from ._base import BaseStore, TranscriptState, check_start
from ._entries import EncodedEntry, decode_lines
from ._key import SessionKey, check_name
from ._summary import SessionInfo, SessionSummary, SummaryBuilder


class _MemoryTranscript(TranscriptState):
    __slots__ = ("lines",)

    def __init__(self, key: SessionKey) -> None:
        super().__init__(summary=SummaryBuilder() if key.is_main else None, uuids=set(), mtime_ms=0)
        self.lines: list[bytes] = []


class _MemorySession:
    __slots__ = ("main", "subs")

    def __init__(self) -> None:
        self.main: _MemoryTranscript | None = None
        self.subs: dict[str, _MemoryTranscript] = {}


class MemoryStore(BaseStore):
    """Transcripts kept in memory, with the same rules as ``FileStore``.

    Entries are kept as the JSON lines ``FileStore`` would write, so both
    accept and return exactly the same things. Every change happens without
    a checkpoint in the middle, so an append or delete is never seen half done.
    """

    def __init__(self, *, clock: Callable[[], int] | None = None) -> None:
        super().__init__(clock=clock)
        self._projects: dict[str, dict[str, _MemorySession]] = {}
        self._by_name: dict[str, _MemoryTranscript] = {}  # by SessionKey.name

    def _find(self, key: SessionKey) -> _MemoryTranscript | None:
        return self._by_name.get(key.name)

    def _cached_state(self, name: str) -> TranscriptState | None:
        return self._by_name.get(name)

    async def _state_for_append(self, key: SessionKey) -> TranscriptState:
        return _MemoryTranscript(key)

    async def _write(
        self, key: SessionKey, state: TranscriptState, fresh: list[EncodedEntry], mtime_ms: int
    ) -> None:
        assert isinstance(state, _MemoryTranscript)
        if not state.lines:
            session = self._projects.setdefault(key.project, {}).setdefault(
                key.session_id, _MemorySession()
            )
            if key.subpath is None:
                session.main = state
            else:
                session.subs[key.subpath] = state
            self._by_name[key.name] = state
        state.lines.extend(e[2] for e in fresh)
        state.commit(fresh, mtime_ms)

    async def load(self, key: SessionKey) -> list[dict[str, Any]] | None:
        """See ``SessionStore.load``."""
        await trio.lowlevel.checkpoint()
        self._check_open()
        state = self._find(key)
        return None if state is None else decode_lines(state.lines)

    async def iter_entries(
        self, key: SessionKey, *, start: int = 0
    ) -> AsyncIterator[dict[str, Any]]:
        """See ``SessionStore.iter_entries``: decodes only the lines from ``start`` on."""
        check_start(start)
        await trio.lowlevel.checkpoint()
        self._check_open()
        state = self._find(key)
        if state is None:
            return
        for entry in decode_lines(state.lines[start:]):
            yield entry

    def _mains(self, project: str) -> list[tuple[str, _MemoryTranscript]]:
        check_name("project", project)
        sessions = self._projects.get(project, {})
        return sorted((sid, s.main) for sid, s in sessions.items() if s.main is not None)

    async def list_sessions(self, project: str) -> list[SessionInfo]:
        """See ``SessionStore.list_sessions``."""
        await trio.lowlevel.checkpoint()
        self._check_open()
        return [SessionInfo(sid, main.mtime_ms) for sid, main in self._mains(project)]

    async def list_session_summaries(self, project: str) -> list[SessionSummary]:
        """See ``SessionStore.list_session_summaries``."""
        await trio.lowlevel.checkpoint()
        self._check_open()
        out = []
        for sid, main in self._mains(project):
            assert main.summary is not None
            out.append(SessionSummary(sid, main.mtime_ms, main.summary.data()))
        return out

    async def delete(self, key: SessionKey) -> bool:
        """See ``SessionStore.delete``."""
        await trio.lowlevel.checkpoint()
        self._check_open()
        sessions = self._projects.get(key.project)
        session = None if sessions is None else sessions.get(key.session_id)
        if sessions is None or session is None:
            return False
        if key.subpath is None:
            del sessions[key.session_id]
            for sub in session.subs:
                del self._by_name[key.child(sub).name]
            self._by_name.pop(key.name, None)
            existed = True
        else:
            existed = session.subs.pop(key.subpath, None) is not None
            self._by_name.pop(key.name, None)
            if session.main is None and not session.subs:
                del sessions[key.session_id]
        if not sessions:
            del self._projects[key.project]
        return existed

    async def list_subkeys(self, key: SessionKey) -> list[str]:
        """See ``SessionStore.list_subkeys``."""
        await trio.lowlevel.checkpoint()
        self._check_open()
        session = self._projects.get(key.project, {}).get(key.session_id)
        if session is None:
            return []
        prefix = "" if key.subpath is None else key.subpath + "/"
        return sorted(sub for sub in session.subs if sub.startswith(prefix))

    async def aclose(self) -> None:
        """Refuse further use; nothing to release."""
        self._closed = True
        await trio.lowlevel.cancel_shielded_checkpoint()
