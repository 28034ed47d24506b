"""The faults a user meets, injected into real runs against a live ``bso up``.

The issue's promise, checked from the user's seat: no failure of bso ends a
training run or stalls it for long, a script's own bug is never charged to a
batch size, and what happened is counted in ``bso status`` afterwards.

* the service stopped mid-run for longer than the client's bound (``bso up``
  stopped with Ctrl-C, then started again on the same port and data folder):
  the run trains every epoch, exits 0 with one warning, and its epochs reach
  ``bso status`` once the service is back, exactly once, marked detached;
* a wrong port at start: the run trains with the job's default size after at
  most the default bound, one warning naming the URL without its password,
  and the next run with the right URL delivers it;
* five runs that raise before their first epoch (bso's own usage errors and a
  user's typo), then a good run: the good run gets a size and trains, and no
  size is charged with the bugs;
* Ctrl-C: the run ends as a user expects (the KeyboardInterrupt exit), the
  trial is interrupted, not failed, and the next run goes on;
* a wrong API key: one ERROR line naming the fix, and the run trains.
* a lane with no size left (``NoFeasibleBatchSize``): the run trains at the
  default after one ERROR naming what ruled the sizes out and the way out.
* a job spec changed between recurrences (``ConfigMismatch``): the run trains at
  the new spec's default after one ERROR naming the field, both values and the fix.
* a notebook: a cell without ``with`` stopped by Ctrl-C, then run again in the
  same process: the trial left open ends as interrupted, the next one explores;
  a finished run the cell never closed is closed by the next without a warning.
* two jobs trained side by side in one process (their ``with`` blocks ending in
  the order they began, recurrence after recurrence), then SIGTERM in the third:
  the process dies of it, ending its two open trials as interrupted and no
  earlier one (it used to log a thousand endings of long-closed trials and die of
  a RecursionError instead); two runs of one job so (a sweep) each train to their
  end with their own trial (the second's start used to end the first's trial as
  "left open", and the first run died of an OperationOrderError).
* preemption: a run killed (``kill -9``) after its epoch-3 checkpoint and started
  again from it (``resume=bso.state_dict()`` as saved) goes on with the same
  trial and size: one trial holds every epoch and the time of both processes;
  restarted on other hardware (a DDP job of 2 processes killed, resumed with 1),
  it trains on without bso and the first lane's trial is not charged with it;
  restarted while the service is down, it trains every epoch after one warning
  that names the bound the user knows (``unavailable_bound_s``) and the fix;
  a Lightning run checkpointed at the end of validation and resumed with
  ``fit(ckpt_path=...)`` trains on with its trial after one warning; a run
  whose bug ended it, fixed and started again from its last checkpoint, goes
  on with the trial the bug ended.
* a ``fork`` pool torn down mid-run (``terminate()``: SIGTERM to its workers,
  which inherited bso's handler): the run keeps its trial, no worker ends it.

Every bound is the client's default: what a user who sets nothing gets.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.acceptance.conftest import (
    EXIT_RELAUNCH,
    ROOT,
    RUN_TIMEOUT_S,
    LiveService,
    TrainerRun,
    free_port,
    record_time,
    run_trainer,
    status_file_env,
    torchrun_argv,
    trainer_argv,
    trials_of,
)

pytestmark = pytest.mark.integration

MNIST_EPOCHS = 6
MNIST_TARGET = 0.9
"""``mnist_loop.py``'s default ``--max-epochs`` and ``--target``."""


def is_detached(trial: dict[str, Any]) -> bool:
    """``bso status`` marks a run delivered from a client's journal."""
    return bool(trial.get("detached"))


def start_trainer(argv: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str], Path]:
    env, status_file = status_file_env(env)
    popen = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    return popen, status_file


@contextmanager
def paused(trainer: subprocess.Popen[str]) -> Iterator[None]:
    """The block runs with ``trainer`` stopped (SIGSTOP), so that what it does lands
    between two of the run's calls, however slowly a busy machine runs it."""
    trainer.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        trainer.send_signal(signal.SIGCONT)


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
    started: tuple[subprocess.Popen[str], Path], argv: list[str], read: list[str], t0: float
) -> TrainerRun:
    popen, status_file = started
    stdout, stderr = popen.communicate(timeout=RUN_TIMEOUT_S)
    wall_s = time.monotonic() - t0
    run = TrainerRun(argv, popen.returncode, "".join(read) + stdout, stderr, wall_s, status_file)
    record_time(run)
    return run


