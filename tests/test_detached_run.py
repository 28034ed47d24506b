"""A detached run whose cache disk fills mid-run (bso_client.detached_run)."""

from __future__ import annotations

import errno
import json
import logging

import pytest

from bso.core.vocabulary import StopReason, TrialStatus
from bso_client.detached_journal import DetachedJournal, job_folder
from tests.test_fail_open import Switch, make, train, warnings_of

LOGGER = "bso_client.optimizer"


@pytest.fixture
def disk() -> dict[str, bool]:
    """``disk["full"] = True`` makes every journal write fail as a full disk does."""
    return {"full": False}


@pytest.fixture(autouse=True)
def _fillable(monkeypatch: pytest.MonkeyPatch, disk: dict[str, bool]) -> None:
    save = DetachedJournal.save

    def save_unless_full(journal: DetachedJournal) -> None:
        if disk["full"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        save(journal)

    monkeypatch.setattr(DetachedJournal, "save", save_unless_full)


def test_a_disk_that_fills_mid_run_still_delivers_the_whole_run_at_exit(
    disk: dict[str, bool], caplog: pytest.LogCaptureFixture
) -> None:
    """The service is lost at epoch 2, the disk fills at epoch 3, the run converges at
    epoch 4 and the service is back at its exit: the run used to drop its journal at
    the first refused write, so nothing was delivered and its trial ended only when the
    lease ran out (interrupted), while the epochs on disk were delivered by the next
    run as an interruption that the line had said would never be delivered."""
    switch = Switch()

    def faults(epoch: int) -> None:
        switch.up = epoch < 2
        disk["full"] = epoch >= 3

    with caplog.at_level(logging.INFO, LOGGER), make(switch) as bso:
        assert train(bso, [0.2, 0.4, 0.6, 0.95], faults) == 4
        assert bso.detached
        switch.up = True
    detach, full = (r.getMessage() for r in warnings_of(caplog))
    assert "training goes on detached" in detach
    assert "cannot write the detached run's journal" in full
    assert "No space left on device" in full
    assert "delivered at exit if the service is back then" in full
    assert "keeps its first 2 epoch(s) only" in full
    assert "delivered the detached run" in caplog.text
    (trial,) = switch.trials()
    assert (trial.status, trial.stop_reason, trial.epochs, trial.detached) == (
        TrialStatus.CONVERGED,
        StopReason.TARGET_REACHED,
        4,
        True,
    )
    assert not list(job_folder("job").glob("*.json"))


def test_a_full_disk_with_the_service_still_down_says_what_stays_journaled(
    disk: dict[str, bool], caplog: pytest.LogCaptureFixture
) -> None:
    switch = Switch()

    def faults(epoch: int) -> None:
        switch.up = epoch < 2
        disk["full"] = epoch >= 3

    with caplog.at_level(logging.INFO, LOGGER), make(switch) as bso:
        train(bso, [0.2, 0.4, 0.6, 0.95], faults)
    *_, exit_line = (r.getMessage() for r in warnings_of(caplog))
    assert "was not delivered" in exit_line
    assert "holds its first 2 of 4 epoch(s) only" in exit_line
    assert "delivers those as an interruption" in exit_line
    (path,) = job_folder("job").glob("*.json")
    document = json.loads(path.read_text())
    assert len(document["run"]["epochs"]) == 2
    assert not document["ended"]  # its writer gone, the next run delivers it as interrupted


def test_a_disk_that_has_room_again_gets_the_whole_journal(
    disk: dict[str, bool], caplog: pytest.LogCaptureFixture
) -> None:
    switch = Switch()

    def faults(epoch: int) -> None:
        switch.up = epoch < 2
        disk["full"] = epoch == 3

    with caplog.at_level(logging.INFO, LOGGER), make(switch) as bso:
        train(bso, [0.2, 0.4, 0.6, 0.7, 0.95], faults)
    assert "is written again" in caplog.text
    (path,) = job_folder("job").glob("*.json")
    document = json.loads(path.read_text())
    assert (len(document["run"]["epochs"]), document["ended"]) == (5, True)


def test_out_of_file_descriptors_is_not_called_a_full_disk(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``ulimit -n`` reached by the script's own files: the journal's write fails with
    EMFILE, and the line names the limit, not the cache folder's space."""

    def no_descriptor(journal: DetachedJournal) -> None:
        raise OSError(errno.EMFILE, "Too many open files")

    switch = Switch()
    with caplog.at_level(logging.INFO, LOGGER), make(switch) as bso:
        train(bso, [0.2, 0.4, 0.6, 0.95], lambda epoch: setattr(switch, "up", epoch < 2))
        monkeypatch.setattr(DetachedJournal, "save", no_descriptor)
    full = next(m for m in caplog.messages if "cannot write the detached run's journal" in m)
    assert "raise ulimit -n" in full
    assert "free space" not in full
