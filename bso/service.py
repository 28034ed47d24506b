"""The in-process API: the whole bso loop with no Redis and no Celery.

:class:`BsoService` turns one event into one reply inside one store
transaction: look up a reply already given to the event id (idempotency),
build a frozen snapshot, ask the policy, persist the outcome and the reply.
The Celery tasks are thin wrappers around :meth:`BsoService.handle`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np

from bso.api import EventApi
from bso.apikeys import DEFAULT_TENANT, check_secret, job_key, key_id_of
from bso.core.lane_status import lane_status
from bso.core.micro_batch import Timings
from bso.core.outcomes import script_error_notice
from bso.core.policies import policy_for
from bso.core.state import JobSnapshot
from bso.core.vocabulary import StopReason, TrialPhase, TrialStatus
from bso.detached_runs import apply_detached_run, charged_to, check_trained_to
from bso.errors import (
    BsoError,
    EventIdConflict,
    InvalidEvent,
    OutOfOrder,
    UnknownJob,
    UnknownTrial,
    error_from_code,
)
from bso.job_admin import job_summary, reset_job, set_lane_sizes
from bso.lane_snapshots import build_snapshot, lane_snapshot, started_from, with_other_lanes
from bso.micro_batch_wire import timings_from_wire, timings_to_wire
from bso.registration import register_again
from bso.resumes import resume_trial
from bso.spec import listed
from bso.status import JobStatus
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
from bso.wire.events import (
    REPLY_ADAPTER,
    DeleteJob,
    DeliverDetachedRun,
    DetachedRunDelivered,
    EndTrial,
    EpochDecision,
    EpochReport,
    ErrorReply,
    Event,
    Heartbeat,
    HeartbeatAck,
    JobDeleted,
    JobRegistered,
    NextTrial,
    RegisterJob,
    Reply,
    ResetJob,
    ResumeTrial,
    SetLaneSizes,
    TrialAssigned,
    TrialEnded,
)
from bso.wire.jobs_query import MAX_LISTED_JOBS, JobSummary
from bso.wire.micro_batch_timings import MicroBatchTiming


def utcnow() -> datetime:
    return datetime.now(UTC)


def event_digest(event: Event) -> str:
    """SHA-256 of the event's canonical JSON: what makes two sends "the same event".

    Computed on the validated model, so spelling differences that mean the same
    event (key order, whitespace, an explicit default) do not count.
    """
    return hashlib.sha256(event.model_dump_json().encode()).hexdigest()


def generated_job_id(prefix: str, event_id: str) -> str:
    """Job id for a spec that gave only a prefix; a retried register gets the same one."""
    return f"{prefix}-{hashlib.sha256(event_id.encode()).hexdigest()[:12]}"


class BsoService(EventApi):
    """Register jobs, hand out trials, judge epochs, end trials; see the module doc."""

    def __init__(self, store: Store, clock: Callable[[], datetime] = utcnow) -> None:
        self.store = store
        self.clock = clock

    # -- the one entry point the workers use -------------------------------------------

    def handle(self, event: Event, tenant: str = DEFAULT_TENANT) -> Reply:
        """Apply ``event`` once for ``tenant`` and return its reply; typed errors
        become error replies.  ``tenant``: :meth:`authenticate`'s answer for the
        event's API key (in-process callers are the default tenant)."""
        try:
            return self._apply(event, tenant)
        except BsoError as exc:
            return ErrorReply(event_id=event.event_id, code=exc.code, message=exc.message)

    def authenticate(self, api_key: str | None) -> str:
        """The tenant of ``api_key``; :class:`~bso.errors.Unauthorized` if it is
        missing, malformed, unknown, wrong or revoked.  Nothing is written."""
        key_id, secret = key_id_of(api_key)
        return check_secret(self.store.get_api_key(key_id), key_id, secret)

    def _apply(self, event: Event, tenant: str) -> Reply:
        """Idempotency is per (job, event id) and checks the body: the first answer to
        an event is returned to every later copy of it, and only to its own tenant.

        Job ids are per tenant: the event's job is ``tenant``'s job of that id
        (:func:`~bso.apikeys.job_key`), so another tenant's job of the same id is
        never touched nor seen, and reads exactly like a job that does not exist.

        The first answer may be a refusal (out of order, unknown trial, ...): it is
        recorded like any reply, so a copy of the event still in flight (a client's
        re-send, a redelivery) can never be applied after its caller was told no.
        The handlers raise their typed errors before writing anything, so committing
        the refusal commits nothing else.  A conflicting body is not recorded: it
        says nothing about the event and must not occupy the owner's event id.
        """
        job_id = self._job_id_of(event)
        digest = event_digest(event)
        with self.store.transaction(job_key(tenant, job_id)) as tx:
            if isinstance(event, Heartbeat):  # repeatable as it is: never recorded
                return self._heartbeat(tx, event)
            recorded = tx.recorded_reply(event.event_id)
            if recorded is not None:
                if recorded.body_sha256 is not None and recorded.body_sha256 != digest:
                    raise EventIdConflict(
                        f"job {job_id} already applied event {event.event_id} with a "
                        "different body; a retry must send the same event, a new event "
                        "needs a new event_id"
                    )
                return REPLY_ADAPTER.validate_json(recorded.reply_json)
            reply: Reply
            try:
                reply = self._dispatch(tx, event, tenant)
            except BsoError as exc:
                reply = ErrorReply(event_id=event.event_id, code=exc.code, message=exc.message)
            tx.record_reply(
                event.event_id, StoredReply(reply.model_dump_json(), digest, tenant), self.clock()
            )
            return reply

    @staticmethod
    def _job_id_of(event: Event) -> str:
        if isinstance(event, RegisterJob):
            spec = event.spec
            if spec.job_id is not None:
                return spec.job_id
            assert spec.job_id_prefix is not None  # guaranteed by JobSpec validation
            return generated_job_id(spec.job_id_prefix, event.event_id)
        return event.job_id

    def _dispatch(self, tx: JobTransaction, event: Event, tenant: str) -> Reply:
        match event:
            case RegisterJob():
                return self._register(tx, event, tenant)
            case NextTrial():
                return self._next_trial(tx, event)
            case EpochReport():
                return self._report_epoch(tx, event)
            case EndTrial():
                return self._end_trial(tx, event)
            case Heartbeat():
                return self._heartbeat(tx, event)
            case DeleteJob():
                return JobDeleted(
                    event_id=event.event_id, job_id=tx.public_job_id, existed=tx.delete_job()
                )
            case DeliverDetachedRun():
                return self._deliver_detached_run(tx, event)
            case ResetJob():
                require_job(tx)
                return reset_job(tx, event)
            case SetLaneSizes():
                return set_lane_sizes(tx, require_job(tx), event)
            case ResumeTrial():  # a run resumed from a checkpoint (bso.resumes)
                job = require_job(tx)
                snapshot = lane_snapshot(tx, job, tx.get_lane(event.hardware_key))
                return resume_trial(tx, snapshot, event, self.clock())

    def request(self, event: Event) -> Reply:
        """Apply ``event`` once; typed errors are raised (the :class:`EventApi` contract)."""
        reply = self._apply(event, DEFAULT_TENANT)
        if isinstance(reply, ErrorReply):
            raise error_from_code(reply.code, reply.message)
        return reply

    # -- event handlers ----------------------------------------------------------------

    def _register(self, tx: JobTransaction, event: RegisterJob, tenant: str) -> JobRegistered:
        spec = event.spec.model_copy(update={"job_id": tx.public_job_id})
        existing = tx.get_job()
        if existing is None:
            tx.create_job(spec, self.clock(), tenant)
            return JobRegistered(event_id=event.event_id, job_id=tx.public_job_id, created=True)
        kept = register_again(tx, existing, spec, event.plan_proposed)
        return JobRegistered(
            event_id=event.event_id, job_id=tx.public_job_id, created=False, plan=kept
        )

    def _next_trial(self, tx: JobTransaction, event: NextTrial) -> TrialAssigned:
        job = require_job(tx)
        hardware = event.hardware or job.spec.hardware
        lane = tx.get_lane(hardware.key)
        rng = restore_rng(lane.rng_state if lane else None, job.spec.mab_seed)
        reprobed_through = lane.memory_reprobed_through if lane else 0
        if event.reprobe_memory:
            reprobed_through = max((t.trial_number for t in tx.trials()), default=0)
        plan = lane.plan if lane else None
        snapshot = build_snapshot(tx, job, hardware, reprobed_through, plan)
        snapshot = with_other_lanes(tx, job, snapshot, start=True)
        assignment = policy_for(snapshot).assign(snapshot, rng)
        tx.save_lane(LaneRecord(hardware, dict(rng.bit_generator.state), reprobed_through, plan))
        trial = tx.add_trial(hardware.key, assignment.batch_size, assignment.phase, self.clock())
        if event.lease_s is not None:
            trial = trial.replace(lease_s=event.lease_s)
            tx.save_trial(trial)
        return TrialAssigned(
            event_id=event.event_id,
            job_id=tx.public_job_id,
            trial_number=trial.trial_number,
            batch_size=trial.batch_size,
            phase=trial.phase,
            notice=script_error_notice(tx.public_job_id, snapshot),
            micro_batches=timings_to_wire(snapshot.micro_batch_timings(trial.batch_size)),
        )

    def _report_epoch(self, tx: JobTransaction, event: EpochReport) -> EpochDecision:
        job = require_job(tx)
        trial = require_trial(tx, event.trial_number)
        if trial.status is not TrialStatus.RUNNING:
            raise OutOfOrder(
                f"trial {trial.trial_number} of job {tx.public_job_id} already ended "
                f"({trial.status.value}, {trial.stop_reason}); start a new trial"
            )
        expected = trial.epochs + 1
        if event.epoch != expected:
            # Epochs count up by exactly one.  A gap would charge the missing epochs'
            # time and energy (reports are cumulative) to a trial whose per-epoch
            # judgements (cost bound, projection) never saw them; a step back would
            # undo a decision already given.  Either way the caller is out of step.
            seen = f"reported epochs 1..{trial.epochs}" if trial.epochs else "reported no epoch"
            raise OutOfOrder(
                f"trial {trial.trial_number} of job {tx.public_job_id} {seen}; the next report "
                f"must be epoch {expected}, got {event.epoch} (a retry must reuse its event_id)"
            )
        if event.time_s < trial.time_s or event.energy_j < trial.energy_j:
            raise InvalidEvent(
                "time_s and energy_j are cumulative over the trial and cannot decrease "
                f"(had {trial.time_s} s / {trial.energy_j} J, got {event.time_s} s / "
                f"{event.energy_j} J)"
            )
        lane = tx.get_lane(trial.hardware_key)
        snapshot = lane_snapshot(tx, job, lane)
        if trial.phase is TrialPhase.EXPLORATION or job.spec.exploration_budget is not None:
            # The other lanes' epochs are read by an exploration's stops and by the
            # budget's outlook alone: other epochs are spared reading the job's trials.
            snapshot = with_other_lanes(tx, job, snapshot, start=False)
        current = checked_batch_size(snapshot, trial, event.batch_size)
        check_trained_to(snapshot, event)
        cost = snapshot.cost(event.energy_j, event.time_s)
        if not math.isfinite(cost):  # the field bounds rule this out; never store it
            raise InvalidEvent(
                f"time_s={event.time_s} and energy_j={event.energy_j} give a non-finite cost"
            )
        updated = trial.replace(
            epochs=event.epoch,
            time_s=event.time_s,
            energy_j=event.energy_j,
            cost=cost,
            last_metric=event.metric,
            updated_at=self.clock(),
            current_batch_size=current,
        )
        if event.micro_batches is not None and not trial.micro_batches:
            updated = updated.replace(micro_batches=explored(snapshot, trial, event.micro_batches))
        verdict = policy_for(snapshot).judge_epoch(snapshot, updated.snapshot(), event.metric)
        if verdict.stop:
            updated = updated.replace(
                status=TrialStatus.CONVERGED if verdict.converged else TrialStatus.FAILED,
                stop_reason=verdict.reason,
            )
            if event.trained_to is not None and not verdict.converged:
                updated = charged_to(snapshot, updated, event.trained_to)
        message = verdict.message
        if updated.status is TrialStatus.CONVERGED and not verdict.converged:
            message = f"target reached at epoch {updated.epochs}, trained while bso was away"
        tx.save_trial(updated)
        return EpochDecision(
            event_id=event.event_id,
            job_id=tx.public_job_id,
            trial_number=trial.trial_number,
            epoch=event.epoch,
            stop=verdict.stop,
            converged=updated.status is TrialStatus.CONVERGED,
            reason=updated.stop_reason if verdict.stop else verdict.reason,
            cost=updated.cost,
            message=message,
        )

    def _end_trial(self, tx: JobTransaction, event: EndTrial) -> TrialEnded:
        job = require_job(tx)
        trial = require_trial(tx, event.trial_number)
        if trial.status is TrialStatus.RUNNING:
            if event.batch_size is not None:  # grown online: check it against the lane
                snapshot = lane_snapshot(tx, job, tx.get_lane(trial.hardware_key))
                grown = checked_batch_size(snapshot, trial, event.batch_size)
                trial = trial.replace(current_batch_size=grown)
            trial = end_trial(tx, trial, event.reason, self.clock())
        return TrialEnded(
            event_id=event.event_id,
            job_id=tx.public_job_id,
            trial_number=trial.trial_number,
            status=trial.status,
            reason=trial.stop_reason,
        )

    def _heartbeat(self, tx: JobTransaction, event: Heartbeat) -> HeartbeatAck:
        require_job(tx)
        trial = require_trial(tx, event.trial_number)
        if trial.status is TrialStatus.RUNNING:
            trial = trial.replace(updated_at=self.clock())
            tx.save_trial(trial)
        return HeartbeatAck(
            event_id=event.event_id,
            job_id=tx.public_job_id,
            trial_number=trial.trial_number,
            status=trial.status,
            reason=trial.stop_reason,
        )

    def _deliver_detached_run(
        self, tx: JobTransaction, event: DeliverDetachedRun
    ) -> DetachedRunDelivered:
        """A run that trained while the service was unreachable (:mod:`bso.detached_runs`)."""
        job = require_job(tx)
        lane = tx.get_lane(event.hardware.key)
        if lane is None:  # a run on hardware the job never ran on: its lane starts here
            lane = LaneRecord(event.hardware)
            tx.save_lane(lane)
        return apply_detached_run(tx, lane_snapshot(tx, job, lane), event, self.clock())

    # -- maintenance and reads ---------------------------------------------------------

    def interrupt_stale_trials(self, default_lease: timedelta) -> list[tuple[str, int]]:
        """End running trials silent for longer than their lease as interrupted.

        A lease is what the caller promised (``NextTrial.lease_s``: its heartbeat
        interval times the misses it allows), else ``default_lease``.  A vanished
        caller (SIGKILL, the OOM killer, a lost node) is not the size's fault; only
        repeated interruptions of one size count against it (:mod:`bso.core.outcomes`).
        """
        now = self.clock()
        ended = []
        for job_id, number in self.store.stale_trials(now, default_lease):
            with self.store.transaction(job_id) as tx:
                trial = tx.get_trial(number)
                # Re-check under the lock: a report may have arrived meanwhile.
                if trial is not None and lease_expired(trial, now, default_lease):
                    end_trial(tx, trial, StopReason.HEARTBEAT_TIMEOUT, now)
                    ended.append((job_id, number))
        return ended

    def status(self, job_id: str, tenant: str = DEFAULT_TENANT) -> JobStatus:
        """``tenant``'s job ``job_id`` as :class:`JobStatus` (a read: no job lock, so
        status polling never delays events)."""
        with self.store.read(job_key(tenant, job_id)) as tx:
            job = require_job(tx)
            records = tx.trials()
            keys = sorted({t.hardware_key for t in records})
            snapshots = [lane_snapshot(tx, job, tx.get_lane(key)) for key in keys]
            lanes = [lane_status(lane, started_from(tx, job, lane, records)) for lane in snapshots]
            return JobStatus(job_id=job_id, spec=job.spec, lanes=lanes, tenant=job.owner)

    def list_jobs(self, tenant: str = DEFAULT_TENANT) -> list[JobSummary]:
        """The tenant's jobs, most recently active first (a read: no job lock)."""
        return [job_summary(a) for a in self.store.jobs_of(tenant, MAX_LISTED_JOBS)]


