"""A detached run goes back to the service once it is back (bso_client/reattachment.py).

In process: the real service behind the switch of tests/test_fail_open.py, which
fails every call as an unreachable service does while it is off.  The look at the
service is made due at every epoch (``look_interval_s`` 0); the live version,
with ``bso up`` stopped and started again mid-run, is in
tests/acceptance/test_faults.py.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from bso.core.vocabulary import StopReason, TrialStatus
from bso.errors import ServiceUnavailable
from bso.storage.base import TrialRecord
from bso_client import reattachment
from bso_client.detached_journal import DetachedJournal, job_folder
from bso_client.errors import TrainFailError
from bso_client.optimizer import BatchSizeOptimizer
from tests.test_fail_open import SPEC, Switch, make, warnings_of
from tests.test_resume import make as make_resumable
from tests.test_resume import run_until_checkpoint

LOGGER = "bso_client.optimizer"


def journals() -> int:
    """The job's journals on this machine, a running writer's included."""
    return len(list(job_folder("job").glob("*.json")))


@pytest.fixture(autouse=True)
def look_at_every_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reattachment, "LOOK_COST_SHARE", float("inf"))


def detach_at_epoch_2(bso: BatchSizeOptimizer, switch: Switch) -> None:
    """Epoch 1 reported; the service lost before epoch 2's report: detached, epoch 2
    journaled."""
    bso.get_batch_size()
    bso.on_train_begin()
    bso.on_evaluate(0.2)
    switch.up = False
    bso.on_evaluate(0.3)
    assert bso.detached


def checkpoint_at(bso: BatchSizeOptimizer, trial: TrialRecord) -> dict[str, Any]:
    """The checkpoint a run of ``bso`` saved where ``trial`` stands: what a scheduler
    that took the run for dead starts the job again from."""
    figures = {"epochs": trial.epochs, "time_s": trial.time_s, "energy_j": trial.energy_j}
    return {**bso.state_dict(), **figures}


def converged_first_run(switch: Switch) -> None:
    """Trial 1: the default size converged at its first epoch, in microseconds."""
    with make(switch) as first:
        first.get_batch_size()
        first.on_train_begin()
        assert first.on_evaluate(0.95).converged


def test_a_run_detached_mid_trial_goes_on_attached_once_the_service_is_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Lost at epoch 2, still down at epoch 3, back at epoch 4: the trial holds every
    epoch, reported one by one (none journaled is left), and bso judges the rest."""
    switch = Switch()
    with caplog.at_level(logging.INFO, LOGGER), make(switch) as bso:
        detach_at_epoch_2(bso, switch)
        bso.on_evaluate(0.4)  # a look: still down
        assert bso.detached
        assert journals() == 1  # epochs 1-3
        switch.up = True
        decision = bso.on_evaluate(0.5)  # a look: back; 2 and 3 sent, then 4 as any
        assert not bso.detached
        assert (decision.epoch, decision.stop) == (4, False)
        assert bso.on_evaluate(0.95).converged  # bso's own verdict, attached
    (trial,) = switch.trials()
    assert (trial.status, trial.stop_reason, trial.epochs, trial.detached) == (
        TrialStatus.CONVERGED,
        StopReason.TARGET_REACHED,
        5,
        False,
    )
    assert journals() == 0  # sent as epoch reports: nothing left to deliver
    [warning] = warnings_of(caplog)  # the detach; going back is INFO
    assert "training goes on detached" in warning.getMessage()
    assert "goes on attached (2 epoch(s) trained detached sent)" in caplog.text


class LostReply(Switch):
    """Applies the next epoch report, then fails as if its reply were lost, and stays
    off: the service has the epoch the run thinks it does not."""

    def __init__(self) -> None:
        super().__init__()
        self.lose_next_report = False

    def __getattr__(self, name: str) -> Any:
        call = super().__getattr__(name)

        def maybe_lost(*args: Any, **kwargs: Any) -> Any:
            result = call(*args, **kwargs)
            if name == "report_epoch" and self.lose_next_report:
                self.lose_next_report, self.up = False, False
                raise ServiceUnavailable("bso service at test: no reply within 5 s (test)")
            return result

        return maybe_lost


