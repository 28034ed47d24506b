"""What the service learns from a detached run (bso.detached_runs), and that a serial
replay of the recorded events agrees (bso.audit)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from bso.audit import audit
from bso.core.vocabulary import StopReason, TrialPhase, TrialStatus
from bso.errors import InvalidEvent, UnknownJob, UnknownTrial
from bso.service import BsoService
from bso.spec import Hardware, JobSpec
from bso.storage.base import TrialRecord
from bso.storage.history import RecordedReply
from bso.storage.memory import MemoryStore
from bso.wire.events import (
    DeliverDetachedRun,
    DetachedEpoch,
    EndReason,
    EpochReport,
    Event,
    NextTrial,
    RegisterJob,
    ResumeTrial,
)

SPEC = JobSpec(
    job_id="j",
    batch_sizes=[32, 64, 128],
    default_batch_size=64,
    target_metric=0.9,
    max_epochs=4,
    mab_seed=3,
)
A100 = Hardware(gpu_model="A100", max_power_w=400.0)


def epochs(*metrics: float, size: int | None = None) -> list[DetachedEpoch]:
    return [
        DetachedEpoch(epoch=i, time_s=10.0 * i, energy_j=1000.0 * i, metric=m, batch_size=size)
        for i, m in enumerate(metrics, start=1)
    ]


def run(
    *metrics: float,
    trial: int | None = None,
    size: int = 64,
    hardware: Hardware = SPEC.hardware,
    end: EndReason = StopReason.ABANDONED,
) -> DeliverDetachedRun:
    return DeliverDetachedRun(
        job_id="j",
        hardware=hardware,
        batch_size=size,
        trial_number=trial,
        epochs=epochs(*metrics),
        end_reason=end,
    )


@pytest.fixture
def service() -> BsoService:
    service = BsoService(MemoryStore())
    service.register(SPEC)
    return service


def trial_of(service: BsoService, number: int) -> TrialRecord:
    with service.store.read("j") as tx:
        trial = tx.get_trial(number)
    assert trial is not None
    return trial


def test_the_runs_own_running_trial_is_rewritten_up_to_the_target(service: BsoService) -> None:
    assigned = service.next_trial("j")
    service.report_epoch("j", assigned.trial_number, epoch=1, time_s=10, energy_j=1e3, metric=0.3)
    reply = service.deliver_detached_run(
        run(0.3, 0.6, 0.92, 0.95, trial=assigned.trial_number, size=assigned.batch_size)
    )
    assert reply.rewritten
    trial = trial_of(service, assigned.trial_number)
    assert (trial.status, trial.stop_reason, trial.epochs, trial.detached) == (
        TrialStatus.CONVERGED,
        StopReason.TARGET_REACHED,
        3,  # bso would have stopped it there: the cost up to the target
        True,
    )
    assert trial.time_s == 30.0
    assert trial.cost > 0


def test_a_deleted_jobs_journal_is_refused_by_the_job_registered_again(
    service: BsoService,
) -> None:
    """A run detached mid-trial; the operator deletes the job and it is registered
    again, and another run of it trains.  The old run's journal used to rewrite the
    new job's trial of the same number (its epochs and its end); now it names a trial
    below the new job's first and is refused, and the new job keeps only its own."""
    old = service.next_trial("j")
    service.delete_job("j")
    service.register(SPEC)
    new = service.next_trial("j")
    assert new.trial_number == old.trial_number + 1
    service.report_epoch("j", new.trial_number, epoch=1, time_s=10, energy_j=1e3, metric=0.3)
    with pytest.raises(UnknownTrial, match="as it was before it was deleted"):
        service.deliver_detached_run(
            run(0.3, 0.6, 0.95, trial=old.trial_number, size=old.batch_size)
        )
    with service.store.read("j") as tx:
        assert [(t.trial_number, t.epochs, t.detached) for t in tx.trials()] == [
            (new.trial_number, 1, False)
        ]


