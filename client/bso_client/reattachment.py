"""A detached run goes back to the service once the service is back: its trial goes on.

A run that lost the service mid-trial trains on detached (:mod:`bso_client.fail_open`):
only the target or ``max_epochs`` end it, and its epochs go to a journal.  Were that
for the rest of the run, a restart of ``bso up`` that took ten seconds would leave a
run of three days without bso's stops for all of them.  So at an epoch's end, at most
once every :func:`look_interval_s` (50 s with the default bound), rank 0 takes a
look at the service (a GET on a fresh connection, a fifth of the bound at most) and,
if it answers:

1. reopens the run's trial at the epochs the service acknowledged before the
   outage (:class:`~bso.wire.events.ResumeTrial`, :mod:`bso.resumes`, the rules of a
   run resumed from a checkpoint: a trial still running, or ended as interrupted by
   its lease, goes on; one that converged or was stopped is refused), if it stands
   where this run left it: a trial another process resumed meanwhile (a scheduler
   that took the silent run for dead) stays that process's, and this run's journal
   is delivered as a run of its own;
2. sends the journaled epochs in order, each an ordinary epoch report with a new
   event id, judged as it would have been (a report whose reply was lost in the
   outage is rewound by step 1 and sent again: nothing is counted twice); the first
   carries the run's micro-batch exploration, if the report that should have carried
   it was journaled;
3. removes the journal, which the service now holds, and the run goes on attached
   (its heartbeats start again) with the epoch that just ended.

A run that keeps no journal on disk (one resumed from a checkpoint, whose journal
would lack the epochs before it; a cache folder that cannot be written) goes back
the same way, from the epochs it holds in memory.

A look sends journaled epochs for one bound at most (a journal of days holds
thousands): the rest wait for the next look, which goes on from the last epoch
sent, so an epoch's end is never held up for longer.

If one of the journaled epochs would have been stopped (its cost past the bound,
say), the trial is stopped there, as it would have been without the outage, and
the run is stopped now: bso stops it later than it would have, not never.  Each
journaled report names the epoch that just ended (``EpochReport.trained_to``), so
a trial stopped at a journaled epoch ends where the run really stopped: charged
the epochs the outage cost (in the size's cost and the exploration budget), and
converged if that epoch reached the target (the look is taken at such an epoch
too, so that a run without a journal does not leave its trial to its lease).

A stop whose reply was lost (the report that began the outage, or one a look sent,
the service then gone again) is not lost with it: the next look finds the trial
ended for good (``bso status``'s read of it), sends that report again as the same
event (its id and body), and the service, which answers every copy of an event
with its first reply, gives the run the stop it never heard; the epochs trained
since are not charged.

A refusal (the trial ended meanwhile, the job was deleted) leaves the run detached
for good, with one INFO line; a service that fails again leaves it detached until
the next look, the journal whole, so its delivery at exit still holds every epoch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Literal, cast

from bso.errors import BsoError, TrialNotResumable
from bso.spec import Hardware
from bso.status import FINAL_OUTCOMES, JobStatus
from bso.wire.events import DetachedEpoch, EpochDecision, TrialStanding
from bso.wire.micro_batch_timings import MicroBatchTiming
from bso_client.epoch_meter import TrialTotals
from bso_client.fail_open import PROBE_FRACTION, is_refusal
from bso_client.resume import Checkpoint

if TYPE_CHECKING:
    from bso_client.detachment import Detachment
    from bso_client.service_calls import JobCalls

logger = logging.getLogger("bso_client.optimizer")

LOOK_COST_SHARE = 0.02
"""The most of a detached run's time its looks at the service may take: a look at a
host that drops packets costs a fifth of the bound (1 s of the default 5 s); a
refused connection costs nothing."""


def look_interval_s(bound_s: float) -> float:
    """How often a detached run looks whether the service is back: every 50 s with the
    default bound, so that the looks cost at most :data:`LOOK_COST_SHARE` of its time."""
    return bound_s * PROBE_FRACTION / LOOK_COST_SHARE


class Reattachment:
    """When rank 0's detached run next looks at the service, and whether it still may."""

    def __init__(self, interval_s: float, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._interval_s = interval_s
        self._monotonic = monotonic
        self.next_look = monotonic() + interval_s
        self.given_up = False
        """The service refused to take the trial back: it stays detached for good."""
        self.lost_report: Callable[[], EpochDecision] | None = None
        """The epoch report whose reply the outage or a look lost, as the same event
        (:meth:`~bso_client.service_calls.JobCalls.forget_unanswered`): kept until a
        resume rewinds the trial past it, for a refusal that may be its own stop."""

    def due(self) -> bool:
        """Whether to look now; a look is due once an interval passed since the last."""
        now = self._monotonic()
        if self.given_up or now < self.next_look:
            return False
        self.next_look = now + self._interval_s
        return True


def reattach(
    detachment: Detachment, calls: JobCalls, ended: DetachedEpoch | None
) -> EpochDecision | Literal[True] | None:
    """Rank 0: take the detached run back to the service (see the module); ``ended``:
    the epoch that just ended (None if its metric was not a number).  None: still
    detached; True: attached again, the epoch that just ended is to be reported as
    any; a decision: the service stopped the trial at a journaled epoch."""
    run, guard = detachment.run, detachment.guard
    if run is None or guard is None or detachment.trial_number is None:
        return None
    if guard.failure is not None and is_refusal(guard.failure):
        return None  # a refused key is not cured by the service coming back
    if not guard.probe(detachment.bound_s * PROBE_FRACTION):
        return None
    guard.reattach()
    lost = calls.forget_unanswered()
    if lost is not None and detachment.reattachment is not None:
        detachment.reattachment.lost_report = lost
    job_id, number = cast(str, detachment.job_id), detachment.trial_number
    acknowledged = list(detachment.epochs)
    last = acknowledged[-1] if acknowledged else None
    # Where the service left off: the last epoch it acknowledged, else where it
    # reopened a run resumed from a checkpoint, else the trial's start.
    left = (
        TrialTotals(last.epoch, last.time_s, last.energy_j)
        if last
        else detachment.reopened_at or TrialTotals(0, 0.0, 0.0)
    )
    checkpoint = Checkpoint(
        job_id=job_id,
        trial_number=number,
        batch_size=cast(int, detachment.batch_size),
        hardware_key=cast(Hardware, detachment.hardware).key,
        epochs=left.epoch,
        time_s=left.time_s,
        energy_j=left.energy_j,
    )
    journal = run.journal
    journaled = run.epochs[len(acknowledged) :]
    standing = (
        TrialStanding(epochs=checkpoint.epochs, time_s=checkpoint.time_s),
        *(TrialStanding(epochs=record.epoch, time_s=record.time_s) for record in journaled[:1]),
    )
    trained = ended or (journaled[-1] if journaled else None)
    stopped: EpochDecision | None = None
    stopped_unheard = False  # the service had stopped the trial at a report's lost reply
    deadline = time.monotonic() + detachment.bound_s
    try:
        resume = partial(calls.resume_trial, job_id, checkpoint, standing)
        try:
            resumed = detachment.attempt(resume)
        except TrialNotResumable as refusal:
            stopped = _stop_never_heard(detachment, calls, refusal)
            if stopped is None:
                return None  # failed again: detached until the next look
            stopped_unheard, journaled = True, []
        else:
            if resumed is None:
                return None  # failed again: detached until the next look
            if detachment.reattachment is not None:
                detachment.reattachment.lost_report = None  # rewound past it
        for index, record in enumerate(journaled):
            if index and time.monotonic() > deadline:
                _sent_in_part(detachment, index, len(journaled))
                return None
            micro_batches = detachment.unsent_micro_batches if index == 0 else None
            later = trained if trained is not None and trained.epoch > record.epoch else None
            report = partial(
                _report,
                calls,
                job_id,
                number,
                record,
                micro_batches=micro_batches,
                trained_to=later,
            )
            decision = detachment.attempt(report)
            if decision is None:
                return None
            detachment.unsent_micro_batches = None
            detachment.epochs.append(record)
            if decision.stop:
                stopped = decision
                break
    except BsoError as err:
        if detachment.reattachment is not None:
            detachment.reattachment.given_up = True
        logger.info(
            "bso service at %s is back, but trial %d of job %s goes on detached (%s); its "
            "journal is delivered at the end of the run",
            guard.address,
            number,
            job_id,
            err,
        )
        return None
    try:
        if journal is not None:
            journal.remove()
    except OSError as err:  # the service has every epoch; a leftover file is refused later
        logger.warning("bso: cannot remove the journal %s (%s)", run.journal_path, err)
    detachment.run = None
    if stopped is not None and stopped_unheard:
        logger.info(
            "bso service at %s is back: it had stopped trial %d of job %s at epoch %d (%s), "
            "and the reply was lost on the way; the run is stopped now",
            guard.address,
            number,
            job_id,
            stopped.epoch,
            stopped.reason.value if stopped.reason else "no reason",
        )
        return stopped
    logger.info(
        "bso service at %s is back: trial %d of job %s goes on attached (%d epoch(s) trained "
        "detached sent)%s",
        guard.address,
        number,
        job_id,
        len(detachment.epochs) - len(acknowledged),
        f"; it would have been stopped at epoch {stopped.epoch}, and is stopped now"
        if stopped is not None
        else "",
    )
    return stopped if stopped is not None else True


def _stop_never_heard(
    detachment: Detachment, calls: JobCalls, refusal: TrialNotResumable
) -> EpochDecision | None:
    """The stop a refused resume may stand for: the trial ended for good at a report of
    this run's whose reply was lost (the outage began with it, or a look lost it).
    Sent again as the same event, that report is answered with the stop the service
    recorded for it.  None: the service failed again; ``refusal`` is raised if the
    trial ended some other way.

    Only a trial that ``bso status`` lists as ended for good is sent it
    (:data:`~bso.status.FINAL_OUTCOMES`; a read, nothing written): a trial that can
    be resumed may have been, by another run, which would take a report this run
    lost before it reached the service as its own next epoch (review of c51641b).
    An ended trial takes no new report (it is refused as out of order), so a stop
    that comes back is the one recorded for this run's report.
    """
    lost = detachment.reattachment.lost_report if detachment.reattachment else None
    if lost is None:
        raise refusal
    job_id, number = cast(str, detachment.job_id), cast(int, detachment.trial_number)
    hardware_key = cast(Hardware, detachment.hardware).key
    try:
        status = detachment.attempt(partial(calls.service.status, job_id))  # a read
        if status is None:
            return None
        if not _ended_for_good(status, hardware_key, number):
            raise refusal
        answer = detachment.attempt(lost)
    except BsoError:  # the job is gone, or the report never reached the service
        raise refusal from None
    if answer is not None and not answer.stop:
        raise refusal
    return answer


def _ended_for_good(status: JobStatus, hardware_key: str, number: int) -> bool:
    """Whether trial ``number`` of the lane ``hardware_key`` ended for good, as ``bso
    status`` lists it."""
    return any(
        point.trial_number == number and point.outcome in FINAL_OUTCOMES
        for lane in status.lanes
        if lane.hardware.key == hardware_key
        for point in lane.history
    )


def _sent_in_part(detachment: Detachment, sent: int, journaled: int) -> None:
    """A look sends journaled epochs for one bound at most: the run trains on detached,
    its trial at the last epoch sent, and the next look, at the next epoch's end, sends
    on from there."""
    if detachment.reattachment is not None:
        detachment.reattachment.next_look = 0.0  # a backlog goes at every epoch's end
    logger.info(
        "bso service is back: %d of %d epoch(s) trained detached sent to trial %s of job "
        "%s; the rest at the next look",
        sent,
        journaled,
        detachment.trial_number,
        detachment.job_id,
    )


def _report(
    calls: JobCalls,
    job_id: str,
    number: int,
    record: DetachedEpoch,
    *,
    micro_batches: list[MicroBatchTiming] | None,
    trained_to: DetachedEpoch | None,
) -> EpochDecision:
    return calls.report_epoch(
        job_id,
        number,
        epoch=record.epoch,
        time_s=record.time_s,
        energy_j=record.energy_j,
        metric=record.metric,
        batch_size=record.batch_size,
        micro_batches=micro_batches,
        trained_to=trained_to,
    )
