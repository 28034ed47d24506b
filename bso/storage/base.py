"""The store interface: one locked unit of work per job.

Every event touches exactly one job, so the whole read-decide-write cycle of an
event runs inside :meth:`Store.transaction`, which serializes all work on that
job across threads *and processes* (a row lock on PostgreSQL, the database
write lock on SQLite, a mutex in memory).  That is what makes trial numbering
and best-cost bookkeeping race-free without any lock held outside the store.

Reads that decide nothing (status pages, dashboards, polling) use
:meth:`Store.read` instead: a consistent snapshot of the job that takes no lock,
so they never queue behind events nor make events queue behind them.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from bso.apikeys import DEFAULT_TENANT, ApiKeyRecord, TenantLimits, split_job_key
from bso.core.micro_batch import Timings
from bso.core.state import TrialSnapshot
from bso.core.vocabulary import StopReason, TrialPhase, TrialStatus
from bso.spec import BatchPlan, Hardware, JobSpec


@dataclass(frozen=True, slots=True)
class JobRecord:
    job_id: str
    """The store's key of the job (:func:`bso.apikeys.job_key`); ``spec.job_id`` is
    the id its tenant uses."""
    spec: JobSpec
    created_at: datetime
    owner: str = DEFAULT_TENANT
    """The tenant whose API key registered the job: the only one that may touch it."""


@dataclass(frozen=True, slots=True)
class StoredReply:
    """The reply a job gave to one event id, and what identifies that event."""

    reply_json: str
    body_sha256: str | None = None
    """Hash of the event's body (:func:`bso.service.event_digest`): the same id with
    another body is a different event.  None for replies recorded before it was kept."""
    owner: str = DEFAULT_TENANT
    """The tenant that sent the event; no other tenant is ever shown the reply."""


@dataclass(frozen=True, slots=True)
class LaneRecord:
    """What a job learned on one hardware key: the hardware and the bandit's RNG."""

    hardware: Hardware
    rng_state: dict[str, Any] | None = None
    memory_reprobed_through: int = 0
    """Trial numbers up to this ran before the caller's last memory re-probe: their
    out-of-memory outcomes no longer limit the sizes (:mod:`bso.core.outcomes`)."""
    plan: BatchPlan | None = None
    """The batch sizes this hardware registered, where they differ from the job's
    spec; None: the spec's own."""


@dataclass(frozen=True, slots=True)
class TrialRecord:
    job_id: str
    trial_number: int
    hardware_key: str
    batch_size: int
    phase: TrialPhase
    created_at: datetime
    updated_at: datetime
    """Time of the last event of the trial: the heartbeat."""
    status: TrialStatus = TrialStatus.RUNNING
    epochs: int = 0
    time_s: float = 0.0
    energy_j: float = 0.0
    cost: float = 0.0
    last_metric: float | None = None
    stop_reason: StopReason | None = None
    lease_s: float | None = None
    """The caller promised an event at least this often (``NextTrial.lease_s``); None:
    the service's heartbeat timeout applies."""
    current_batch_size: int | None = None
    """The batch size of the latest epoch (online growth); None: ``batch_size``."""
    detached: bool = False
    """The run trained while the service was unreachable and was delivered afterwards
    from the client's journal (:class:`bso.wire.events.DeliverDetachedRun`)."""
    micro_batches: tuple[tuple[int, Timings], ...] = ()
    """The run's micro-batch exploration (:attr:`TrialSnapshot.micro_batches`)."""

    def replace(self, **changes: Any) -> TrialRecord:
        return dataclasses.replace(self, **changes)

    def snapshot(self) -> TrialSnapshot:
        return TrialSnapshot(
            trial_number=self.trial_number,
            batch_size=self.batch_size,
            phase=self.phase,
            status=self.status,
            epochs=self.epochs,
            time_s=self.time_s,
            energy_j=self.energy_j,
            cost=self.cost,
            stop_reason=self.stop_reason,
            grown_to=self.current_batch_size,
            detached=self.detached,
            micro_batches=self.micro_batches,
        )


