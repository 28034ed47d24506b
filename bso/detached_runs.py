"""What the service learns from a run that trained while it was unreachable.

A client that could not reach the service within its bound keeps training
"detached" (:mod:`bso_client.fail_open`): bso cannot stop it early, and its
epochs go to a local journal that is delivered later as one
:class:`~bso.wire.events.DeliverDetachedRun` event.  :func:`apply_detached_run`
turns that journal into one trial, under the outcome rules of
:mod:`bso.core.outcomes`:

* the run's own trial (assigned before the outage), if the service still has it
  running or ended it only because the client went silent (a heartbeat
  timeout or an interruption), is rewritten from the journal; a trial the
  service had ended on its own (it converged or was stopped before the
  outage, the reply was lost) is kept as it is: the first decision stands; so
  is a trial that went on past the journal's last epoch (the run went back to
  the service and its journal could not be removed, or another run resumed the
  trial and trained further): the journal's epochs are the trial's already;
* a run that never got a trial (the service was unreachable at its start) is
  added as a new trial of phase ``concurrent`` (it ran the best size known on
  its machine, not one the policy chose), and so is a run whose trial a reset
  forgot, or another run resumed from a checkpoint meanwhile (the trial stands at
  figures the journal never held, ended or not); a run of a job that was deleted
  since (its trial number is below the first of the job registered again,
  :meth:`~bso.storage.base.JobReader.first_trial_number`) is refused
  (``UnknownTrial``): nothing of a deleted job is learned by the new one;
* either way the trial is marked ``detached``, and ends as its epochs say:
  converged at the first epoch that reached the target (its cost up to there:
  what it really cost, since bso could not stop it), failed with
  ``max_epochs`` when it reached ``max_epochs`` without, else as the client's
  end reason (a crash, out of memory, an interruption) says.

The event's id is the journal's, so delivering a journal again is a no-op
answered with the first reply (:meth:`bso.service.BsoService.handle`).

A run that goes back to the service mid-trial sends its journaled epochs as
ordinary reports instead (``bso_client.reattachment``), each naming in
:attr:`~bso.wire.events.EpochReport.trained_to` how far the run trained on: a
report bso stops ends the trial there (:func:`charged_to`), so the epochs it
trained after the stop, which bso could not prevent, are charged like a
delivered journal's, not left out of the size's cost and the exploration budget.
"""

from __future__ import annotations

import math
from datetime import datetime

from bso.core.state import JobSnapshot
from bso.core.vocabulary import StopReason, TrialPhase, TrialStatus
from bso.errors import InvalidEvent, UnknownTrial
from bso.resumes import stands_at
from bso.spec import listed
from bso.storage.base import JobTransaction, TrialRecord
from bso.wire.events import (
    DeliverDetachedRun,
    DetachedEpoch,
    DetachedRunDelivered,
    EpochReport,
    TrialStanding,
)

REWRITABLE = frozenset({StopReason.HEARTBEAT_TIMEOUT, StopReason.INTERRUPTED})
"""A trial the service ended for these reasons only lost touch with its run: the
journal says what the run really did."""


def apply_detached_run(
    tx: JobTransaction, snapshot: JobSnapshot, event: DeliverDetachedRun, now: datetime
) -> DetachedRunDelivered:
    """Record ``event`` as one detached trial of ``snapshot``'s lane (see the module)."""
    epochs = checked_epochs(snapshot, event)
    trial = _own_trial(tx, event)
    if trial is not None and trial.epochs > len(epochs):
        return _reply(event, trial, rewritten=False)  # it went on past the journal
    if trial is not None and not _left_by(trial, epochs):
        trial = None  # another run resumed it meanwhile: it is that run's, ended or not
    if trial is not None and not _rewritable(trial):
        return _reply(event, trial, rewritten=False)
    status, reason, used = ending(snapshot, event, epochs)
    if trial is None:
        trial = tx.add_trial(event.hardware.key, event.batch_size, TrialPhase.CONCURRENT, now)
        rewritten = False
    else:
        rewritten = True
    last = used[-1] if used else None
    grown = last.batch_size if last is not None else None
    trial = trial.replace(
        status=status,
        stop_reason=reason,
        epochs=last.epoch if last else 0,
        time_s=last.time_s if last else 0.0,
        energy_j=last.energy_j if last else 0.0,
        cost=snapshot.cost(last.energy_j, last.time_s) if last else 0.0,
        last_metric=last.metric if last else None,
        current_batch_size=grown if grown != event.batch_size else None,
        updated_at=now,
        detached=True,
    )
    if not math.isfinite(trial.cost):  # the field bounds rule this out; never store it
        raise InvalidEvent("the detached run's time_s and energy_j give a non-finite cost")
    tx.save_trial(trial)
    return _reply(event, trial, rewritten=rewritten)


def checked_epochs(snapshot: JobSnapshot, event: DeliverDetachedRun) -> list[DetachedEpoch]:
    """The run's epochs, refused unless they could have been reported one by one:
    numbered 1, 2, ..., cumulative figures that never decrease, a batch size that is
    one of the lane's and only grows."""
    sizes = snapshot.spec.batch_sizes
    if event.batch_size not in sizes:
        raise InvalidEvent(
            f"a detached run of job {snapshot.spec.job_id} ran at batch size "
            f"{event.batch_size}, which is not one of the lane's sizes {listed(sizes)}"
        )
    size, time_s, energy_j = event.batch_size, 0.0, 0.0
    for expected, epoch in enumerate(event.epochs, start=1):
        if epoch.epoch != expected:
            raise InvalidEvent(f"a detached run's epochs must count 1, 2, ...; got {epoch.epoch}")
        if epoch.time_s < time_s or epoch.energy_j < energy_j:
            raise InvalidEvent("a detached run's time_s and energy_j are cumulative")
        grown = epoch.batch_size or size
        if grown < size or grown not in sizes:
            raise InvalidEvent(
                f"epoch {epoch.epoch} of a detached run ran at {grown}; a run may only grow "
                f"from {size} to one of the lane's sizes {listed(sizes)}"
            )
        size, time_s, energy_j = grown, epoch.time_s, epoch.energy_j
    return list(event.epochs)


