"""``bso status``: a job's recommendation, confidence, gain and outcomes, from a database."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bso.cli import main
from bso.commands import status as status_command
from bso.core.vocabulary import StopReason
from bso.replay.simulate import make_world, run_recurrence
from bso.replay.workloads import synthetic_workloads
from bso.service import BsoService
from bso.spec import JobSpec
from bso.storage.memory import MemoryStore
from bso.storage.sql import SqlStore
from bso.storage.sql.engine import upgrade
from bso.wire.events import JobRegistered, RegisterJob


def migrated_store(folder: Path) -> tuple[str, SqlStore]:
    """A SQLite database at the latest schema in ``folder``: its URL and a store on it."""
    url = f"sqlite:///{folder / 'bso.sqlite3'}"
    upgrade(url)
    return url, SqlStore(url)


@pytest.fixture(scope="module")
def database_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A job with six recurrences and one trial ended out of memory."""
    url, store = migrated_store(tmp_path_factory.mktemp("status"))
    service = BsoService(store)
    workload = synthetic_workloads()[1]
    service.register(workload.job_spec(job_id="lang", seed=1))
    world = make_world(workload, 6, seed=1)
    for index, attempts in enumerate(world.draws):
        run_recurrence(
            service, workload=workload, job_id="lang", index=index, attempts=attempts, eta_knob=0.5
        )
    oom = service.next_trial("lang", workload.hardware)
    service.end_trial("lang", oom.trial_number, reason=StopReason.OUT_OF_MEMORY)
    store.close()
    return url


def test_text(database_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--database-url", database_url]) == 0
    out = capsys.readouterr().out
    first, header, *rows = out.splitlines()
    assert first.startswith("bso-status job=lang ")
    for field in ("recommended=", "confidence=", "gain=", "sizes="):
        assert field in first
    assert header.split() == [
        "size", "trials", "converged", "stopped", "failed", "out_of_memory", "interrupted",
        "script_error", "running", "mean", "cost", "P(best)",
    ]  # fmt: skip
    assert " tenant=default" in first
    assert any(line.strip().startswith("out of memory from batch size") for line in rows)


def test_json_matches_the_service(database_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "lang", "--database-url", database_url, "--json"]) == 0
    (document,) = json.loads(capsys.readouterr().out)
    store = SqlStore(database_url)
    try:
        assert document == BsoService(store).status("lang").model_dump(mode="json")
    finally:
        store.close()
    (lane,) = document["lanes"]
    oom_size = lane["history"][-1]["batch_size"]
    assert lane["memory_limit"] == oom_size
    # The recommendation is among the sizes that still fit, or there is none.
    if lane["recommended_batch_size"] is None:
        assert lane["confidence"] is None
    else:
        assert lane["recommended_batch_size"] < oom_size
        assert 0 <= lane["confidence"] <= 100
    assert sum(s["outcomes"].get("out_of_memory", 0) for s in lane["sizes"]) == 1
    assert lane["history"][-1]["outcome"] == "out_of_memory"


