"""Read models of what a job has learned: shared by the service and its callers.

They live apart from :mod:`bso.service` so that the client can parse a status
reply without importing the decision core or the storage layer.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict

from bso.spec import Hardware, JobSpec


class SizeStatus(BaseModel):
    model_config = ConfigDict(frozen=True)

    batch_size: int
    trials: int
    converged: int
    failed: int
    """Trials that failed through the size's own fault (the ``failed`` outcome: a
    diverged metric, ``max_epochs``; a crash is the script's, ``script_error``); a stop by
    bso's cost rules is ``stopped``, see ``outcomes``."""
    not_converged: int = 0
    """Trials that ended without converging, for any reason."""
    outcomes: dict[str, int] = {}
    """Trials per outcome (:class:`bso.core.outcomes.Outcome` values)."""
    mean_cost: float | None
    probability_best: float | None


HISTORY_LIMIT = 1000
"""Trials of a lane listed in its status (the newest): enough to plot, bounded in size."""


FINAL_OUTCOMES = frozenset({"converged", "stopped", "failed", "out_of_memory"})
"""The :attr:`TrialPoint.outcome` values of trials that ended for good: no run reports
into them again, and :mod:`bso.resumes` never reopens them (``interrupted`` and
``script_error`` trials may be resumed; tests/test_status.py checks the two
agree).  A detached run back from an outage reads it (:mod:`bso_client.reattachment`)."""


class TrialPoint(BaseModel):
    """One trial of the lane's history, for plots."""

    model_config = ConfigDict(frozen=True)

    trial_number: int
    batch_size: int
    outcome: str
    """A :class:`bso.core.outcomes.Outcome` value."""
    epochs: int
    cost: float
    """Cost so far (the whole run's once it ended)."""
    detached: bool = False
    """Trained while the service was unreachable; delivered afterwards from its journal."""


class BudgetStatus(BaseModel):
    """A lane's exploration budget (``JobSpec.exploration_budget``), in runs of its
    baseline (the default size): what ``bso status`` shows of :mod:`bso.core.budget`."""

    model_config = ConfigDict(frozen=True)

    budget: float
    """The job's fraction: extra cost allowed over always running the default."""
    baseline_batch_size: int
    baseline_cost: float
    """Mean cost of the baseline's converged runs: one default run."""
    recurrences: int
    """Recurrences that ended with a converged run."""
    used_runs: float
    """Cost of the ended runs above always-default's, in default runs (negative: saved)."""
    allowed_runs: float
    """Excess allowed by the end of the next recurrence, in default runs."""

    @property
    def left_runs(self) -> float:
        return self.allowed_runs - self.used_runs


class StartStatus(BaseModel):
    """What a lane's first run was taken from: another lane's recommendation
    (:mod:`bso.core.transfer`)."""

    model_config = ConfigDict(frozen=True)

    from_lane: str
    recommended: int
    """The other lane's recommendation when this lane began."""
    batch_size: int
    """This lane's nearest candidate: its first run's size."""
    converged_runs: int
    """Converged runs of the other lane behind that recommendation."""


class MicroBatchStatus(BaseModel):
    """The micro-batch runs at one global batch size have settled on so far
    (:mod:`bso.core.micro_batch`, learned across recurrences)."""

    model_config = ConfigDict(frozen=True)

    batch_size: int
    """The global batch the runs explored."""
    micro_batch_size: int
    """The recommended micro-batch: samples per device per pass."""
    confidence: int
    """0-100: the probability, in percent (rounded down), that it is within 1% of the
    fastest micro-batch timed; at :data:`bso.core.micro_batch.STOP_CONFIDENCE` or
    above, later runs skip the exploration."""
    runs: int
    """Runs whose timings the choice comes from: those that explored this global
    batch, the latest 20 at most (:data:`bso.core.micro_batch.KEPT_RUNS`)."""
    timed_steps: int
    """Optimizer steps counted over all candidates and runs."""


