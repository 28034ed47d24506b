"""A stop whose reply was lost goes to the run at its next look (bso_client/reattachment.py).

A detached run's look is refused when its trial ended meanwhile; if the trial
ended for good at a report of this run's whose reply was lost, the report is sent
again as the same event and the service's recorded answer, the stop, stops the
run.  A trial another run resumed is never sent it: there a report that never
reached the service would be taken as that run's next epoch (review of c51641b,
helper).  In process, behind tests/test_fail_open.py's switch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import pytest

from bso.core.vocabulary import StopReason, TrialStatus
from bso_client import reattachment
from bso_client.errors import TrainFailError
from bso_client.optimizer import BatchSizeOptimizer
from tests.test_fail_open import SPEC, Switch, make
from tests.test_reattachment import (
    LOGGER,
    LostReply,
    checkpoint_at,
    converged_first_run,
    journals,
)


@pytest.fixture(autouse=True)
def look_at_every_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reattachment, "LOOK_COST_SHARE", float("inf"))


@contextmanager
def another_run_resumed(switch: Switch, checkpoint: dict[str, Any]) -> Iterator[BatchSizeOptimizer]:
    """The service back, and another process (a scheduler's restart) resumed from the
    epoch-1 ``checkpoint``, its epoch 2 reported quickly: the trial is that run's now."""
    switch.up = True
    with make(switch, resume=checkpoint) as other:
        other.get_batch_size()
        other.on_train_begin()
        other.on_evaluate(0.25)  # epoch 2 of the other run, quick
        yield other


def dear_second_run(switch: LostReply, lose_at: int) -> tuple[int, int]:
    """After :func:`converged_first_run`: a run of a dear size, cut off from its first
    epoch's end to its third's, the reply to the report of epoch ``lose_at``'s end
    lost (1: the report that cut it off; 2: the look, the journal's epoch 1 replayed).
    Returns (epochs trained, trial number) once bso stopped it (TrainFailError)."""
    trained = {"epochs": 0, "trial": 0}

    def run() -> None:
        with make(switch) as bso:
            bso.get_batch_size()
            bso.on_train_begin()
            trained["trial"] = cast(int, bso.trial_number)
            while trained["epochs"] < SPEC.max_epochs:
                time.sleep(0.05)  # dear: the first run's epoch took microseconds
                trained["epochs"] += 1
                switch.up = trained["epochs"] != 1 or lose_at == 1
                switch.lose_next_report = trained["epochs"] == lose_at
                bso.on_evaluate(0.1)

    with pytest.raises(TrainFailError):
        run()
    return trained["epochs"], trained["trial"]


@pytest.mark.parametrize("lose_at", [1, 2], ids=["the-outage-began-with-it", "a-look-lost-it"])
def test_a_stop_whose_reply_was_lost_stops_the_run_at_the_next_look(
    lose_at: int, caplog: pytest.LogCaptureFixture
) -> None:
    """bso stopped the trial (its cost past the bound) and the reply never reached the
    run.  The next look found the trial ended, and the run trained on detached to
    max_epochs, its trial's stop never heard of.  Now the look sends the lost report
    again as the same event, and the service's recorded answer, the stop, stops the
    run there."""
    caplog.set_level(logging.INFO, LOGGER)
    switch = LostReply()
    converged_first_run(switch)
    epochs, number = dear_second_run(switch, lose_at)
    assert epochs == lose_at + 1  # the next look, not max_epochs
    trial = switch.trials()[number - 1]
    assert (trial.status, trial.stop_reason) == (TrialStatus.FAILED, StopReason.COST_BOUND)
    assert f"it had stopped trial {number} of job job at epoch 1 (cost_bound)" in caplog.text
    assert "is back, but trial" not in caplog.text  # not given up
    assert journals() == 0  # the service has the trial's end


def test_an_undelivered_lost_report_is_not_applied_to_a_trial_another_run_resumed() -> None:
    """Epochs 1-2 reported; epoch 3's report never reached the service (it was down):
    detached, the report kept as the 'lost' one.  Meanwhile a scheduler resumed trial 1
    from the epoch-1 checkpoint in another process, which reported epoch 2.  The look
    is refused (the trial stands elsewhere, it is the other run's), and the lost
    report, sent again, is a *new* event to the service: epoch 3 is the next epoch of
    the other run's trial, so this run's epoch 3 is written into it, and the other
    run's own epoch 3 is then refused as out of order (it loses its trial)."""
    switch = Switch()
    with make(switch) as bso:
        bso.get_batch_size()
        bso.on_train_begin()
        time.sleep(0.05)
        bso.on_evaluate(0.2)  # epoch 1
        checkpoint = checkpoint_at(bso, switch.trials()[0])  # epoch 1
        time.sleep(0.05)
        bso.on_evaluate(0.25)  # epoch 2
        switch.up = False
        time.sleep(0.05)
        bso.on_evaluate(0.3)  # epoch 3: never reached the service
        assert bso.detached
        with another_run_resumed(switch, checkpoint) as other:
            taken = switch.trials()[0]
            assert taken.epochs == 2
            time.sleep(0.05)
            bso.on_evaluate(0.4)  # a look: refused, the trial is the other run's
            assert bso.detached
            assert switch.trials()[0] == taken, "this run's epoch 3 went into the other's trial"
            other.on_evaluate(0.3)  # the other run's epoch 3
            assert not other.detached, "the other run lost its trial"


def test_a_stop_of_another_runs_trial_is_not_given_to_this_run() -> None:
    """The same with a dear epoch: this run's undelivered epoch-3 report, sent again
    at the look, is judged as the next epoch of the trial another process resumed
    (from the epoch-1 checkpoint, its epoch 2 quick), stops that trial for its cost,
    and this run is told "it had stopped trial 2 ... the reply was lost" (TrainFailError),
    though bso never stopped anything of this run's."""
    switch = Switch()
    with make(switch) as first:  # trial 1: the default size converged in 0.1 s
        first.get_batch_size()
        first.on_train_begin()
        time.sleep(0.1)
        assert first.on_evaluate(0.95).converged
    with make(switch) as bso:
        bso.get_batch_size()
        bso.on_train_begin()
        assert bso.trial_number == 2
        bso.on_evaluate(0.2)  # epoch 1, quick: goes on
        checkpoint = checkpoint_at(bso, switch.trials()[1])  # epoch 1
        bso.on_evaluate(0.21)  # epoch 2, quick: goes on
        switch.up = False
        time.sleep(1.0)
        bso.on_evaluate(0.3)  # epoch 3, dear: never reached the service
        assert bso.detached
        with another_run_resumed(switch, checkpoint):
            assert switch.trials()[1].status is TrialStatus.RUNNING
            try:
                bso.on_evaluate(0.4)  # a look: refused, the trial is the other run's
            except TrainFailError as err:
                pytest.fail(f"this run was stopped by a verdict on another run's epoch: {err}")
            assert switch.trials()[1].status is TrialStatus.RUNNING
