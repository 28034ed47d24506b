"""A run left open in a long-lived process (a notebook) is ended when its thread starts
another run of the job (bso_client.open_runs), against the in-process service."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from bso.core.vocabulary import StopReason, TrialPhase, TrialStatus
from bso.wire.events import TrialAssigned
from bso_client.optimizer import BatchSizeOptimizer
from tests.test_optimizer import RecordingService, make


def started(service: RecordingService) -> BatchSizeOptimizer:
    """A notebook cell without ``with``: a trial, one epoch, then Ctrl-C caught by the kernel."""
    bso = make(service, heartbeat_interval_s=None)
    bso.get_batch_size()
    bso.on_train_begin()
    bso.on_evaluate(0.5)
    return bso


def test_a_cell_run_again_ends_the_trial_its_interrupted_run_left_open(
    caplog: pytest.LogCaptureFixture,
) -> None:
    service = RecordingService()
    first = started(service)  # the kernel keeps the process (and ``first``) alive
    with caplog.at_level(logging.WARNING, logger="bso_client"):
        again = make(service, heartbeat_interval_s=None)
    assert first.closed
    trial = service.trial(1)
    assert (trial.status, trial.stop_reason) == (TrialStatus.INTERRUPTED, StopReason.INTERRUPTED)
    (line,) = [r.getMessage() for r in caplog.records if "still open" in r.getMessage()]
    assert "bso trial 1 of job job (batch size 16) was still open in this process" in line
    assert "ending it as interrupted, not held against its batch size" in line
    # The job explores again: not a "concurrent" trial beside a forgotten one.
    assert again.get_batch_size() == 16
    assert service.trial(2).phase is TrialPhase.EXPLORATION
    again.close()
    assert service.trial(1).status is TrialStatus.INTERRUPTED  # ended once, not again


def test_a_run_closed_before_is_left_alone(caplog: pytest.LogCaptureFixture) -> None:
    service = RecordingService()
    first = started(service)
    first.close(KeyboardInterrupt())
    sent = len(service.calls)
    with caplog.at_level(logging.WARNING, logger="bso_client"):
        make(service, heartbeat_interval_s=None).close()
    assert "still open" not in caplog.text
    assert service.methods()[sent:] == ["register"]


def test_a_finished_run_never_closed_is_closed_without_a_word(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A loop over recurrences that never closes its optimizers (no ``with``, no
    ``close()``): each run converged, yet the next one's construction warned that its
    trial "was still open ... ending it as interrupted", for a trial the service had
    ended as converged (and left so).  A run whose training is over is only released."""
    service = RecordingService()
    first = started(service)
    first.on_evaluate(0.95)  # the target: bso ends the trial as converged
    assert first.training_finished
    with caplog.at_level(logging.WARNING, logger="bso_client"):
        make(service, heartbeat_interval_s=None).close()
    assert "still open" not in caplog.text
    assert first.closed
    assert service.trial(1).status is TrialStatus.CONVERGED


def test_another_threads_run_of_the_job_goes_on() -> None:
    """Two loops training one job at once (overlapping recurrences) never end each other."""
    service = RecordingService()
    runs: list[BatchSizeOptimizer] = []
    thread = threading.Thread(target=lambda: runs.append(started(service)))
    thread.start()
    thread.join()
    other = make(service, heartbeat_interval_s=None)
    assert not runs[0].closed
    assert service.trial(1).status is TrialStatus.RUNNING
    other.get_batch_size()
    assert service.trial(2).phase is TrialPhase.CONCURRENT
    other.close()
    runs[0].close()


def test_another_job_in_the_same_thread_goes_on() -> None:
    """A sweep: several jobs in one loop, each its own run."""
    service = RecordingService()
    first = started(service)
    other = make(
        service, spec=first.spec.model_copy(update={"job_id": "other"}), heartbeat_interval_s=None
    )
    assert not first.closed
    other.close()
    first.close()


def test_a_run_inside_its_with_block_is_never_taken_for_one_left_open(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two runs of one job side by side in one thread, each in its own ``with`` block
    (a sweep of two learning rates stepped by generators or asyncio tasks, or
    ``with A, B``): the second's construction used to end the first's trial as
    "still open ... never closed (a notebook cell ...?)", and the first run's next
    ``on_evaluate`` raised OperationOrderError, ending the training.  A block ends
    its run whatever happens, so a run inside one is nobody's leftover."""
    service = RecordingService()
    with make(service, heartbeat_interval_s=None) as first:
        first.get_batch_size()
        first.on_train_begin()
        first.on_evaluate(0.5)
        with (
            caplog.at_level(logging.WARNING, logger="bso_client"),
            make(service, heartbeat_interval_s=None) as second,
        ):
            second.get_batch_size()
            second.on_train_begin()
            first.on_evaluate(0.6)  # the first run goes on with its trial
            second.on_evaluate(0.6)
        assert not first.closed
    assert "still open" not in caplog.text
    assert service.trial(1).epochs == 2
    assert service.trial(2).phase is TrialPhase.CONCURRENT


def test_a_detached_run_left_open_is_named_as_such(caplog: pytest.LogCaptureFixture) -> None:
    service = RecordingService(fail_after={1})  # the registration's reply is lost: detached
    first = make(service, heartbeat_interval_s=None)
    first.get_batch_size()
    assert first.detached
    with caplog.at_level(logging.WARNING, logger="bso_client"):
        make(service, heartbeat_interval_s=None).close()
    assert first.closed
    assert "bso detached run of job job (batch size 16) was still open" in caplog.text


class CtrlCWhileWaiting(RecordingService):
    """The first ``next_trial`` reaches the service, then Ctrl-C lands while the client
    waits for its reply (a notebook cell stopped a moment after it started)."""

    def __init__(self) -> None:
        super().__init__()
        self.interrupt = True

    def next_trial(self, *args: Any, **kwargs: Any) -> TrialAssigned:
        reply = super().next_trial(*args, **kwargs)
        if self.interrupt:
            self.interrupt = False
            raise KeyboardInterrupt
        return reply


def test_a_trial_assigned_while_ctrl_c_stopped_the_wait_is_ended_with_the_run() -> None:
    """Else it stays running, unseen, until its lease runs out (two minutes), and being
    an exploration every run meanwhile gets the best size known (``concurrent``)."""
    service = CtrlCWhileWaiting()
    bso = make(service, heartbeat_interval_s=None)
    with pytest.raises(KeyboardInterrupt):
        bso.get_batch_size()
    assert bso.trial_number is None
    bso.close(KeyboardInterrupt())
    next_trials = [e for m, e, _ in service.calls if m == "next_trial"]
    assert len(next_trials) == 2
    assert next_trials[0] == next_trials[1]  # the same event: its first reply
    trial = service.trial(1)
    assert (trial.status, trial.stop_reason) == (TrialStatus.INTERRUPTED, StopReason.INTERRUPTED)
    again = make(service, heartbeat_interval_s=None)
    again.get_batch_size()
    assert service.trial(2).phase is TrialPhase.EXPLORATION
    again.close()