def ending(
    snapshot: JobSnapshot, event: DeliverDetachedRun, epochs: list[DetachedEpoch]
) -> tuple[TrialStatus, StopReason, list[DetachedEpoch]]:
    """How the run ends for learning, and the epochs that count: up to the first that
    reached the target (converged), or ``max_epochs`` (failed), else all of them,
    ended as the client's end reason says."""
    spec = snapshot.spec
    for index, epoch in enumerate(epochs[: spec.max_epochs]):
        if spec.metric_reached(epoch.metric):
            return TrialStatus.CONVERGED, StopReason.TARGET_REACHED, epochs[: index + 1]
    if len(epochs) >= spec.max_epochs:
        return TrialStatus.FAILED, StopReason.MAX_EPOCHS, epochs[: spec.max_epochs]
    reason = StopReason(event.end_reason)
    status = TrialStatus.INTERRUPTED if reason in REWRITABLE else TrialStatus.FAILED
    return status, reason, epochs


def _own_trial(tx: JobTransaction, event: DeliverDetachedRun) -> TrialRecord | None:
    """The trial the run was assigned, checked against what the journal says it ran."""
    if event.trial_number is None:
        return None
    trial = tx.get_trial(event.trial_number)
    if trial is None and event.trial_number < tx.first_trial_number():
        raise UnknownTrial(
            f"trial {event.trial_number} was of job {tx.public_job_id!r} as it was before it "
            "was deleted; the job registered again since learns nothing of that job's runs"
        )
    if trial is None:
        return None  # forgotten meanwhile (a reset job): the run counts as a new trial
    if trial.hardware_key != event.hardware.key or trial.batch_size != event.batch_size:
        raise InvalidEvent(
            f"trial {trial.trial_number} of job {tx.public_job_id} ran batch size "
            f"{trial.batch_size} on {trial.hardware_key}; the detached run says "
            f"{event.batch_size} on {event.hardware.key}"
        )
    return trial


def _left_by(trial: TrialRecord, epochs: list[DetachedEpoch]) -> bool:
    """Whether ``trial`` stands where the journaled run left it: at one of its epochs
    (or none), at that epoch's cumulative time.  A trial elsewhere was resumed by
    another process (a scheduler that took the silent run for dead, from a checkpoint)
    and reported on since: rewriting it would undo that run's epochs."""
    if trial.epochs == 0:
        return True
    left = TrialStanding(epochs=trial.epochs, time_s=epochs[trial.epochs - 1].time_s)
    return stands_at(trial, left)


def _rewritable(trial: TrialRecord) -> bool:
    return trial.status is TrialStatus.RUNNING or (
        trial.status is TrialStatus.INTERRUPTED and trial.stop_reason in REWRITABLE
    )


def _reply(
    event: DeliverDetachedRun, trial: TrialRecord, *, rewritten: bool
) -> DetachedRunDelivered:
    return DetachedRunDelivered(
        event_id=event.event_id,
        job_id=event.job_id,
        trial_number=trial.trial_number,
        status=trial.status,
        reason=trial.stop_reason,
        rewritten=rewritten,
    )


def check_trained_to(snapshot: JobSnapshot, event: EpochReport) -> None:
    """Refuse a ``trained_to`` no run could have trained: an epoch before the report
    or past ``max_epochs`` (a detached run ends there), cumulative figures below the
    report's."""
    trained = event.trained_to
    if trained is None:
        return
    if trained.epoch > snapshot.spec.max_epochs:
        raise InvalidEvent(
            f"trained_to names epoch {trained.epoch}, past the job's max_epochs "
            f"{snapshot.spec.max_epochs}, where a run ends"
        )
    if (
        trained.epoch < event.epoch
        or trained.time_s < event.time_s
        or trained.energy_j < event.energy_j
    ):
        raise InvalidEvent(
            f"trained_to (epoch {trained.epoch}, {trained.time_s:g} s, {trained.energy_j:g} J) "
            f"is before the report it comes with (epoch {event.epoch}, {event.time_s:g} s, "
            f"{event.energy_j:g} J)"
        )


def charged_to(snapshot: JobSnapshot, stopped: TrialRecord, trained: DetachedEpoch) -> TrialRecord:
    """``stopped``, a trial bso just stopped at a journaled epoch, ended where its run
    really stopped training: the epochs after the stop are what it cost, and it
    converged if that epoch reached the target (as a delivered journal would)."""
    reached = snapshot.spec.metric_reached(trained.metric)
    charged = stopped.replace(
        status=TrialStatus.CONVERGED if reached else stopped.status,
        stop_reason=StopReason.TARGET_REACHED if reached else stopped.stop_reason,
        epochs=trained.epoch,
        time_s=trained.time_s,
        energy_j=trained.energy_j,
        cost=snapshot.cost(trained.energy_j, trained.time_s),
        last_metric=trained.metric,
    )
    if not math.isfinite(charged.cost):  # the field bounds rule this out; never store it
        raise InvalidEvent("trained_to's time_s and energy_j give a non-finite cost")
    return charged
