"""The real in-process bso service, with a log of what the client sent it.

The ``oom`` and ``heartbeat`` sections check what ``BatchSizeOptimizer`` sent
(one ``EndTrial``, the heartbeats) and what the service recorded, without
Redis, Celery or a database.
"""

from __future__ import annotations

import threading
from typing import Any

from bso.service import BsoService
from bso.storage.base import TrialRecord
from bso.storage.memory import MemoryStore
from bso.wire.events import Event, Reply


class RecordingService(BsoService):
    """The real in-process service over a memory store, logging every event and reply."""

    def __init__(self) -> None:
        super().__init__(MemoryStore())
        self._log: list[tuple[Event, Reply]] = []
        self._log_lock = threading.Lock()  # heartbeats arrive on the client's thread

    def request(self, event: Event) -> Reply:
        reply = super().request(event)
        with self._log_lock:
            self._log.append((event, reply))
        return reply

    def events(self, kind: type[Any]) -> list[tuple[Any, Any]]:
        """The logged (event, reply) pairs whose event is a ``kind``."""
        with self._log_lock:
            return [(e, r) for e, r in self._log if isinstance(e, kind)]

    def trial(self, job_id: str, number: int) -> TrialRecord:
        with self.store.read(job_id) as tx:
            trial = tx.get_trial(number)
        assert trial is not None, f"trial {number} of {job_id} not found"
        return trial
