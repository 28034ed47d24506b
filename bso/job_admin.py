"""What ``bso jobs`` does to a job: reset it, give a lane a new list of sizes, list jobs.

These are the ways out of a job that learned something its owner wants to undo
(``NoFeasibleBatchSize`` names them): :class:`~bso.wire.events.ResetJob` forgets
the finished trials but keeps the spec and the lanes,
:class:`~bso.wire.events.SetLaneSizes` replaces one lane's sizes and keeps what
still applies.  Both run inside the job's transaction like every event
(:meth:`bso.service.BsoService.handle`), so they are idempotent and never race a
training run's events.
"""

from __future__ import annotations

import dataclasses
import math

from pydantic import ValidationError

from bso.apikeys import split_job_key
from bso.errors import InvalidEvent, InvalidSpec
from bso.spec import BatchPlan, JobSpec, listed
from bso.storage.base import JobActivity, JobRecord, JobTransaction, LaneRecord
from bso.wire.events import JobReset, LaneSizesSet, ResetJob, SetLaneSizes
from bso.wire.jobs_query import JobSummary


def reset_job(tx: JobTransaction, event: ResetJob) -> JobReset:
    """Forget the job's finished trials.

    Running trials stay: deleting one would fail its run's next report, and bso
    never ends a user's run.  Lanes keep their sizes and the bandit's random
    state; the memory re-probe mark may stay as it is, since trial numbers are
    never reused.  Replies already given stay recorded, so a retried event
    still gets its first answer.
    """
    forgotten = tx.forget_finished_trials()
    return JobReset(
        event_id=event.event_id,
        job_id=tx.public_job_id,
        forgotten=forgotten,
        running=len(tx.trials()),
    )


def set_lane_sizes(tx: JobTransaction, job: JobRecord, event: SetLaneSizes) -> LaneSizesSet:
    """Give ``event.lane`` the new list: the lane's micro-batch size and devices stay,
    trials at sizes still listed keep counting, the others are set aside (the
    learning view only takes trials at listed sizes)."""
    lane = lane_record(tx, job, event.lane)
    current = lane.plan or job.spec.plan
    sizes = sorted(set(event.batch_sizes))
    default = event.default_batch_size or nearest(sizes, current.default_batch_size)
    plan = checked_plan(
        job.spec,
        BatchPlan(
            batch_sizes=sizes,
            default_batch_size=default,
            micro_batch_size=current.micro_batch_size,
            devices=current.devices,
        ),
    )
    tx.save_lane(dataclasses.replace(lane, plan=plan))
    trials = tx.trials(event.lane)
    kept = sum(t.batch_size in sizes for t in trials)
    return LaneSizesSet(
        event_id=event.event_id,
        job_id=tx.public_job_id,
        lane=event.lane,
        plan=plan,
        kept_trials=kept,
        set_aside_trials=len(trials) - kept,
    )


def lane_record(tx: JobTransaction, job: JobRecord, key: str) -> LaneRecord:
    """The stored lane of ``key``; the job's own hardware has one even before its
    first trial.  Any other key the job never saw is refused, naming its lanes."""
    lane = tx.get_lane(key)
    if lane is not None:
        return lane
    if key == job.spec.hardware.key:
        return LaneRecord(job.spec.hardware)
    known = sorted({job.spec.hardware.key, *(t.hardware_key for t in tx.trials())})
    raise InvalidEvent(
        f"job {tx.public_job_id} has no lane {key!r}; its lanes: "
        f"{', '.join(repr(k) for k in known)} (as bso status or bso jobs list shows them)"
    )


def nearest(sizes: list[int], default: int) -> int:
    """The old default if still listed, else the listed size nearest it on a log
    scale (the smaller one on a tie: its learning rate was tuned for the default)."""
    return min(sizes, key=lambda b: (abs(math.log(b / default)), b))


def checked_plan(spec: JobSpec, plan: BatchPlan) -> BatchPlan:
    """``plan`` validated with the job's other settings (default listed, sizes whole
    micro-batches on every device)."""
    try:
        merged = JobSpec.model_validate({**spec.model_dump(), **plan.model_dump()})
    except ValidationError as exc:
        # pydantic prefixes a validator's own message with "Value error, ".
        problems = "; ".join(
            str(e["msg"]).removeprefix("Value error, ") for e in exc.errors(include_url=False)
        )
        raise InvalidSpec(
            f"batch sizes {listed(plan.batch_sizes)} (default {plan.default_batch_size}) "
            f"do not fit the lane: {problems}"
        ) from None
    return merged.plan


def job_summary(activity: JobActivity) -> JobSummary:
    """The list entry of a job, by the id its tenant uses."""
    return JobSummary(
        job_id=split_job_key(activity.job_id)[1],
        lanes=list(activity.lanes),
        trials=activity.trials,
        running_trials=activity.running_trials,
        last_activity=activity.last_activity,
    )