def test_a_trial_ended_by_its_lease_is_rewritten_from_the_journal(service: BsoService) -> None:
    assigned = service.next_trial("j", lease_s=10.0)
    service.clock = lambda: trial_of(service, 1).updated_at + timedelta(hours=1)
    assert service.interrupt_stale_trials(timedelta(hours=6)) == [("j", 1)]
    assert trial_of(service, 1).stop_reason is StopReason.HEARTBEAT_TIMEOUT
    reply = service.deliver_detached_run(run(0.1, 0.2, 0.3, 0.4, trial=1, size=assigned.batch_size))
    assert (reply.status, reply.reason, reply.rewritten) == (
        TrialStatus.FAILED,
        StopReason.MAX_EPOCHS,
        True,
    )


def test_a_trial_another_run_resumed_meanwhile_is_not_rewritten(service: BsoService) -> None:
    """The journaled run went silent; a scheduler took it for dead and resumed its
    trial from the epoch-1 checkpoint, and that run reported epoch 2 at its own time.
    The journal, delivered later, counts as a run of its own: the other run's epochs
    stay as they were reported."""
    assigned = service.next_trial("j")
    number, size = assigned.trial_number, assigned.batch_size
    service.report_epoch("j", number, epoch=1, time_s=10.0, energy_j=1e3, metric=0.1)
    service.resume_trial(
        ResumeTrial(job_id="j", trial_number=number, hardware_key=SPEC.hardware.key,
                    batch_size=size, epochs=1, time_s=10.0, energy_j=1e3)
    )  # fmt: skip
    service.report_epoch("j", number, epoch=2, time_s=23.0, energy_j=2.3e3, metric=0.2)
    before = trial_of(service, number)
    reply = service.deliver_detached_run(run(0.1, 0.2, 0.3, trial=number, size=size))
    assert not reply.rewritten
    assert reply.trial_number != number
    assert trial_of(service, number) == before
    own = trial_of(service, reply.trial_number)
    assert (own.phase, own.detached, own.epochs) == (TrialPhase.CONCURRENT, True, 3)


def test_a_journal_that_holds_the_trials_last_epoch_rewrites_it(service: BsoService) -> None:
    """The service recorded the run's last report and the reply was lost: the trial
    stands at an epoch the journal holds, and is the journal's."""
    assigned = service.next_trial("j")
    number, size = assigned.trial_number, assigned.batch_size
    for epoch in (1, 2):
        service.report_epoch(
            "j", number, epoch=epoch, time_s=10.0 * epoch, energy_j=1e3 * epoch, metric=0.1
        )
    reply = service.deliver_detached_run(run(0.1, 0.2, 0.3, trial=number, size=size))
    assert reply.rewritten
    assert trial_of(service, number).epochs == 3


def explored_and_dear(service: BsoService) -> tuple[int, int]:
    """The default converged at one epoch of 10 s; the next trial explores another
    size at 100 s an epoch, past the cost bound at its first: (its number, its size)."""
    service.next_trial("j")
    service.report_epoch("j", 1, epoch=1, time_s=10.0, energy_j=1e3, metric=0.95)
    second = service.next_trial("j")
    return second.trial_number, second.batch_size


def test_a_journaled_report_bso_stops_is_charged_up_to_where_the_run_trained(
    service: BsoService,
) -> None:
    """A run back from an outage sends its journaled epoch 1 naming epoch 3, the one
    that just ended: bso stops the trial at epoch 1, and it ends at epoch 3, charged
    what the run spent (bso could not stop it sooner)."""
    number, _ = explored_and_dear(service)
    trained = DetachedEpoch(epoch=3, time_s=300.0, energy_j=3e4, metric=0.3)
    decision = service.report_epoch(
        "j", number, epoch=1, time_s=100.0, energy_j=1e4, metric=0.1, trained_to=trained
    )
    assert decision.stop
    assert not decision.converged
    trial = trial_of(service, number)
    assert (trial.status, trial.epochs, trial.time_s, trial.energy_j, trial.last_metric) == (
        TrialStatus.FAILED, 3, 300.0, 3e4, 0.3
    )  # fmt: skip
    assert trial.cost == pytest.approx(service.status("j").lanes[0].history[-1].cost)
    assert decision.cost == trial.cost