def killed_in_epoch(
    argv: list[str], env: dict[str, str], epoch: int, *, at: str | None = None
) -> None:
    """A run preempted outright (SIGKILL) once it says it trained ``epoch`` (or prints
    the line ``at``): the kill a checkpointing job is resumed after."""
    t0 = time.monotonic()
    started = start_trainer(argv, env)
    read = wait_for_epoch(started[0], epoch) if at is None else wait_for_line(started[0], at)
    started[0].send_signal(signal.SIGKILL)
    killed = finish(started, argv, read, t0)
    assert killed.returncode == -signal.SIGKILL, str(killed)


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
    t0 = time.monotonic()
    trainer = start_trainer(slow, service.env())
    read = wait_for_epoch(trainer[0], 1)
    service.stop()  # Ctrl-C on bso up: Redis and the workers go away mid-run
    try:
        outage = finish(trainer, slow, read, t0)
    finally:
        service.start()  # the same port, data folder and credentials
    # The run is not lost: it ends as it would have with the service (max_epochs:
    # relaunch), not as a crash.
    assert outage.run_status["outcome"] in ("finished", "relaunch"), str(outage)
    assert outage.returncode == outage.run_status["exit_code"], str(outage)
    assert outage.summary["detached"], str(outage)
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


def test_a_run_detached_by_a_restart_of_bso_up_goes_on_attached_once_it_is_back(
    service: LiveService,
) -> None:
    """``bso up`` stopped after epoch 1 and started again seconds later: the run trains
    on detached, then, at its next look at the service (every 10 bounds: 10 s with
    ``BSO_UNAVAILABLE_BOUND_S=1``), sends the epochs it journaled and goes on attached,
    so bso judges the rest of the run.  It used to stay detached to its end: for a run
    of days, a restart of seconds cost bso's stops for all of them."""
    job = "acceptance-reattached"
    argv = trainer_argv(
        "mnist_loop", "--job-id", job, "--target", "0.999", "--max-epochs", "12",
        "--epoch-seconds", "2",
    )  # fmt: skip
    env = service.env(BSO_UNAVAILABLE_BOUND_S="1")
    t0 = time.monotonic()
    trainer = start_trainer(argv, env)
    read = wait_for_epoch(trainer[0], 1)
    service.stop()  # Ctrl-C on bso up: Redis and the workers go away mid-run
    try:
        time.sleep(4)  # epoch 2's report finds the service gone
    finally:
        # Paused while bso up starts, however long that takes on a busy machine: the
        # run has as many looks left after the restart as the docstring says.
        with paused(trainer[0]):
            service.start()  # the same port, data folder and credentials
    run = finish(trainer, argv, read, t0)
    assert run.returncode == EXIT_RELAUNCH, str(run)  # max_epochs: bso's verdict
    assert run.epochs == list(range(1, 13)), str(run)
    assert not run.summary["detached"], str(run)  # attached again at its end
    [warning] = run.bso_lines("WARNING")
    assert "training goes on detached" in warning, warning
    [back] = [line for line in run.bso_lines("INFO") if "is back:" in line]
    assert f"trial {run.summary['trial_number']} of job {job} goes on attached" in back, back
    [trial] = trials_of(service.status(job)).values()
    assert trial["epochs"] == 12, trial  # every epoch, each once
    assert not is_detached(trial), trial  # reported one by one, not delivered as a journal
    assert trial["outcome"] == "failed", trial  # max_epochs, bso's own stop


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
    assert run.summary["detached"], str(run)
    # Every epoch up to the target (checked on this machine) or max_epochs; none skipped.
    assert run.epochs == list(range(1, len(run.epochs) + 1)), str(run)
    reached = run.summary["accuracy"] >= MNIST_TARGET
    assert reached or len(run.epochs) == MNIST_EPOCHS, str(run)
    assert run.run_status["outcome"] == ("converged" if reached else "finished"), str(run)
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
    runs = []
    for bug in BUGS:
        run = run_trainer(trainer_argv("mnist_loop", "--job-id", job, "--bug", bug), service.env())
        assert run.returncode == 1, str(run)  # the user's own traceback, as without bso
        assert BUG_ERRORS[bug] in run.stderr, str(run)
        assert run.run_status["outcome"] == "crashed", str(run)
        assert run.epochs == [], str(run)
        runs.append(run)
    good = run_trainer(trainer_argv("mnist_loop", "--job-id", job), service.env())
    assert good.returncode in (0, EXIT_RELAUNCH), str(good)  # a size, not NoFeasibleBatchSize
    assert good.epochs, str(good)
    # After three in a row, each next run's log says so plainly: one warning, not a flood.
    for number, run in enumerate([*runs, good]):
        warnings = run.bso_lines("WARNING")
        if number < 3:
            assert warnings == [], str(run)
        else:
            (warning,) = warnings
            assert "were ended by the training script itself" in warning, str(run)
    status = service.status(job)
    trials = trials_of(status)
    assert len(trials) == len(BUGS) + 1, trials
    assert trials[len(BUGS) + 1]["epochs"] == len(good.epochs)
    outcomes = [size["outcomes"] for lane in status["lanes"] for size in lane["sizes"]]
    assert all(o.get("failed", 0) == 0 for o in outcomes), outcomes  # no size charged
    assert sum(o.get("script_error", 0) for o in outcomes) == len(BUGS), outcomes


