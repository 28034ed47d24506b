"""The read-only "list my jobs" query and its reply (``bso jobs list``).

Like the status query (:mod:`bso.wire.status_query`) it is a read answered on the
queue but never recorded, and it names no job: the service answers with the jobs
of the API key's own tenant only, so another tenant's jobs are never listed.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from bso.wire.events import EventId, new_event_id

MAX_LISTED_JOBS = 10_000
"""Most jobs one reply lists (newest activity first): a reply stays a few MB at most."""


class ListJobs(BaseModel):
    """Ask for the tenant's jobs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = 1
    event_id: EventId = Field(default_factory=new_event_id)
    kind: Literal["list_jobs"] = "list_jobs"


class JobSummary(BaseModel):
    """One job as ``bso jobs list`` shows it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_id: str
    lanes: list[str]
    """Hardware keys of the job's lanes (registered or with trials), sorted."""
    trials: int
    running_trials: int
    last_activity: datetime
    """The latest trial event, or the registration when there is no trial."""


class JobList(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = 1
    event_id: str
    kind: Literal["job_list"] = "job_list"
    jobs: list[JobSummary]
    """Most recently active first, at most :data:`MAX_LISTED_JOBS`."""
