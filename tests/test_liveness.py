"""Heartbeats, end reasons from exceptions, and the client's refusals (bso_client.liveness)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from bso.core.vocabulary import StopReason, TrialPhase, TrialStatus
from bso.errors import InvalidSpec, ServiceUnavailable
from bso.service import BsoService
from bso.spec import JobSpec
from bso.storage.memory import MemoryStore
from bso.wire.events import MAX_LEASE_S, MIN_LEASE_S, HeartbeatAck, TrialAssigned
from bso_client.energy.time_only import TimeOnlyMonitor
from bso_client.errors import UnexpectedBatchSize
from bso_client.liveness import (
    Heartbeater,
    TrialLease,
    end_reason_for,
    is_accelerator_out_of_memory,
)
from bso_client.optimizer import BatchSizeOptimizer

SPEC = JobSpec(
    job_id="job",
    batch_sizes=[16, 32, 64],
    default_batch_size=32,
    target_metric=0.9,
    max_epochs=5,
    mab_seed=1,
)


def ack(status: TrialStatus = TrialStatus.RUNNING) -> HeartbeatAck:
    return HeartbeatAck(event_id="e", job_id="job", trial_number=1, status=status, reason=None)


def wait_for(condition: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


class OomError(RuntimeError):
    pass


OomError.__name__ = "OutOfMemoryError"


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (None, StopReason.ABANDONED),
        (ValueError("x"), StopReason.ABANDONED),
        (MemoryError(), StopReason.ABANDONED),  # host memory: not the accelerator's limit
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), StopReason.OUT_OF_MEMORY),
        (OomError("anything"), StopReason.OUT_OF_MEMORY),
        (KeyboardInterrupt(), StopReason.INTERRUPTED),
    ],
)
def test_end_reason_for(exc: BaseException | None, reason: StopReason) -> None:
    assert end_reason_for(exc) is reason
    if exc is not None:
        assert is_accelerator_out_of_memory(exc) is (reason is StopReason.OUT_OF_MEMORY)


def test_heartbeater_beats_survives_failures_and_stops_when_the_trial_ended() -> None:
    calls: list[int] = []
    script = [
        ack(),
        ServiceUnavailable("down"),
        RuntimeError("bug"),
        ack(),
        ack(TrialStatus.INTERRUPTED),
    ]

    def send() -> HeartbeatAck:
        calls.append(1)
        result = script[len(calls) - 1]
        if isinstance(result, Exception):
            raise result
        return result

    beater = Heartbeater(send, 0.01, "trial 1")
    beater.start()
    wait_for(lambda: not beater.running)
    assert len(calls) == len(script)  # it went on after both failures, stopped on the end


def test_heartbeater_stop() -> None:
    sent = threading.Event()

    def send() -> HeartbeatAck:
        sent.set()
        return ack()

    beater = Heartbeater(send, 0.01, "trial 1")
    beater.start()
    assert sent.wait(5)
    beater.stop()
    wait_for(lambda: not beater.running)


@contextmanager
def a_report_in_flight_as_a_heartbeat_hears_the_trial_ended(lease: TrialLease) -> Iterator[None]:
    """The block runs while the run's report is on its way (:meth:`TrialLease.own_call`)
    and a heartbeat has been answered that the trial ended (max_epochs)."""
    answered = threading.Event()

    def send() -> HeartbeatAck:
        answered.set()
        return HeartbeatAck(
            event_id="e",
            job_id="job",
            trial_number=1,
            status=TrialStatus.FAILED,
            reason=StopReason.MAX_EPOCHS,
        )

    with lease.own_call():
        lease.start_heartbeats(send, "trial 1 of job job")
        assert answered.wait(5)
        time.sleep(0.05)  # the heartbeat's answer is in: its thread waits for the report
        yield


def test_a_heartbeat_answered_with_the_verdict_of_the_runs_own_report_warns_of_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The heartbeat queued behind the run's last report is answered with that
    # report's verdict while the run still waits for the report's reply.
    lease = TrialLease(0.01, 100)
    with caplog.at_level(logging.DEBUG, "bso_client.liveness"):
        with a_report_in_flight_as_a_heartbeat_hears_the_trial_ended(lease):
            lease.stop_heartbeats()  # the report's reply: stopped (max_epochs)
        wait_for(lambda: caplog.records)
    assert [r.levelname for r in caplog.records] == ["DEBUG"], caplog.text
    assert "answered after the run ended it (failed, max_epochs)" in caplog.text


def test_a_run_that_detached_instead_of_hearing_the_end_is_told(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # An operator's reset ended the trial while the report was on its way, and the
    # report went unanswered: the run detaches, without knowing how its trial ended.
    lease = TrialLease(0.01, 100)
    with caplog.at_level(logging.WARNING, "bso_client.liveness"):
        with a_report_in_flight_as_a_heartbeat_hears_the_trial_ended(lease):
            lease.stop_heartbeats(run_knows_the_end=False)
        wait_for(lambda: caplog.records)
    (warning,) = caplog.records
    assert "meanwhile (failed, max_epochs): its results will not be used" in warning.message


def test_a_trial_ended_by_someone_else_is_told_once_the_runs_call_is_handled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lease = TrialLease(0.01, 100)
    with caplog.at_level(logging.WARNING, "bso_client.liveness"):
        with a_report_in_flight_as_a_heartbeat_hears_the_trial_ended(lease):
            assert caplog.records == []  # judged once the report (answered "go on") is handled
        wait_for(lambda: caplog.records)
    (warning,) = caplog.records
    assert "bso ended trial 1 of job job meanwhile (failed, max_epochs)" in warning.message
    lease.stop_heartbeats()


def test_trial_lease_checks_its_settings_and_keeps_the_service_minimum() -> None:
    assert TrialLease(None, 3).lease_s is None
    assert TrialLease(30.0, 3).lease_s == 90.0
    assert TrialLease(0.001, 1).lease_s == MIN_LEASE_S
    for interval_s in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="heartbeat_interval_s must be > 0"):
            TrialLease(interval_s, 3)
    with pytest.raises(ValueError, match="heartbeat_misses must be >= 1"):
        TrialLease(30.0, 0)
    assert TrialLease(MAX_LEASE_S / 4, 4).lease_s == MAX_LEASE_S


def test_a_lease_longer_than_the_service_grants_is_refused_when_the_optimizer_is_built() -> None:
    """A heartbeat a day with 8 misses allowed (for epochs of days): 8 days, over the
    service's 7.  It used to be refused only by get_batch_size, as pydantic's
    ValidationError of NextTrial.lease_s, which ended the run."""
    service = CountingService()
    with pytest.raises(ValueError, match=r"heartbeat_interval_s \* heartbeat_misses is 691200 s"):
        BatchSizeOptimizer(
            SPEC,
            service=service,
            monitor=TimeOnlyMonitor(),
            environ={},
            heartbeat_interval_s=86400.0,
            heartbeat_misses=8,
        )
    with service.store.read("job") as tx:
        assert tx.get_job() is None  # refused before anything was registered


class CountingService(BsoService):
    def __init__(self) -> None:
        super().__init__(MemoryStore())
        self.heartbeats = 0

    def heartbeat(
        self, job_id: str, trial_number: int, *, event_id: str | None = None
    ) -> HeartbeatAck:
        self.heartbeats += 1
        return super().heartbeat(job_id, trial_number, event_id=event_id)


def test_the_optimizer_leases_its_trial_and_sends_heartbeats_while_training() -> None:
    service = CountingService()
    bso = BatchSizeOptimizer(
        SPEC,
        service=service,
        monitor=TimeOnlyMonitor(),
        environ={},
        heartbeat_interval_s=0.02,
        heartbeat_misses=1000,
    )
    bso.get_batch_size()
    with service.store.transaction("job") as tx:
        trial = tx.get_trial(1)
    assert trial is not None
    assert trial.lease_s == 20.0
    wait_for(lambda: service.heartbeats >= 3)
    bso.close()
    after_close = service.heartbeats
    time.sleep(0.1)
    assert service.heartbeats <= after_close + 1  # at most one was in flight


def test_no_heartbeats_means_no_lease() -> None:
    service = CountingService()
    with BatchSizeOptimizer(
        SPEC, service=service, monitor=TimeOnlyMonitor(), environ={}, heartbeat_interval_s=None
    ) as bso:
        bso.get_batch_size()
        with service.store.transaction("job") as tx:
            trial = tx.get_trial(1)
        assert trial is not None
        assert trial.lease_s is None


def test_energy_only_without_an_energy_source_is_refused_when_asked_to_raise() -> None:
    with pytest.raises(InvalidSpec, match="eta_knob=1"):
        BatchSizeOptimizer(
            SPEC.model_copy(update={"eta_knob": 1.0}),
            service=BsoService(MemoryStore()),
            monitor=TimeOnlyMonitor(),
            environ={},
            on_unavailable="raise",
        )


class WrongSizeService(BsoService):
    def next_trial(self, job_id: str, hardware: Any = None, **options: Any) -> TrialAssigned:
        assigned = super().next_trial(job_id, hardware, **options)
        return assigned.model_copy(update={"batch_size": -1})


def test_a_size_outside_the_candidates_is_refused() -> None:
    service = WrongSizeService(MemoryStore())
    bso = BatchSizeOptimizer(SPEC, service=service, monitor=TimeOnlyMonitor(), environ={})
    with pytest.raises(UnexpectedBatchSize, match="-1"):
        bso.get_batch_size()
    with service.store.transaction("job") as tx:
        trial = tx.get_trial(1)
    assert trial is not None
    assert trial.status is TrialStatus.INTERRUPTED
    bso.close()


def test_one_status_line_per_recurrence(caplog: pytest.LogCaptureFixture) -> None:
    service = BsoService(MemoryStore())
    caplog.set_level(logging.INFO, logger="bso_client.optimizer")
    with BatchSizeOptimizer(SPEC, service=service, monitor=TimeOnlyMonitor(), environ={}) as bso:
        bso.get_batch_size()
        bso.on_train_begin()
        assert bso.on_evaluate(0.95).converged
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("bso-status ")]
    assert len(lines) == 1
    (line,) = lines
    assert "job=job" in line
    assert "recommended=32" in line
    assert "sizes=32:converged=1" in line
    assert service.status("job").lanes[0].trials == 1
    assert TrialPhase.EXPLORATION.value not in line  # fields, not the trial's phase
