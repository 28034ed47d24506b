"""Persistence of jobs, trials, RNG states and recorded replies."""

from bso.storage.base import (
    JobRecord,
    JobTransaction,
    LaneRecord,
    Store,
    StoredReply,
    TrialRecord,
)
from bso.storage.memory import MemoryStore

__all__ = [
    "JobRecord",
    "JobTransaction",
    "LaneRecord",
    "MemoryStore",
    "Store",
    "StoredReply",
    "TrialRecord",
]