@dataclass(frozen=True, slots=True)
class JobActivity:
    """One job as a tenant's job list shows it (:meth:`Store.jobs_of`)."""

    job_id: str
    """The store's key of the job (:func:`bso.apikeys.job_key`)."""
    lanes: tuple[str, ...]
    """The job's own hardware key and those of its trials, sorted."""
    trials: int
    running_trials: int
    last_activity: datetime
    """The latest trial event, or the registration when there is no trial."""


def job_activity(job: JobRecord, trials: list[TrialRecord]) -> JobActivity:
    """The list entry of ``job`` with its ``trials``."""
    return JobActivity(
        job_id=job.job_id,
        lanes=tuple(sorted({job.spec.hardware.key, *(t.hardware_key for t in trials)})),
        trials=len(trials),
        running_trials=sum(t.status is TrialStatus.RUNNING for t in trials),
        last_activity=max((t.updated_at for t in trials), default=job.created_at),
    )


class JobReader(ABC):
    """Reads of one job, all from the same consistent state of it.

    ``job_id`` is the store's key of the job, which holds its tenant
    (:func:`bso.apikeys.job_key`); what the tenant calls it is :attr:`public_job_id`.
    """

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id

    @property
    def public_job_id(self) -> str:
        """The job id its tenant's events and replies use."""
        return split_job_key(self.job_id)[1]

    @abstractmethod
    def get_job(self) -> JobRecord | None: ...

    @abstractmethod
    def trials(self, hardware_key: str | None = None) -> list[TrialRecord]:
        """The job's trials (of one hardware key, if given) by trial number."""

    @abstractmethod
    def get_trial(self, trial_number: int) -> TrialRecord | None: ...

    @abstractmethod
    def get_lane(self, hardware_key: str) -> LaneRecord | None: ...

    @abstractmethod
    def first_trial_number(self) -> int:
        """The number the job as registered now gave, or will give, its first trial: 1,
        or, for a job deleted and registered again, the deleted job's next.  A lower
        number named in an event was the deleted job's trial."""


class JobTransaction(JobReader):
    """Reads and writes of one job, all committed together or not at all."""

    @abstractmethod
    def create_job(self, spec: JobSpec, now: datetime, owner: str = DEFAULT_TENANT) -> JobRecord:
        """Insert the job, owned by ``owner``; the caller has checked it does not exist yet."""

    @abstractmethod
    def delete_job(self) -> bool:
        """Remove the job with its trials and lanes; False if it did not exist.

        Its next trial number is kept: the job registered again under its id numbers
        its trials on from there, never from 1.  A run of the deleted job that still
        trains, or its journal, then names a trial the new job does not have, instead
        of taking over the new job's trial of the same number."""

    @abstractmethod
    def add_trial(
        self, hardware_key: str, batch_size: int, phase: TrialPhase, now: datetime
    ) -> TrialRecord:
        """Create a running trial with the job's next trial number (1, 2, ...)."""

    @abstractmethod
    def save_trial(self, trial: TrialRecord) -> None:
        """Overwrite an existing trial's mutable fields."""

    @abstractmethod
    def forget_finished_trials(self) -> int:
        """Delete the job's trials that are not running; returns how many went.  The
        trial counter is kept, so numbers are never reused (``bso jobs reset``)."""

    @abstractmethod
    def save_lane(self, lane: LaneRecord) -> None:
        """Insert or overwrite the lane of ``lane.hardware.key``."""

    @abstractmethod
    def recorded_reply(self, event_id: str) -> StoredReply | None:
        """The reply this job already gave to ``event_id``, if any (ids are per job)."""

    @abstractmethod
    def record_reply(self, event_id: str, reply: StoredReply, now: datetime) -> None: ...