def test_runs_whose_validation_code_raises_mid_training_do_not_rule_out_their_size(
    service: LiveService,
) -> None:
    """Three good runs, then four whose validation code raises in epoch 2 (after one
    epoch was reported), then the fixed script: it gets the size the broken runs were
    given and trains, no size is charged with the bug, and from the fourth broken run
    on the log says plainly whose bug it is.  One candidate size, the user's, so
    that no stop of bso's comes before the bug: charged to the size, two such
    crashes ruled it out and the fixed script got NoFeasibleBatchSize."""
    job = "acceptance-bug-mid-run"
    # No size reaches 0.9 in one epoch, so every broken run reports one and then raises.
    argv = trainer_argv("mnist_loop", "--job-id", job, "--batch-sizes", "32")
    for _ in range(3):
        run = run_trainer(argv, service.env())
        assert run.returncode in (0, EXIT_RELAUNCH), str(run)
    broken = [run_trainer([*argv, "--bug-at-epoch", "2"], service.env()) for _ in range(4)]
    for run in broken:
        assert run.returncode == 1, str(run)  # the user's own traceback, as without bso
        assert "KeyError" in run.stderr, str(run)
        assert len(run.epochs) == 1, str(run)
    fixed = run_trainer(argv, service.env())
    assert fixed.returncode in (0, EXIT_RELAUNCH), str(fixed)  # a size, not NoFeasibleBatchSize
    assert fixed.epochs, str(fixed)
    (warning,) = broken[3].bso_lines("WARNING")
    assert "were ended by the training script itself" in warning, str(broken[3])
    trials = trials_of(service.status(job))
    crashed = [trials[n] for n in range(4, 8)]
    assert [t["outcome"] for t in crashed] == ["script_error"] * 4, crashed  # not "failed"
    assert len({t["batch_size"] for t in crashed}) == 1, crashed
    assert trials[8]["batch_size"] == crashed[0]["batch_size"]


def test_runs_whose_validation_set_is_empty_do_not_rule_out_their_size(
    service: LiveService,
) -> None:
    """A wrong path left the validation set empty: every accuracy is NaN, which bso
    reads as a diverged run.  Before any run of the job reported a number, that is
    as likely the script's as the size's: the size gets the next run again (the
    log names both causes), so the fixed script trains at the size the broken ones
    had.  Charged to the sizes, three such runs ruled out three sizes and the job
    had no feasible size left."""
    job = "acceptance-empty-validation"
    argv = trainer_argv("mnist_loop", "--job-id", job, "--batch-sizes", "16,32,64")
    broken = [run_trainer([*argv, "--validation-size", "0"], service.env()) for _ in range(2)]
    for run in broken:
        assert run.returncode == EXIT_RELAUNCH, str(run)
        assert run.epochs == [1], str(run)
        assert "the metric of epoch 1 is nan: training diverged" in run.stderr, str(run)
        assert "an empty validation set" in run.stderr, str(run)
    fixed = run_trainer(argv, service.env())
    assert fixed.returncode in (0, EXIT_RELAUNCH), str(fixed)
    assert len(fixed.epochs) > 1, str(fixed)
    trials = trials_of(service.status(job))
    assert [trials[n]["batch_size"] for n in (1, 2, 3)] == [32, 32, 32], trials
    assert service.status(job)["lanes"][0]["stage"] != "stuck"


