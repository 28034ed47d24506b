"""One recurring job per framework integration, run as a user runs it, three times.

Like optuna/optuna-examples' CI, which runs each integration's example: the
trainer scripts under ``trainers/`` follow docs/client.md's snippets (a plain
PyTorch loop shaped like pytorch/examples' mnist, a Hugging Face ``Trainer``
with a tiny randomly initialised BERT, a Lightning module, and a DDP script
under ``torchrun``), against a live ``bso up``.  After each recurrence the
user sees: an exit code that is 0 or "relaunch" (3; under torchrun, which
exits 1, the ``RunStatus`` file and last ``bso:`` line say which), every epoch
the loop trained, no warning flood, and ``bso status`` counting the run with
the batch size that actually trained.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.acceptance.conftest import (
    EXIT_RELAUNCH,
    LiveService,
    TrainerRun,
    run_trainer,
    torchrun_argv,
    trainer_argv,
    trials_of,
)

pytestmark = pytest.mark.integration

RECURRENCES = 3


def assert_ran_as_recorded(run: TrainerRun, status: dict[str, Any]) -> None:
    """The run finished, trained every epoch it reported, and bso recorded what trained."""
    outcome = run.run_status["outcome"]
    assert outcome in ("converged", "relaunch"), str(run)
    assert run.last_bso_line.startswith(f"bso: {outcome.upper()} "), str(run)
    summary = run.summary
    epochs = run.epochs
    assert epochs == list(range(1, len(epochs) + 1)), str(run)  # none skipped
    assert epochs, str(run)
    trial = trials_of(status)[summary["trial_number"]]
    assert trial["epochs"] == len(epochs), (trial, str(run))  # every epoch trained is recorded
    assert trial["batch_size"] == summary["trained_batch"], (trial, str(run))
    if outcome == "converged":
        assert trial["outcome"] == "converged", trial
    else:  # bso's verdict from epochs: not converged by max_epochs, or a cost stop
        assert trial["outcome"] in ("failed", "stopped"), trial
    assert len(run.bso_lines("WARNING")) <= 1, str(run)  # a warning, not a flood
    assert not run.bso_lines("ERROR"), str(run)


def exit_code_of(run: TrainerRun) -> int:
    """What the user's launcher got: the script's own status, which torchrun turns into 1."""
    code = int(run.run_status["exit_code"])
    assert code in (0, EXIT_RELAUNCH), str(run)
    launched_by_torchrun = run.argv[0].endswith("torchrun")
    assert run.returncode == (min(code, 1) if launched_by_torchrun else code), str(run)
    return code


def recur(service: LiveService, job_id: str, argvs: list[list[str]]) -> list[TrainerRun]:
    runs = []
    for argv in argvs:
        run = run_trainer(argv, service.env())
        exit_code_of(run)
        runs.append(run)
    status = service.status(job_id)  # one read for all: the CLI takes seconds to start
    for run in runs:
        assert_ran_as_recorded(run, status)
    assert sum(lane["trials"] for lane in status["lanes"]) == len(argvs)
    assert all(lane["running_trials"] == 0 for lane in status["lanes"])
    assert sorted(trials_of(status)) == list(range(1, len(argvs) + 1))
    return runs


def test_a_plain_pytorch_loop_recurs(service: LiveService) -> None:
    job = "acceptance-mnist"
    runs = recur(service, job, [trainer_argv("mnist_loop", "--job-id", job)] * RECURRENCES)
    assert runs[0].summary["batch_size"] == 32  # the default first
    assert runs[0].run_status["outcome"] == "converged", str(runs[0])  # it reaches the target


def test_a_hugging_face_trainer_recurs(service: LiveService) -> None:
    job = "acceptance-hf"
    runs = recur(service, job, [trainer_argv("hf_trainer", "--job-id", job)] * RECURRENCES)
    assert runs[0].run_status["outcome"] == "converged", str(runs[0])


def test_a_lightning_module_recurs(service: LiveService) -> None:
    job = "acceptance-lightning"
    runs = recur(service, job, [trainer_argv("lightning_trainer", "--job-id", job)] * RECURRENCES)
    assert runs[0].run_status["outcome"] == "converged", str(runs[0])


def test_a_ddp_job_relaunched_with_another_process_count(service: LiveService) -> None:
    """torchrun with 2 processes, then 1, then 2: the global batch that trains is
    the one bso hands out and records, whatever the process count."""
    job = "acceptance-ddp"
    runs = recur(
        service,
        job,
        [torchrun_argv(n, "ddp_trainer", "--job-id", job) for n in (2, 1, 2)],
    )
    assert [r.summary["world_size"] for r in runs] == [2, 1, 2]
