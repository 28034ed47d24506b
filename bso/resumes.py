"""What the service does with a run resumed from a checkpoint (:class:`ResumeTrial`).

A run preempted after a checkpoint and started again from it is the same run:
its trial goes on.  :func:`resume_trial` reopens it, under these rules:

* only a trial that lost its run may be reopened: one still ``running`` (the
  process was killed outright and its lease has not run out yet), ended as
  ``interrupted`` (SIGTERM, Ctrl-C, a lease that ran out), or ended by the
  script (``abandoned``: a bug in epoch 5, fixed, and the run resumed from its
  epoch-4 checkpoint is the same optimisation going on; the crash said nothing
  of the size).  A trial that converged or failed by what its size did ended
  for good: :class:`~bso.errors.TrialNotResumable`, and nothing is written;
* the checkpoint must be the trial's: same lane and batch size, and no more
  epochs, time or energy than the service has (the figures were reported
  before the checkpoint was saved);
* a run that never stopped but lost the service (its trial's last epochs were
  journaled, ``bso_client.reattachment``) names where it left its trial
  (:attr:`~bso.wire.events.ResumeTrial.standing`); a trial that stands elsewhere was
  resumed by another process (a scheduler that took the silent run for dead) and
  stays that process's;
* the trial is rewound to the checkpoint: its epochs, cumulative time, energy
  and cost are the checkpoint's, and the run's next report is the epoch after
  it.  Epochs the killed process ran after its last checkpoint are the lost
  work of the preemption: the trial is measured as what the checkpoint holds
  plus what the resumed run adds;
* the trial is ``running`` again, with the resumed run's lease: the interruption
  is not an outcome of its own (:mod:`bso.core.outcomes` never sees it), so it
  cannot count towards three interruptions in a row.

The reply is the trial as :class:`~bso.wire.events.TrialAssigned`.  Redelivery
is answered with the first reply, like every recorded event
(:meth:`bso.service.BsoService.handle`); tenants are scoped by the job's key.
"""

from __future__ import annotations

import math
from datetime import datetime

from bso.core.state import JobSnapshot
from bso.core.vocabulary import TrialStatus, lost_its_run
from bso.errors import InvalidEvent, TrialNotResumable, UnknownTrial
from bso.storage.base import JobTransaction, TrialRecord
from bso.wire.events import ResumeTrial, TrialAssigned, TrialStanding


def resume_trial(
    tx: JobTransaction, snapshot: JobSnapshot, event: ResumeTrial, now: datetime
) -> TrialAssigned:
    """Reopen ``event``'s trial at the checkpoint's figures (see the module)."""
    trial = tx.get_trial(event.trial_number)
    if trial is None:
        raise UnknownTrial(
            f"job {tx.public_job_id!r} has no trial {event.trial_number} (reset or deleted "
            "since the checkpoint was saved)"
        )
    check_resumable(tx.public_job_id, trial, event)
    cost = snapshot.cost(event.energy_j, event.time_s)
    if not math.isfinite(cost):  # the field bounds rule this out; never store it
        raise InvalidEvent("the checkpoint's time_s and energy_j give a non-finite cost")
    reopened = trial.replace(
        status=TrialStatus.RUNNING,
        stop_reason=None,
        epochs=event.epochs,
        time_s=event.time_s,
        energy_j=event.energy_j,
        cost=cost,
        last_metric=None,
        current_batch_size=None,
        lease_s=event.lease_s,
        updated_at=now,
    )
    tx.save_trial(reopened)
    return TrialAssigned(
        event_id=event.event_id,
        job_id=tx.public_job_id,
        trial_number=reopened.trial_number,
        batch_size=reopened.batch_size,
        phase=reopened.phase,
    )


def check_resumable(job_id: str, trial: TrialRecord, event: ResumeTrial) -> None:
    """Raise :class:`TrialNotResumable` unless ``event`` may reopen ``trial``."""
    name = f"trial {trial.trial_number} of job {job_id}"
    if not lost_its_run(trial.status, trial.stop_reason):
        reason = trial.stop_reason.value if trial.stop_reason else "no reason"
        raise TrialNotResumable(
            f"{name} already ended for good ({trial.status.value}, {reason}): only a "
            "running, interrupted or script-ended trial can be resumed"
        )
    if trial.hardware_key != event.hardware_key or trial.batch_size != event.batch_size:
        raise TrialNotResumable(
            f"{name} ran batch size {trial.batch_size} on {trial.hardware_key}; the "
            f"checkpoint says {event.batch_size} on {event.hardware_key}"
        )
    if event.standing and not any(stands_at(trial, where) for where in event.standing):
        raise TrialNotResumable(
            f"{name} stands at epoch {trial.epochs} ({trial.time_s:g} s), not where this run "
            "left it: another run resumed it meanwhile, and it stays that run's"
        )
    if (
        event.epochs > trial.epochs
        or event.time_s > trial.time_s
        or event.energy_j > trial.energy_j
    ):
        raise TrialNotResumable(
            f"{name} has {trial.epochs} epochs, {trial.time_s:g} s and {trial.energy_j:g} J; "
            f"the checkpoint says {event.epochs} epochs, {event.time_s:g} s and "
            f"{event.energy_j:g} J, more than the service was told"
        )


def stands_at(trial: TrialRecord, where: TrialStanding) -> bool:
    """Whether ``trial`` is where a run left it: the same epoch, at the same cumulative
    time (a float that went through JSON and the database unchanged; the tolerance
    only absorbs a database that rounds its last digit).  Also how a delivered
    journal is matched to its trial (:mod:`bso.detached_runs`)."""
    return trial.epochs == where.epochs and math.isclose(
        trial.time_s, where.time_s, rel_tol=1e-9, abs_tol=1e-9
    )