def test_plot(database_url: str, tmp_path: Path) -> None:
    path = tmp_path / "status.png"
    assert main(["status", "--database-url", database_url, "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_job_is_an_error(database_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "nope", "--database-url", database_url]) == 2
    assert "'nope' is not in" in capsys.readouterr().err


def test_an_operator_names_another_tenants_job_with_its_tenant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, store = migrated_store(tmp_path)
    spec = synthetic_workloads()[1].job_spec(job_id="nightly", seed=1)
    for tenant in ("team-a", "team-b"):
        assert isinstance(BsoService(store).handle(RegisterJob(spec=spec), tenant), JobRegistered)
    store.close()
    assert main(["status", "--database-url", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "bso-status job=nightly tenant=team-a (no trials yet)",
        "bso-status job=nightly tenant=team-b (no trials yet)",
    ]
    assert main(["status", "team-b/nightly", "--database-url", url]) == 0
    assert capsys.readouterr().out.split() == [
        "bso-status",
        "job=nightly",
        "tenant=team-b",
        "(no",
        "trials",
        "yet)",
    ]
    assert main(["status", "nightly", "--database-url", url]) == 2
    err = capsys.readouterr().err
    assert "'nightly' is not in" in err
    assert "other tenants' jobs of that id: team-a/nightly, team-b/nightly" in err


def test_a_live_read_needs_a_service_and_a_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BSO_BROKER_URL", raising=False)
    assert main(["status", "lang", "--data-dir", str(tmp_path)]) == 2
    assert "--broker-url" in capsys.readouterr().err
    assert main(["status", "--broker-url", "redis://127.0.0.1:1/0"]) == 2
    assert "name a job" in capsys.readouterr().err


def test_the_table_and_the_json_agree_on_every_count(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", "lang", "--database-url", database_url]) == 0
    _, header, *rows = capsys.readouterr().out.splitlines()
    assert main(["status", "lang", "--database-url", database_url, "--json"]) == 0
    (document,) = json.loads(capsys.readouterr().out)
    assert document["tenant"] == "default"
    columns = header.split()[2:9]
    table = {int(r.split()[0]): r.split() for r in rows if r.split()[:1] and r.split()[0].isdigit()}
    for size in document["lanes"][0]["sizes"]:
        row = table[size["batch_size"]]
        assert int(row[1]) == size["trials"]
        shown = dict(zip(columns, (int(v) for v in row[2:9]), strict=True))
        assert shown == {c: size["outcomes"].get(c, 0) for c in columns}
        assert size["failed"] == shown["failed"]
        assert size["converged"] == shown["converged"]
        assert size["not_converged"] == size["trials"] - shown["converged"] - shown["running"]


@pytest.mark.parametrize(
    ("cost", "shown"),
    [
        (204.0, "204"),
        (156.84, "156.8"),
        (9999.4, "9999"),
        (10763.2, "10,763"),
        (1.08e6, "1,080,000"),
    ],
)
def test_mean_costs_read_without_exponents(cost: float, shown: str) -> None:
    """A new user's table showed ``204`` and ``156.8`` for one job, ``1.076e+04`` for
    another (a walkthrough, helper)."""
    assert status_command.cost_text(cost) == shown
    assert float(shown.replace(",", "")) == pytest.approx(cost, rel=1e-3)


def plotted(jobs: list[Any], path: Path) -> Any:
    """The figure ``bso status --plot`` saves to ``path``, drawn, to read its marks."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figures = []
    real_savefig = plt.Figure.savefig

    def keep(fig: plt.Figure, *args: object, **kwargs: object) -> None:
        fig.canvas.draw()
        figures.append(fig)
        real_savefig(fig, *args, **kwargs)

    plt.Figure.savefig = keep  # type: ignore[method-assign]
    try:
        status_command.plot(jobs, path)
    finally:
        plt.Figure.savefig = real_savefig  # type: ignore[method-assign]
    (figure,) = figures
    return figure


def test_the_plot_explains_every_mark(tmp_path: Path) -> None:
    """Legend entries for the runs, the mean, its band and the recommendation; the cost
    axis says what it was computed from (look at it: tmp_path's status.png)."""
    from bso.commands.status import cost_axis_label

    service = BsoService(MemoryStore())
    workload = synthetic_workloads()[1]
    service.register(workload.job_spec(job_id="lang", seed=1))
    for index, attempts in enumerate(make_world(workload, 6, seed=1).draws):
        run_recurrence(
            service, workload=workload, job_id="lang", index=index, attempts=attempts, eta_knob=0.5
        )
    job = service.status("lang")
    assert job.lanes[0].recommended_batch_size is not None
    (ax,) = plotted([job], tmp_path / "status.png").axes
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    lane = job.lanes[0]
    sizes = sorted({p.batch_size for p in lane.history})
    assert [f"batch {b}" for b in sizes] == legend[: len(sizes)]
    assert "stopped/failed run: cost so far" in legend
    assert "interrupted or script error (not the size's): cost so far" in legend
    assert "ran detached (delivered later)" in legend
    assert "± 1 standard error of that mean" in legend
    assert any(t.startswith(f"recommended {lane.recommended_batch_size}:") for t in legend)
    assert ax.get_ylabel() == cost_axis_label(lane)
    assert all(float(tick).is_integer() for tick in ax.get_xticks())  # trials: 1, 2, ...
    assert (tmp_path / "status.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_lane_of_one_trial_is_plotted_at_trial_1_not_at_fractions(tmp_path: Path) -> None:
    """After a job's first run the trial axis read 0.945, 0.960, ... 1.050."""
    service = BsoService(MemoryStore())
    service.register(
        JobSpec(job_id="first", batch_sizes=[8, 16], default_batch_size=8, target_metric=0.5)
    )
    trial = service.next_trial("first")
    service.report_epoch("first", trial.trial_number, epoch=1, time_s=10.0, energy_j=0.0,
                         metric=0.9)  # fmt: skip
    job = service.status("first")
    assert len(job.lanes[0].history) == 1
    ax = plotted([job], tmp_path / "status.png").axes[0]
    low, high = ax.get_xlim()
    labels = [t.get_text() for t in ax.get_xticklabels() if low <= t.get_position()[0] <= high]
    assert labels == ["1"]


def test_a_budgeted_job_shows_its_budget_used_and_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, store = migrated_store(tmp_path)
    service = BsoService(store)
    workload = synthetic_workloads()[0]
    service.register(workload.job_spec(job_id="budgeted", seed=1, exploration_budget=0.05))
    world = make_world(workload, 8, seed=1)
    for index, attempts in enumerate(world.draws):
        run_recurrence(
            service, workload=workload, job_id="budgeted", index=index, attempts=attempts,
            eta_knob=0.5,
        )  # fmt: skip
    store.close()
    assert main(["status", "budgeted", "--database-url", url, "--json"]) == 0
    (document,) = json.loads(capsys.readouterr().out)
    (lane,) = document["lanes"]
    ledger = lane["exploration_budget"]
    assert ledger["budget"] == 0.05
    assert ledger["baseline_batch_size"] == workload.default_batch_size
    assert ledger["recurrences"] == 8
    assert ledger["allowed_runs"] > 0
    assert main(["status", "budgeted", "--database-url", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    (line,) = [row for row in lines if "exploration budget" in row]
    used = ledger["used_runs"]
    spent = f"used {used:.2f}" if used >= 0 else f"{-used:.2f} default runs saved so far"
    assert line.startswith(
        f"  exploration budget 0.05 of always-default's cost ({workload.default_batch_size}, "
    )
    assert spent in line
    assert line.endswith(f"over 8 recurrence(s), {max(ledger['allowed_runs'] - used, 0):.2f} left")


def test_a_job_without_a_budget_shows_none(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", "lang", "--database-url", database_url, "--json"]) == 0
    (document,) = json.loads(capsys.readouterr().out)
    assert document["lanes"][0]["exploration_budget"] is None
    assert main(["status", "lang", "--database-url", database_url]) == 0
    assert "exploration budget" not in capsys.readouterr().out


def test_a_stuck_job_says_so_and_the_way_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every size hit max_epochs: bso status shows stage=stuck and the message the next
    run would get, rather than stage=exploring while every run fails to start."""
    url, store = migrated_store(tmp_path)
    service = BsoService(store)
    service.register(
        synthetic_workloads()[0]
        .job_spec(job_id="hard", seed=1)
        .model_copy(update={"batch_sizes": [32, 64], "default_batch_size": 32, "max_epochs": 2})
    )
    for _ in range(2):  # bso's walk: the default, then its neighbour; then no size is left
        assigned = service.next_trial("hard")
        for epoch in (1, 2):
            service.report_epoch(
                "hard", assigned.trial_number, epoch=epoch, time_s=epoch, energy_j=epoch, metric=0
            )
    store.close()
    assert main(["status", "hard", "--database-url", url]) == 0
    out = capsys.readouterr().out
    assert " stage=stuck " in out.splitlines()[0]
    (stuck,) = [line for line in out.splitlines() if line.startswith("  stuck: ")]
    assert "the next run gets NoFeasibleBatchSize: job hard has no feasible batch size" in stuck
    assert "bso jobs reset hard" in stuck


def test_a_database_without_jobs_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It printed nothing at all, exit 0: a wrong database or a right one, unused?"""
    url, store = migrated_store(tmp_path)
    store.close()
    assert main(["status", "--database-url", url]) == 0
    assert capsys.readouterr().out == f"no jobs in {url}\n"
    assert main(["status", "--database-url", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
