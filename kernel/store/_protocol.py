"""The ``SessionStore`` protocol every backend implements."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from ._key import SessionKey
from ._summary import SessionInfo, SessionSummary


@runtime_checkable
class SessionStore(Protocol):
    """Durable transcripts of JSON entries, one per ``SessionKey``.

    Per key, the order of entries is the order in which ``append`` calls
    returned. Operations on different keys never wait on each other.
    """

    async def append(self, key: SessionKey, entries: Sequence[Mapping[str, Any]]) -> None:
        """Add ``entries`` to ``key``'s transcript, all or none of them.

        An entry whose ``uuid`` is already stored (or repeated in the batch)
        is skipped; ``append(key, [])`` does nothing.

        Raises:
            UsageError: an entry is not a JSON object with a string ``type``.
            StoreError: the store could not write (nothing was appended).
            CorruptTranscript: the transcript on disk is damaged mid-file.
        """
        ...

    async def load(self, key: SessionKey) -> list[dict[str, Any]] | None:
        """Every entry of ``key``'s transcript, or ``None`` if it was never written.

        Raises:
            CorruptTranscript: the transcript is damaged mid-file.
        """
        ...

    def iter_entries(self, key: SessionKey, *, start: int = 0) -> AsyncIterator[dict[str, Any]]:
        """The entries of ``key``'s transcript from position ``start`` on, streamed.

        A position is the number of entries stored before it in the
        transcript (0 for the first). Positions are stable while a transcript
        is only appended to, so a reader that has seen ``n`` entries picks up
        only what was appended since with ``start=n``. A store may keep an
        index (byte offsets, sequence numbers) to get there without reading
        what comes before; ``BaseStore`` gives a default that reads and skips.

        The entries are those stored when the iteration begins (appends made
        while it runs may or may not be seen, each whole). Nothing is
        yielded when the transcript has ``start`` entries or fewer, was
        never written, or was deleted. A store does *not* detect that the
        transcript was deleted and written again, or repaired to fewer
        entries, since a reader last looked: positions then name other
        entries. A reader that must know reads from ``start=n - 1`` and
        checks that the first entry is the one it saw last (same ``uuid``):
        ``kernel.history.HistoryCache`` does so and re-reads on a mismatch.

        Raises:
            UsageError: ``start`` is negative.
            CorruptTranscript: the transcript is damaged mid-file.
        """
        ...

    async def list_sessions(self, project: str) -> list[SessionInfo]:
        """The project's sessions that have a main transcript, by session id.

        Never reads a transcript.

        Raises:
            UsageError: ``project`` is not a valid name.
        """
        ...

    async def list_session_summaries(self, project: str) -> list[SessionSummary]:
        """The summaries of the sessions ``list_sessions`` gives, in the same order.

        Raises:
            UsageError: ``project`` is not a valid name.
            CorruptTranscript: a summary had to be rebuilt from a damaged transcript.
        """
        ...

    async def delete(self, key: SessionKey) -> bool:
        """Remove ``key``'s transcript; for a main key, its children and summary too.

        Returns whether there was anything to remove.
        """
        ...

    async def list_subkeys(self, key: SessionKey) -> list[str]:
        """The subpaths of ``key``'s session below ``key``'s own subpath, sorted."""
        ...

    async def aclose(self) -> None:
        """Release files and persist what is only in memory; finishes even if cancelled."""
        ...
