"""The core's words for a trial: its status, why it got its size, why it stopped.

They belong to the decision core because the policies decide on them; the
wire (:mod:`bso.wire.events`) carries them as their string values and the storage
keeps those strings, so both map to these enums and neither defines its own.
What each ending means for learning is :mod:`bso.core.outcomes`'s.
"""

from __future__ import annotations

from enum import StrEnum


class TrialStatus(StrEnum):
    RUNNING = "running"
    CONVERGED = "converged"
    FAILED = "failed"
    """Ended without converging: stopped by bso, or the size's own failure (see
    :class:`StopReason` and :mod:`bso.core.outcomes`)."""
    INTERRUPTED = "interrupted"
    """Ended by something that is not the batch size's fault (SIGTERM, preemption,
    operator cancel, a client that vanished): the run says nothing about the size."""


class TrialPhase(StrEnum):
    """Why the trial got its batch size."""

    EXPLORATION = "exploration"
    """Measuring a batch size the job has not (fully) tried yet."""
    EXPLOITATION = "exploitation"
    """Thompson sampling over the sizes that survived exploration."""
    CONCURRENT = "concurrent"
    """Another exploration of the job is still running: use the best known size."""


class StopReason(StrEnum):
    TARGET_REACHED = "target_reached"
    MAX_EPOCHS = "max_epochs"
    COST_BOUND = "cost_bound"
    """Cost passed ``beta_knob`` times the best cost so far."""
    PROJECTED_COST = "projected_cost"
    """Finishing this exploration would cost more than restarting with the best size."""
    EXPLORATION_BUDGET = "exploration_budget"
    """Another epoch would spend more of the job's exploration budget than is left."""
    ABANDONED = "abandoned"
    """The caller ended the trial before it converged because training raised (a crash)."""
    DIVERGED = "diverged"
    """The validation metric became NaN or infinite: training diverged."""
    OUT_OF_MEMORY = "out_of_memory"
    """The batch size did not fit in the accelerator's memory."""
    INTERRUPTED = "interrupted"
    """SIGTERM, preemption or an operator's cancel: not the batch size's fault."""
    HEARTBEAT_TIMEOUT = "heartbeat_timeout"
    """The caller went silent past its lease (killed, OOM-killed, node lost)."""


def lost_its_run(status: TrialStatus, reason: StopReason | None) -> bool:
    """Whether a trial in this state only lost its run, and may be resumed
    (:mod:`bso.resumes`): still running (the process was killed and its lease has not
    run out), interrupted by a signal or by its lease, or ended by its script
    (``abandoned``: the crash said nothing of the size).  Any other ending is for
    good: no run can ever report into that trial again."""
    return (
        status is TrialStatus.RUNNING
        or (
            status is TrialStatus.INTERRUPTED
            and reason in (StopReason.INTERRUPTED, StopReason.HEARTBEAT_TIMEOUT)
        )
        or (status is TrialStatus.FAILED and reason is StopReason.ABANDONED)
    )
