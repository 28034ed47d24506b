"""The read-only status query and its reply: the one request/reply pair on the
queue that is not a job event of :mod:`bso.wire.events`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from bso.status import JobStatus
from bso.wire.events import EventId, JobId, new_event_id


class StatusQuery(BaseModel):
    """Ask for a job's status (what it learned, its current recommendation)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = 1
    event_id: EventId = Field(default_factory=new_event_id)
    kind: Literal["status"] = "status"
    job_id: JobId


class StatusReply(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = 1
    event_id: str
    kind: Literal["status"] = "status"
    status: JobStatus
