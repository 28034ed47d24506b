"""A run resumed from a checkpoint, in one process against the in-process service
(client/bso_client/resume.py)."""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import pytest

from bso.core.vocabulary import StopReason, TrialStatus
from bso.errors import ServiceUnavailable, Unauthorized
from bso.service import BsoService
from bso.spec import Hardware, JobSpec
from bso.storage.base import TrialRecord
from bso.storage.memory import MemoryStore
from bso.wire.connection import BrokerUnreachable
from bso.wire.events import LaneSizesSet, ResumeTrial, SetLaneSizes, TrialAssigned
from bso_client.detached_journal import pending_journals
from bso_client.energy.time_only import TimeOnlyMonitor
from bso_client.errors import OperationOrderError
from bso_client.open_runs import release
from bso_client.optimizer import BatchSizeOptimizer
from tests.test_resumes import SPEC


def make(service: Any, **options: Any) -> BatchSizeOptimizer:
    options.setdefault("monitor", TimeOnlyMonitor())
    return BatchSizeOptimizer(SPEC, service=service, environ={}, **options)


def resumed(
    failing: type[BsoService],
) -> tuple[MemoryStore, dict[str, Any], BatchSizeOptimizer]:
    """A run checkpointed on a working service, started again from its checkpoint on
    ``failing`` (the same store)."""
    store = MemoryStore()
    checkpoint = run_until_checkpoint(BsoService(store))
    return store, checkpoint, make(failing(store), resume=checkpoint["bso"])


def trials(service: BsoService) -> list[TrialRecord]:
    with service.store.transaction("job") as tx:
        return list(tx.trials())


def run_until_checkpoint(service: BsoService, epochs: int = 3) -> dict[str, Any]:
    """A run that saves its checkpoint after ``epochs`` epochs, then dies (SIGKILL:
    nothing ends its trial, which stays running)."""
    bso = make(service)
    bso.get_batch_size()
    bso.on_train_begin()
    for _ in range(epochs):
        bso.on_evaluate(0.1)
    checkpoint = json.loads(json.dumps({"bso": bso.state_dict()}))  # as saved to disk
    bso.on_evaluate(0.2)  # lost work: run after the checkpoint, before the kill
    bso._lease.stop_heartbeats()  # the process is gone: nothing of it runs on
    bso._close_at_exit.cancel()
    release(bso)
    return checkpoint


def test_a_resumed_run_goes_on_with_the_checkpoints_trial() -> None:
    service = BsoService(MemoryStore())
    checkpoint = run_until_checkpoint(service)
    first = trials(service)[0]
    assert checkpoint["bso"]["trial_number"] == first.trial_number
    assert checkpoint["bso"]["epochs"] == 3
    with make(service, resume=checkpoint["bso"]) as bso:
        assert bso.get_batch_size() == first.batch_size
        assert bso.trial_number == first.trial_number
        bso.on_train_begin()
        decision = bso.on_evaluate(0.95)
    assert decision.epoch == 4  # numbered on from the checkpoint's
    assert decision.converged
    [trial] = trials(service)  # one trial holds the whole run
    assert trial.status is TrialStatus.CONVERGED
    assert trial.epochs == 4
    assert trial.time_s >= checkpoint["bso"]["time_s"]  # cumulative: checkpoint + this run


def test_an_interrupted_trial_is_resumed_and_a_converged_one_is_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    service = BsoService(MemoryStore())
    checkpoint = run_until_checkpoint(service)
    service.end_trial("job", 1, reason=StopReason.INTERRUPTED)
    with make(service, resume=checkpoint["bso"]) as bso:
        size = bso.get_batch_size()
        bso.on_train_begin()
        bso.on_evaluate(0.95)
    # Resuming the converged trial again: refused; the run trains on, untracked.
    with (
        caplog.at_level(logging.WARNING, "bso_client"),
        make(service, resume=checkpoint["bso"]) as bso,
    ):
        assert bso.get_batch_size() == size
        bso.on_train_begin()
        for _ in range(6):
            decision = bso.on_evaluate(0.1)
        assert decision.epoch == 9
        assert bso.on_evaluate(0.1).stop  # max_epochs, counted over the whole run
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "without bso" in warnings[0].getMessage()
    assert "ended for good" in warnings[0].getMessage()
    assert "start it without the last run's checkpoint" in warnings[0].getMessage()
    assert [t.status for t in trials(service)] == [TrialStatus.CONVERGED]  # nothing added


