"""The client's log lines about a trial: what runs, what bso recommends so far, and
the service's notice when the lane's last runs were ended by the script itself.

Cerebras's batch exploration reports a running recommendation while it
explores; bso's is the lane's current recommendation with its measured
confidence (:mod:`bso.core.confidence`), read from the service when a trial
starts.  At the end of a recurrence one grep-able ``bso-status`` line says what
the job learned on this hardware.  A status read that fails costs a log line,
never the run.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from bso.errors import BsoError
from bso.spec import BatchSplit, Hardware, JobSpec
from bso.status import LaneStatus, running_recommendation, started_from_text, summary_line
from bso.wire.events import TrialAssigned
from bso_client.service_calls import JobCalls

if TYPE_CHECKING:
    from bso_client.optimizer import BatchSizeOptimizer

logger = logging.getLogger("bso_client.optimizer")
"""The optimizer's logger: users configure one name for everything a run says."""


def log_trial(
    lane: LaneStatus | None,
    job_id: str,
    spec: JobSpec,
    trial: TrialAssigned,
    split: BatchSplit,
    *,
    resumed_after: int | None = None,
) -> None:
    """``bso trial 7 of job J: batch size 256 = 32 x 4 passes x 2 devices (exploration);
    so far 128 is cheapest at confidence 62% (1.18x cheaper than the default)``;
    ``resumed_after``: the checkpoint's epochs, for a run that resumed the trial."""
    how = (
        f" = {split.micro_batch_size} x {split.accumulation_steps} passes x "
        f"{spec.devices or 1} devices"
        if spec.micro_batch_size or spec.devices or split.accumulation_steps > 1
        else ""
    )
    logger.info(
        "bso trial %d of job %s: batch size %d%s (%s)%s",
        trial.trial_number,
        job_id,
        trial.batch_size,
        how,
        trial.phase.value
        if resumed_after is None
        else f"{trial.phase.value}, resumed from its checkpoint after epoch {resumed_after}",
        running_recommendation(lane) if lane else "",
    )
    if trial.notice:  # the lane's last runs were ended by the script itself
        logger.warning("bso: %s", trial.notice)


def log_lane(
    lane: LaneStatus | None, job_id: str, hardware: Hardware, trial: TrialAssigned
) -> None:
    """For a job registered before this run, one line on its lane, once the trial has
    started (the registration's reply does not say whether the lane is new; the lane's
    status, read for the trial's line anyway, does)::

    bso job J: new lane NVIDIA H100 80GB HBM3 x1 (the job was registered before);
    started at 128, from lane NVIDIA A100 x1's recommendation 128 (12 converged runs)
    """
    key = hardware.key
    if lane is None:  # the status read failed: say only what is known
        logger.info("bso job %s already registered; this run is on lane %s", job_id, key)
    elif lane.trials > 1:
        logger.info(
            "bso job %s already registered on %s (%d earlier trial(s) on this lane)",
            job_id,
            key,
            lane.trials - 1,
        )
    else:  # this run's trial is the lane's only one
        start = (
            started_from_text(lane.started_from, lane.default_batch_size)
            if lane.started_from
            else f"its first run at batch size {trial.batch_size}"
            + (" (the default)" if trial.batch_size == lane.default_batch_size else "")
        )
        logger.info(
            "bso job %s: new lane %s (the job was registered before); %s", job_id, key, start
        )


def log_recurrence(calls: JobCalls | None, job_id: str, hardware: Hardware) -> LaneStatus | None:
    """One grep-able ``bso-status`` line: what the job learned on this hardware (returned)."""
    lane = lane_of(calls, job_id, hardware, quiet=False)
    if lane is not None:
        logger.info("%s", summary_line(job_id, lane))
    return lane


def lane_of(
    calls: JobCalls | None, job_id: str, hardware: Hardware, *, quiet: bool = True
) -> LaneStatus | None:
    """What the job learned on ``hardware``; None when it cannot be read (or nothing yet)."""
    if calls is None:
        return None
    try:
        status = calls.service.status(job_id)
    except BsoError as err:
        if not quiet:
            logger.info("bso status of job %s not available: %s", job_id, err)
        return None
    return next((lane for lane in status.lanes if lane.hardware.key == hardware.key), None)


def warn_if_ended_short(run: BatchSizeOptimizer, exc: BaseException | None) -> None:
    """One WARNING when rank 0 closes a running trial without an exception, before bso
    stopped it: the loop ended short of the target and of ``max_epochs`` on its own
    (a loop of fewer epochs, the Trainer's ``num_train_epochs`` below them, an early
    stop of the script's own).  bso counts such a run as the script's
    (``abandoned``), not the size's, and gives the next run the same size, so the
    script must be fixed for bso to learn anything."""
    if exc is not None or run.rank != 0 or run.trial_number is None or run.training_finished:
        return
    if run.closed:  # a second close
        return
    logger.warning(
        "bso trial %d of job %s: training ended after %d epoch(s) without an error, short "
        "of target_metric and of max_epochs (%d): bso counts the run as the script's, not "
        "the batch size's, and gives the next run the same size (does the loop run "
        "job.max_epochs epochs, stopping early only when bso.training_finished is True?)",
        run.trial_number,
        run.job_id,
        run.epoch,
        run.spec.max_epochs,
    )
