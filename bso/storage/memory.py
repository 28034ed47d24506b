"""In-memory store: for tests, simulations and the in-process API.

Each transaction works on a copy of the job's state under the job's mutex and
swaps it in on commit, so an exception leaves the job exactly as it was.  A
read copies the committed state without the job's mutex: commits swap whole
states in under the store's guard, so the copy is always of one committed state.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from bso.apikeys import DEFAULT_TENANT, ApiKeyRecord, TenantLimits
from bso.core.vocabulary import StopReason, TrialPhase, TrialStatus
from bso.spec import JobSpec
from bso.storage.base import (
    JobReader,
    JobRecord,
    JobTransaction,
    LaneRecord,
    Store,
    StoredReply,
    TrialRecord,
    lease_expired,
)

_ReplyKey = tuple[str, str]
"""(job id, event id): event ids are unique per job, not across jobs."""


@dataclass
class _JobState:
    job: JobRecord | None = None
    trials: dict[int, TrialRecord] = field(default_factory=dict)
    next_trial_number: int = 1
    lanes: dict[str, LaneRecord] = field(default_factory=dict)
    first_trial_number: int = 1

    def copy(self) -> _JobState:
        """Copy deep enough for rollback: records are frozen, containers are not."""
        return _JobState(
            self.job,
            dict(self.trials),
            self.next_trial_number,
            dict(self.lanes),
            self.first_trial_number,
        )


class _MemoryReader(JobReader):
    def __init__(self, job_id: str, state: _JobState) -> None:
        super().__init__(job_id)
        self.state = state

    def get_job(self) -> JobRecord | None:
        return self.state.job

    def trials(self, hardware_key: str | None = None) -> list[TrialRecord]:
        return [
            t
            for _, t in sorted(self.state.trials.items())
            if hardware_key is None or t.hardware_key == hardware_key
        ]

    def get_trial(self, trial_number: int) -> TrialRecord | None:
        return self.state.trials.get(trial_number)

    def get_lane(self, hardware_key: str) -> LaneRecord | None:
        return self.state.lanes.get(hardware_key)

    def first_trial_number(self) -> int:
        return self.state.first_trial_number if self.state.job else self.state.next_trial_number


class _MemoryTransaction(_MemoryReader, JobTransaction):
    def __init__(
        self, job_id: str, state: _JobState, committed: Callable[[_ReplyKey], StoredReply | None]
    ) -> None:
        super().__init__(job_id, state)
        self.committed = committed
        self.new_replies: dict[_ReplyKey, tuple[StoredReply, datetime]] = {}

    def create_job(self, spec: JobSpec, now: datetime, owner: str = DEFAULT_TENANT) -> JobRecord:
        self.state.job = JobRecord(self.job_id, spec, now, owner)
        self.state.first_trial_number = self.state.next_trial_number
        return self.state.job

    def delete_job(self) -> bool:
        existed = self.state.job is not None
        self.state.job = None
        self.state.trials.clear()
        self.state.lanes.clear()
        # next_trial_number goes on: see Store.delete_job
        return existed

    def add_trial(
        self, hardware_key: str, batch_size: int, phase: TrialPhase, now: datetime
    ) -> TrialRecord:
        number = self.state.next_trial_number
        self.state.next_trial_number += 1
        trial = TrialRecord(self.job_id, number, hardware_key, batch_size, phase, now, now)
        self.state.trials[number] = trial
        return trial

    def save_trial(self, trial: TrialRecord) -> None:
        if trial.trial_number not in self.state.trials:
            raise KeyError(trial.trial_number)
        self.state.trials[trial.trial_number] = trial

    def forget_finished_trials(self) -> int:
        finished = [n for n, t in self.state.trials.items() if t.status is not TrialStatus.RUNNING]
        for number in finished:
            del self.state.trials[number]
        return len(finished)

    def save_lane(self, lane: LaneRecord) -> None:
        self.state.lanes[lane.hardware.key] = dataclasses.replace(
            lane, rng_state=copy.deepcopy(lane.rng_state)
        )

    def recorded_reply(self, event_id: str) -> StoredReply | None:
        key = (self.job_id, event_id)
        staged = self.new_replies.get(key)
        return staged[0] if staged else self.committed(key)

    def record_reply(self, event_id: str, reply: StoredReply, now: datetime) -> None:
        self.new_replies[(self.job_id, event_id)] = (reply, now)


class MemoryStore(Store):
    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._jobs: dict[str, _JobState] = {}
        self._replies: dict[_ReplyKey, tuple[StoredReply, datetime]] = {}
        self._api_keys: dict[str, ApiKeyRecord] = {}
        self._tenant_limits: dict[str, TenantLimits] = {}

    def _lock(self, job_id: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(job_id, threading.Lock())

    @contextmanager
    def transaction(self, job_id: str) -> Iterator[JobTransaction]:
        with self._lock(job_id):
            with self._guard:
                working = self._jobs.get(job_id, _JobState()).copy()
            tx = _MemoryTransaction(job_id, working, self._committed_reply)
            yield tx
            with self._guard:
                if working.job is None and not working.trials and working.next_trial_number == 1:
                    self._jobs.pop(job_id, None)  # never a job: a deleted one keeps its count
                else:
                    self._jobs[job_id] = working
                self._replies.update(tx.new_replies)

    @contextmanager
    def read(self, job_id: str) -> Iterator[JobReader]:
        with self._guard:
            snapshot = self._jobs.get(job_id, _JobState()).copy()
        yield _MemoryReader(job_id, snapshot)

    def _committed_reply(self, key: _ReplyKey) -> StoredReply | None:
        with self._guard:
            entry = self._replies.get(key)
        return entry[0] if entry else None

    def job_ids(self) -> list[str]:
        with self._guard:
            return sorted(j for j, s in self._jobs.items() if s.job is not None)

    def trial_tallies(self) -> dict[tuple[TrialStatus, StopReason | None], int]:
        with self._guard:
            return dict(
                Counter(
                    (t.status, t.stop_reason)
                    for s in self._jobs.values()
                    for t in s.trials.values()
                )
            )

    def recently_active_jobs(self, limit: int) -> list[str]:
        with self._guard:
            latest = {
                job_id: max(t.updated_at for t in s.trials.values())
                for job_id, s in self._jobs.items()
                if s.job is not None and s.trials
            }
        return sorted(latest, key=lambda j: (latest[j], j), reverse=True)[:limit]

    def stale_trials(self, now: datetime, default_lease: timedelta) -> list[tuple[str, int]]:
        with self._guard:
            return sorted(
                (job_id, t.trial_number)
                for job_id, s in self._jobs.items()
                for t in s.trials.values()
                if lease_expired(t, now, default_lease)
            )

    def prune_replies(self, recorded_before: datetime) -> int:
        with self._guard:
            old = [
                key
                for key, (_, at) in self._replies.items()
                if at < recorded_before and self._jobs.get(key[0], _JobState()).job is None
            ]
            for key in old:
                del self._replies[key]
            return len(old)

    def add_api_key(self, record: ApiKeyRecord) -> None:
        with self._guard:
            if record.key_id in self._api_keys:
                raise KeyError(f"API key id {record.key_id} exists")
            self._api_keys[record.key_id] = record

    def get_api_key(self, key_id: str) -> ApiKeyRecord | None:
        with self._guard:
            return self._api_keys.get(key_id)

    def api_keys(self) -> list[ApiKeyRecord]:
        with self._guard:
            return sorted(self._api_keys.values(), key=lambda r: (r.created_at, r.key_id))

    def revoke_api_key(self, key_id: str, now: datetime) -> bool:
        with self._guard:
            record = self._api_keys.get(key_id)
            if record is None or record.revoked_at is not None:
                return False
            self._api_keys[key_id] = dataclasses.replace(record, revoked_at=now)
            return True

    def set_tenant_limits(self, tenant: str, limits: TenantLimits | None) -> None:
        with self._guard:
            if limits is None:
                self._tenant_limits.pop(tenant, None)
            else:
                self._tenant_limits[tenant] = limits

    def tenant_limits(self) -> dict[str, TenantLimits]:
        with self._guard:
            return dict(sorted(self._tenant_limits.items()))

    def close(self) -> None:
        """Nothing to release: the data lives and dies with the object."""