def test_a_stopped_journaled_report_whose_run_then_converged_ends_converged(
    service: BsoService,
) -> None:
    """bso stops the journaled epoch 1, but the run trained on to epoch 3 and reached
    the target there: the trial converged, at what it cost, as a delivered journal
    would say; the decision says so, so the run is not told to relaunch."""
    number, _ = explored_and_dear(service)
    trained = DetachedEpoch(epoch=3, time_s=300.0, energy_j=3e4, metric=0.95)
    decision = service.report_epoch(
        "j", number, epoch=1, time_s=100.0, energy_j=1e4, metric=0.1, trained_to=trained
    )
    assert (decision.stop, decision.converged, decision.reason) == (
        True, True, StopReason.TARGET_REACHED
    )  # fmt: skip
    assert "target reached at epoch 3" in decision.message
    trial = trial_of(service, number)
    assert (trial.status, trial.epochs, trial.time_s) == (TrialStatus.CONVERGED, 3, 300.0)


def test_trained_to_changes_nothing_when_bso_does_not_stop(service: BsoService) -> None:
    number = service.next_trial("j").trial_number
    trained = DetachedEpoch(epoch=3, time_s=30.0, energy_j=3e3, metric=0.3)
    decision = service.report_epoch(
        "j", number, epoch=1, time_s=10.0, energy_j=1e3, metric=0.1, trained_to=trained
    )
    assert not decision.stop
    trial = trial_of(service, number)
    assert (trial.status, trial.epochs, trial.time_s) == (TrialStatus.RUNNING, 1, 10.0)


@pytest.mark.parametrize(
    "trained",
    [
        DetachedEpoch(epoch=1, time_s=300.0, energy_j=3e4, metric=0.3),
        DetachedEpoch(epoch=3, time_s=50.0, energy_j=3e4, metric=0.3),
        DetachedEpoch(epoch=3, time_s=300.0, energy_j=5e3, metric=0.3),
    ],
    ids=["earlier-epoch", "less-time", "less-energy"],
)
def test_a_trained_to_before_its_report_is_refused(
    service: BsoService, trained: DetachedEpoch
) -> None:
    number = service.next_trial("j").trial_number
    service.report_epoch("j", number, epoch=1, time_s=10.0, energy_j=1e3, metric=0.1)
    with pytest.raises(InvalidEvent, match="trained_to"):
        service.report_epoch(
            "j", number, epoch=2, time_s=100.0, energy_j=1e4, metric=0.1, trained_to=trained
        )
    assert trial_of(service, number).epochs == 1  # nothing written


def test_a_trial_the_service_ended_itself_keeps_its_first_decision(service: BsoService) -> None:
    assigned = service.next_trial("j")
    service.report_epoch("j", 1, epoch=1, time_s=10, energy_j=1e3, metric=0.95)  # converged
    reply = service.deliver_detached_run(
        run(0.95, 0.96, trial=assigned.trial_number, size=assigned.batch_size)
    )
    assert not reply.rewritten
    trial = trial_of(service, 1)
    assert (trial.status, trial.epochs, trial.detached) == (TrialStatus.CONVERGED, 1, False)


def test_a_run_without_a_trial_is_a_new_detached_trial(service: BsoService) -> None:
    reply = service.deliver_detached_run(run(0.2, 0.5, end=StopReason.OUT_OF_MEMORY))
    trial = trial_of(service, reply.trial_number)
    assert (trial.phase, trial.status, trial.stop_reason, trial.detached) == (
        TrialPhase.CONCURRENT,
        TrialStatus.FAILED,
        StopReason.OUT_OF_MEMORY,
        True,
    )
    assert service.status("j").lanes[0].memory_limit == 64  # the outcome rules apply


def test_an_interrupted_detached_run_is_not_held_against_its_size(service: BsoService) -> None:
    reply = service.deliver_detached_run(run(0.2, end=StopReason.INTERRUPTED))
    assert reply.status is TrialStatus.INTERRUPTED
    assert service.next_trial("j").batch_size == 64  # an interrupted size is retried


def test_a_run_on_new_hardware_starts_its_lane(service: BsoService) -> None:
    reply = service.deliver_detached_run(run(0.95, hardware=A100))
    lanes = {lane.hardware.key: lane for lane in service.status("j").lanes}
    assert lanes[A100.key].detached_trials == 1
    assert lanes[A100.key].history[0].trial_number == reply.trial_number
    assert lanes[A100.key].history[0].detached