def require_job(tx: JobReader) -> JobRecord:
    job = tx.get_job()
    if job is None:
        raise UnknownJob(f"job {tx.public_job_id!r} is not registered")
    return job


def require_trial(tx: JobReader, number: int) -> TrialRecord:
    trial = tx.get_trial(number)
    if trial is None:
        raise UnknownTrial(
            f"job {tx.public_job_id!r} has no trial {number} (the job was reset, or deleted "
            "and registered again, since that trial began)"
        )
    return trial


INTERRUPTING_REASONS = frozenset({StopReason.INTERRUPTED, StopReason.HEARTBEAT_TIMEOUT})
"""End reasons that are not the batch size's fault."""


def end_trial(
    tx: JobTransaction, trial: TrialRecord, reason: StopReason, now: datetime
) -> TrialRecord:
    """End a running trial that bso did not stop, as failed or interrupted by ``reason``."""
    status = TrialStatus.INTERRUPTED if reason in INTERRUPTING_REASONS else TrialStatus.FAILED
    ended = trial.replace(status=status, stop_reason=reason, updated_at=now)
    tx.save_trial(ended)
    return ended


def checked_batch_size(
    snapshot: JobSnapshot, trial: TrialRecord, reported: int | None
) -> int | None:
    """The batch size an epoch report says the epoch ran at (online growth), checked.

    A trial starts at its own size and may only grow, within its lane's sizes:
    its cost is charged to the size it started at, and that is what bso learns.
    """
    if reported is None:
        return trial.current_batch_size
    floor = trial.current_batch_size or trial.batch_size
    if reported < floor or reported not in snapshot.spec.batch_sizes:
        raise InvalidEvent(
            f"trial {trial.trial_number} ran at batch size {floor}; an epoch may only grow "
            f"it to one of the lane's sizes {listed(snapshot.spec.batch_sizes)}, got {reported}"
        )
    return reported


def explored(
    snapshot: JobSnapshot, trial: TrialRecord, reported: list[MicroBatchTiming]
) -> tuple[tuple[int, Timings], ...]:
    """A run's micro-batch exploration, checked: each micro-batch runs the trial's
    batch per device in whole passes (:mod:`bso.core.micro_batch`)."""
    per_device = snapshot.spec.split(trial.batch_size).per_device
    strays = [t.micro_batch_size for t in reported if per_device % t.micro_batch_size]
    if strays:
        raise InvalidEvent(
            f"trial {trial.trial_number} runs {per_device} samples per device per step; "
            f"micro-batches {listed(strays)} do not divide it"
        )
    return tuple(sorted(timings_from_wire(reported).items()))


def restore_rng(state: dict[str, Any] | None, seed: int | None) -> np.random.Generator:
    """The job's generator, continuing exactly where the last decision left it."""
    if state is None:
        return np.random.Generator(np.random.PCG64(seed))
    bit_generator = np.random.PCG64()
    bit_generator.state = state  # type: ignore[assignment]  # numpy's TypedDict is stricter
    return np.random.Generator(bit_generator)
