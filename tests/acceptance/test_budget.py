"""A job with an exploration budget, run as a user runs it against a live ``bso up``.

The user sets ``JobSpec(exploration_budget=0.05)`` in the training script and
relaunches it: the first run trains the default (the budget is relative to its
cost), and ``bso status`` shows the budget, what was used and what is left, in
the table and in the JSON.
"""

from __future__ import annotations

import pytest

from tests.acceptance.conftest import LiveService, run_trainer, trainer_argv, trials_of

pytestmark = pytest.mark.integration

DEFAULT = 32
"""``mnist_loop.py``'s default batch size."""


def test_a_budgeted_job_runs_the_default_first_and_bso_status_shows_the_budget(
    service: LiveService,
) -> None:
    job = "acceptance-budget"
    argv = trainer_argv("mnist_loop", "--job-id", job, "--exploration-budget", "0.05")
    runs = [run_trainer(argv, service.env()) for _ in range(2)]
    for run in runs:
        assert run.run_status["outcome"] in ("converged", "relaunch"), str(run)
        assert not run.bso_lines("ERROR"), str(run)
    status = service.status(job)
    trials = trials_of(status)
    assert trials[1]["batch_size"] == DEFAULT, trials
    (lane,) = status["lanes"]
    ledger = lane["exploration_budget"]
    if trials[1]["outcome"] != "converged":
        # The default never converged: always-default's cost is unknown, so is the budget.
        assert ledger is None, lane
        return
    assert ledger["budget"] == 0.05
    assert ledger["baseline_batch_size"] == DEFAULT
    converged = [t for t in trials.values() if t["outcome"] == "converged"]
    assert ledger["recurrences"] == len(converged)
    assert ledger["baseline_cost"] == pytest.approx(trials[1]["cost"])
    text = service.status_text(job)
    line = next(row for row in text.splitlines() if "exploration budget" in row)
    assert line.startswith(f"  exploration budget 0.05 of always-default's cost ({DEFAULT}, "), text
    assert f"over {len(converged)} recurrence(s)" in line, text
    assert line.endswith(f"{max(ledger['allowed_runs'] - ledger['used_runs'], 0):.2f} left"), text
