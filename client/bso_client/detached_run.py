"""A run that lost the service: its batch size, its journal, its own verdicts.

Once detached (:mod:`bso_client.fail_open`), nothing asks the service any more
until the run ends, so the verdicts are local and only the job's spec decides:
the run finishes when its metric reaches ``target_metric`` (converged) or at
``max_epochs``, never earlier; a NaN or infinite metric ends it as diverged.
bso cannot stop it for cost, and never raises :class:`TrainFailError` for it:
the whole run is delivered afterwards and judged then
(:mod:`bso.detached_runs`).  Rank 0 keeps the journal; the other ranks get the
verdicts by broadcast, like every answer.
"""

from __future__ import annotations

import errno
import logging
import math
from collections.abc import Callable
from pathlib import Path

from bso.apikeys import DEFAULT_TENANT
from bso.core.vocabulary import StopReason
from bso.spec import Hardware, JobSpec
from bso.wire.events import DetachedEpoch, EndReason, EpochDecision
from bso_client.detached_journal import NO_OWNER, DetachedJournal
from bso_client.epoch_metric import diverged_message

logger = logging.getLogger("bso_client.optimizer")


class DetachedRun:
    """Rank 0's side of a detached run (see the module)."""

    def __init__(
        self,
        spec: JobSpec,
        *,
        job_id: str | None,
        hardware: Hardware,
        batch_size: int,
        trial_number: int | None,
        epochs: list[DetachedEpoch],
        root: Path | None = None,
        owner: str = DEFAULT_TENANT,
    ) -> None:
        self.spec = spec
        self.job_id = job_id
        self.batch_size = batch_size
        self.trial_number = trial_number
        self.journal: DetachedJournal | None = None
        """None for a job that has no job id yet (only a prefix) or a run of no team
        (:data:`~bso_client.detached_journal.NO_OWNER`): nothing to deliver to; or
        when the journal cannot be started (a full disk): the run goes on."""
        self.write_error: OSError | None = None
        """Why the journal could not be started (a read-only or full folder, no cache
        folder at all): the caller's one line about the detach says it."""
        self.unsaved: OSError | None = None
        """Why the latest write to the started journal failed (a disk that filled
        mid-run); None once it is on disk again.  The journal in memory is whole."""
        self._unjournaled_epochs = list(epochs)
        """The run's epochs while it has no journal to hold them (see :attr:`epochs`)."""
        self.saved_epochs = len(epochs)
        """The epochs the journal on disk holds: all of them unless :attr:`unsaved`."""
        self.diverged = False
        if job_id is not None and owner != NO_OWNER:
            try:
                self.journal = DetachedJournal.start(
                    job_id=job_id,
                    hardware=hardware,
                    batch_size=batch_size,
                    trial_number=trial_number,
                    epochs=epochs,
                    root=root,
                    owner=owner,
                )
            except OSError as err:
                self.write_error = err

    def _journaling(self, write: Callable[[], DetachedJournal | None]) -> None:
        """Run a write to the journal started earlier; if the disk refuses it (full),
        say so once and train on.  The journal stays in memory, whole, and each later
        write tries the disk again: the run used to drop it at the first refusal, so a
        run whose disk filled was not delivered even when the service was back at its
        exit, and the epochs already on disk were delivered later as an interruption
        while the line said nothing would be."""
        try:
            write()
        except OSError as err:
            if self.unsaved is None:
                logger.warning(
                    "bso: cannot write the detached run's journal %s (%s); training goes "
                    "on, the run kept in memory: it is delivered at exit if the service "
                    "is back then, else the journal on disk keeps its first %d epoch(s) "
                    "only%s",
                    self.journal_path,
                    err,
                    self.saved_epochs,
                    _fix_of(err),
                )
            self.unsaved = err
            return
        if self.journal is not None:
            self.saved_epochs = len(self.journal.run.epochs)
        if self.unsaved is not None:
            logger.info("bso: the detached run's journal %s is written again", self.journal_path)
            self.unsaved = None

    @property
    def epochs(self) -> list[DetachedEpoch]:
        """The run's epochs (those before the detach it was given, and every one since):
        what going back to the service sends, journal or not
        (:mod:`bso_client.reattachment`).  A journal holds them whole in memory, even
        when its disk refuses a write."""
        return self.journal.run.epochs if self.journal else self._unjournaled_epochs

    @property
    def journal_path(self) -> str | None:
        return str(self.journal.path) if self.journal else None

    def verdict(self, epoch: int, metric: float, record: DetachedEpoch | None) -> EpochDecision:
        """Journal ``record`` (None: the metric was not finite) and judge the epoch."""
        journal = self.journal
        if record is not None and journal is None:
            self._unjournaled_epochs.append(record)
        if record is not None and journal is not None:
            self._journaling(lambda: journal.record(record))
        stop, converged, reason, message = False, False, None, "detached: training goes on"
        if record is None:
            self.diverged = True
            stop, reason = True, StopReason.DIVERGED
            message = diverged_message(epoch, metric)
        elif self.spec.metric_reached(metric):
            stop, converged, reason = True, True, StopReason.TARGET_REACHED
            message = "target metric reached (detached)"
        elif epoch >= self.spec.max_epochs:
            stop, reason = True, StopReason.MAX_EPOCHS
            message = f"target not reached in {self.spec.max_epochs} epochs (detached)"
        return EpochDecision(
            event_id=self.journal.run.event_id if self.journal else "detached",
            job_id=self.job_id or "",
            trial_number=self.trial_number or 0,
            epoch=epoch,
            stop=stop,
            converged=converged,
            reason=reason,
            cost=0.0,
            message=message,
        )

    def end(self, reason: EndReason) -> None:
        """The run is over; the journal may be delivered from now on."""
        journal = self.journal
        if journal is not None:
            self._journaling(lambda: journal.end(StopReason.DIVERGED if self.diverged else reason))


def _fix_of(err: OSError) -> str:
    """What to do about a refused journal write, where the error says it: a full disk
    or quota is the cache folder's; out of file descriptors (``EMFILE``) is the
    process's, and no folder would help."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return " (free space in the cache folder, BSO_CACHE_DIR)"
    if err.errno in (errno.EMFILE, errno.ENFILE):
        return " (the process is out of file descriptors: raise ulimit -n)"
    return ""


def epoch_record(
    epoch: int, time_s: float, energy_j: float, metric: float, batch_size: int | None
) -> DetachedEpoch | None:
    """The journal's record of an epoch; None when the metric is NaN or infinite (or
    beyond what bso accepts, :data:`bso.spec.MAX_METRIC`): the run diverged."""
    if not math.isfinite(metric):
        return None
    try:
        return DetachedEpoch(
            epoch=epoch, time_s=time_s, energy_j=energy_j, metric=metric, batch_size=batch_size
        )
    except ValueError:
        return None
