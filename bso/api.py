"""The typed calls of bso's events, written once for every way of reaching the service.

:class:`bso.service.BsoService` (in-process) and
:class:`bso_client.transport.ServiceClient` (through Redis and Celery) differ
only in how one event travels and comes back; both implement
:meth:`EventApi.request`, and the convenience methods below build the events.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, TypeVar

from bso.core.vocabulary import StopReason
from bso.errors import InvalidEvent
from bso.spec import Hardware, JobSpec
from bso.status import JobStatus
from bso.wire.events import (
    DeleteJob,
    DeliverDetachedRun,
    DetachedEpoch,
    DetachedRunDelivered,
    EndReason,
    EndTrial,
    EpochDecision,
    EpochReport,
    Event,
    Heartbeat,
    HeartbeatAck,
    JobDeleted,
    JobRegistered,
    JobReset,
    LaneSizesSet,
    NextTrial,
    RegisterJob,
    Reply,
    ResetJob,
    ResumeTrial,
    SetLaneSizes,
    TrialAssigned,
    TrialEnded,
)
from bso.wire.micro_batch_timings import MicroBatchTiming

R = TypeVar("R", bound=Reply)


def event_id_field(event_id: str | None) -> dict[str, Any]:
    """Keyword for an explicit event id; without one the model draws a fresh id."""
    return {} if event_id is None else {"event_id": event_id}


class EventApi(ABC):
    """Register, next trial, epoch report, end trial, delete, status."""

    @abstractmethod
    def request(self, event: Event) -> Reply:
        """Apply ``event`` once and return its reply; typed errors are raised, not returned."""

    @abstractmethod
    def status(self, job_id: str) -> JobStatus:
        """What the job learned so far and its current recommendation (a read)."""

    def _expect(self, event: Event, expected: type[R]) -> R:
        reply = self.request(event)
        if not isinstance(reply, expected):  # a recorded reply of another kind: id reused
            raise InvalidEvent(
                f"event id {event.event_id} was already used by another event: expected a "
                f"{expected.__name__} reply, got {type(reply).__name__}"
            )
        return reply

    def register(
        self, spec: JobSpec, *, plan_proposed: bool = False, event_id: str | None = None
    ) -> JobRegistered:
        event = RegisterJob(spec=spec, plan_proposed=plan_proposed, **event_id_field(event_id))
        return self._expect(event, JobRegistered)

    def next_trial(
        self,
        job_id: str,
        hardware: Hardware | None = None,
        *,
        lease_s: float | None = None,
        reprobe_memory: bool = False,
        event_id: str | None = None,
    ) -> TrialAssigned:
        event = NextTrial(
            job_id=job_id,
            hardware=hardware,
            lease_s=lease_s,
            reprobe_memory=reprobe_memory,
            **event_id_field(event_id),
        )
        return self._expect(event, TrialAssigned)

    def report_epoch(
        self,
        job_id: str,
        trial_number: int,
        *,
        epoch: int,
        time_s: float,
        energy_j: float,
        metric: float,
        batch_size: int | None = None,
        event_id: str | None = None,
        micro_batches: list[MicroBatchTiming] | None = None,
        trained_to: DetachedEpoch | None = None,
    ) -> EpochDecision:
        report = EpochReport(
            job_id=job_id,
            trial_number=trial_number,
            epoch=epoch,
            time_s=time_s,
            energy_j=energy_j,
            metric=metric,
            batch_size=batch_size,
            micro_batches=micro_batches,
            trained_to=trained_to,
            **event_id_field(event_id),
        )
        return self._expect(report, EpochDecision)

    def end_trial(
        self,
        job_id: str,
        trial_number: int,
        *,
        reason: EndReason = StopReason.ABANDONED,
        batch_size: int | None = None,
        event_id: str | None = None,
    ) -> TrialEnded:
        event = EndTrial(
            job_id=job_id,
            trial_number=trial_number,
            reason=reason,
            batch_size=batch_size,
            **event_id_field(event_id),
        )
        return self._expect(event, TrialEnded)

    def heartbeat(
        self, job_id: str, trial_number: int, *, event_id: str | None = None
    ) -> HeartbeatAck:
        event = Heartbeat(job_id=job_id, trial_number=trial_number, **event_id_field(event_id))
        return self._expect(event, HeartbeatAck)

    def delete_job(self, job_id: str, *, event_id: str | None = None) -> JobDeleted:
        return self._expect(DeleteJob(job_id=job_id, **event_id_field(event_id)), JobDeleted)

    def reset_job(self, job_id: str, *, event_id: str | None = None) -> JobReset:
        """Forget the job's finished trials; keep its spec, lanes and running trials."""
        return self._expect(ResetJob(job_id=job_id, **event_id_field(event_id)), JobReset)

    def set_lane_sizes(
        self,
        job_id: str,
        lane: str,
        batch_sizes: list[int],
        *,
        default_batch_size: int | None = None,
        event_id: str | None = None,
    ) -> LaneSizesSet:
        """Give the lane ``lane`` (a hardware key) a new list of batch sizes; trials at
        sizes still listed keep counting."""
        event = SetLaneSizes(
            job_id=job_id,
            lane=lane,
            batch_sizes=batch_sizes,
            default_batch_size=default_batch_size,
            **event_id_field(event_id),
        )
        return self._expect(event, LaneSizesSet)

    def deliver_detached_run(self, run: DeliverDetachedRun) -> DetachedRunDelivered:
        """Deliver a run that trained while the service was unreachable (its journal)."""
        return self._expect(run, DetachedRunDelivered)

    def resume_trial(self, event: ResumeTrial) -> TrialAssigned:
        """Reopen a trial for a run resumed from a checkpoint (:mod:`bso.resumes`)."""
        return self._expect(event, TrialAssigned)
