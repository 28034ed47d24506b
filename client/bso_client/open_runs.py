"""One open run per job and thread: a run left open is ended when the thread starts another.

A notebook runs every cell in one long-lived process, on its main thread.  A
cell that builds a :class:`~bso_client.optimizer.BatchSizeOptimizer` without
``with`` and is stopped by Ctrl-C (or fails) leaves its trial open: the
kernel catches the exception, ``atexit`` does not run until the kernel shuts
down, and the heartbeat thread keeps the trial alive all that while.  Running
the cell again then started a second trial beside it, and while an exploring
trial runs every other trial of the lane gets the best size known
(``concurrent``), so the job stopped exploring until the kernel restarted; at
shutdown the forgotten trial ended as ``abandoned`` with a warning that the
loop ended "without an error".

A new optimizer for the same job (same service, key, rank) in the same thread,
while an earlier one is open outside any ``with`` block, means the earlier one
was abandoned: it is ended now, as ``interrupted`` (a cancel, not the batch
size's fault), with one WARNING naming it; one whose training was over
(converged, or stopped by bso) is only closed, without a word.  A run inside its ``with`` block is
never ended so: the block ends it whatever happens, and one thread may step
several runs of a job in turn (a sweep of generators or asyncio tasks, ``with
A, B``).  Two threads or two processes training one job at once (overlapping
recurrences) never end each other's runs.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Hashable
from typing import TYPE_CHECKING

from bso.core.vocabulary import StopReason

if TYPE_CHECKING:
    from bso_client.optimizer import BatchSizeOptimizer

logger = logging.getLogger("bso_client.optimizer")

_lock = threading.Lock()
_open: dict[tuple[int, Hashable], weakref.ref[BatchSizeOptimizer]] = {}
"""(thread, job key) -> the optimizer that thread last opened for the job."""


def claim(run: BatchSizeOptimizer, job: Hashable) -> None:
    """``run`` is this thread's run of ``job`` now: end the one it superseded, if open."""
    key = (threading.get_ident(), job)
    with _lock:
        earlier_ref = _open.get(key)
        _open[key] = weakref.ref(run)
    earlier = earlier_ref() if earlier_ref is not None else None
    if earlier is None or earlier is run or earlier.closed or earlier.in_block:
        return
    if earlier.training_finished:  # converged or stopped: nothing open, only released
        earlier._close(StopReason.INTERRUPTED)
        return
    if earlier.rank == 0 and (earlier.trial_number is not None or earlier.detached):
        which = f"trial {earlier.trial_number}" if earlier.trial_number else "detached run"
        logger.warning(
            "bso %s of job %s (batch size %s) was still open in this process: the "
            "BatchSizeOptimizer that started it was never closed (a notebook cell stopped "
            "by Ctrl-C or an error, then run again?); ending it as interrupted, not held "
            "against its batch size. Use `with BatchSizeOptimizer(...) as bso:` (or "
            "bso.close(exc) in an except) so that a run ends when its training stops",
            which,
            earlier.job_id,
            earlier.batch_size,
        )
    earlier._close(StopReason.INTERRUPTED)


def release(run: BatchSizeOptimizer) -> None:
    """``run`` closed: forget it (a later optimizer of its job supersedes nothing)."""
    with _lock:
        for key, ref in list(_open.items()):
            if ref() is run or ref() is None:
                del _open[key]
