"""The faults a user meets, injected into real runs against a live ``bso up``.

The issue's promise, checked from the user's seat: no failure of bso ends a
training run or stalls it for long, a script's own bug is never charged to a
batch size, and what happened is counted in ``bso status`` afterwards.

* the service stopped mid-run for longer than the client's bound (``bso up``
  stopped with Ctrl-C, then started again on the same port and data folder):
  the run trains every epoch, exits 0 with one warning, and its epochs reach
  ``bso status`` once the service is back, exactly once, marked detached;
* a wrong port at start: the run trains with the job's default size after at
  most the default bound, one warning naming the URL without its password;
* five runs that raise before their first epoch (bso's own usage errors and a
  user's typo), then a good run: the good run gets a size and trains, and no
  size is charged with the bugs;
* Ctrl-C: the run ends as a user expects (the KeyboardInterrupt exit), the
  trial is interrupted, not failed, and the next run goes on.

Every bound is the client's default: what a user who sets nothing gets.
"""

from __future__ import annotations

import signal
import subprocess
import time
from typing import Any

import pytest

from tests.acceptance.conftest import (
    EXIT_RELAUNCH,
    ROOT,
    LiveService,
    TrainerRun,
    free_port,
    run_trainer,
    trainer_argv,
    trials_of,
)

pytestmark = pytest.mark.integration

MNIST_EPOCHS = 6
"""``mnist_loop.py``'s default ``--max-epochs``."""


def is_detached(trial: dict[str, Any]) -> bool:
    """``bso status`` marks a run delivered from a client's journal."""
    return bool(trial.get("detached"))