def test_a_run_on_a_lane_with_no_size_left_trains_at_the_default_after_one_error(
    service: LiveService,
) -> None:
    """The job's one size reaches max_epochs short of the target: nothing is left to
    try, and the next nightly run used to die in get_batch_size() before it trained.
    It trains now, at the default, after one ERROR that says what ruled the size out
    and the way out; bso status says the lane is stuck; nothing is recorded."""
    job = "acceptance-stuck"
    argv = trainer_argv(
        "mnist_loop", "--job-id", job, "--batch-sizes", "32", "--max-epochs", "1",
        "--target", "0.999",
    )  # fmt: skip
    first = run_trainer(argv, service.env())
    assert first.returncode in (0, EXIT_RELAUNCH), str(first)
    stuck = run_trainer(argv, service.env())
    assert stuck.returncode in (0, EXIT_RELAUNCH), str(stuck)  # not NoFeasibleBatchSize
    assert stuck.epochs == [1], str(stuck)
    (error,) = stuck.bso_lines("ERROR")
    assert f"job {job} has no feasible batch size" in error, str(stuck)
    assert "32: failed (max_epochs)" in error, str(stuck)
    assert "raise max_epochs" in error, str(stuck)
    assert f"bso jobs reset {job}" in error, str(stuck)
    assert "training goes on at the job's default batch size 32 without bso" in error
    status = service.status(job)
    assert len(trials_of(status)) == 1, status
    (lane,) = status["lanes"]
    assert lane["stage"] == "stuck", lane


def test_a_run_whose_spec_changed_between_recurrences_trains_after_one_error(
    service: LiveService,
) -> None:
    """The job's owner raises max_epochs between two nightly runs: the job id is
    registered with the old configuration, and the run used to die with
    ConfigMismatch before it trained.  It trains now, at its default, after one ERROR
    that names the field, both values and the fix; nothing is recorded."""
    job = "acceptance-respec"
    argv = trainer_argv("mnist_loop", "--job-id", job)
    first = run_trainer(argv, service.env())
    assert first.returncode in (0, EXIT_RELAUNCH), str(first)
    longer = run_trainer([*argv, "--max-epochs", str(MNIST_EPOCHS + 2)], service.env())
    assert longer.returncode == 0, str(longer)  # converged, not ConfigMismatch
    assert longer.epochs, str(longer)
    (error,) = longer.bso_lines("ERROR")
    assert f"max_epochs (registered {MNIST_EPOCHS}, this registration {MNIST_EPOCHS + 2})" in error
    assert f"bso jobs delete {job}" in error, str(longer)
    assert "training goes on at the job's default batch size 32 without bso" in error
    assert len(trials_of(service.status(job))) == 1


