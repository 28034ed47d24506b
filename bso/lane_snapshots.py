"""The lane snapshots the decision core reads, from the store's records.

A snapshot is one hardware lane's trials with the job's spec (or the lane's own
batch plan); :func:`with_other_lanes` adds what the job's other lanes learned
(:mod:`bso.core.transfer`): their epochs per size as they stand, and where the
lane starts, as it was when the lane began (:func:`started_from`).  The service
builds them inside its transactions and hands them to the policies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from bso.core.state import JobSnapshot
from bso.core.transfer import LaneStart, epoch_floors, epoch_guesses, lane_prior, lane_start
from bso.core.vocabulary import TrialStatus
from bso.spec import BatchPlan, Hardware
from bso.storage.base import JobReader, JobRecord, LaneRecord, TrialRecord


def lane_snapshot(
    tx: JobReader,
    job: JobRecord,
    lane: LaneRecord | None,
    trials: Sequence[TrialRecord] | None = None,
) -> JobSnapshot:
    """The snapshot of a stored lane (None: a lane that has no record yet, on the job's
    own hardware); ``trials``: those of its trials to include (default: all)."""
    if lane is None:
        return build_snapshot(tx, job, job.spec.hardware, trials=trials)
    return build_snapshot(
        tx, job, lane.hardware, lane.memory_reprobed_through, lane.plan, trials=trials
    )


def started_from(
    tx: JobReader,
    job: JobRecord,
    lane: JobSnapshot,
    records: Sequence[TrialRecord] | None = None,
) -> LaneStart | None:
    """Where ``lane`` starts, from the job's other lanes (:mod:`bso.core.transfer`) as
    they were when its first trial began: only their trials that had ended by then
    count (a trial still running then may converge later, and the start must not
    move under a lane that has begun).  Only bso's policy transfers (Zeus's
    baseline starts at the default, as Zeus does).  ``records``: the job's trials,
    when the caller has read them already."""
    if job.spec.policy != "bso":
        return None
    if records is None:
        records = tx.trials()
    mine = [r for r in records if r.hardware_key == lane.hardware.key]
    began = min((r.created_at for r in mine), default=None)
    earlier: dict[str, list[TrialRecord]] = {}
    for r in records:
        if r.hardware_key == lane.hardware.key:
            continue
        if began is None or (r.status is not TrialStatus.RUNNING and r.updated_at <= began):
            earlier.setdefault(r.hardware_key, []).append(r)
    others = [lane_snapshot(tx, job, tx.get_lane(key), earlier[key]) for key in sorted(earlier)]
    return lane_start(lane, others)


def with_other_lanes(
    tx: JobReader, job: JobRecord, lane: JobSnapshot, *, start: bool
) -> JobSnapshot:
    """``lane`` with what the job's other lanes taught it: the epochs to target they
    measured per size and the epochs their cost-stopped runs proved, as they stand
    (:func:`bso.core.transfer.epoch_guesses`, :func:`~bso.core.transfer.epoch_floors`:
    a run's stops judge it by them), and, with ``start``, where the lane starts and the other
    lane's cost curve, as they were when it began (:func:`started_from`: what bso's walk
    reads).  Only bso's policy transfers (Zeus's baseline learns each lane alone, as
    Zeus does)."""
    if job.spec.policy != "bso":
        return lane
    records = tx.trials()
    ended: dict[str, list[TrialRecord]] = {}
    for r in records:
        if r.hardware_key != lane.hardware.key and r.status is not TrialStatus.RUNNING:
            ended.setdefault(r.hardware_key, []).append(r)
    if not ended:
        return lane  # nothing converged elsewhere: no start, no epochs
    others = [lane_snapshot(tx, job, tx.get_lane(key), ended[key]) for key in sorted(ended)]
    found = started_from(tx, job, lane, records) if start else None
    return dataclasses.replace(
        lane,
        prior=None if found is None else lane_prior(lane, found),
        other_lanes_epochs=epoch_guesses(lane, others),
        other_lanes_floors=epoch_floors(lane, others),
    )


def build_snapshot(
    tx: JobReader,
    job: JobRecord,
    hardware: Hardware,
    memory_reprobed_through: int = 0,
    plan: BatchPlan | None = None,
    *,
    trials: Sequence[TrialRecord] | None = None,
) -> JobSnapshot:
    """The lane's stored trials (or ``trials``, some of them), as the core reads them
    (policies then take :func:`bso.core.outcomes.learning_view` of it); ``plan``: the
    lane's own batch sizes, if it registered other ones than the job's."""
    if trials is None:
        trials = tx.trials(hardware.key)
    return JobSnapshot(
        spec=job.spec if plan is None else job.spec.with_plan(plan),
        hardware=hardware,
        trials=tuple(t.snapshot() for t in trials),
        memory_reprobed_through=memory_reprobed_through,
    )