class LaneStatus(BaseModel):
    """What the job learned on one hardware configuration."""

    model_config = ConfigDict(frozen=True)

    hardware: Hardware
    stage: Literal["exploring", "exploiting", "stuck"]
    """``stuck``: no batch size is left to hand out (see :attr:`stuck`)."""
    trials: int
    running_trials: int
    stuck: str | None = None
    """Why the lane's next run gets ``NoFeasibleBatchSize`` (what ruled each size out,
    and the commands that get out); None while a size is handed out."""
    detached_trials: int = 0
    """Trials that ran detached (the service was unreachable) and were delivered later."""
    memory_limit: int | None = None
    """Smallest size that ran out of memory since the last re-probe: it and larger
    sizes are not handed out on this hardware."""
    recommended_batch_size: int | None
    confidence: int | None
    """0-100: the posterior probability, in percent (rounded down), that the
    recommended size costs at most 1% more than the cheapest of the lane's
    candidate sizes (``bso.core.confidence.TOLERANCE``)."""
    gain_over_default: float | None = None
    """Expected cost of the default batch size over the recommendation's (1.18: the
    recommendation is 1.18x cheaper); None while the default has no estimate."""
    converged_sizes: int = 0
    """Sizes with at least one converged run among those still handed out."""
    expected_cost: float | None
    sizes: list[SizeStatus]
    history: list[TrialPoint] = []
    """The newest :data:`HISTORY_LIMIT` trials, oldest first."""
    batch_sizes: list[int] = []
    """The lane's candidate sizes (its own plan where it registered one)."""
    default_batch_size: int | None = None
    exploration_budget: BudgetStatus | None = None
    """None when the job has no budget, or its default has not converged yet."""
    started_from: StartStatus | None = None
    """None: the lane started at the default (the job's first lane, or no other lane
    had converged runs when it began)."""
    micro_batches: list[MicroBatchStatus] = []
    """Per global batch that runs explored micro-batches at, the choice so far."""


class JobStatus(BaseModel):
    model_config = ConfigDict(frozen=True)

    job_id: str
    spec: JobSpec
    lanes: list[LaneStatus]
    tenant: str | None = None
    """The tenant that owns the job (the operator's view names it)."""


def percent(probability: float | None) -> int | None:
    """A probability as a 0-100 confidence, rounded down: 99 means at least 0.99."""
    return None if probability is None else min(100, max(0, int(probability * 100)))


def summary_line(job_id: str, lane: LaneStatus) -> str:
    """One grep-able line per job and lane, the same fields as ``bso status``::

    bso-status job=resnet hardware="Tesla V100 x1" recommended=360 confidence=73
    gain=1.18x stage=exploiting trials=12 sizes=256:converged=5/stopped=1,360:converged=4

    (``detached=N`` after ``trials`` when N of them ran detached, see docs/client.md.)
    """

    def field(value: object) -> str:
        return "-" if value is None else str(value)

    gain = None if lane.gain_over_default is None else f"{lane.gain_over_default:.2f}x"
    detached = f" detached={lane.detached_trials}" if lane.detached_trials else ""
    sizes = ",".join(
        f"{s.batch_size}:" + "/".join(f"{k}={v}" for k, v in s.outcomes.items()) for s in lane.sizes
    )
    return (
        f"bso-status job={job_id} hardware={json.dumps(lane.hardware.key)} "
        f"recommended={field(lane.recommended_batch_size)} "
        f"confidence={field(lane.confidence)} gain={field(gain)} stage={lane.stage} "
        f"trials={lane.trials}{detached} sizes={sizes or '-'}"
    )


def started_from_text(start: StartStatus, default: int | None) -> str:
    """What a lane's first run was taken from (:mod:`bso.core.transfer`), as ``bso
    status`` and the client's log say it: ``started at 128, from lane Tesla V100 x1's
    recommendation 128 (50 converged runs)``."""
    behind = f"lane {start.from_lane}'s recommendation {start.recommended}"
    runs = f"({start.converged_runs} converged runs)"
    if start.batch_size == default and start.recommended != default:
        return (
            f"started at the default {default}: {behind} {runs} is not cheaper than it by "
            "more than curves differ between GPUs"
        )
    return f"started at {start.batch_size}, from {behind} {runs}"


def running_recommendation(lane: LaneStatus) -> str:
    """The answer so far, for a trial's log line while bso explores (empty when none)::

    ; so far 128 is cheapest at confidence 62% (1.18x cheaper than the default)
    """
    if lane.recommended_batch_size is None:
        return ""
    gain = lane.gain_over_default
    versus = "" if gain is None or gain < 1.005 else f" ({gain:.2f}x cheaper than the default)"
    return (
        f"; so far {lane.recommended_batch_size} is cheapest at confidence "
        f"{lane.confidence}%{versus}"
    )