def test_a_report_whose_reply_was_lost_is_counted_once() -> None:
    """Epoch 2's report reached the service, its reply did not: the run detached with
    epoch 2 journaled.  Going back rewinds the trial to epoch 1, the run's last
    answered epoch, and sends 2 again: the trial's time is the run's, not more."""
    switch = LostReply()
    with make(switch) as bso:
        bso.get_batch_size()
        bso.on_train_begin()
        bso.on_evaluate(0.2)
        switch.lose_next_report = True
        bso.on_evaluate(0.3)
        assert bso.detached
        assert switch.trials()[0].epochs == 2  # the service took epoch 2
        switch.up = True
        bso.on_evaluate(0.4)
        assert not bso.detached
        time_s = bso.state_dict()["time_s"]
    (trial,) = switch.trials()
    assert trial.epochs == 3
    assert trial.time_s == pytest.approx(time_s)


def test_a_trial_that_ended_meanwhile_keeps_the_run_detached_with_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The trial ended for good while the run was detached (here an out-of-memory end
    recorded for it by another process): the service refuses to take it back; the
    run goes on detached, says so once, and looks no more."""
    switch = Switch()
    with caplog.at_level(logging.INFO, LOGGER), make(switch) as bso:
        detach_at_epoch_2(bso, switch)
        switch.service.end_trial("job", 1, reason=StopReason.OUT_OF_MEMORY)
        switch.up = True
        bso.on_evaluate(0.4)
        assert bso.detached
        tried = len(switch.calls)
        bso.on_evaluate(0.5)
        assert len(switch.calls) == tried  # given up: no more looks
    assert caplog.text.count("is back, but trial 1 of job job goes on detached") == 1


def test_a_journaled_epoch_bso_would_have_stopped_stops_the_run_now(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The default size converged at once (trial 1); the next run explores another
    size, loses the service and trains detached, its epochs far dearer than the bound
    (``beta_knob`` times the best cost).  Back, the first journaled epoch past the
    bound ends the trial where bso would have, and the run is stopped now
    (TrainFailError) instead of training to max_epochs.  The trial is charged every
    epoch the run trained: the ones after the stop cost what they cost."""
    caplog.set_level(logging.INFO, LOGGER)
    switch = Switch()
    converged_first_run(switch)
    epochs = 0

    def second_run() -> None:
        nonlocal epochs
        with make(switch) as bso:
            bso.get_batch_size()
            bso.on_train_begin()
            assert bso.trial_number == 2
            switch.up = False
            while epochs < SPEC.max_epochs:
                time.sleep(0.05)  # dear: the first run's epoch took microseconds
                epochs += 1
                bso.on_evaluate(0.1)
                switch.up = bso.detached  # back at the next epoch's end

    with pytest.raises(TrainFailError):
        second_run()
    trial = switch.trials()[-1]
    assert trial.status is TrialStatus.FAILED
    assert trial.stop_reason in (StopReason.COST_BOUND, StopReason.PROJECTED_COST)
    assert epochs < SPEC.max_epochs  # stopped late, not never
    assert "it would have been stopped at epoch 1, and is stopped now" in caplog.text
    assert trial.epochs == epochs  # charged up to where it stopped, not epoch 1


def test_a_run_that_reaches_its_target_at_the_reattaching_epoch_is_not_failed() -> None:
    """Detached at epoch 1 (a dear exploration bso would have stopped), the service is
    back at epoch 2, and epoch 2 reaches the target.  Going back used to replay epoch
    1, get bso's stop and return it instead of judging epoch 2: TrainFailError
    ("relaunch the job") for a model that had just converged (review-today, helper).
    An epoch that reaches the target ends the run detached; its journal is delivered
    at exit, converged."""
    switch = Switch()
    converged_first_run(switch)
    with make(switch) as bso:
        bso.get_batch_size()
        bso.on_train_begin()
        assert bso.trial_number == 2
        switch.up = False
        time.sleep(0.05)
        bso.on_evaluate(0.1)  # the report fails: detached, epoch 1 journaled
        assert bso.detached
        switch.up = True
        time.sleep(0.05)
        decision = bso.on_evaluate(0.95)  # the target reached, as the service comes back
        assert decision.converged
    trial = switch.trials()[-1]
    assert trial.status is TrialStatus.CONVERGED


