"""Batch runs: one agent over many tasks, concurrent, resumable, budgeted (docs/batch.md).

Floor 6 (assembly): it drives a ``Kernel``.
"""

from ._ledger import Claim as Claim
from ._ledger import Ledger as Ledger
from ._ledger import LedgerCounts as LedgerCounts
from ._records import FINISHED_REASONS as FINISHED_REASONS
from ._records import BatchTask as BatchTask
from ._records import TaskLimits as TaskLimits
from ._records import TaskReason as TaskReason
from ._records import TaskResult as TaskResult
from ._records import check_task_id as check_task_id
from ._records import converter as converter
from ._postgres import DEFAULT_LEASE_S as DEFAULT_LEASE_S
from ._postgres import PostgresLedger as PostgresLedger
from ._postgres import open_postgres_ledger as open_postgres_ledger