def test_delivering_a_journal_again_is_a_no_op(service: BsoService) -> None:
    journal = run(0.5, 0.95)
    first = service.deliver_detached_run(journal)
    assert service.deliver_detached_run(journal) == first
    with service.store.read("j") as tx:
        assert len(tx.trials()) == 1


@pytest.mark.parametrize(
    ("journal", "why"),
    [
        (run(0.5, size=48), "not one of the lane's sizes"),
        (
            DeliverDetachedRun(
                job_id="j",
                hardware=SPEC.hardware,
                batch_size=64,
                epochs=[DetachedEpoch(epoch=2, time_s=1, energy_j=1, metric=0.1)],
            ),
            "count 1, 2",
        ),
        (
            DeliverDetachedRun(
                job_id="j",
                hardware=SPEC.hardware,
                batch_size=64,
                epochs=[
                    DetachedEpoch(epoch=1, time_s=5, energy_j=1, metric=0.1),
                    DetachedEpoch(epoch=2, time_s=4, energy_j=2, metric=0.1),
                ],
            ),
            "cumulative",
        ),
        (
            DeliverDetachedRun(
                job_id="j",
                hardware=SPEC.hardware,
                batch_size=64,
                epochs=[DetachedEpoch(epoch=1, time_s=5, energy_j=1, metric=0.1, batch_size=32)],
            ),
            "may only grow",
        ),
    ],
)
def test_a_journal_that_could_not_have_been_reported_is_refused(
    service: BsoService, journal: DeliverDetachedRun, why: str
) -> None:
    with pytest.raises(InvalidEvent, match=why):
        service.deliver_detached_run(journal)
    with service.store.read("j") as tx:
        assert tx.trials() == []


def test_a_trial_of_another_size_is_refused(service: BsoService) -> None:
    assigned = service.next_trial("j")
    other = next(b for b in SPEC.batch_sizes if b != assigned.batch_size)
    with pytest.raises(InvalidEvent, match="detached run says"):
        service.deliver_detached_run(run(0.5, trial=assigned.trial_number, size=other))


def test_an_unknown_job_is_refused() -> None:
    with pytest.raises(UnknownJob):
        BsoService(MemoryStore()).deliver_detached_run(run(0.5))


def test_the_audit_replay_agrees_with_detached_runs() -> None:
    live = BsoService(MemoryStore())
    sent: list[Event] = []

    def send(event: Event) -> None:
        sent.append(event)
        live.handle(event)

    send(RegisterJob(spec=SPEC))
    send(NextTrial(job_id="j"))
    with live.store.read("j") as tx:
        first = tx.trials()[0]
    send(EpochReport(job_id="j", trial_number=1, epoch=1, time_s=10.0, energy_j=1e3, metric=0.2))
    journal = run(0.2, 0.5, 0.93, trial=1, size=first.batch_size)
    send(journal)
    send(journal)  # redelivered: the same reply, nothing changes
    send(run(0.4, 0.91, size=32))
    ids = list(dict.fromkeys(e.event_id for e in sent))  # in the order they were applied
    with live.store.transaction("j") as tx:
        replies = {i: tx.recorded_reply(i) for i in ids}
    recorded = [RecordedReply(i, "j", r.reply_json) for i, r in replies.items() if r is not None]
    report = audit({"j": recorded}, {e.event_id: e for e in sent}, live.store)
    assert report.ok, report.differences
    assert report.trials == 2


def test_a_trained_to_past_max_epochs_is_refused(service: BsoService) -> None:
    """A client (buggy or adversarial) names epoch 1,000,000 of a job whose
    ``max_epochs`` is 4: no run trains past max_epochs, so it is refused, and nothing
    is written (it was stored as a trial of a million epochs, review of 18d5469)."""
    number, _ = explored_and_dear(service)
    trained = DetachedEpoch(epoch=1_000_000, time_s=101.0, energy_j=1.01e4, metric=0.1)
    with pytest.raises(InvalidEvent, match="trained_to"):
        service.report_epoch(
            "j", number, epoch=1, time_s=100.0, energy_j=1e4, metric=0.1, trained_to=trained
        )
    with service.store.read("j") as tx:
        trial = tx.get_trial(number)
    assert trial is not None
    assert trial.epochs <= SPEC.max_epochs
