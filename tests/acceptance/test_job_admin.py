"""An operator's ``bso jobs`` commands while a run of the job trains, against a live
``bso up``: the run is the user's, and no command run beside it may end it.

* ``bso jobs delete JOB`` mid-run: the run trains every epoch to its end, after
  one WARNING saying bso no longer takes its reports, and exits as it would have;
  nothing of it is recorded in the job registered afresh later.
* ``bso jobs delete JOB`` mid-run, and the job relaunched at once with a new
  configuration: the job registered afresh numbers its trials on from the
  deleted job's, so the old run's reports name no trial of it; the new run is
  bso's from its first epoch to its last.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from tests.acceptance.conftest import BIN, EXIT_RELAUNCH, LiveService, trainer_argv, trials_of
from tests.acceptance.test_faults import finish, paused, start_trainer, wait_for_epoch

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
    with paused(trainer[0]):  # the delete lands mid-run, however slow the command is
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


def wait_for_running_trial(service: LiveService, job: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        listed = bso_jobs(service, "list", "--json")
        if listed.returncode == 0:
            for entry in json.loads(listed.stdout):
                if entry["job_id"] == job and entry["running_trials"] >= 1:
                    return
        time.sleep(0.3)
    pytest.fail(f"job {job} never had a running trial")


def test_a_run_of_a_deleted_job_never_reports_into_the_job_registered_afresh(
    service: LiveService,
) -> None:
    """The operator deletes the job to change its configuration (docs/client.md) while
    a run of the old one trains, and the job is relaunched at once.  The job
    registered afresh numbered its trials from 1 again, so the old run's reports
    landed in the new run's trial 1: the old run stayed attached, its epochs were
    charged to the new configuration's size, and the new run had its own first
    report refused and trained without bso (review-admin, helper)."""
    job = "acceptance-deleted-reregistered"
    old_argv = trainer_argv(
        "mnist_loop", "--job-id", job, "--target", "0.999", "--max-epochs", "2",
        "--epoch-seconds", "12",
    )  # fmt: skip
    new_argv = trainer_argv(
        "mnist_loop", "--job-id", job, "--target", "0.999", "--max-epochs", "2",
        "--epoch-seconds", "4", "--batch-sizes", "32,64",
    )  # fmt: skip
    t0 = time.monotonic()
    old = start_trainer(old_argv, service.env())
    wait_for_running_trial(service, job)  # the old run has its trial 1, epoch 1 under way
    with paused(old[0]):  # its first report comes after the new run registered, always
        deleted = bso_jobs(service, "delete", job)
        assert deleted.returncode == 0, deleted.stdout + deleted.stderr
        new = start_trainer(new_argv, service.env())  # relaunched at once, new configuration
        wait_for_running_trial(service, job)  # the new run's: the old job is gone
    old_run = finish(old, old_argv, [], t0)
    new_run = finish(new, new_argv, [], t0)

    assert old_run.epochs == [1, 2], str(old_run)  # the old run trained on, all the same
    [warning] = old_run.bso_lines("WARNING")
    assert "no longer takes this run's reports" in warning, warning
    assert f"job '{job}' has no trial 1 (the job was reset, or deleted and registered" in warning
    assert new_run.bso_lines("WARNING") == [], str(new_run)
    assert new_run.summary["detached"] is False, str(new_run)
    assert new_run.summary["trial_number"] == 2, str(new_run)  # numbered on from the old job
    trials = trials_of(service.status(job))
    assert list(trials) == [2], trials  # only the new run's epochs in the new job
    assert trials[2]["epochs"] == len(new_run.epochs) == 2, (trials, str(new_run))


def test_a_deleted_jobs_journal_never_rewrites_the_job_registered_afresh(
    service: LiveService,
) -> None:
    """The same through fail-open's journal: a run detached by a restart of ``bso up``
    and then killed leaves a journal naming its trial 1; the job is deleted and
    registered afresh, and the new job's first run delivers the journals it finds.
    That journal used to rewrite the new job's trial of the same number (another
    run's, with its own epochs); the service now refuses it, the new run says so in
    one WARNING and removes it, and the new job keeps only its own trial
    (review-admin, helper)."""
    job = "acceptance-deleted-journal"
    argv = trainer_argv(
        "mnist_loop", "--job-id", job, "--target", "0.999", "--max-epochs", "6",
        "--epoch-seconds", "1",
    )  # fmt: skip
    env = service.env(BSO_UNAVAILABLE_BOUND_S="1")
    t0 = time.monotonic()
    old = start_trainer(argv, env)
    read = wait_for_epoch(old[0], 1)
    service.stop()  # Ctrl-C on bso up: the old run's next report detaches it
    read += wait_for_epoch(old[0], 3)  # epochs 2 and 3 journaled
    old[0].send_signal(signal.SIGKILL)  # and the run is lost: its journal stays
    finish(old, argv, read, t0)
    service.start()  # the same port, data folder and credentials
    deleted = bso_jobs(service, "delete", job)
    assert deleted.returncode == 0, deleted.stdout + deleted.stderr
    new_argv = [*argv[:-4], "--max-epochs", "2", "--epoch-seconds", "0.5"]
    new = finish(start_trainer(new_argv, env), new_argv, [], time.monotonic())

    [refused] = new.bso_lines("WARNING")
    assert "bso refused the detached run" in refused, refused
    assert "as it was before it was deleted" in refused, refused
    assert new.summary["detached"] is False, str(new)
    trials = trials_of(service.status(job))
    assert list(trials) == [new.summary["trial_number"]], trials
    [trial] = trials.values()
    assert not trial.get("detached"), trial  # the new run's own trial, not the journal
    assert trial["epochs"] == len(new.epochs) == 2, (trials, str(new))


def test_bso_up_after_its_key_was_revoked_says_it_made_a_new_one(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The operator revokes the default tenant's key that ``.bso/credentials.env`` holds
    (a leaked key), then restarts ``bso up``: it makes a new key, saves it there, and
    says so beside the key it prints; the operator's own commands then work again.
    The new key used to appear without a word, though every script still holding the
    old one goes on detached until it is given the new one."""
    folder = tmp_path_factory.mktemp("revoked-default")
    (folder / "home").mkdir()
    own = LiveService(data_dir=folder / "bso-data", home=folder / "home")
    own.start()
    try:
        old_key = own.credentials["BSO_API_KEY"]
        revoked = subprocess.run(
            [str(BIN / "bso"), "keys", "revoke", old_key.split("_")[1],
             "--data-dir", str(own.data_dir)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert revoked.returncode == 0, revoked.stdout + revoked.stderr
        refused = bso_jobs(own, "list")
        assert refused.returncode != 0, refused.stdout
        assert "credentials.env" in refused.stderr, refused.stderr  # where the URL came from
        own.stop()
        own.output.clear()
        own.start()
        new_key = own.credentials["BSO_API_KEY"]
        assert new_key != old_key
        [line] = [line for line in own.output if line.strip().startswith("api key")]
        assert new_key in line, line
        assert "the key the credentials file held was revoked" in line, line
        assert old_key not in own.log()
        listed = bso_jobs(own, "list")
        assert listed.returncode == 0, listed.stdout + listed.stderr
    finally:
        own.kill()