def start_trainer(argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


def wait_for_epoch(popen: subprocess.Popen[str], epoch: int) -> list[str]:
    """Read the trainer's stdout until it says it trained ``epoch``; returns the lines read."""
    assert popen.stdout is not None
    lines = []
    for line in popen.stdout:
        lines.append(line)
        if line.startswith(f"epoch {epoch} "):
            return lines
    pytest.fail(f"the trainer ended before epoch {epoch}: {''.join(lines)}")


def finish(
    popen: subprocess.Popen[str], argv: list[str], read: list[str], started: float
) -> TrainerRun:
    stdout, stderr = popen.communicate(timeout=180)
    wall_s = time.monotonic() - started
    return TrainerRun(argv, popen.returncode, "".join(read) + stdout, stderr, wall_s)


def test_the_service_stopped_mid_run_costs_neither_the_run_nor_its_epochs(
    service: LiveService,
) -> None:
    job = "acceptance-outage"
    # Target out of reach: bso would never stop these runs for convergence, so
    # every run trains all its epochs, and the detached one has no verdict to miss.
    argv = trainer_argv("mnist_loop", "--job-id", job, "--target", "0.999", "--max-epochs", "8")
    before = run_trainer(argv, service.env())
    assert before.returncode == EXIT_RELAUNCH, str(before)  # max_epochs: bso's verdict

    slow = [*argv, "--epoch-seconds", "1.5"]
    started = time.monotonic()
    popen = start_trainer(slow, service.env())
    read = wait_for_epoch(popen, 1)
    service.stop()  # Ctrl-C on bso up: Redis and the workers go away mid-run
    try:
        outage = finish(popen, slow, read, started)
    finally:
        service.start()  # the same port, data folder and credentials
    assert outage.returncode == 0, str(outage)  # the run is not lost
    assert outage.epochs == list(range(1, 9)), str(outage)  # every epoch trained
    warnings = outage.bso_lines("WARNING")
    assert len(warnings) == 1, str(outage)  # one warning, not one per epoch or heartbeat
    assert service.password not in outage.stderr

    after = run_trainer(argv, service.env())  # the next run delivers the journal
    assert after.returncode == EXIT_RELAUNCH, str(after)
    status = service.status(job)
    trials = trials_of(status)
    assert len(trials) == 3, trials  # the detached run counted, once
    (detached,) = [t for t in trials.values() if is_detached(t)]
    assert detached["epochs"] == 8, detached  # each journaled epoch delivered exactly once
    assert all(lane["running_trials"] == 0 for lane in status["lanes"]), status


def test_a_wrong_port_at_start_trains_with_the_default_after_one_warning(
    service: LiveService,
) -> None:
    job = "acceptance-wrong-port"
    wrong = service.broker_url.replace(f":{service.port}/", f":{free_port()}/")
    assert wrong != service.broker_url
    argv = trainer_argv("mnist_loop", "--job-id", job, "--broker-url", wrong)
    run = run_trainer(argv, service.env())
    assert run.returncode == 0, str(run)
    assert run.summary["batch_size"] == 32  # the job's default: nothing known on this machine
    assert run.epochs == list(range(1, MNIST_EPOCHS + 1)), str(run)  # bso never stops it early
    (warning,) = run.bso_lines("WARNING")
    assert wrong.rsplit("@", 1)[1] in warning, warning  # names the address...
    assert service.password not in run.stderr  # ...never the password

    # With the right URL, the next run of the job delivers what the first one journaled.
    fixed = run_trainer(trainer_argv("mnist_loop", "--job-id", job), service.env())
    assert fixed.returncode in (0, EXIT_RELAUNCH), str(fixed)
    trials = trials_of(service.status(job))
    assert len(trials) == 2, trials
    assert sum(is_detached(t) for t in trials.values()) == 1, trials


BUGS = ("scheduler-first", "report-before-begin", "data", "scheduler-first", "data")
BUG_ERRORS = {
    "scheduler-first": "ValueError",
    "report-before-begin": "OperationOrderError",
    "data": "KeyError",
}


def test_five_runs_that_raise_before_epoch_one_do_not_cost_the_job(
    service: LiveService,
) -> None:
    job = "acceptance-script-bugs"
    for bug in BUGS:
        run = run_trainer(trainer_argv("mnist_loop", "--job-id", job, "--bug", bug), service.env())
        assert run.returncode == 1, str(run)  # the user's own traceback, as without bso
        assert BUG_ERRORS[bug] in run.stderr.splitlines()[-1], str(run)
        assert run.epochs == [], str(run)
        assert len(run.bso_lines("WARNING")) <= 1, str(run)
    good = run_trainer(trainer_argv("mnist_loop", "--job-id", job), service.env())
    assert good.returncode in (0, EXIT_RELAUNCH), str(good)  # a size, not NoFeasibleBatchSize
    assert good.epochs, str(good)
    status = service.status(job)
    trials = trials_of(status)
    assert len(trials) == len(BUGS) + 1, trials
    assert trials[len(BUGS) + 1]["epochs"] == len(good.epochs)
    for lane in status["lanes"]:
        for size in lane["sizes"]:
            assert size["outcomes"].get("failed", 0) == 0, size  # no size charged with a bug


def test_ctrl_c_interrupts_the_run_and_the_next_one_goes_on(service: LiveService) -> None:
    job = "acceptance-ctrl-c"
    argv = trainer_argv("mnist_loop", "--job-id", job, "--target", "0.999", "--epoch-seconds", "1")
    started = time.monotonic()
    popen = start_trainer(argv, service.env())
    read = wait_for_epoch(popen, 1)
    popen.send_signal(signal.SIGINT)
    run = finish(popen, argv, read, started)
    assert run.returncode in (-signal.SIGINT, 130), str(run)  # what Ctrl-C gives a Python script
    assert "KeyboardInterrupt" in run.stderr, str(run)
    assert len(run.bso_lines("WARNING")) <= 1, str(run)
    assert not run.bso_lines("ERROR"), str(run)
    trials = trials_of(service.status(job))
    assert trials[1]["outcome"] == "interrupted", trials  # not the size's fault
    # Ctrl-C may land between an epoch's line and its report: that epoch is not counted.
    assert trials[1]["epochs"] in (len(run.epochs) - 1, len(run.epochs)), (trials, str(run))

    after = run_trainer(
        trainer_argv("mnist_loop", "--job-id", job, "--target", "0.999"), service.env()
    )
    assert after.returncode == EXIT_RELAUNCH, str(after)  # max_epochs: a verdict from epochs
    assert after.epochs == list(range(1, MNIST_EPOCHS + 1)), str(after)
    status = service.status(job)
    assert sum(lane["trials"] for lane in status["lanes"]) == 2
    assert all(lane["running_trials"] == 0 for lane in status["lanes"])
