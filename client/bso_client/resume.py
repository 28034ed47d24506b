"""Resuming a run from a checkpoint: the same trial goes on.

A run saves ``bso.state_dict()`` in its checkpoint; the run started again from
that checkpoint passes it back, ``BatchSizeOptimizer(job, url, resume=state)``.
Its :meth:`~bso_client.optimizer.BatchSizeOptimizer.get_batch_size` then asks the
service to reopen the checkpoint's trial (:class:`~bso.wire.events.ResumeTrial`,
:mod:`bso.resumes`) instead of starting a new one, and returns the checkpoint's
batch size; its epochs are numbered on from the checkpoint's, and its time and
energy add to the checkpoint's (:meth:`bso_client.epoch_meter.EpochMeter.resume`).

Where bso cannot follow the run, it trains on at the checkpoint's size *without*
bso (:meth:`bso_client.detachment.Detachment.untracked`), with one WARNING: the
service refused (the trial converged, failed or was ended by the script; the
job was reset), the checkpoint's run had no trial (it ran detached), its batch
size is no longer one of the job's (``bso jobs set-sizes``), it ran on
another hardware lane than this run (another GPU model or count, or another
number of processes), or the service is unreachable.  Nothing of such a run is
journaled: a journal would lack the epochs before the checkpoint and make the
size look cheaper than it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bso.errors import BsoError, TrialNotResumable
from bso.spec import (
    MAX_BATCH_SIZE,
    MAX_ENERGY_J,
    MAX_SQL_INT,
    MAX_TIME_S,
    Hardware,
    JobSpec,
    listed,
)
from bso.wire.events import LaneKey, ResumeTrial, TrialAssigned, TrialNumber, TrialStanding
from bso_client.epoch_meter import TrialTotals
from bso_client.fail_open import is_service_failure

if TYPE_CHECKING:
    from bso_client.detachment import Detachment
    from bso_client.service_calls import JobCalls


class Checkpoint(BaseModel):
    """What ``bso.state_dict()`` returns (as a plain dict of JSON values)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bso_state: Literal[1] = 1
    """The format's version."""
    # The bounds are ResumeTrial's: a state that could not be sent is refused here,
    # at construction, rather than as a pydantic error out of get_batch_size().
    job_id: str
    trial_number: TrialNumber | None
    """None: the run had no trial (it ran detached from its start)."""
    batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)]
    hardware_key: LaneKey
    epochs: Annotated[int, Field(ge=0, le=MAX_SQL_INT)]
    """Epochs the service had been told of when the state was taken."""
    time_s: Annotated[float, Field(ge=0, le=MAX_TIME_S, allow_inf_nan=False)]
    energy_j: Annotated[float, Field(ge=0, le=MAX_ENERGY_J, allow_inf_nan=False)]

    @classmethod
    def read(cls, state: Mapping[str, Any], job_id: str | None) -> Checkpoint:
        """``state`` checked: a ValueError (at construction, before any training) says
        what is wrong with it."""
        try:
            checkpoint = cls.model_validate(dict(state))
        except (ValidationError, TypeError, ValueError) as err:
            raise ValueError(
                f"resume= takes the dict bso.state_dict() returned, as saved: {err}"
            ) from None
        if job_id is not None and checkpoint.job_id != job_id:
            raise ValueError(
                f"resume=: the checkpoint is of job {checkpoint.job_id!r}, not {job_id!r}"
            )
        return checkpoint

    @property
    def totals(self) -> TrialTotals:
        return TrialTotals(self.epochs, self.time_s, self.energy_j)

    def event(
        self,
        job_id: str,
        lease_s: float | None,
        event_id: str,
        standing: tuple[TrialStanding, ...] = (),
    ) -> ResumeTrial:
        assert self.trial_number is not None
        return ResumeTrial(
            event_id=event_id,
            job_id=job_id,
            trial_number=self.trial_number,
            hardware_key=self.hardware_key,
            batch_size=self.batch_size,
            epochs=self.epochs,
            time_s=self.time_s,
            energy_j=self.energy_j,
            lease_s=lease_s,
            standing=standing,
        )


def state(
    job_id: str, trial_number: int | None, batch_size: int, hardware: Hardware, totals: TrialTotals
) -> dict[str, Any]:
    """The checkpoint's part of a run, as plain JSON values."""
    checkpoint = Checkpoint(
        job_id=job_id,
        trial_number=trial_number,
        batch_size=batch_size,
        hardware_key=hardware.key,
        epochs=totals.epoch,
        time_s=totals.time_s,
        energy_j=totals.energy_j,
    )
    return checkpoint.model_dump(mode="json")


def resume_trial(
    calls: JobCalls, detachment: Detachment, job_id: str, checkpoint: Checkpoint, spec: JobSpec
) -> TrialAssigned | None:
    """Rank 0: the checkpoint's trial reopened, or None when the run goes on without bso
    (a refusal is logged here; an unreachable service leaves ``detachment`` down).
    ``spec``: what this run registered: its hardware lane must be the checkpoint's, and
    its sizes hold the checkpoint's."""
    lane = spec.hardware.key
    if checkpoint.trial_number is None:
        detachment.untracked(checkpoint.batch_size, None, "the checkpoint's run had no trial")
        return None
    if checkpoint.job_id != job_id:  # only with job_id_prefix: the id is checked at read
        detachment.untracked(
            checkpoint.batch_size,
            checkpoint.trial_number,
            f"the checkpoint's run was of job {checkpoint.job_id}, this run registered a new "
            f"job, {job_id}: a spec with job_id_prefix makes a new job at every registration; "
            "give the job a fixed job_id to resume its runs",
            of_job=checkpoint.job_id,
        )
        return None
    if checkpoint.hardware_key != lane:  # the trial's lane: its costs are that hardware's
        detachment.untracked(
            checkpoint.batch_size,
            checkpoint.trial_number,
            f"the checkpoint's run trained on {checkpoint.hardware_key}, this run on {lane}: "
            "bso learns each hardware lane apart, and this run's epochs would be charged "
            "to the other lane's batch size",
        )
        return None
    if checkpoint.batch_size not in spec.batch_sizes:  # e.g. bso jobs set-sizes took it off
        detachment.untracked(
            checkpoint.batch_size,
            checkpoint.trial_number,
            f"its batch size {checkpoint.batch_size} is not one of the lane's batch_sizes "
            f"now, {listed(spec.batch_sizes)}",
        )
        return None
    try:
        reopened = detachment.attempt(lambda: calls.resume_trial(job_id, checkpoint))
    except BsoError as err:
        if is_service_failure(err):  # on_unavailable="raise": raised as any call's
            raise
        why = str(err)
        if isinstance(err, TrialNotResumable):
            why += f"; {LEFTOVER_CHECKPOINT}"
        detachment.untracked(checkpoint.batch_size, checkpoint.trial_number, why)
        return None
    if reopened is not None:
        detachment.reopened_at = checkpoint.totals
    return reopened


LEFTOVER_CHECKPOINT = (
    "a checkpoint of a run that ended is not resumed: if this run is the job's next "
    "recurrence, start it without the last run's checkpoint (remove a run's checkpoint "
    "once the run is over, as docs/client.md's snippet does)"
)
"""What a refusal of a finished trial most likely means: a nightly job that kept the
previous night's checkpoint, whose every later run would train without bso."""
