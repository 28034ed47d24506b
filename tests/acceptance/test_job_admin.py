"""An operator's ``bso jobs`` commands while a run of the job trains, against a live
``bso up``: the run is the user's, and no command run beside it may end it.

* ``bso jobs delete JOB`` mid-run: the run trains every epoch to its end, after
  one WARNING saying bso no longer takes its reports, and exits as it would have;
  nothing of it is recorded in the job registered afresh later.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.acceptance.conftest import BIN, EXIT_RELAUNCH, LiveService, trainer_argv
from tests.acceptance.test_faults import finish, start_trainer, wait_for_epoch

pytestmark = pytest.mark.integration


def bso_jobs(service: LiveService, *argv: str) -> subprocess.CompletedProcess[str]:
    """``bso jobs ... --data-dir DIR``, as the operator types it beside ``bso up``."""
    return subprocess.run(
        [str(BIN / "bso"), "jobs", *argv, "--data-dir", str(service.data_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_job_deleted_while_its_run_trains_does_not_end_the_run(service: LiveService) -> None:
    job = "acceptance-deleted"
    argv = trainer_argv(
        "mnist_loop", "--job-id", job, "--target", "0.999", "--max-epochs", "5",
        "--epoch-seconds", "1",
    )  # fmt: skip
    t0 = time.monotonic()
    trainer = start_trainer(argv, service.env())
    read = wait_for_epoch(trainer[0], 1)
    deleted = bso_jobs(service, "delete", job)
    assert deleted.returncode == 0, deleted.stdout + deleted.stderr
    run = finish(trainer, argv, read, t0)
    # Trained to its end (max_epochs short of the target: a relaunch), not UnknownJob.
    assert run.returncode in (0, EXIT_RELAUNCH), str(run)
    assert run.epochs == [1, 2, 3, 4, 5], str(run)
    (warning,) = run.bso_lines("WARNING")
    assert f"no longer takes this run's reports (job '{job}' is not registered)" in warning
    assert "training goes on at batch size" in warning
    assert not run.bso_lines("ERROR"), str(run)
    listed = bso_jobs(service, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert job not in listed.stdout  # nothing recreated the job the operator deleted
