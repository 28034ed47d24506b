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
    mean_cost: float | None
    probability_best: float | None


class LaneStatus(BaseModel):
    """What the job learned on one hardware configuration."""

    model_config = ConfigDict(frozen=True)

    hardware: Hardware
    stage: Literal["exploring", "exploiting"]
    trials: int
    running_trials: int
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