def test_a_journal_that_cannot_be_removed_does_not_end_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cache folder went read-only while the run was detached; going back, the
    journal's removal raised OSError out of on_evaluate and ended the training run
    (review-today, helper).  The run goes on attached."""

    def refuse(self: DetachedJournal) -> None:
        raise OSError(30, "Read-only file system", str(self.path))

    switch = Switch()
    with make(switch) as bso:
        detach_at_epoch_2(bso, switch)
        switch.up = True
        monkeypatch.setattr(DetachedJournal, "remove", refuse)
        bso.on_evaluate(0.4)  # must not raise
        assert not bso.detached


def test_a_trial_another_run_resumed_meanwhile_stays_its_and_the_journal_is_a_run_of_its_own(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """While this run was cut off, a scheduler took it for dead and started the job
    again from its epoch-1 checkpoint: that run resumed trial 1 and reported epoch 2.
    Back, this run does not take the trial from it (its reports would have undone the
    other's); it trains on detached, and its journal is a trial of its own."""
    switch = Switch()
    with caplog.at_level(logging.INFO, LOGGER), make(switch) as bso:
        detach_at_epoch_2(bso, switch)
        checkpoint = checkpoint_at(bso, switch.trials()[0])  # epoch 1
        switch.up = True
        with make(switch, resume=checkpoint) as other:
            assert other.get_batch_size() == bso.batch_size
            other.on_train_begin()
            other.on_evaluate(0.25)  # epoch 2, at the other run's time
            taken = switch.trials()[0]
            bso.on_evaluate(0.4)  # a look: the service is back, the trial is the other's
            assert bso.detached
            assert switch.trials()[0] == taken
    trials = switch.trials()
    assert (trials[0].epochs, trials[0].time_s) == (taken.epochs, taken.time_s)
    assert [(t.trial_number, t.detached, t.epochs) for t in trials[1:]] == [(2, True, 3)]
    assert "another run resumed it meanwhile" in caplog.text


class SlowReports(Switch):
    """Every epoch report takes ``report_s`` to answer."""

    def __init__(self, report_s: float) -> None:
        super().__init__()
        self.report_s = report_s

    def __getattr__(self, name: str) -> Any:
        call = super().__getattr__(name)
        if name != "report_epoch":
            return call

        def slow(*args: Any, **kwargs: Any) -> Any:
            time.sleep(self.report_s)
            return call(*args, **kwargs)

        return slow


def test_a_long_journal_goes_back_a_bound_at_a_time(caplog: pytest.LogCaptureFixture) -> None:
    """Eighteen epochs journaled and reports of 0.1 s, with a bound of 0.25 s: a look
    sends what fits in one bound (the epoch's end is not held up for the whole
    journal) and the next goes on from there, until the run is attached again with
    every epoch counted once."""
    spec = SPEC.model_copy(update={"max_epochs": 40})
    switch = SlowReports(report_s=0.0)
    with caplog.at_level(logging.INFO, LOGGER), make(switch, spec, unavailable_bound_s=0.25) as bso:
        detach_at_epoch_2(bso, switch)
        for _ in range(17):
            bso.on_evaluate(0.35)  # looks find it down: epochs 3-19 journaled
        switch.up, switch.report_s = True, 0.1
        looks = 0
        while bso.detached and looks < 20:
            sent = switch.calls.count("report_epoch")
            bso.on_evaluate(0.4)
            looks += 1
            # One bound holds three reports, and the deadline lets a fourth start; the
            # last look also reports its own epoch.
            assert switch.calls.count("report_epoch") - sent <= 5
        assert not bso.detached
        held = switch.trials()[0].epochs
    assert looks >= 3
    assert "the rest at the next look" in caplog.text
    assert held == 19 + looks  # epochs 1-19, and each look's own epoch


def test_a_run_resumed_from_a_checkpoint_goes_back_to_its_trial_too(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A run resumed from its epoch-3 checkpoint keeps no journal (it would lack epochs
    1-3), so it used to stay detached for the rest of its run once the service was
    lost, and its epochs were never learned.  It holds them in memory and goes back
    from the checkpoint's figures: the trial holds the whole run."""
    switch = Switch()
    checkpoint = run_until_checkpoint(switch.service)
    with (
        caplog.at_level(logging.INFO, LOGGER),
        make_resumable(switch, resume=checkpoint["bso"], heartbeat_interval_s=None) as bso,
    ):
        bso.get_batch_size()
        bso.on_train_begin()
        switch.up = False
        bso.on_evaluate(0.2)  # epoch 4: the report fails, detached
        assert bso.detached
        bso.on_evaluate(0.3)  # epoch 5: a look, still down
        switch.up = True
        bso.on_evaluate(0.4)  # epoch 6: back; 4 and 5 sent, then 6
        assert not bso.detached
        time_s = bso.state_dict()["time_s"]
    (trial,) = switch.trials()
    assert (trial.epochs, trial.detached) == (6, False)
    assert trial.time_s == pytest.approx(time_s)
    assert "they go to its trial if the service is back" in caplog.text
    assert "goes on attached (2 epoch(s) trained detached sent)" in caplog.text


@pytest.fixture
def unwritable_journal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache folder that cannot be written: no journal can be started."""

    def read_only(**_: Any) -> DetachedJournal:
        raise OSError(30, "Read-only file system", "/cache")

    monkeypatch.setattr(DetachedJournal, "start", read_only)


@pytest.mark.usefixtures("unwritable_journal")
def test_a_run_whose_journal_cannot_be_written_goes_back_from_memory() -> None:
    switch = Switch()
    with make(switch) as bso:
        detach_at_epoch_2(bso, switch)
        switch.up = True
        bso.on_evaluate(0.4)
        assert not bso.detached
    (trial,) = switch.trials()
    assert trial.epochs == 3


def test_a_journal_left_after_going_back_is_not_counted_as_a_second_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The run went back to the service (its journaled epochs sent as reports), but the
    journal could not be removed (a read-only cache folder), and the run converged
    attached at epoch 5.  The next run of the job on this machine delivers the
    leftover journal (epochs 1-3): the trial went on past it, so it is the trial's
    already, not a second run of the size (review of 46ebddf, helper)."""

    def refuse(self: DetachedJournal) -> None:
        self.release()  # the process exits later: its lock goes with it
        raise OSError(30, "Read-only file system", str(self.path))

    switch = Switch()
    with make(switch) as bso:
        detach_at_epoch_2(bso, switch)
        bso.on_evaluate(0.35)  # epoch 3, still down: journaled
        switch.up = True
        monkeypatch.setattr(DetachedJournal, "remove", refuse)
        bso.on_evaluate(0.4)  # back: 2 and 3 sent, 4 reported
        assert not bso.detached
        assert bso.on_evaluate(0.95).converged  # epoch 5, attached
    monkeypatch.undo()
    assert journals() == 1  # left behind
    assert [t.epochs for t in switch.trials()] == [5]
    with make(switch) as later:  # registering delivers the job's journals
        later.get_batch_size()
    trials = switch.trials()
    assert [(t.trial_number, t.epochs, t.detached) for t in trials if t.trial_number == 1] == [
        (1, 5, False)
    ]
    counted = [(t.trial_number, t.phase.value, t.status.value, t.epochs) for t in trials]
    assert len([t for t in trials if t.epochs > 0 or t.detached]) == 1, counted  # once


def test_a_resumed_run_that_converges_when_the_service_is_back_ends_its_trial() -> None:
    """A run resumed from its epoch-3 checkpoint keeps no journal.  It loses the service
    at epoch 4; the service is back at epoch 5, which reaches the target.  The look is
    taken at that epoch too (it used to be skipped, leaving a run without a journal
    to its lease: three such interruptions fail a size), and the trial converges with
    the whole run (review of 0d0df84, helper)."""
    switch = Switch()
    checkpoint = run_until_checkpoint(switch.service)
    with make_resumable(switch, resume=checkpoint["bso"], heartbeat_interval_s=None) as bso:
        bso.get_batch_size()
        bso.on_train_begin()
        switch.up = False
        bso.on_evaluate(0.2)  # epoch 4: detached, held in memory
        assert bso.detached
        switch.up = True
        assert bso.on_evaluate(0.95).converged  # epoch 5: the target, the service back
    (trial,) = switch.trials()
    assert (trial.status, trial.epochs) == (TrialStatus.CONVERGED, 5)


@pytest.mark.usefixtures("unwritable_journal")
def test_a_run_whose_journal_cannot_be_written_and_converges_when_back_ends_its_trial() -> None:
    """The same for a run whose cache folder cannot be written."""
    switch = Switch()
    with make(switch) as bso:
        detach_at_epoch_2(bso, switch)  # epoch 1 reported, epoch 2 detached
        switch.up = True
        assert bso.on_evaluate(0.95).converged  # epoch 3: the target, the service back
    (trial,) = switch.trials()
    assert (trial.status, trial.epochs) == (TrialStatus.CONVERGED, 3)
