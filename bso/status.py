"""Read models of what a job has learned: shared by the service and its callers.

They live apart from :mod:`bso.service` so that the client can parse a status
reply without importing the decision core or the storage layer.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from bso.spec import Hardware, JobSpec


class SizeStatus(BaseModel):
    model_config = ConfigDict(frozen=True)

    batch_size: int
    trials: int
    converged: int
    failed: int
    """Trials that ended without converging, for any reason (see ``outcomes``)."""
    outcomes: dict[str, int] = {}
    """Trials per outcome (:class:`bso.core.outcomes.Outcome` values)."""
    mean_cost: float | None
    probability_best: float | None


class LaneStatus(BaseModel):
    """What the job learned on one hardware configuration."""

    model_config = ConfigDict(frozen=True)

    hardware: Hardware
    stage: Literal["exploring", "exploiting"]
    trials: int
    running_trials: int
    memory_limit: int | None = None
    """Smallest size that ran out of memory since the last re-probe: it and larger
    sizes are not handed out on this hardware."""
    recommended_batch_size: int | None
    confidence: float | None
    """Posterior probability that the recommended size is the cheapest."""
    expected_cost: float | None
    sizes: list[SizeStatus]


class JobStatus(BaseModel):
    model_config = ConfigDict(frozen=True)

    job_id: str
    spec: JobSpec
    lanes: list[LaneStatus]
