"""The service's rules for a run resumed from a checkpoint (bso/resumes.py)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from bso.core.vocabulary import StopReason, TrialStatus
from bso.errors import TrialNotResumable, UnknownTrial
from bso.service import BsoService
from bso.spec import Hardware, JobSpec
from bso.storage.base import TrialRecord
from bso.storage.memory import MemoryStore
from bso.wire.events import ErrorReply, ResumeTrial, TrialAssigned, TrialStanding

SPEC = JobSpec(
    job_id="job",
    batch_sizes=[8, 16, 32],
    default_batch_size=16,
    target_metric=0.9,
    max_epochs=10,
    mab_seed=1,
)
KEY = Hardware().key


def started(epochs: int = 5) -> tuple[BsoService, TrialAssigned]:
    """A job with one trial that reported ``epochs`` epochs of 10 s and 100 J each."""
    service = BsoService(MemoryStore())
    service.register(SPEC)
    trial = service.next_trial("job")
    for epoch in range(1, epochs + 1):
        service.report_epoch(
            "job", trial.trial_number, epoch=epoch, time_s=10.0 * epoch,
            energy_j=100.0 * epoch, metric=0.1,
        )  # fmt: skip
    return service, trial


def resume(trial: TrialAssigned, **changes: Any) -> ResumeTrial:
    fields: dict[str, Any] = {
        "job_id": "job",
        "trial_number": trial.trial_number,
        "hardware_key": KEY,
        "batch_size": trial.batch_size,
        "epochs": 3,
        "time_s": 30.0,
        "energy_j": 300.0,
    }
    return ResumeTrial(**(fields | changes))


def stored(service: BsoService, number: int) -> TrialRecord:
    with service.store.transaction("job") as tx:
        trial = tx.get_trial(number)
    assert trial is not None
    return trial


@pytest.mark.parametrize("end", [None, StopReason.INTERRUPTED, "lease", StopReason.ABANDONED])
def test_a_running_interrupted_or_script_ended_trial_goes_on_from_the_checkpoint(
    end: object,
) -> None:
    """Killed (still running), interrupted, its lease run out, or ended by a bug in
    the script (abandoned) that was fixed before the run was started again from its
    checkpoint: the trial lost its run, not its size's verdict, and goes on."""
    service, trial = started()
    if end in (StopReason.INTERRUPTED, StopReason.ABANDONED):
        service.end_trial("job", trial.trial_number, reason=end)  # type: ignore[arg-type]
    elif end == "lease":
        later = stored(service, 1).updated_at + timedelta(days=2)
        service.clock = lambda: later
        assert service.interrupt_stale_trials(default_lease=timedelta(days=1))
    reply = service.resume_trial(resume(trial, lease_s=60.0))
    assert (reply.trial_number, reply.batch_size) == (trial.trial_number, trial.batch_size)
    record = stored(service, trial.trial_number)
    assert record.status is TrialStatus.RUNNING
    assert record.stop_reason is None
    assert (record.epochs, record.time_s, record.energy_j, record.lease_s) == (3, 30.0, 300.0, 60.0)
    # The epochs after the checkpoint are lost work: the next report is epoch 4.
    decision = service.report_epoch(
        "job", trial.trial_number, epoch=4, time_s=41.0, energy_j=410.0, metric=0.95
    )
    assert decision.converged
    record = stored(service, trial.trial_number)
    assert (record.status, record.epochs, record.time_s) == (TrialStatus.CONVERGED, 4, 41.0)
    with service.store.transaction("job") as tx:
        assert len(tx.trials()) == 1  # one trial holds the whole run


@pytest.mark.parametrize("end", [StopReason.DIVERGED, StopReason.OUT_OF_MEMORY, "converged"])
def test_a_trial_that_ended_for_good_is_not_resumable(end: object) -> None:
    service, trial = started()
    if end == "converged":
        service.report_epoch("job", 1, epoch=6, time_s=60.0, energy_j=600.0, metric=0.95)
    else:
        service.end_trial("job", trial.trial_number, reason=end)  # type: ignore[arg-type]
    before = stored(service, trial.trial_number)
    with pytest.raises(TrialNotResumable, match="ended for good"):
        service.resume_trial(resume(trial))
    assert stored(service, trial.trial_number) == before  # nothing written


