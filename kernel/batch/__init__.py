"""Batch runs: one agent over many tasks, concurrent, resumable, budgeted (docs/batch.md).

Floor 6 (assembly): it drives a ``Kernel``.
"""

from ._directory import MAX_LINE_BYTES as MAX_LINE_BYTES
from ._directory import DirectoryLedger as DirectoryLedger
from ._directory import RunManifest as RunManifest
from ._directory import load_tasks as load_tasks
from ._directory import open_run_dir as open_run_dir
from ._ledger import Claim as Claim
from ._ledger import Ledger as Ledger
from ._ledger import LedgerCounts as LedgerCounts
from ._postgres import DEFAULT_LEASE_S as DEFAULT_LEASE_S
from ._postgres import PostgresLedger as PostgresLedger
from ._postgres import open_postgres_ledger as open_postgres_ledger
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
from ._summary import BatchSummary as BatchSummary
