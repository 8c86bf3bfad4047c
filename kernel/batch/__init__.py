"""Batch runs: one agent over many tasks, concurrent, resumable, budgeted (docs/batch.md).

Floor 6 (assembly): it drives a ``Kernel``.
"""

from ._directory import MAX_LINE_BYTES as MAX_LINE_BYTES
from ._directory import DirectoryLedger as DirectoryLedger
from ._directory import RunManifest as RunManifest
from ._directory import load_tasks as load_tasks
from ._directory import open_run_dir as open_run_dir
from ._directory import read_run_dir as read_run_dir
from ._ledger import Claim as Claim
from ._ledger import Ledger as Ledger
from ._ledger import LedgerCounts as LedgerCounts
from ._postgres import DEFAULT_LEASE_S as DEFAULT_LEASE_S
from ._postgres import PostgresLedger as PostgresLedger
from ._postgres import open_postgres_ledger as open_postgres_ledger
from ._postgres import read_postgres_run as read_postgres_run
from ._records import FINISHED_REASONS as FINISHED_REASONS
from ._records import MAX_RUN_ID as MAX_RUN_ID
from ._records import BatchTask as BatchTask
from ._records import TaskLimits as TaskLimits
from ._records import TaskReason as TaskReason
from ._records import TaskResult as TaskResult
from ._records import check_run_id as check_run_id
from ._records import check_task_id as check_task_id
from ._records import converter as converter
from ._records import session_project as session_project
from ._run import BatchProgress as BatchProgress
from ._run import Scorer as Scorer
from ._run import TaskOutcome as TaskOutcome
from ._run import run_batch as run_batch
from ._settings import RunSettings as RunSettings
from ._settings import TasksFile as TasksFile
from ._summary import BatchSummary as BatchSummary
from ._view import RunView as RunView

__all__ = [
    "DEFAULT_LEASE_S",
    "FINISHED_REASONS",
    "MAX_LINE_BYTES",
    "MAX_RUN_ID",
    "BatchProgress",
    "BatchSummary",
    "BatchTask",
    "Claim",
    "DirectoryLedger",
    "Ledger",
    "LedgerCounts",
    "PostgresLedger",
    "RunManifest",
    "RunSettings",
    "RunView",
    "Scorer",
    "TaskLimits",
    "TaskOutcome",
    "TaskReason",
    "TaskResult",
    "TasksFile",
    "check_run_id",
    "check_task_id",
    "converter",
    "load_tasks",
    "open_postgres_ledger",
    "open_run_dir",
    "read_postgres_run",
    "read_run_dir",
    "run_batch",
    "session_project",
]
