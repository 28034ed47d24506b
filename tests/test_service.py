"""BsoService, the in-process API: idempotent per event id, typed errors, lanes, RNG."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from bso.apikeys import new_api_key
from bso.core.state import JobSnapshot, TrialSnapshot
from bso.core.vocabulary import StopReason, TrialPhase, TrialStatus
from bso.core.zeus_policy import ZeusPolicy
from bso.errors import (
    BsoError,
    ConfigMismatch,
    EventIdConflict,
    InvalidEvent,
    NoFeasibleBatchSize,
    OutOfOrder,
    Unauthorized,
    UnknownJob,
    UnknownTrial,
    error_from_code,
)
from bso.service import BsoService
from bso.spec import Hardware, JobSpec
from bso.storage.memory import MemoryStore
from bso.wire.events import (
    EVENT_ADAPTER,
    DeleteJob,
    EndTrial,
    EpochDecision,
    EpochReport,
    ErrorReply,
    Event,
    JobDeleted,
    JobRegistered,
    NextTrial,
    RegisterJob,
    TrialAssigned,
)

T0 = datetime(2026, 3, 1, 8, 0, tzinfo=UTC)
V100 = Hardware(gpu_model="Tesla V100", gpu_count=1, max_power_w=250.0)
A100X8 = Hardware(gpu_model="NVIDIA A100", gpu_count=8, max_power_w=400.0)

# Per batch size: seconds per epoch, average watts of the job, epochs to the target.
EPOCH_TIME = {32: 40.0, 64: 25.0, 128: 20.0}
POWER = {32: 150.0, 64: 200.0, 128: 240.0}
EPOCHS_NEEDED: dict[int, int | None] = {32: 3, 64: 3, 128: 4}


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **delta: float) -> None:
        self.now += timedelta(**delta)


def make_spec(**changes: Any) -> JobSpec:
    fields: dict[str, Any] = {
        "job_id": "job",
        "batch_sizes": [32, 64, 128],
        "default_batch_size": 64,
        "target_metric": 0.9,
        "max_epochs": 6,
        "policy": "zeus",
        "mab_seed": 7,
        "hardware": V100,
    }
    fields.update(changes)
    return JobSpec.model_validate(fields)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def service(clock: Clock) -> BsoService:
    return BsoService(MemoryStore(), clock=clock)


@pytest.fixture
def job(service: BsoService) -> str:
    return service.register(make_spec()).job_id


def report(
    service: BsoService, job_id: str, trial: int, epoch: int, *, size: int = 64, **event: Any
) -> EpochDecision:
    """Cumulative figures of ``epoch`` epochs of ``size``; metric reaches the target when due."""
    needed = EPOCHS_NEEDED[size]
    metric = 1.0 if needed is not None and epoch >= needed else 0.1
    time_s = epoch * EPOCH_TIME[size]
    return service.report_epoch(
        job_id,
        trial,
        epoch=epoch,
        time_s=time_s,
        energy_j=time_s * POWER[size],
        metric=metric,
        **event,
    )


def run_to_end(
    service: BsoService, job_id: str, trial: TrialAssigned, noise: float = 1.0
) -> EpochDecision:
    """Train ``trial`` epoch by epoch until the service says stop."""
    size = trial.batch_size
    needed = EPOCHS_NEEDED[size]
    for epoch in range(1, 100):
        time_s = epoch * EPOCH_TIME[size] * noise
        decision = service.report_epoch(
            job_id,
            trial.trial_number,
            epoch=epoch,
            time_s=time_s,
            energy_j=time_s * POWER[size],
            metric=1.0 if needed is not None and epoch >= needed else 0.1,
        )
        if decision.stop:
            return decision
    raise AssertionError("the service never stopped the trial")


# -- register ---------------------------------------------------------------------------


def test_register_creates_once(service: BsoService) -> None:
    first = service.register(make_spec())
    again = service.register(make_spec())
    assert (first.job_id, first.created) == ("job", True)
    assert (again.job_id, again.created) == ("job", False)


def test_register_redelivered_gets_the_same_reply(service: BsoService) -> None:
    first = service.register(make_spec(), event_id="reg-1")
    redelivered = service.register(make_spec(), event_id="reg-1")
    assert redelivered == first
    assert redelivered.created is True  # the reply given the first time, not a new one


def test_register_with_other_hardware_is_the_same_job(service: BsoService) -> None:
    service.register(make_spec())
    assert service.register(make_spec(hardware=A100X8)).created is False


def test_register_with_other_config_names_the_differing_fields(service: BsoService) -> None:
    service.register(make_spec())
    with pytest.raises(ConfigMismatch) as info:
        service.register(make_spec(eta_knob=0.9, beta_knob=None))
    message = info.value.message
    assert "beta_knob" in message
    assert "eta_knob" in message
    assert "batch_sizes" not in message
    assert "job" in message
    # The job keeps its first configuration.
    assert service.status("job").spec.eta_knob == 0.5


def test_register_with_prefix_generates_a_stable_id(service: BsoService) -> None:
    spec = make_spec(job_id=None, job_id_prefix="mnist")
    first = service.register(spec, event_id="launch-1")
    retried = service.register(spec, event_id="launch-1")
    other = service.register(spec, event_id="launch-2")
    assert first.job_id.startswith("mnist-")
    assert first.job_id != "mnist-"
    assert retried == first
    assert other.job_id != first.job_id
    assert other.created is True
    status = service.status(first.job_id)
    assert status.job_id == first.job_id
    assert status.spec.job_id == first.job_id


def test_a_generated_job_id_is_a_usable_job_id(service: BsoService) -> None:
    """Any prefix the spec accepts must give an id that later events can name."""
    prefix = "p" * 128
    refused = None
    try:
        spec = make_spec(job_id=None, job_id_prefix=prefix)
    except ValidationError as exc:
        refused = str(exc)
    if refused is not None:  # refusing over-long prefixes up front is fine too
        assert "job_id_prefix" in refused
        return
    job_id = service.register(spec, event_id="long-prefix").job_id
    assert job_id.startswith(prefix[:100])
    assert make_spec(job_id=job_id).job_id == job_id  # obeys the job id rules
    assert service.next_trial(job_id).trial_number == 1


# -- trials and epochs ------------------------------------------------------------------


def test_trials_are_numbered_one_two_three(service: BsoService, job: str) -> None:
    trials = [service.next_trial(job) for _ in range(3)]
    assert [t.trial_number for t in trials] == [1, 2, 3]
    assert trials[0] == TrialAssigned(
        event_id=trials[0].event_id,
        job_id=job,
        trial_number=1,
        batch_size=64,
        phase=TrialPhase.EXPLORATION,
    )
    # The default's exploration is still running: the others use the default too.
    assert [(t.batch_size, t.phase) for t in trials[1:]] == [(64, TrialPhase.CONCURRENT)] * 2


def test_concurrent_callers_get_distinct_trial_numbers(service: BsoService, job: str) -> None:
    numbers: list[int] = []

    def ask() -> None:
        for _ in range(10):
            numbers.append(service.next_trial(job).trial_number)

    threads = [threading.Thread(target=ask) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(numbers) == list(range(1, 61))


def test_epoch_decisions_and_cost(service: BsoService, job: str) -> None:
    trial = service.next_trial(job)
    first = report(service, job, trial.trial_number, 1)
    assert (first.stop, first.converged, first.reason) == (False, False, None)
    assert first.epoch == 1
    assert first.cost == pytest.approx(0.5 * 25.0 * 200.0 + 0.5 * 250.0 * 25.0)
    report(service, job, trial.trial_number, 2)
    last = report(service, job, trial.trial_number, 3)
    assert (last.stop, last.converged, last.reason) == (True, True, StopReason.TARGET_REACHED)
    assert last.cost == pytest.approx(3 * first.cost)


def test_cumulative_figures_must_not_decrease(service: BsoService, job: str) -> None:
    trial = service.next_trial(job).trial_number
    service.report_epoch(job, trial, epoch=1, time_s=100.0, energy_j=5000.0, metric=0.1)
    with pytest.raises(InvalidEvent, match="cumulative"):
        service.report_epoch(job, trial, epoch=2, time_s=90.0, energy_j=6000.0, metric=0.1)
    with pytest.raises(InvalidEvent, match="cumulative"):
        service.report_epoch(job, trial, epoch=2, time_s=110.0, energy_j=4000.0, metric=0.1)
    # The rejected reports changed nothing: epoch 2 can still come.
    decision = service.report_epoch(job, trial, epoch=2, time_s=200.0, energy_j=10000.0, metric=0.1)
    assert decision.epoch == 2


def test_an_epoch_already_reported_is_out_of_order(service: BsoService, job: str) -> None:
    trial = service.next_trial(job).trial_number
    report(service, job, trial, 1)
    report(service, job, trial, 2)
    for epoch in (1, 2):
        with pytest.raises(
            OutOfOrder, match=r"reported epochs 1\.\.2; the next report must be epoch 3"
        ):
            report(service, job, trial, epoch)


def test_a_refused_event_id_stays_refused(service: BsoService, job: str) -> None:
    """Its refusal is recorded: a copy still in flight cannot be applied once the
    event would have become valid (here: epoch 2 after epoch 1 arrived)."""
    trial = service.next_trial(job).trial_number
    early = epoch_event(job, trial, 2, 200.0)
    first = service.handle(early)
    assert isinstance(first, ErrorReply)
    assert first.code == OutOfOrder.code
    report(service, job, trial, 1)
    assert service.handle(early) == first
    assert report(service, job, trial, 2).epoch == 2  # a new event for epoch 2 is fine


def test_epochs_count_up_by_exactly_one(service: BsoService, job: str) -> None:
    """A gap (1, 5, 9) is refused and changes nothing: epoch 2 is still the next one."""
    trial = service.next_trial(job).trial_number
    with pytest.raises(OutOfOrder, match="reported no epoch; the next report must be epoch 1"):
        report(service, job, trial, 2)
    report(service, job, trial, 1)
    with pytest.raises(OutOfOrder, match="must be epoch 2, got 5"):
        report(service, job, trial, 5)
    assert report(service, job, trial, 2).epoch == 2


def test_reports_after_the_trial_ended_are_out_of_order(service: BsoService, job: str) -> None:
    trial = service.next_trial(job)
    decision = run_to_end(service, job, trial)
    assert decision.converged
    with pytest.raises(OutOfOrder, match="already ended"):
        report(service, job, trial.trial_number, decision.epoch + 1)
    abandoned = service.next_trial(job).trial_number
    service.end_trial(job, abandoned)
    with pytest.raises(OutOfOrder):
        report(service, job, abandoned, 1)


def test_unknown_job_and_trial(service: BsoService, job: str) -> None:
    with pytest.raises(UnknownJob, match="nope"):
        service.next_trial("nope")
    with pytest.raises(UnknownJob):
        report(service, "nope", 1, 1)
    with pytest.raises(UnknownJob):
        service.end_trial("nope", 1)
    with pytest.raises(UnknownJob):
        service.status("nope")
    with pytest.raises(UnknownTrial, match="no trial 5"):
        report(service, job, 5, 1)
    with pytest.raises(UnknownTrial):
        service.end_trial(job, 1)


# -- handle(): error replies instead of exceptions ---------------------------------------


def epoch_event(job_id: str, trial: int, epoch: int, time_s: float, **kw: Any) -> EpochReport:
    return EpochReport(
        job_id=job_id,
        trial_number=trial,
        epoch=epoch,
        time_s=time_s,
        energy_j=time_s * 100.0,
        metric=0.1,
        **kw,
    )


def test_handle_turns_errors_into_typed_error_replies(service: BsoService, job: str) -> None:
    service.next_trial(job)
    report(service, job, 1, 1)
    report(service, job, 1, 2)
    cases: list[tuple[Event, type[BsoError]]] = [
        (NextTrial(job_id="ghost"), UnknownJob),
        (EndTrial(job_id=job, trial_number=42), UnknownTrial),
        (epoch_event(job, 1, 2, 500.0), OutOfOrder),
        (epoch_event(job, 1, 3, 1.0), InvalidEvent),
        (RegisterJob(spec=make_spec(max_epochs=50)), ConfigMismatch),
    ]
    for event, error in cases:
        reply = service.handle(event)
        assert isinstance(reply, ErrorReply), event
        assert reply.event_id == event.event_id
        assert reply.code == error.code
        assert reply.message
        assert type(error_from_code(reply.code, reply.message)) is error
    mismatch = service.handle(RegisterJob(spec=make_spec(max_epochs=50)))
    assert isinstance(mismatch, ErrorReply)
    assert "max_epochs" in mismatch.message


def test_handle_reports_no_feasible_batch_size(service: BsoService) -> None:
    spec = make_spec(job_id="hopeless", batch_sizes=[32, 64], default_batch_size=32)
    service.register(spec)
    for _ in range(2):
        trial = service.next_trial("hopeless")
        for epoch in range(1, 100):
            decision = service.report_epoch(
                "hopeless",
                trial.trial_number,
                epoch=epoch,
                time_s=epoch * 10.0,
                energy_j=epoch * 1000.0,
                metric=0.0,
            )
            if decision.stop:
                assert decision.reason is StopReason.MAX_EPOCHS
                break
    reply = service.handle(NextTrial(job_id="hopeless"))
    assert isinstance(reply, ErrorReply)
    assert reply.code == NoFeasibleBatchSize.code
    with pytest.raises(NoFeasibleBatchSize):
        service.next_trial("hopeless")
    # Refusing created no trial.
    assert service.status("hopeless").lanes[0].trials == 2


def test_handle_accepts_events_from_the_wire(service: BsoService) -> None:
    event = EVENT_ADAPTER.validate_json(RegisterJob(spec=make_spec()).model_dump_json())
    reply = service.handle(event)
    assert isinstance(reply, JobRegistered)
    assert reply.event_id == event.event_id


# -- redelivery -------------------------------------------------------------------------


def test_redelivered_next_trial_creates_one_trial(service: BsoService, job: str) -> None:
    event = NextTrial(job_id=job, event_id="nt-1")
    first = service.handle(event)
    again = service.handle(event)
    assert again == first
    assert isinstance(first, TrialAssigned)
    assert first.trial_number == 1
    assert service.next_trial(job).trial_number == 2
    assert service.status(job).lanes[0].trials == 2


def test_redelivered_epoch_changes_state_once(service: BsoService, job: str) -> None:
    trial = service.next_trial(job).trial_number
    event = epoch_event(job, trial, 1, 25.0, event_id="ep-1")
    first = service.handle(event)
    assert isinstance(first, EpochDecision)
    assert service.handle(event) == first
    assert service.handle(event).model_dump_json() == first.model_dump_json()
    # The typed method with the same id also gets the recorded reply.
    assert (
        service.report_epoch(
            job, trial, epoch=1, time_s=25.0, energy_j=2500.0, metric=0.1, event_id="ep-1"
        )
        == first
    )
    # Epoch 1 was applied once: epoch 2 is next, epoch 1 under a new id is refused.
    assert isinstance(service.handle(epoch_event(job, trial, 2, 50.0)), EpochDecision)
    late = service.handle(epoch_event(job, trial, 1, 25.0))
    assert isinstance(late, ErrorReply)
    assert late.code == OutOfOrder.code


def test_redelivered_end_and_delete(service: BsoService, job: str) -> None:
    trial = service.next_trial(job).trial_number
    end = EndTrial(job_id=job, trial_number=trial, event_id="end-1")
    assert service.handle(end) == service.handle(end)
    delete = DeleteJob(job_id=job, event_id="del-1")
    first = service.handle(delete)
    assert service.handle(delete) == first
    assert service.delete_job(job).existed is False


def test_an_event_id_reused_for_another_event_is_refused(service: BsoService, job: str) -> None:
    service.next_trial(job, event_id="shared-id")
    with pytest.raises(EventIdConflict, match="different body"):
        service.end_trial(job, 1, event_id="shared-id")
    # Same kind, other content: refused as well, and nothing changed.
    report(service, job, 1, 1, event_id="epoch-id")
    with pytest.raises(EventIdConflict):
        service.report_epoch(
            job, 1, epoch=1, time_s=1.0, energy_j=1.0, metric=0.5, event_id="epoch-id"
        )
    assert service.status(job).lanes[0].trials == 1


def test_the_same_event_id_in_another_job_is_another_event(service: BsoService, job: str) -> None:
    other = service.register(make_spec(job_id="other-job")).job_id
    first = service.next_trial(job, event_id="same-id")
    second = service.next_trial(other, event_id="same-id")
    assert (first.job_id, second.job_id) == (job, other)
    assert service.next_trial(other, event_id="same-id") == second


def test_a_retry_long_after_is_answered_from_the_record(job: str) -> None:
    """While the job exists its replies are kept: a late retry of next_trial gets the
    same trial, not a second one (the sweep prunes only deleted jobs' replies)."""
    store = MemoryStore()
    service = BsoService(store)
    service.register(make_spec(job_id=job))
    first = service.next_trial(job, event_id="late")
    assert store.prune_replies(datetime.now(UTC) + timedelta(days=365)) == 0
    assert service.next_trial(job, event_id="late") == first
    assert service.status(job).lanes[0].trials == 1


# -- tenants ------------------------------------------------------------------------------


def test_another_tenants_job_reads_exactly_like_one_that_does_not_exist() -> None:
    service = BsoService(MemoryStore())
    spec = make_spec(job_id="team-job")
    assert isinstance(service.handle(RegisterJob(spec=spec), "team-a"), JobRegistered)
    trial = service.handle(NextTrial(job_id="team-job"), "team-a")
    assert isinstance(trial, TrialAssigned)

    def refusals(job_id: str) -> list[tuple[str, str]]:
        events: list[Event] = [
            NextTrial(job_id=job_id, event_id="e-next"),
            epoch_event(job_id, trial.trial_number, 1, 10.0),
            EndTrial(job_id=job_id, trial_number=trial.trial_number, event_id="e-end"),
        ]
        replies = [service.handle(event, "team-b") for event in events]
        assert all(isinstance(r, ErrorReply) for r in replies)
        return [(r.code, r.message.replace(job_id, "<job>")) for r in replies]  # type: ignore[union-attr]

    assert refusals("team-job") == refusals("no-such-job")
    assert refusals("team-job")[0] == (UnknownJob.code, "job '<job>' is not registered")
    with pytest.raises(UnknownJob, match="job 'team-job' is not registered"):
        service.status("team-job", "team-b")
    deleted = service.handle(DeleteJob(job_id="team-job"), "team-b")
    assert isinstance(deleted, JobDeleted)
    assert not deleted.existed
    # Nothing of team-a's changed: one running trial.
    status = service.status("team-job", "team-a")
    assert status.lanes[0].trials == 1
    assert status.lanes[0].running_trials == 1


def test_two_tenants_each_have_their_own_job_of_one_id() -> None:
    service = BsoService(MemoryStore())
    for tenant, sizes in (("team-a", [16, 32]), ("team-b", [64, 128, 256])):
        spec = make_spec(job_id="nightly", batch_sizes=sizes, default_batch_size=sizes[0])
        registered = service.handle(RegisterJob(spec=spec), tenant)
        assert isinstance(registered, JobRegistered)
        assert registered.created
        assert registered.job_id == "nightly"
    trial = service.handle(NextTrial(job_id="nightly"), "team-b")
    assert isinstance(trial, TrialAssigned)
    assert (trial.job_id, trial.batch_size) == ("nightly", 64)
    assert service.status("nightly", "team-a").lanes == []
    assert service.status("nightly", "team-b").spec.batch_sizes == [64, 128, 256]
    assert [j.job_id for j in service.list_jobs("team-a")] == ["nightly"]
    assert service.list_jobs("team-b")[0].trials == 1
    assert service.list_jobs() == []


def test_another_tenant_replaying_an_event_id_gets_no_reply_of_it() -> None:
    service = BsoService(MemoryStore())
    register = RegisterJob(spec=make_spec(job_id="secret-job"))
    assert isinstance(service.handle(register, "team-a"), JobRegistered)
    delete = DeleteJob(job_id="secret-job")
    assert isinstance(service.handle(delete, "team-a"), JobDeleted)
    # The job is gone; its delete reply is kept for retries, but only for team-a.
    again = service.handle(delete, "team-a")
    assert isinstance(again, JobDeleted)
    assert again.existed
    theirs = service.handle(delete, "team-b")
    assert isinstance(theirs, JobDeleted)
    assert not theirs.existed


def test_authenticate_accepts_only_valid_unrevoked_keys() -> None:
    store = MemoryStore()
    service = BsoService(store)
    key, record = new_api_key("team-a", datetime.now(UTC))
    store.add_api_key(record)
    assert service.authenticate(key) == "team-a"
    wrong_secret = key[:-1] + ("A" if key[-1] != "A" else "B")
    unknown = "bso_" + "0" * 12 + key[16:]
    for bad in (None, "", "nonsense", wrong_secret, unknown):
        with pytest.raises(Unauthorized) as caught:
            service.authenticate(bad)
        assert key[17:] not in caught.value.message
    store.revoke_api_key(record.key_id, datetime.now(UTC))
    with pytest.raises(Unauthorized, match="revoked"):
        service.authenticate(key)


# -- ending trials ----------------------------------------------------------------------


def test_end_trial_on_a_running_trial_abandons_it(service: BsoService, job: str) -> None:
    first = service.next_trial(job)
    run_to_end(service, job, first)  # 64 converges
    second = service.next_trial(job)
    assert (second.batch_size, second.phase) == (32, TrialPhase.EXPLORATION)
    report(service, job, second.trial_number, 1, size=32)
    ended = service.end_trial(job, second.trial_number)
    assert (ended.status, ended.reason) == (TrialStatus.FAILED, StopReason.ABANDONED)
    # The script's, not 32's: the next run (the fixed script) gets 32 again.
    third = service.next_trial(job)
    assert (third.batch_size, third.phase) == (32, TrialPhase.EXPLORATION)
    sizes = {s.batch_size: s for s in service.status(job).lanes[0].sizes}
    assert (sizes[32].trials, sizes[32].failed, sizes[32].converged) == (2, 0, 0)
    assert sizes[32].outcomes == {"script_error": 1, "running": 1}


def test_end_trial_after_convergence_keeps_the_verdict(service: BsoService, job: str) -> None:
    trial = service.next_trial(job)
    run_to_end(service, job, trial)
    ended = service.end_trial(job, trial.trial_number)
    assert (ended.status, ended.reason) == (TrialStatus.CONVERGED, StopReason.TARGET_REACHED)
    assert service.end_trial(job, trial.trial_number).status is TrialStatus.CONVERGED


def test_interrupt_stale_trials(service: BsoService, job: str, clock: Clock) -> None:
    silent = service.next_trial(job).trial_number  # exploration of 64
    alive = service.next_trial(job).trial_number  # concurrent
    clock.advance(minutes=8)
    report(service, job, alive, 1)
    clock.advance(minutes=2)
    assert service.interrupt_stale_trials(timedelta(minutes=5)) == [(job, silent)]
    assert service.interrupt_stale_trials(timedelta(minutes=5)) == []
    ended = service.end_trial(job, silent)
    assert (ended.status, ended.reason) == (
        TrialStatus.INTERRUPTED,
        StopReason.HEARTBEAT_TIMEOUT,
    )
    with pytest.raises(OutOfOrder):
        report(service, job, silent, 1)
    assert report(service, job, alive, 2).epoch == 2
    lane = service.status(job).lanes[0]
    assert lane.running_trials == 1
    # A vanished caller is not the size's fault: 64 is explored again.
    again = service.next_trial(job)
    assert (again.batch_size, again.phase) == (64, TrialPhase.EXPLORATION)


def test_nothing_is_stale_within_the_timeout(service: BsoService, job: str, clock: Clock) -> None:
    service.next_trial(job)
    clock.advance(minutes=4, seconds=59)
    assert service.interrupt_stale_trials(timedelta(minutes=5)) == []


# -- status -----------------------------------------------------------------------------


def test_status_of_a_fresh_job(service: BsoService, job: str) -> None:
    status = service.status(job)
    assert status.job_id == job
    assert status.spec == make_spec()
    assert status.lanes == []


# -- hardware lanes ---------------------------------------------------------------------


def test_learning_is_kept_per_hardware(service: BsoService, job: str) -> None:
    for _ in range(4):
        run_to_end(service, job, service.next_trial(job))
    v100_next = service.next_trial(job)
    # V100: round 0 explored 64, 32, 128; round 1 started again from 64, then 32.
    assert (v100_next.batch_size, v100_next.phase) == (32, TrialPhase.EXPLORATION)
    a100 = service.next_trial(job, A100X8)
    assert (a100.batch_size, a100.phase) == (64, TrialPhase.EXPLORATION)
    assert a100.trial_number == 6  # one numbering per job
    decision = report(service, job, a100.trial_number, 1)
    # The trial's own hardware sets MaxPower: 8 x 400 W.
    assert decision.cost == pytest.approx(0.5 * 25.0 * 200.0 + 0.5 * 3200.0 * 25.0)
    status = service.status(job)
    lanes = {lane.hardware.key: lane for lane in status.lanes}
    assert set(lanes) == {V100.key, A100X8.key}
    assert lanes[A100X8.key].trials == 1
    assert lanes[A100X8.key].stage == "exploring"
    assert lanes[V100.key].trials == 5


# -- RNG continuity ---------------------------------------------------------------------


def drive(services: list[BsoService], job_id: str, trials: int) -> list[tuple[int, str]]:
    """Run ``trials`` noisy trials, moving on to the next service object (a restart) evenly.

    The noise of a trial depends on its number only, so every run sees the same world.
    """
    sequence = []
    for i in range(trials):
        service = services[min(i * len(services) // trials, len(services) - 1)]
        trial = service.next_trial(job_id)
        sequence.append((trial.batch_size, trial.phase.value))
        noise = float(np.random.default_rng(trial.trial_number).lognormal(0.0, 0.3))
        run_to_end(service, job_id, trial, noise=noise)
    return sequence


@pytest.mark.parametrize("policy", ["zeus", "bso"])
def test_a_restart_continues_the_same_random_sequence(policy: str) -> None:
    spec = make_spec(policy=policy, mab_seed=11)
    steady = BsoService(MemoryStore())
    steady.register(spec)
    expected = drive([steady], "job", 30)

    store = MemoryStore()
    BsoService(store).register(spec)
    restarted = drive([BsoService(store), BsoService(store), BsoService(store)], "job", 30)
    assert restarted == expected
    assert any(phase == "exploitation" for _, phase in expected)


def test_the_service_draws_from_one_continuing_stream_seeded_by_mab_seed() -> None:
    """The same decisions as ZeusPolicy fed by one generator seeded with ``mab_seed``."""
    spec = make_spec(mab_seed=11)
    service = BsoService(MemoryStore())
    service.register(spec)
    sequence = drive([service], "job", 30)
    exploitation = [size for size, phase in sequence if phase == "exploitation"]
    assert len(set(exploitation)) > 1  # the draws matter in this job

    rng = np.random.Generator(np.random.PCG64(11))
    lane = service.status("job").lanes[0]
    assert lane.trials == 30
    trials: list[TrialSnapshot] = []
    replayed = []
    store_trials = _trials_of(service, "job")
    for record in store_trials:
        snapshot = JobSnapshot(spec, V100, tuple(trials))
        assignment = ZeusPolicy().next_trial(snapshot, rng)
        replayed.append((assignment.batch_size, assignment.phase.value))
        trials.append(record)
    assert replayed == sequence


def _trials_of(service: BsoService, job_id: str) -> list[TrialSnapshot]:
    with service.store.transaction(job_id) as tx:
        return [t.snapshot() for t in tx.trials()]


def test_different_seeds_give_different_sequences() -> None:
    sequences = set()
    for seed in range(4):
        service = BsoService(MemoryStore())
        service.register(make_spec(mab_seed=seed))
        sequences.add(tuple(drive([service], "job", 30)))
    assert len(sequences) > 1


# -- delete -----------------------------------------------------------------------------


def test_delete_job(service: BsoService, job: str) -> None:
    service.next_trial(job)
    deleted = service.delete_job(job)
    assert (deleted.job_id, deleted.existed) == (job, True)
    with pytest.raises(UnknownJob):
        service.next_trial(job)
    with pytest.raises(UnknownJob):
        service.status(job)
    assert service.delete_job(job).existed is False
    # The id is free again, even with another configuration.
    again = service.register(make_spec(eta_knob=0.9))
    assert again.created is True
    first = service.next_trial(job)
    assert (first.batch_size, first.phase) == (64, TrialPhase.EXPLORATION)
    assert service.status(job).lanes[0].trials == 1


def test_an_exploration_whose_size_ran_out_of_memory_meanwhile_still_gets_decisions(
    service: BsoService,
) -> None:
    """A concurrent trial of the same size ran out of memory, so the size is no
    longer a candidate on this hardware; the exploration still running at it
    must get an answer for its next epoch, not an error (bso policy: a KeyError
    in the early stop before)."""
    job_id = service.register(make_spec(policy="bso", default_batch_size=128)).job_id
    first = service.next_trial(job_id, V100)
    second = service.next_trial(job_id, V100)
    assert first.batch_size == second.batch_size == 128
    service.end_trial(job_id, second.trial_number, reason=StopReason.OUT_OF_MEMORY)
    decision = report(service, job_id, first.trial_number, 1, size=128)
    assert decision.stop is False
    assert service.next_trial(job_id, V100).batch_size < 128
