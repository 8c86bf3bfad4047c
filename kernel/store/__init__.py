"""Durable sessions: transcripts of JSON entries, their summaries, and the stores.

``SessionStore`` is the protocol; ``MemoryStore``, ``FileStore`` and
``PostgresStore`` implement it. See docs/store.md.
"""

from ._disk import RepairReport as RepairReport
from ._file import Durability as Durability
from ._file import FileStore as FileStore
from ._key import SessionKey as SessionKey
from ._memory import MemoryStore as MemoryStore
from ._open import open_store as open_store
from ._postgres import PostgresStore as PostgresStore  # psycopg loads on first use
from ._protocol import SessionStore as SessionStore
from ._summary import SessionInfo as SessionInfo
from ._summary import SessionSummary as SessionSummary
from ._summary import SummaryData as SummaryData
from ._summary import fold_session_summary as fold_session_summary

__all__ = [
    "Durability",
    "FileStore",
    "MemoryStore",
    "PostgresStore",
    "RepairReport",
    "SessionInfo",
    "SessionKey",
    "SessionStore",
    "SessionSummary",
    "SummaryData",
    "fold_session_summary",
    "open_store",
]