class Unreachable(BsoService):
    def resume_trial(self, event: ResumeTrial) -> TrialAssigned:
        raise ServiceUnavailable("bso service at test did not answer")


def test_an_unreachable_service_at_resume_trains_on_at_the_checkpoints_size(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store, checkpoint, run = resumed(Unreachable)
    with caplog.at_level(logging.WARNING, "bso_client"), run as bso:
        assert bso.get_batch_size() == checkpoint["bso"]["batch_size"]
        bso.on_train_begin()
        assert bso.on_evaluate(0.95).converged
    assert [r.levelno for r in caplog.records if r.levelno >= logging.WARNING] == [logging.WARNING]
    [trial] = trials(BsoService(store))
    assert trial.epochs == 4  # untouched: the lease ends it as interrupted


def test_with_on_unavailable_raise_an_unreachable_service_is_raised() -> None:
    store = MemoryStore()
    checkpoint = run_until_checkpoint(BsoService(store))
    bso = make(Unreachable(store), resume=checkpoint["bso"], on_unavailable="raise")
    with pytest.raises(ServiceUnavailable):
        bso.get_batch_size()
    bso.close()


def test_a_checkpoint_of_another_job_or_no_state_is_refused_at_construction() -> None:
    service = BsoService(MemoryStore())
    checkpoint = run_until_checkpoint(service)
    with pytest.raises(ValueError, match="not 'job'"):
        make(service, resume=checkpoint["bso"] | {"job_id": "other"})
    with pytest.raises(ValueError, match="state_dict"):
        make(service, resume={"epoch": 3})


def test_state_dict_comes_after_get_batch_size() -> None:
    bso = make(BsoService(MemoryStore()))
    with pytest.raises(OperationOrderError):
        bso.state_dict()
    bso.close()


class LostMidRun(BsoService):
    """The service goes away after the resume: every epoch report fails."""

    def report_epoch(self, *args: Any, **kwargs: Any) -> Any:
        raise ServiceUnavailable("bso service at test did not answer")


def test_a_resumed_run_that_loses_the_service_goes_on_detached_without_a_journal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    *_, run = resumed(LostMidRun)
    with caplog.at_level(logging.WARNING, "bso_client"), run as bso:
        bso.get_batch_size()
        bso.on_train_begin()
        decision = bso.on_evaluate(0.95)
        assert bso.detached
    assert decision.converged  # the local verdict: the target
    assert pending_journals("job") == []  # a journal would lack epochs 1 to 3
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "resumed run's journal would lack the epochs before its checkpoint" in warning


def test_the_meter_goes_on_from_the_checkpoints_totals() -> None:
    service = BsoService(MemoryStore())
    checkpoint = run_until_checkpoint(service)
    bso = make(service, resume=checkpoint["bso"])
    bso.get_batch_size()
    bso.on_train_begin()
    bso.on_evaluate(0.1)
    state = bso.state_dict()
    bso.close()
    assert state["epochs"] == checkpoint["bso"]["epochs"] + 1
    assert state["time_s"] >= checkpoint["bso"]["time_s"]
    assert state["trial_number"] == checkpoint["bso"]["trial_number"]


def test_two_runs_resumed_from_one_checkpoint_at_once_both_train_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two processes restarted from the same checkpoint: the first to report keeps the
    trial; the other's report is out of order, and it trains on without bso instead of
    raising (and ends nothing: the trial stays the first run's)."""
    service = BsoService(MemoryStore())
    checkpoint = run_until_checkpoint(service)
    first = make(service, resume=checkpoint["bso"])
    other: list[BatchSizeOptimizer] = []
    thread = threading.Thread(target=lambda: other.append(make(service, resume=checkpoint["bso"])))
    thread.start()
    thread.join()
    [second] = other
    with caplog.at_level(logging.WARNING, "bso_client"):
        for run in (first, second):
            run.get_batch_size()
            run.on_train_begin()
        assert not first.on_evaluate(0.1).stop  # epoch 4: the trial's
        assert not second.on_evaluate(0.1).stop  # epoch 4 again: no longer its trial
        assert second.detached
        assert second.on_evaluate(0.95).converged  # its own verdict, untracked
        second.close()
        assert first.on_evaluate(0.95).converged  # epoch 5: the trial goes on
        first.close()
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "no longer takes this run's reports" in warning
    [trial] = trials(service)
    assert (trial.status, trial.epochs) == (TrialStatus.CONVERGED, 5)
    assert pending_journals("job") == []


@pytest.mark.parametrize(
    "forged",
    [
        {"epochs": 10**15},
        {"time_s": 1e300},
        {"energy_j": 1e300},
        {"trial_number": 0},
        {"trial_number": 10**30},
        {"batch_size": 10**12},
        {"hardware_key": "x" * 5000},
        {"hardware_key": "a\x00b"},
    ],
)
def test_a_state_the_service_could_not_take_is_refused_at_construction(
    forged: dict[str, Any],
) -> None:
    """Not a pydantic ValidationError out of get_batch_size(), after the script set up."""
    service = BsoService(MemoryStore())
    checkpoint = run_until_checkpoint(service)
    with pytest.raises(ValueError, match="resume= takes the dict"):
        make(service, resume=checkpoint["bso"] | forged)


def test_a_resumed_run_logs_its_trial_as_resumed_not_as_a_new_lanes_first_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    service = BsoService(MemoryStore())
    checkpoint = run_until_checkpoint(service)
    with (
        caplog.at_level(logging.INFO, "bso_client"),
        make(service, resume=checkpoint["bso"]) as bso,
    ):
        bso.get_batch_size()
    lines = [r.getMessage() for r in caplog.records]
    assert not [line for line in lines if "new lane" in line], lines
    assert [line for line in lines if "resumed from its checkpoint after epoch 3" in line], lines


class AnotherGpu(TimeOnlyMonitor):
    """Times like the time-only monitor, on a lane of its own."""

    @property
    def hardware(self) -> Hardware:
        return Hardware(gpu_model="another-gpu", gpu_count=1, max_power_w=300.0)


def test_a_run_resumed_on_other_hardware_leaves_the_checkpoints_trial_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Preempted on one GPU model, restarted from the checkpoint on another: the
    trial is the first lane's, and this run's epochs (another GPU's seconds and
    joules) would be charged to that lane's batch size.  The run trains on without
    bso, and the first lane's trial is left to its lease."""
    service = BsoService(MemoryStore())
    checkpoint = run_until_checkpoint(service)
    with (
        caplog.at_level(logging.WARNING, "bso_client"),
        make(service, resume=checkpoint["bso"], monitor=AnotherGpu()) as bso,
    ):
        assert bso.get_batch_size() == checkpoint["bso"]["batch_size"]
        assert bso.trial_number is None
        bso.on_train_begin()
        assert bso.on_evaluate(0.95).converged  # its own verdict, untracked
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "trained on cpu-time-only x1, this run on another-gpu x1" in warning
    [trial] = trials(service)
    assert (trial.status, trial.epochs) == (TrialStatus.RUNNING, 4)  # untouched


class BrokerDown(BsoService):
    """The transport's error for a broker that refused connections all through the
    call's share of the bound: its outage window (cut to 4 s) wraps the broker's own."""

    def resume_trial(self, event: ResumeTrial) -> TrialAssigned:
        refused = BrokerUnreachable("cannot reach the bso broker at test: Connection refused")
        raise ServiceUnavailable(
            "bso broker at test unreachable: gave up after waiting 4.0 s (outage_window_s="
            "3.98, set by BSO_OUTAGE_WINDOW_S or ServiceClient.connect(outage_window_s=...))"
        ) from refused


class WrongKey(BsoService):
    def resume_trial(self, event: ResumeTrial) -> TrialAssigned:
        raise Unauthorized("the API key is not accepted")


def test_a_resume_the_service_fails_is_said_as_a_detached_runs_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The line names the bound the user set (unavailable_bound_s, 5 s), the broker's
    own error and the fix, not the transport's cut of the bound as a setting of
    BSO_OUTAGE_WINDOW_S; a refused key is an ERROR naming BSO_API_KEY, as for a run
    that is not resumed."""
    _, checkpoint, run = resumed(BrokerDown)
    with caplog.at_level(logging.WARNING, "bso_client"), run as bso:
        bso.get_batch_size()
    [down] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert down.levelno == logging.WARNING
    message = down.getMessage()
    assert "unavailable within 5 s (unavailable_bound_s): cannot reach the bso broker" in message
    assert "outage_window_s" not in message
    assert "fix: check the URL and port" in message
    assert f"checkpoint's batch size {checkpoint['bso']['batch_size']} without bso" in message
    caplog.clear()
    *_, run = resumed(WrongKey)
    with caplog.at_level(logging.WARNING, "bso_client"), run as bso:
        bso.get_batch_size()
    [refused] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert refused.levelno == logging.ERROR
    assert "refused this client (the API key is not accepted)" in refused.getMessage()
    assert "fix: check BSO_API_KEY" in refused.getMessage()


def test_a_run_resumed_at_a_size_taken_off_the_lane_trains_on_without_bso(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``bso jobs set-sizes`` took the checkpoint's size off the lane, and the job lists
    the new sizes: the resumed run trains on at its checkpoint's size without bso, with
    one WARNING saying why, instead of raising UnexpectedBatchSize ("a bug in the
    service") out of get_batch_size() and ending the run before it trained."""
    service = BsoService(MemoryStore())
    checkpoint = run_until_checkpoint(service)
    size = checkpoint["bso"]["batch_size"]
    kept = [b for b in SPEC.batch_sizes if b != size]
    lane = checkpoint["bso"]["hardware_key"]
    event = SetLaneSizes(job_id="job", lane=lane, batch_sizes=kept, default_batch_size=kept[-1])
    reply = service.handle(event)
    assert isinstance(reply, LaneSizesSet), reply
    spec = SPEC.model_copy(update={"batch_sizes": kept, "default_batch_size": kept[-1]})
    with (
        caplog.at_level(logging.WARNING, "bso_client"),
        BatchSizeOptimizer(
            spec, service=service, environ={}, monitor=TimeOnlyMonitor(), resume=checkpoint["bso"]
        ) as bso,
    ):
        assert bso.get_batch_size() == size
        assert bso.trial_number is None
        bso.on_train_begin()
        assert bso.on_evaluate(0.95).converged  # its own verdict, untracked
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert f"its batch size {size} is not one of the lane's batch_sizes now" in warning


def test_a_run_of_a_prefixed_job_resumed_in_the_new_job_its_registration_made_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A spec with job_id_prefix registers a new job every time, so its resumed run is
    in another job than its checkpoint: it trains on without bso, and the line says
    that (it said the trial was reset or deleted, which nobody did) and the fix."""
    prefixed = JobSpec.model_validate(
        {**SPEC.model_dump(exclude={"job_id"}), "job_id": None, "job_id_prefix": "nightly"}
    )
    service = BsoService(MemoryStore())
    bso = BatchSizeOptimizer(prefixed, service=service, environ={}, monitor=TimeOnlyMonitor())
    bso.get_batch_size()
    bso.on_train_begin()
    bso.on_evaluate(0.1)
    checkpoint = json.loads(json.dumps(bso.state_dict()))
    bso.close()
    caplog.clear()
    with (
        caplog.at_level(logging.WARNING, "bso_client"),
        BatchSizeOptimizer(
            prefixed, service=service, environ={}, monitor=TimeOnlyMonitor(), resume=checkpoint
        ) as again,
    ):
        assert again.get_batch_size() == checkpoint["batch_size"]
        assert again.trial_number is None
        assert again.job_id != checkpoint["job_id"]
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert f"resume trial 1 of job {checkpoint['job_id']} from the checkpoint" in warning
    assert f"the checkpoint's run was of job {checkpoint['job_id']}" in warning
    assert "give the job a fixed job_id" in warning
    assert "reset or deleted" not in warning
