"""Rank 0's side of fail-open for one optimizer: when to detach, the journal, delivery.

:class:`Detachment` holds what :class:`~bso_client.optimizer.BatchSizeOptimizer`
needs to follow the rules of :mod:`bso_client.fail_open`: the guarded service,
the bound, the run's epochs so far (journaled if it detaches), the detached
run itself once there is one, and the two deliveries (the job's earlier
journals after registering; this run's at exit, within one bound).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar, cast

from bso.apikeys import DEFAULT_TENANT
from bso.core.vocabulary import StopReason
from bso.errors import (
    BsoError,
    ConfigMismatch,
    InvalidEvent,
    InvalidSpec,
    NoFeasibleBatchSize,
    OutOfOrder,
    UnknownJob,
    UnknownTrial,
)
from bso.spec import Hardware, JobSpec
from bso.status import LaneStatus
from bso.wire.events import DetachedEpoch, EndReason, EpochDecision
from bso.wire.micro_batch_timings import MicroBatchTiming
from bso_client.detached_journal import NO_OWNER, deliver, pending_journals
from bso_client.detached_run import DetachedRun, epoch_record
from bso_client.epoch_meter import TrialTotals
from bso_client.fail_open import (
    DEADLINE_SHARE,
    PROBE_FRACTION,
    GuardedService,
    detached_message,
    failure_fix,
    failure_line,
    is_refusal,
)
from bso_client.last_recommendation import recall, remember
from bso_client.reattachment import Reattachment, look_interval_s, reattach
from bso_client.service_calls import JobCalls

if TYPE_CHECKING:
    from bso_client.transport import ServiceClient

logger = logging.getLogger("bso_client.optimizer")

T = TypeVar("T")


class Detachment:
    """Rank 0's fail-open state; ``guard`` None means ``on_unavailable="raise"``."""

    def __init__(
        self,
        guard: GuardedService | None,
        bound_s: float,
        client: ServiceClient | None,
        owner: str = DEFAULT_TENANT,
        delivers: tuple[str, ...] = (),
    ) -> None:
        self.guard = guard
        self.owner = owner
        """Whose journals and recommendations on this machine are this run's
        (:func:`~bso_client.detached_journal.local_owner`)."""
        self.delivers = delivers or (owner,)
        """Whose journals of the job this run delivers after registering (its owner's,
        and its key's from runs on a URL that names no tenant)."""
        self.bound_s = bound_s
        self._client = client
        self.run: DetachedRun | None = None
        """The journal and local verdicts, once the run detached."""
        self.epochs: list[DetachedEpoch] = []
        """The run's epochs so far: what a journal opened mid-run starts with."""
        self.spec: JobSpec | None = None
        self.job_id: str | None = None
        self.hardware: Hardware | None = None
        self.batch_size: int | None = None
        self.trial_number: int | None = None
        self.resumed = False
        """The run resumed a trial from a checkpoint: a journal of it would lack the
        epochs before the checkpoint, so none is kept (:mod:`bso_client.resume`)."""
        self.reattachment: Reattachment | None = None
        """When a run detached mid-trial next looks whether the service is back."""
        self.reopened_at: TrialTotals | None = None
        """Where the service reopened the trial of a run resumed from a checkpoint: what
        it acknowledged before this run's first report."""
        self.unsent_micro_batches: list[MicroBatchTiming] | None = None
        """The run's micro-batch exploration, whose report was journaled: sent with the
        first journaled epoch if the run goes back to the service."""

    def bind(self, spec: JobSpec, job_id: str | None, hardware: Hardware) -> None:
        """The run this state is about, once it registered (or failed to)."""
        self.spec, self.job_id, self.hardware = spec, job_id, hardware

    def assigned(self, batch_size: int, trial_number: int | None) -> None:
        """The run's size, and its trial when the service gave one."""
        self.batch_size, self.trial_number = batch_size, trial_number

    @property
    def down(self) -> bool:
        return self.guard is not None and self.guard.down

    def attempt(self, call: Callable[[], T]) -> T | None:
        """``call()``, or None once a failure of the service detached this run; with
        ``on_unavailable="raise"`` every error is raised."""
        if self.guard is None:
            return call()
        if self.guard.down:
            return None
        try:
            return call()
        except BsoError:
            if self.down:  # the guard saw a failure of the service
                return None
            raise

    def report(
        self,
        calls: JobCalls,
        *,
        epoch: int,
        time_s: float,
        energy_j: float,
        metric: float,
        grown: int | None,
        micro_batches: list[MicroBatchTiming] | None = None,
    ) -> tuple[EpochDecision, bool]:
        """Report the epoch, or journal it once detached: (the verdict, detached?).  The
        first report that fails opens the journal with the epochs before it.
        ``micro_batches``: the run's micro-batch exploration, with the first report
        after it (kept for the service if the run goes back to it, else not)."""
        record = epoch_record(epoch, time_s, energy_j, metric, grown)
        number = self.trial_number
        if self.run is not None and micro_batches:
            self.unsent_micro_batches = micro_batches
        if self.run is None and number is not None:
            try:
                decision = self.attempt(
                    lambda: calls.report_epoch(
                        cast(str, self.job_id),
                        number,
                        epoch=epoch,
                        time_s=time_s,
                        energy_j=energy_j,
                        metric=metric,
                        batch_size=grown,
                        micro_batches=micro_batches,
                    )
                )
            except (OutOfOrder, UnknownJob, UnknownTrial, InvalidEvent) as err:  # not this run's
                return self.lost_trial(err).verdict(epoch, metric, record), True
            if decision is not None:
                if record is not None:
                    self.epochs.append(record)
                return decision, False
            self.unsent_micro_batches = micro_batches
            self.start("this run's own")
            self.reattachment = Reattachment(look_interval_s(self.bound_s))
        elif self.reattachment is not None and self.reattachment.due():
            back = reattach(self, calls, record)
            if back is True:  # the epoch that just ended is the attached run's first
                return self.report(
                    calls,
                    epoch=epoch,
                    time_s=time_s,
                    energy_j=energy_j,
                    metric=metric,
                    grown=grown,
                )
            if back is not None:  # stopped at a journaled epoch: the run stops now
                return back, False
        assert self.run is not None
        return self.run.verdict(epoch, metric, record), True

    def start(self, source: str) -> DetachedRun:
        """Open the journal with the epochs so far and log the one line that says so;
        ``source``: where the batch size comes from."""
        assert self.batch_size is not None
        self.run = self._journal(self.epochs)
        failure = self.guard.failure if self.guard else None
        message = detached_message(
            self.guard.address if self.guard else "the bso service",
            failure or RuntimeError("unknown failure"),
            bound_s=self.bound_s,
            batch_size=self.batch_size,
            size_source=source,
            journal=self.run.journal_path,
            unjournaled=self._unjournaled(self.run),
        )
        logger.log(logging.ERROR if failure and is_refusal(failure) else logging.WARNING, message)
        return self.run

    def _unjournaled(self, run: DetachedRun) -> str:
        """Why ``run`` keeps no journal, as the run's one line about it says."""
        if run.write_error is not None:
            return (
                f"cannot write the journal: {run.write_error}; set BSO_CACHE_DIR to a "
                "writable folder"
            )
        if self.resumed and self.trial_number is not None:
            return (
                "a resumed run's journal would lack the epochs before its checkpoint; they "
                "go to its trial if the service is back while it trains"
            )
        if self.resumed:
            return "a resumed run's journal would lack the epochs before its checkpoint"
        if self.owner == NO_OWNER:
            return (
                "no valid API key, on a URL that names no team: no later run could tell "
                "whose they are"
            )
        return "the job has no job_id yet"

    def untracked(
        self,
        batch_size: int,
        trial_number: int | None,
        why: str | None = None,
        failure: BaseException | None = None,
        of_job: str | None = None,
    ) -> None:
        """A resumed run bso does not follow: it trains on at the checkpoint's size with
        local verdicts only, nothing journaled; one line says why (the first call):
        ``why``, or the ``failure`` of the service, said as a detached run's line says
        it (an ERROR naming the fix for a refused key).  ``of_job``: the checkpoint's
        job, where it is not this run's."""
        if self.run is not None:
            return
        self.resumed = True
        self.assigned(batch_size, None)
        self.run = self._journal([])
        going_on = (
            f"training goes on at the checkpoint's batch size {batch_size} without bso (it "
            "will not stop the run early nor learn from it)"
        )
        job = of_job or self.job_id
        name = f"bso cannot resume trial {trial_number} of job {job} from the checkpoint"
        if failure is None:
            logger.warning("%s (%s); %s", name, why, going_on)
            return
        address = self.guard.address if self.guard else "the bso service"
        logger.log(
            logging.ERROR if is_refusal(failure) else logging.WARNING,
            "%s: %s; %s; %s (on_unavailable='raise' fails instead)",
            name,
            failure_line(address, failure, self.bound_s),
            going_on,
            failure_fix(failure),
        )

    def lost_trial(self, err: OutOfOrder | UnknownJob | UnknownTrial | InvalidEvent) -> DetachedRun:
        """The service refused a report as out of order (the trial went on or ended
        without this run: another process resumed it from the same checkpoint, or its
        lease ran out), or no longer has its job or trial (``bso jobs delete`` while
        the run trained).  The run trains on at its size without bso, nothing
        journaled (a journal would rewrite a trial that is not this run's, or recreate
        a job its owner deleted), nothing ended."""
        trial, size = self.trial_number, cast(int, self.batch_size)
        self.resumed = True  # no journal, as for a resumed run bso cannot follow
        self.assigned(size, None)
        self.run = self._journal([])
        logger.warning(
            "bso trial %s of job %s no longer takes this run's reports (%s); training "
            "goes on at batch size %d without bso (it will not stop the run early nor "
            "learn from it)",
            trial,
            self.job_id,
            err,
            size,
        )
        return self.run

    def refused(
        self, err: NoFeasibleBatchSize | ConfigMismatch | InvalidSpec, size: int, source: str
    ) -> bool:
        """The service refused the run, for a reason no retry changes: the lane has no
        batch size left to give (every one ruled out), or the job id is registered with
        another configuration; or the client did (``InvalidSpec``: energy only, where
        none is measured).  With ``on_unavailable="continue"`` the run trains on at
        ``size`` (``source``: "the job's default", "the checkpoint's") without bso,
        nothing journaled (the service would refuse it again), after one ERROR line
        with the service's message, which names the cause and the fix; True.  A nightly
        job then still has its model, where raising ended the run before it trained.
        False: ``on_unavailable="raise"``, the caller raises it."""
        if self.guard is None:
            return False
        self.resumed = True  # no journal, as for a resumed run bso cannot follow
        self.assigned(size, None)
        self.run = self._journal([])
        logger.error(
            "%s; training goes on at %s batch size %d without bso (it will not stop the "
            "run early nor learn from it; on_unavailable='raise' fails instead)",
            err.message,
            source,
            size,
        )
        return True

    def journal_end(self, reason: EndReason) -> None:
        """The end of an attached run could not be sent: journal the whole run."""
        run = self._journal(self.epochs)
        run.end(reason)
        kept = (
            f"its end is journaled to {run.journal_path} and delivered when the service is back"
            if run.journal is not None
            else f"its end is not journaled ({self._unjournaled(run)}): the service ends it as "
            "interrupted once its lease runs out"
        )
        logger.warning(
            "could not end bso trial %s of job %s (%s); %s",
            self.trial_number,
            self.job_id,
            self.guard.failure if self.guard else None,
            kept,
        )

    def _journal(self, epochs: list[DetachedEpoch]) -> DetachedRun:
        assert self.spec is not None
        assert self.hardware is not None
        assert self.batch_size is not None
        return DetachedRun(
            self.spec,
            job_id=None if self.resumed else self.job_id,
            hardware=self.hardware,
            batch_size=self.batch_size,
            trial_number=self.trial_number,
            epochs=list(epochs),
            owner=self.owner,
        )

    def end_trial(self, calls: JobCalls, reason: EndReason, running: int | None) -> bool:
        """Send EndTrial for the attached trial; True if the service ended it now.  If
        the service is down, the whole run is journaled with ``reason`` instead."""
        job_id, trial = cast(str, self.job_id), cast(int, self.trial_number)
        try:
            ended = calls.end_trial(job_id, trial, reason, running)
        except BsoError as err:
            if self.down:
                self.journal_end(reason)
                return False
            gone = isinstance(err, UnknownJob | UnknownTrial)  # bso jobs delete took it
            logger.warning(
                "could not end bso trial %d of job %s (%s); %s",
                trial,
                job_id,
                err,
                "nothing is left to end"
                if gone
                else "the service ends it as interrupted once its lease runs out",
            )
            return False
        if ended is None:
            return False
        if ended.reason is StopReason.ABANDONED:  # bso status: script_error
            logger.info(
                "bso trial %d of job %s ended: abandoned by the script (it raised, or "
                "stopped short of the target): not held against the batch size",
                trial,
                job_id,
            )
            return True
        if ended.reason is StopReason.INTERRUPTED:  # Ctrl-C, SIGTERM, a superseded run
            logger.info(
                "bso trial %d of job %s ended: interrupted (Ctrl-C, SIGTERM or a cancel): not "
                "held against the batch size, which the next run gets again (three "
                "interruptions in a row after a first epoch count as one failure)",
                trial,
                job_id,
            )
            return True
        logger.info(
            "bso trial %d of job %s ended: %s (%s)",
            trial,
            job_id,
            ended.status.value,
            ended.reason.value if ended.reason else "no reason",
        )
        return True

    def end_unanswered_trial(self, calls: JobCalls, reason: EndReason) -> bool:
        """A Ctrl-C while ``next_trial`` waited for its reply (a notebook cell stopped
        early): the service may have assigned a trial that nobody runs, and an
        exploring one holds the lane's exploration (every other run gets the best size
        known) until its lease runs out.  Ask again with the same event id (the service
        answers with the trial it assigned) and end it with ``reason``; within one bound,
        and only in ``"continue"`` mode (``"raise"`` would wait out the outage window)."""
        if self.guard is None or self.down or not calls.next_trial_unanswered:
            return False
        job_id, hardware = cast(str, self.job_id), cast(Hardware, self.hardware)
        try:
            trial = calls.next_trial(job_id, hardware)
        except BsoError:  # gone: the lease ends the trial, if there is one
            return False
        self.assigned(trial.batch_size, trial.trial_number)
        return self.end_trial(calls, reason, None)

    def finish(self, reason: EndReason, calls: JobCalls | None) -> None:
        """Close the journal; if the service is back, deliver it and end a trial assigned
        too late for the run (:meth:`end_late_trial`), all within one bound."""
        run = self.run
        assert run is not None
        run.end(reason)
        guard, journal = self.guard, run.journal
        late = calls if calls is not None and calls.next_trial_unanswered else None
        if guard is None or (journal is None and late is None):
            return
        started = time.monotonic()
        kept = journal is not None
        if guard.probe(self.bound_s * PROBE_FRACTION):
            guard.reattach()
            if journal is not None and self._time_left(started):
                try:  # delivered, or refused for good: either way no longer kept
                    deliver(journal, guard.deliver_detached_run)
                    kept = False
                except (BsoError, OSError):  # kept for the next run; close() never raises
                    pass
            if late is not None and not guard.down and self._time_left(started):
                self.end_late_trial(late)
        if kept and journal is not None and run.unsaved is not None:
            logger.warning(
                "bso: the detached run was not delivered, and its journal %s holds its "
                "first %d of %d epoch(s) only (%s): the next run of job %s on this machine "
                "delivers those as an interruption; the rest is lost",
                journal.path,
                run.saved_epochs,
                len(journal.run.epochs),
                run.unsaved,
                run.job_id,
            )
        elif kept and journal is not None:
            logger.info(
                "bso: the detached run stays journaled at %s; the next run of job %s on this "
                "machine delivers it once the service takes it",
                journal.path,
                run.job_id,
            )

    def _time_left(self, started: float) -> bool:
        """Whether the exit begun at ``started`` may make a call: at most what is left."""
        left = self.bound_s * DEADLINE_SHARE - (time.monotonic() - started)
        if self._client is not None:
            self._client.call_deadline_s = max(left, 0.05)
        return left > 0

    def end_late_trial(self, calls: JobCalls) -> None:
        """The service assigned this run's trial after the run stopped waiting (slow, not
        gone): ask again under the same event id and end it as interrupted before its
        first epoch, which counts against no size (a lease running out on it would
        count towards three interruptions in a row)."""
        job_id, hardware = cast(str, self.job_id), cast(Hardware, self.hardware)
        try:
            trial = calls.next_trial(job_id, hardware)
            calls.end_trial(job_id, trial.trial_number, StopReason.INTERRUPTED)
        except BsoError:  # the end, queued, lands later; else the lease ends it
            return
        logger.info(
            "bso trial %d of job %s (batch size %d) was assigned after this run stopped "
            "waiting for it; ended as interrupted: not held against the batch size",
            trial.trial_number,
            job_id,
            trial.batch_size,
        )

    def deliver_pending(self) -> None:
        """After registering: deliver the job's journals left on this machine by earlier
        detached runs, for at most one bound."""
        if self.guard is None or self.job_id is None:
            return
        started = time.monotonic()
        job_id = self.job_id
        for journal in (j for o in self.delivers for j in pending_journals(job_id, owner=o)):
            if time.monotonic() - started > self.bound_s:
                break
            try:
                deliver(journal, self.guard.deliver_detached_run)
            except (BsoError, OSError):
                break

    def remember(self, lane: LaneStatus | None) -> None:
        """Keep the lane's recommendation for a run that starts detached."""
        if self.guard is None or self.job_id is None or self.hardware is None or lane is None:
            return
        if lane.recommended_batch_size:
            remember(self.job_id, self.hardware.key, lane.recommended_batch_size, owner=self.owner)

    def size_known_here(
        self, spec: JobSpec, job_id: str | None, hardware: Hardware
    ) -> tuple[int, str]:
        """The size a run detached at its start trains at, and where it comes from."""
        known = recall(job_id, hardware.key, owner=self.owner) if job_id else None
        if known is not None and known in spec.batch_sizes:
            return known, "the last recommendation known on this machine"
        return spec.default_batch_size, "the job's default"
