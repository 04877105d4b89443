"""The ledger: a disallow list of consumed samples kept across runs, so that a changed configuration
(world size, workers, seed) resumes with no sample repeated and none lost in the epoch.

Imports ``wdsraft.core``, ``io``, ``index`` and ``pipeline``; never ``wdsraft.llm``.
"""

from wdsraft.core.errors import LedgerError
from wdsraft.ledger.consumed import ConsumedSet, positions_of
from wdsraft.ledger.ledger import Ledger
from wdsraft.ledger.rank_file import RankFile, default_run_id

__all__ = ["ConsumedSet", "Ledger", "LedgerError", "RankFile", "default_run_id", "positions_of"]