@pytest.fixture
def ctrl_c_as_a_terminal_delivers_it() -> Iterator[None]:
    """SIGINT handled in this process, so that the trainer starts with its default.

    A shell script that runs the tests in the background (``make test &``,
    ``nohup``) starts them with SIGINT ignored, and a child inherits an ignored
    signal: its Ctrl-C would then do nothing at all (the run trained on to its
    end).  A user's terminal never does that, and a handler, unlike SIG_IGN, is
    reset to the default in the child.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("ctrl_c_as_a_terminal_delivers_it")
def test_ctrl_c_interrupts_the_run_and_the_next_one_goes_on(service: LiveService) -> None:
    job = "acceptance-ctrl-c"
    argv = trainer_argv("mnist_loop", "--job-id", job, "--target", "0.999", "--epoch-seconds", "1")
    t0 = time.monotonic()
    trainer = start_trainer(argv, service.env())
    read = wait_for_epoch(trainer[0], 1)
    trainer[0].send_signal(signal.SIGINT)
    run = finish(trainer, argv, read, t0)
    assert run.returncode in (-signal.SIGINT, 130), str(run)  # what Ctrl-C gives a Python script
    assert "KeyboardInterrupt" in run.stderr, str(run)
    assert run.run_status["outcome"] == "interrupted", str(run)
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


def test_a_wrong_api_key_is_one_error_line_and_the_run_goes_on(service: LiveService) -> None:
    job = "acceptance-wrong-key"
    wrong_key = "bso_" + "x" * 40
    run = run_trainer(
        trainer_argv("mnist_loop", "--job-id", job), service.env(BSO_API_KEY=wrong_key)
    )
    assert run.returncode == 0, str(run)  # fail-open: the refusal does not end the run
    assert run.epochs == list(range(1, len(run.epochs) + 1)), str(run)
    assert run.epochs, str(run)
    (error,) = run.bso_lines("ERROR")  # one line, at once, naming the fix
    assert "BSO_API_KEY" in error, error
    assert run.bso_lines("WARNING") == [], str(run)
    assert wrong_key not in run.stderr
    assert service.password not in run.stderr


def test_a_notebook_cell_run_again_after_ctrl_c_gets_a_trial_of_its_own(
    service: LiveService,
) -> None:
    """One long-lived process: a cell without ``with`` stopped by Ctrl-C in epoch 2, the
    kernel catching it, then the cell run again.  The trial the first run left open is
    ended as interrupted when the second starts (it stayed running, heartbeating, and
    the second got a ``concurrent`` trial beside it; at exit it was ended as the
    script's), and the second run explores as a fresh run would."""
    job = "acceptance-notebook"
    run = run_trainer(trainer_argv("notebook_cells", "--job-id", job), service.env())
    assert run.returncode == 0, str(run)
    assert "KeyboardInterrupt caught by the kernel" in run.stdout, str(run)
    (warning,) = run.bso_lines("WARNING")
    assert f"bso trial 1 of job {job} (batch size 32) was still open in this process" in warning
    assert f"bso trial 2 of job {job}: batch size 32 (exploration)" in run.stderr, str(run)
    trials = trials_of(service.status(job))
    assert (trials[1]["outcome"], trials[1]["epochs"]) == ("interrupted", 1), trials
    assert (trials[2]["outcome"], trials[2]["epochs"]) == ("failed", 3), trials  # max_epochs


def test_sigterm_after_recurrences_of_two_jobs_side_by_side_kills_the_process(
    service: LiveService,
) -> None:
    job = "acceptance-side-by-side"
    argv = trainer_argv("side_by_side", "--job-id", job, "--recurrences", "3")
    t0 = time.monotonic()
    trainer = start_trainer(argv, service.env())
    read = wait_for_line(trainer[0], "recurrence 3")
    read += wait_for_line(trainer[0], f"epoch 1 {job}-b")
    trainer[0].send_signal(signal.SIGTERM)
    run = finish(trainer, argv, read, t0)
    assert run.returncode == -signal.SIGTERM, str(run)[-3000:]
    assert "RecursionError" not in run.stderr
    endings = [line for line in run.bso_lines("WARNING") if "SIGTERM: ending" in line]
    assert len(endings) == 2, str(run)[-3000:]  # the two open trials, no closed one
    assert all(line.endswith("ending bso trial 3 before exiting") for line in endings), endings
    for name in ("a", "b"):
        trials = trials_of(service.status(f"{job}-{name}"))
        outcomes = [trials[n]["outcome"] for n in sorted(trials)]
        assert outcomes == ["failed", "failed", "interrupted"], trials  # max_epochs twice


def test_two_runs_of_one_job_side_by_side_each_train_to_their_end(service: LiveService) -> None:
    job = "acceptance-sweep"
    argv = trainer_argv("side_by_side", "--job-id", job, "--recurrences", "1", "--same-job")
    run = run_trainer(argv, service.env())
    assert run.returncode == 0, str(run)
    assert "OperationOrderError" not in run.stderr, str(run)
    assert run.bso_lines("WARNING") == [], str(run)
    assert run.stdout.count(f"epoch 3 {job}") == 2, str(run)  # both ran max_epochs
    trials = trials_of(service.status(job))
    assert [(t["outcome"], t["epochs"]) for t in trials.values()] == [("failed", 3)] * 2, trials


def wait_for_line(popen: subprocess.Popen[str], wanted: str) -> list[str]:
    """Read the trainer's stdout up to the line ``wanted``; returns the lines read."""
    assert popen.stdout is not None
    lines = []
    for line in popen.stdout:
        lines.append(line)
        if line.rstrip("\n") == wanted:
            return lines
    pytest.fail(f"the trainer ended before {wanted!r}: {''.join(lines)}")


def test_a_notebook_that_never_closes_its_finished_runs_is_not_told_they_were_open(
    service: LiveService,
) -> None:
    """The cell run a second time trains to max_epochs (bso ends its trial as failed)
    but never closes its optimizer; the third run used to warn that trial 2 "was
    still open ... ending it as interrupted", for a trial long ended as failed."""
    job = "acceptance-notebook-unclosed"
    run = run_trainer(trainer_argv("notebook_cells", "--job-id", job, "--unclosed"), service.env())
    assert run.returncode == 0, str(run)
    (warning,) = run.bso_lines("WARNING")  # the Ctrl-C'd cell's, as ever
    assert f"bso trial 1 of job {job} (batch size 32) was still open" in warning, str(run)
    trials = trials_of(service.status(job))
    assert (trials[2]["outcome"], trials[2]["epochs"]) == ("failed", 3), trials


def test_a_run_killed_and_resumed_from_its_checkpoint_is_one_trial(
    service: LiveService, tmp_path: Path
) -> None:
    """Preempted (kill -9) after its epoch-3 checkpoint, the run is started again from
    it: it gets the same batch size, goes on with the same trial from epoch 4, and
    ``bso status`` and the store show one trial with every epoch and the time of both
    processes (what the checkpoint had, plus the resumed part)."""
    job = "acceptance-resume"
    argv = trainer_argv(
        "mnist_loop", "--job-id", job, "--target", "0.999", "--max-epochs", "6",
        "--epoch-seconds", "0.5", "--checkpoint", str(tmp_path / "ckpt.pt"),
    )  # fmt: skip
    killed_in_epoch(argv, service.env(), 4)  # epoch 3 reported and checkpointed, 4 under way
    saved = torch.load(tmp_path / "ckpt.pt")["bso"]  # the last checkpoint before the kill
    assert saved["epochs"] in (3, 4), saved

    resumed = run_trainer(argv, service.env())
    assert resumed.returncode == EXIT_RELAUNCH, str(resumed)  # max_epochs: bso's verdict
    assert resumed.epochs == list(range(saved["epochs"] + 1, 7)), str(resumed)
    assert resumed.bso_lines("WARNING") == [], str(resumed)

    trials = trials_of(service.status(job))
    assert len(trials) == 1, trials  # one trial holds the whole run, no interruption
    [(number, trial)] = trials.items()
    assert trial["epochs"] == 6
    assert (saved["trial_number"], saved["batch_size"]) == (number, trial["batch_size"])
    assert (resumed.summary["trial_number"], resumed.summary["batch_size"]) == (
        number,
        trial["batch_size"],
    )
    [database] = service.data_dir.rglob("*.sqlite3")
    with sqlite3.connect(database) as db:
        ((epochs, time_s, status),) = db.execute(
            "SELECT epochs, time_s, status FROM trials WHERE job_id LIKE ?", (f"%{job}",)
        ).fetchall()
    assert (epochs, status) == (6, "failed")
    # Cumulative: the checkpoint's time plus the resumed epochs (each padded 0.5 s).
    assert time_s >= saved["time_s"] + (6 - saved["epochs"]) * 0.5
    assert saved["time_s"] >= saved["epochs"] * 0.5


def test_a_run_whose_bug_was_fixed_resumes_its_trial_from_the_last_checkpoint(
    service: LiveService, tmp_path: Path
) -> None:
    """The validation code raises in epoch 3, after the epoch-2 checkpoint; the user
    fixes it and starts the run again from that checkpoint: the trial the bug ended
    goes on from epoch 3 (it was refused as 'ended for good' and the run trained
    untracked), and bso status shows one trial that reached max_epochs."""
    job = "acceptance-resume-after-bug"
    argv = trainer_argv(
        "mnist_loop", "--job-id", job, "--target", "0.999", "--max-epochs", "4",
        "--checkpoint", str(tmp_path / "ckpt.pt"),
    )  # fmt: skip
    broken = run_trainer([*argv, "--bug-at-epoch", "3"], service.env())
    assert broken.returncode == 1, str(broken)  # the user's own traceback
    assert "KeyError" in broken.stderr, str(broken)
    saved = torch.load(tmp_path / "ckpt.pt")["bso"]
    assert saved["epochs"] == 2, saved
    fixed = run_trainer(argv, service.env())
    assert fixed.returncode == EXIT_RELAUNCH, str(fixed)  # max_epochs: bso's verdict
    assert fixed.epochs == [3, 4], str(fixed)
    assert fixed.bso_lines("WARNING") == [], str(fixed)
    assert fixed.summary["trial_number"] == saved["trial_number"], str(fixed)
    trials = trials_of(service.status(job))
    assert list(trials) == [saved["trial_number"]], trials
    assert trials[saved["trial_number"]]["epochs"] == 4


def test_a_checkpointing_nightly_job_gets_a_trial_of_its_own_every_night(
    service: LiveService, tmp_path: Path
) -> None:
    """The checkpointing script run as is, night after night in one folder: the
    first night's run ends (bso's verdict at max_epochs) and removes its checkpoint,
    so the second night is a new recurrence with a trial of its own, tracked by bso.
    A checkpoint kept past its run's end used to make every later night resume the
    finished trial, be refused, and train without bso."""
    job = "acceptance-checkpoint-nightly"
    ckpt = tmp_path / "ckpt.pt"
    argv = trainer_argv(
        "mnist_loop", "--job-id", job, "--target", "0.999", "--max-epochs", "2",
        "--checkpoint", str(ckpt),
    )  # fmt: skip
    nights = [run_trainer(argv, service.env()) for _ in range(2)]
    for night in nights:
        assert night.returncode == EXIT_RELAUNCH, str(night)  # max_epochs: bso's verdict
        assert night.epochs == [1, 2], str(night)
        assert night.bso_lines("WARNING") == [], str(night)
        assert not night.summary["detached"], str(night)
    assert not ckpt.exists()
    numbers = [night.summary["trial_number"] for night in nights]
    assert numbers[0] != numbers[1], numbers
    trials = trials_of(service.status(job))
    assert sorted(trials) == sorted(numbers), trials
    assert [trials[n]["epochs"] for n in numbers] == [2, 2], trials


def test_a_checkpoint_kept_past_its_runs_end_is_refused_with_the_fix(
    service: LiveService, tmp_path: Path
) -> None:
    """A script that keeps its checkpoint when the run is over (``--keep-checkpoint``):
    the next night trains without bso, and its one WARNING says why and what to
    change, not only that the trial ended."""
    job = "acceptance-checkpoint-kept"
    argv = trainer_argv(
        "mnist_loop", "--job-id", job, "--target", "0.999", "--max-epochs", "2",
        "--checkpoint", str(tmp_path / "ckpt.pt"), "--keep-checkpoint",
    )  # fmt: skip
    first = run_trainer(argv, service.env())
    assert first.returncode == EXIT_RELAUNCH, str(first)  # max_epochs: bso's verdict
    assert (tmp_path / "ckpt.pt").exists()
    second = run_trainer(argv, service.env())
    assert second.returncode == EXIT_RELAUNCH, str(second)  # its own max_epochs
    [warning] = second.bso_lines("WARNING")
    assert f"bso cannot resume trial {first.summary['trial_number']} of job {job}" in warning
    assert "already ended for good" in warning, warning
    assert "start it without the last run's checkpoint" in warning, warning
    assert len(trials_of(service.status(job))) == 1


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants, parents first (torchrun starts its ranks in
    sessions of their own, so a process group does not hold them)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    tree = [pid]
    for parent in tree:
        tree += [child for child, of in parents.items() if of == parent]
    return tree


def test_a_run_resumed_on_other_hardware_is_not_charged_to_the_checkpoints_lane(
    service: LiveService, tmp_path: Path
) -> None:
    """A DDP job of 2 processes killed (kill -9, the whole group) after a checkpoint,
    restarted from it with 1 process: another lane (``... dp2`` against the plain
    one), whose seconds are not the first lane's.  The run trains every remaining
    epoch without bso, says so in one WARNING naming both lanes, and the 2-process
    trial keeps the epochs it had: the resumed run's are not added to it."""
    job = "acceptance-resume-lane"
    options = ["--job-id", job, "--target", "0.999", "--max-epochs", "6"]
    options += ["--epoch-seconds", "0.6", "--checkpoint", str(tmp_path / "ckpt.pt")]
    argv = torchrun_argv(2, "ddp_trainer", *options)
    env, status_file = status_file_env(service.env())
    t0 = time.monotonic()
    popen = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    read = wait_for_line(popen, "checkpoint 3")  # epoch 3 reported, then checkpointed
    for pid in reversed(process_tree(popen.pid)):  # both ranks, then torchrun: the node died
        os.kill(pid, signal.SIGKILL)
    killed = finish((popen, status_file), argv, read, t0)
    assert killed.returncode == -signal.SIGKILL, str(killed)
    saved = torch.load(tmp_path / "ckpt.pt")["bso"]
    assert saved["hardware_key"].endswith(" dp2"), saved

    resumed = run_trainer(torchrun_argv(1, "ddp_trainer", *options), service.env())
    assert resumed.run_status["outcome"] == "relaunch", str(resumed)  # max_epochs, locally
    assert resumed.epochs == list(range(saved["epochs"] + 1, 7)), str(resumed)
    assert resumed.summary["trial_number"] is None, str(resumed)
    [warning] = resumed.bso_lines("WARNING")
    lane = saved["hardware_key"].removesuffix(" dp2")
    assert f"trained on {lane} dp2, this run on {lane}:" in warning, warning

    [(number, trial)] = trials_of(service.status(job)).items()  # none on the plain lane
    assert trial["lane"]["gpu_model"] in saved["hardware_key"], trial
    assert (number, trial["epochs"]) == (saved["trial_number"], saved["epochs"]), trial


def test_a_run_resumed_while_the_service_is_down_trains_on_after_one_warning(
    service: LiveService, tmp_path: Path
) -> None:
    """Preempted after a checkpoint, restarted while ``bso up`` is stopped: the run
    trains every remaining epoch at the checkpoint's size, within the default bound,
    after one WARNING that says what a run that loses the service says (the bound
    and the setting the user knows, the broker's own error, the fix), not the
    transport's share of the bound as if ``BSO_OUTAGE_WINDOW_S`` had set it."""
    job = "acceptance-resume-down"
    argv = trainer_argv(
        "mnist_loop", "--job-id", job, "--target", "0.999", "--max-epochs", "5",
        "--epoch-seconds", "0.5", "--checkpoint", str(tmp_path / "ckpt.pt"),
    )  # fmt: skip
    killed_in_epoch(argv, service.env(), 3)  # epoch 2 reported and checkpointed, 3 under way
    saved = torch.load(tmp_path / "ckpt.pt")["bso"]
    service.stop()
    try:
        resumed = run_trainer(argv, service.env())
    finally:
        service.start()
    assert resumed.returncode == EXIT_RELAUNCH, str(resumed)  # max_epochs, its own verdict
    assert resumed.epochs == list(range(saved["epochs"] + 1, 6)), str(resumed)
    [warning] = resumed.bso_lines("WARNING")
    assert f"cannot resume trial {saved['trial_number']} of job {job}" in warning, warning
    assert "unavailable within 5 s (unavailable_bound_s): cannot reach the bso broker" in warning
    assert "outage_window_s" not in warning, warning
    assert "fix: check the URL and port" in warning, warning
    assert service.password not in resumed.stderr
    assert resumed.wall_s < 60, str(resumed)


def test_a_lightning_run_resumed_from_a_validation_end_checkpoint_trains_on(
    service: LiveService, tmp_path: Path
) -> None:
    """Lightning checkpointing at the end of each validation (before bso's report of the
    epoch), killed in epoch 4 and resumed with ``fit(ckpt_path=...)`` and ``resume=``:
    Lightning ends the restored epoch again without validating it.  The run used to
    die there of the callback's KeyError ("the model logged nothing"); it now reports
    that epoch with the metric the checkpoint kept and trains every remaining epoch
    with the same trial, whose epochs are Lightning's, after one WARNING that names
    the fix."""
    job = "acceptance-resume-lightning"
    argv = trainer_argv(
        "lightning_trainer", "--job-id", job, "--target", "0.999", "--max-epochs", "6",
        "--epoch-seconds", "0.6", "--checkpoint-dir", str(tmp_path / "ckpts"),
        "--save-at", "validation-end",
    )  # fmt: skip
    # epoch 3 validated, checkpointed and reported, then killed in epoch 4's padding
    killed_in_epoch(argv, service.env(), 3, at="starting epoch 4")

    resumed = run_trainer(argv, service.env())
    assert resumed.returncode == EXIT_RELAUNCH, str(resumed)  # max_epochs: bso's verdict
    assert resumed.epochs == [4, 5, 6], str(resumed)
    [warning] = resumed.bso_lines("WARNING")
    assert "saved at the end of epoch 3's validation" in warning, warning
    assert "save_on_train_epoch_end=True" in warning, warning
    assert "reports it with the metric that validation logged" in warning, warning
    [(number, trial)] = trials_of(service.status(job)).items()  # one trial, resumed
    assert resumed.summary["trial_number"] == number, str(resumed)
    assert (trial["outcome"], trial["epochs"]) == ("failed", 6), trial  # max_epochs


def test_a_fork_pool_torn_down_mid_run_leaves_the_trial_to_the_run(service: LiveService) -> None:
    """A pool forked from the training process and terminated (SIGTERM to each worker,
    which had inherited bso's handler) used to end the parent's trial as interrupted
    from the workers: the run's later reports were refused, it trained on without bso,
    and nothing of it was learned."""
    job = "acceptance-fork-pool"
    run = run_trainer(
        trainer_argv("mnist_loop", "--job-id", job, "--pool-at-epoch", "2"), service.env()
    )
    assert run.returncode in (0, EXIT_RELAUNCH), str(run)
    assert "SIGTERM" not in run.stderr, str(run)
    assert not run.bso_lines("WARNING"), str(run)
    (trial,) = trials_of(service.status(job)).values()
    assert trial["outcome"] != "interrupted", trial
    assert trial["epochs"] == len(run.epochs), (trial, str(run))
