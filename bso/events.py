"""Versioned events (caller -> service) and replies (service -> caller).

Every event carries an ``event_id``: the service records the reply it gave to
each id, so a retried or redelivered event changes state once and gets the
same reply again.  The models are plain JSON on the wire (no pickle).
"""

from __future__ import annotations

import uuid
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from bso.spec import Hardware, JobSpec

SCHEMA_VERSION: Literal[1] = 1

EventId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")]


def new_event_id() -> str:
    """A fresh random event id."""
    return uuid.uuid4().hex


class TrialStatus(StrEnum):
    RUNNING = "running"
    CONVERGED = "converged"
    FAILED = "failed"


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
    ABANDONED = "abandoned"
    """The caller ended the trial before it converged (crash, OOM, Ctrl-C)."""
    HEARTBEAT_TIMEOUT = "heartbeat_timeout"
    """The caller went silent for longer than the heartbeat timeout."""


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = SCHEMA_VERSION
    event_id: EventId = Field(default_factory=new_event_id)


JobId = Annotated[str, Field(min_length=1, max_length=128)]


class RegisterJob(_Event):
    kind: Literal["register"] = "register"
    spec: JobSpec


class NextTrial(_Event):
    kind: Literal["next_trial"] = "next_trial"
    job_id: JobId
    hardware: Hardware | None = None
    """Hardware of this recurrence; the registered spec's hardware when omitted."""


class EpochReport(_Event):
    kind: Literal["epoch"] = "epoch"
    job_id: JobId
    trial_number: Annotated[int, Field(ge=1)]
    epoch: Annotated[int, Field(ge=1)]
    """1-based index of the epoch that just finished."""
    time_s: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    """Cumulative training time of the trial so far."""
    energy_j: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    """Cumulative energy of the trial so far (all GPUs of the job)."""
    metric: Annotated[float, Field(allow_inf_nan=False)]


class EndTrial(_Event):
    kind: Literal["end"] = "end"
    job_id: JobId
    trial_number: Annotated[int, Field(ge=1)]


class DeleteJob(_Event):
    kind: Literal["delete"] = "delete"
    job_id: JobId


Event = Annotated[
    RegisterJob | NextTrial | EpochReport | EndTrial | DeleteJob, Field(discriminator="kind")
]
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)


class _Reply(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = SCHEMA_VERSION
    event_id: str


class JobRegistered(_Reply):
    kind: Literal["registered"] = "registered"
    job_id: str
    created: bool
    """False when the job already existed with the same configuration."""


class TrialAssigned(_Reply):
    kind: Literal["trial"] = "trial"
    job_id: str
    trial_number: int
    batch_size: int
    phase: TrialPhase


class EpochDecision(_Reply):
    kind: Literal["epoch_decision"] = "epoch_decision"
    job_id: str
    trial_number: int
    epoch: int
    stop: bool
    converged: bool
    reason: StopReason | None
    cost: float
    """Cost of the trial so far (joules)."""
    message: str = ""


class TrialEnded(_Reply):
    kind: Literal["trial_ended"] = "trial_ended"
    job_id: str
    trial_number: int
    status: TrialStatus
    reason: StopReason | None


class JobDeleted(_Reply):
    kind: Literal["deleted"] = "deleted"
    job_id: str
    existed: bool


class ErrorReply(_Reply):
    """A typed error: ``code`` names a :mod:`bso.errors` class."""

    kind: Literal["error"] = "error"
    code: str
    message: str


Reply = Annotated[
    JobRegistered | TrialAssigned | EpochDecision | TrialEnded | JobDeleted | ErrorReply,
    Field(discriminator="kind"),
]
REPLY_ADAPTER: TypeAdapter[Reply] = TypeAdapter(Reply)