@pytest.mark.parametrize(
    "changes",
    [{"batch_size": 32}, {"hardware_key": "NVIDIA A100 x1"}, {"epochs": 6}, {"time_s": 51.0}],
)
def test_a_checkpoint_that_is_not_the_trials_is_refused(changes: dict[str, Any]) -> None:
    service, trial = started()
    if changes.get("batch_size") == trial.batch_size:
        changes = {"batch_size": 8}
    with pytest.raises(TrialNotResumable):
        service.resume_trial(resume(trial, **changes))
    assert stored(service, trial.trial_number).epochs == 5


def test_an_unknown_trial_is_refused() -> None:
    service, trial = started()
    with pytest.raises(UnknownTrial):
        service.resume_trial(resume(trial, trial_number=9))


def test_a_redelivered_resume_gets_its_first_reply_and_changes_nothing_again() -> None:
    service, trial = started()
    event = resume(trial)
    first = service.handle(event)
    service.report_epoch("job", 1, epoch=4, time_s=40.0, energy_j=400.0, metric=0.1)
    assert service.handle(event) == first
    assert stored(service, trial.trial_number).epochs == 4  # not rewound again


def test_another_tenant_cannot_resume_the_trial() -> None:
    service, trial = started()
    service.end_trial("job", trial.trial_number, reason=StopReason.INTERRUPTED)
    reply = service.handle(resume(trial), tenant="other")
    assert isinstance(reply, ErrorReply)
    assert reply.code == "unknown_job"
    assert stored(service, trial.trial_number).status is TrialStatus.INTERRUPTED


def test_a_resumed_interruption_is_not_an_outcome_of_its_own() -> None:
    """Three interruptions in a row fail a size; a trial interrupted and resumed three
    times is one running trial, never an interruption."""
    service, trial = started(epochs=1)
    for _ in range(3):
        service.end_trial("job", trial.trial_number, reason=StopReason.INTERRUPTED)
        service.resume_trial(resume(trial, epochs=1, time_s=10.0, energy_j=100.0))
    with service.store.transaction("job") as tx:
        statuses = [t.status for t in tx.trials()]
    assert statuses == [TrialStatus.RUNNING]
    lane = service.status("job").lanes[0]
    assert lane.trials == 1


def standing(*points: tuple[int, float]) -> tuple[TrialStanding, ...]:
    return tuple(TrialStanding(epochs=epochs, time_s=time_s) for epochs, time_s in points)


@pytest.mark.parametrize(
    "points",
    [((5, 50.0),), ((4, 40.0), (5, 50.0))],
    ids=["last-acknowledged", "next-reply-lost"],
)
def test_a_run_that_lost_the_service_takes_back_its_trial_where_it_left_it(
    points: tuple[tuple[int, float], ...],
) -> None:
    """A run back from an outage names where it left its trial: at the epoch
    acknowledged last, or the next (the service recorded it, the reply was lost)."""
    service, trial = started()
    acknowledged = points[0]
    reply = service.resume_trial(
        resume(trial, epochs=acknowledged[0], time_s=acknowledged[1],
               energy_j=10.0 * acknowledged[1], standing=standing(*points))
    )  # fmt: skip
    assert reply.trial_number == trial.trial_number
    assert stored(service, trial.trial_number).epochs == acknowledged[0]


@pytest.mark.parametrize(
    "points", [((5, 50.0),), ((3, 30.0), (4, 40.0))], ids=["same-epoch-other-time", "behind"]
)
def test_a_trial_another_run_resumed_meanwhile_stays_that_runs(
    points: tuple[tuple[int, float], ...],
) -> None:
    """A scheduler took the silent run for dead and resumed its trial from a
    checkpoint; the other run reported since.  The first run, back, is refused, and
    nothing of the trial changes."""
    service, trial = started()
    service.resume_trial(resume(trial, epochs=3, time_s=30.0, energy_j=300.0))
    for epoch in (4, 5):
        service.report_epoch(
            "job", 1, epoch=epoch, time_s=10.0 * epoch - 1, energy_j=100.0 * epoch, metric=0.1
        )
    before = stored(service, trial.trial_number)
    acknowledged = points[0]
    with pytest.raises(TrialNotResumable, match="another run resumed it"):
        service.resume_trial(
            resume(trial, epochs=acknowledged[0], time_s=acknowledged[1],
                   energy_j=10.0 * acknowledged[1], standing=standing(*points))
        )  # fmt: skip
    assert stored(service, trial.trial_number) == before


def test_a_resume_names_at_most_two_standings() -> None:
    with pytest.raises(ValueError, match="at most 2"):
        ResumeTrial(
            job_id="job", trial_number=1, hardware_key=KEY, batch_size=16, epochs=1,
            standing=standing((1, 1.0), (2, 2.0), (3, 3.0)),
        )  # fmt: skip