class Store(ABC):
    """Jobs, trials and replies; see the module docstring for the locking contract."""

    @abstractmethod
    def transaction(self, job_id: str) -> AbstractContextManager[JobTransaction]:
        """Exclusive unit of work on ``job_id``: commit on normal exit, roll back on error."""

    def read(self, job_id: str) -> AbstractContextManager[JobReader]:
        """Consistent read-only view of ``job_id`` that waits for no lock and holds none.

        What it shows is the job as of some committed state: it may miss an
        event committed while it is open, so nothing read here may be written
        back.  This default takes the exclusive transaction, which is correct
        but queues; stores override it with a lock-free snapshot.
        """
        return self.transaction(job_id)

    @abstractmethod
    def job_ids(self) -> list[str]:
        """Every registered job's key (:func:`bso.apikeys.job_key`), sorted."""

    def jobs_of(self, owner: str, limit: int) -> list[JobActivity]:
        """Up to ``limit`` jobs of tenant ``owner``, the most recently active first
        (then by job id).  This default reads every job; stores override it with one
        query."""
        found = []
        for job_id in self.job_ids():
            with self.read(job_id) as tx:
                job = tx.get_job()
                if job is not None and job.owner == owner:
                    found.append(job_activity(job, tx.trials()))
        return sorted_activity(found)[:limit]

    @abstractmethod
    def trial_tallies(self) -> dict[tuple[TrialStatus, StopReason | None], int]:
        """How many trials of every job are in each (status, stop reason): what the
        metrics export as decisions and outcomes
        (:func:`bso.core.outcomes.outcome_from` needs no more), counted where they
        are kept, once."""

    @abstractmethod
    def recently_active_jobs(self, limit: int) -> list[str]:
        """Up to ``limit`` jobs' keys, those whose latest trial event is newest first."""

    @abstractmethod
    def stale_trials(self, now: datetime, default_lease: timedelta) -> list[tuple[str, int]]:
        """(job key, trial number) of running trials silent for longer than their lease
        (``lease_s``, or ``default_lease`` when they have none) at ``now``."""

    @abstractmethod
    def prune_replies(self, recorded_before: datetime) -> int:
        """Forget the replies of deleted jobs recorded before the cutoff; returns how
        many went.  A job's replies live as long as the job: a retry of any of its
        events, however late, gets the first answer again."""

    # -- API keys (bso.apikeys): stored hashed, looked up by key id ---------------------

    @abstractmethod
    def add_api_key(self, record: ApiKeyRecord) -> None:
        """Store a new key's record; its key id is fresh (random)."""

    @abstractmethod
    def get_api_key(self, key_id: str) -> ApiKeyRecord | None: ...

    @abstractmethod
    def api_keys(self) -> list[ApiKeyRecord]:
        """Every key record, revoked ones included, oldest first."""

    @abstractmethod
    def revoke_api_key(self, key_id: str, now: datetime) -> bool:
        """Mark the key revoked; False if there is no such key or it was revoked already."""

    # -- tenants' admission limits (bso.apikeys.TenantLimits) -------------------------

    @abstractmethod
    def set_tenant_limits(self, tenant: str, limits: TenantLimits | None) -> None:
        """Give ``tenant`` its own limits; None: back to the defaults."""

    @abstractmethod
    def tenant_limits(self) -> dict[str, TenantLimits]:
        """The tenants given limits of their own (every other has the defaults)."""

    @abstractmethod
    def close(self) -> None:
        """Release connections and other resources held by the store."""


def lease_expired(trial: TrialRecord, now: datetime, default_lease: timedelta) -> bool:
    """Whether running ``trial`` has been silent for longer than its lease at ``now``."""
    lease = timedelta(seconds=trial.lease_s) if trial.lease_s is not None else default_lease
    return trial.status is TrialStatus.RUNNING and trial.updated_at + lease < now


def sorted_activity(jobs: list[JobActivity]) -> list[JobActivity]:
    """Most recently active first, then by job id: the order of :meth:`Store.jobs_of`."""
    by_id = sorted(jobs, key=lambda j: j.job_id)
    return sorted(by_id, key=lambda j: j.last_activity, reverse=True)
