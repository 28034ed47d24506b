"""scripts/bench_open_loop.py's pure parts: arrival schedule, percentiles, the summaries and
selections its tables print, argument handling, and one job's lane against a fake service.

No timing of any service is asserted (the figures depend on the machine and on who else
uses it), and nothing here starts a process: the live run is the script's own ``--quick``.
"""

from __future__ import annotations

import math
import threading
import time
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from tests.fixtures.scripts import load_script as load_named_script


def load_script() -> ModuleType:
    return load_named_script("bench_open_loop")


# -- the arrival schedule ------------------------------------------------------------------


def test_poisson_schedule_has_the_offered_mean_rate_and_exponential_gaps() -> None:
    bench = load_script()
    rate, duration = 200.0, 50.0
    times = bench.poisson_schedule(rate, duration, np.random.default_rng(7))
    expected = rate * duration  # 10000 arrivals; a Poisson count's sd is sqrt(10000) = 100
    assert abs(len(times) - expected) < 4 * math.sqrt(expected)
    assert times == sorted(times)
    assert times[0] >= 0
    assert times[-1] < duration
    gaps = np.diff([0.0, *times])
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    # Exponential gaps: standard deviation equal to the mean (a regular ticker has 0).
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)


def test_schedules_are_seeded_per_rate_and_the_same_for_every_system() -> None:
    bench = load_script()

    def schedule(seed: int, rate: float) -> list[float]:
        return list(bench.poisson_schedule(rate, 5.0, bench.schedule_rng(seed, rate)))

    assert schedule(1, 100.0) == schedule(1, 100.0)
    assert schedule(1, 100.0) != schedule(2, 100.0)
    assert schedule(1, 100.0) != schedule(1, 150.0)[: len(schedule(1, 100.0))]
    assert bench.poisson_schedule(0.0, 5.0, np.random.default_rng(1)) == []
    assert bench.poisson_schedule(10.0, 0.0, np.random.default_rng(1)) == []


# -- percentiles ---------------------------------------------------------------------------


def test_percentiles_are_nearest_rank_and_exact_on_small_samples() -> None:
    p = load_script().percentile
    hundred = [float(v) for v in range(100, 0, -1)]  # unsorted on purpose
    assert (p(hundred, 50), p(hundred, 99), p(hundred, 99.9)) == (50.0, 99.0, 100.0)
    thousand = [float(v) for v in range(1, 1001)]
    # 99.9% of 1000 is exactly 999: no float rounding up to the maximum.
    assert (p(thousand, 99), p(thousand, 99.9)) == (990.0, 999.0)
    # Fewer than 1000 values: p99.9 is the slowest call; a single value is every percentile.
    assert p([3.0, 1.0, 2.0], 99.9) == 3.0
    assert p([5.0], 50) == p([5.0], 99.9) == 5.0
    assert p(list(range(1, 11)), 50) == 5
    # Dropped calls (inf) are the slowest; no values, no percentile.
    assert p([1.0, 2.0, math.inf], 99) == math.inf
    assert math.isnan(p([], 50))


# -- one step's figures, and the selections ------------------------------------------------


def test_summarize_measures_only_the_window_and_counts_drops_as_infinite() -> None:
    bench = load_script()
    call = bench.Call
    calls = [
        call(0.5, 0.5, 0.51, "ok", True),  # warm-up: not measured
        call(1.0, 1.001, 1.011, "ok", True),  # 11 ms, client lag 1 ms
        call(1.5, 1.5, 1.52, "ok", True),  # 20 ms
        call(2.0, 2.1, 2.13, "ok", False),  # 130 ms: waited for its job's previous call
        call(2.5, 2.5, 2.5, "dropped", False),
        call(2.9, 2.9, 3.2, "error", True),
        call(2.95, 2.96, 3.05, "ok", True),  # measured, but answered after the window
        call(3.0, 3.0, 3.01, "ok", True),  # after the window
    ]
    step = bench.summarize("bso sqlite 1w", 100.0, calls, 1.0, 2.0)
    assert step.calls == 6
    assert step.offered_per_s == 3.0
    assert step.achieved_per_s == 1.5  # 3 answered inside [1, 3)
    assert (step.dropped, step.errors) == (1, 1)
    assert step.p50_ms == pytest.approx(100.0)  # 11, 20, 100, 130, inf, inf: the third
    assert step.p99_ms == step.p999_ms == math.inf
    assert step.client_lag_p99_ms == pytest.approx(10.0)  # idle, not dropped: 1, 0, 0, 10 ms
    assert not step.kept_up
    assert not step.held()


def made_up(system: str, rate: float, p99: float, achieved: float | None = None) -> Any:
    bench = load_script()
    return bench.Step(
        system=system,
        rate=rate,
        offered_per_s=rate,
        achieved_per_s=rate if achieved is None else achieved,
        calls=int(rate * 8),
        p50_ms=p99 / 4,
        p99_ms=p99,
        p999_ms=p99 * 2,
        dropped=0,
        errors=0,
        client_lag_p99_ms=0.5,
    )


def test_highest_rate_held_saturation_and_capacity() -> None:
    bench = load_script()
    zeus = [
        made_up("zeus", 25, 8.0),
        made_up("zeus", 50, 30.0),
        made_up("zeus", 100, 60.0),  # keeps up, but p99 > 50 ms: not held
        made_up("zeus", 150, 900.0, achieved=120.0),  # does not keep up (< 95%)
    ]
    assert bench.highest_held(zeus) == 50
    assert bench.highest_held(zeus, limit_ms=100.0) == 100
    assert bench.saturation_rate(zeus) == 100
    assert bench.first_failure(zeus) == 150
    # Highest achieved is 120 (the overloaded step) > 100: the capacity.
    assert bench.capacity(zeus) == (120.0, False)
    # Measured below the first failure only (the goal rate may come later, lower).
    assert bench.runs_at(zeus, "zeus", 100)
    assert not bench.runs_at(zeus, "zeus", 150)
    assert not bench.runs_at(zeus, "zeus", 300)
    # A noisy miss at a low rate does not hide a higher rate held.
    noisy = [made_up("b", 25, 70.0), made_up("b", 50, 10.0), made_up("b", 100, 400.0, 50.0)]
    assert bench.highest_held(noisy) == 50
    # Kept up with everything: saturation unknown, throughput only a lower bound.
    fine = [made_up("b", 25, 3.0), made_up("b", 50, 4.0)]
    assert bench.saturation_rate(fine) is None
    assert bench.capacity(fine) == (50.0, True)
    assert bench.highest_held([]) is None
    assert bench.saturation_rate([]) is None


def test_report_prints_the_goal_and_scale_out_lines(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script()
    steps = [
        made_up("zeus sqlite", 100, 30.0),
        made_up("zeus sqlite", 150, 900.0, achieved=110.0),
        made_up("bso postgres 1w", 100, 5.0),
        made_up("bso postgres 1w", 150, 300.0, achieved=140.0),
        made_up("bso postgres 4w", 100, 4.0),
        made_up("bso postgres 4w", 200, 12.0),
        made_up("bso postgres 4w", 300, 400.0, achieved=250.0),
    ]
    systems = ["bso postgres 1w", "bso postgres 4w", "zeus sqlite"]
    summary = bench.print_report(steps, systems)
    out = capsys.readouterr().out
    assert (
        "at 2 x Zeus's saturation rate (100/s, the highest it kept up with) = 200/s: "
        "bso postgres 4w p99 = 12.0 ms (goal <= 20 ms): met"
    ) in out
    assert "at 200/s: bso postgres 1w stopped keeping up at 150/s: MISSED" in out
    assert "4 workers / 1 worker highest achieved rate = 250.0 / 140.0 = 1.79x" in out
    assert "| bso postgres 4w | 200 | 200 | 250.0 |" in out
    assert "| zeus sqlite | 100 | 100 | 110.0 |" in out
    assert summary["goal"] == {
        "zeus_saturation": 100,
        "rate": 200.0,
        "bso_p99_ms": {"bso postgres 1w": None, "bso postgres 4w": 12.0},
    }
    assert summary["scale_out"]["ratio"] == pytest.approx(250 / 140)
    assert bench.jsonable({"x": [math.inf, math.nan, 1.5]}) == {"x": [None, None, 1.5]}

    bench.print_report([made_up("bso sqlite 1w", 50, 3.0)], ["bso sqlite 1w"])
    out = capsys.readouterr().out
    assert "goal at 2 x Zeus's saturation rate: n/a (no Zeus run)" in out
    assert "scale-out, PostgreSQL 4w / 1w: n/a" in out
    assert "| bso sqlite 1w | 50 | 50 (every rate) | >= 50.0 |" in out


# -- arguments -----------------------------------------------------------------------------


def test_arguments_and_the_plan() -> None:
    bench = load_script()

    def plan(*argv: str) -> Any:
        return bench.make_plan(bench.build_parser().parse_args(list(argv)))

    full = plan()
    assert full.rates == [float(r) for r in bench.DEFAULT_RATES]
    assert (full.duration_s, full.warmup_s, full.jobs, full.epochs) == (8.0, 1.0, 32, 50)
    assert full.workers == [1, 2, 4]
    assert full.databases == ["sqlite", "postgres"]
    assert full.zeus
    assert full.systems() == [
        "bso sqlite 1w", "bso sqlite 2w", "bso sqlite 4w",
        "bso postgres 1w", "bso postgres 2w", "bso postgres 4w",
        "zeus sqlite",
    ]  # fmt: skip
    # Every rate on every system, 10 s a step: the upper bound the script prints.
    assert full.longest_s() == 10.0 * 9 * 7
    quick = plan("--quick")
    assert quick.rates == [20.0, 100.0, 300.0]
    assert (quick.duration_s, quick.warmup_s, quick.workers, quick.jobs) == (3.0, 1.0, [1], 8)
    mine = plan(
        "--quick", "--rates", "300,50,50", "--duration", "12", "--workers", "4,1",
        "--databases", "postgres", "--no-zeus", "--jobs", "64", "--keep-going",
    )  # fmt: skip
    assert mine.rates == [50.0, 300.0]
    assert (mine.duration_s, mine.workers, mine.databases, mine.jobs) == (
        12.0,
        [4, 1],
        ["postgres"],
        64,
    )
    assert mine.systems() == ["bso postgres 4w", "bso postgres 1w"]
    assert mine.keep_going
    assert not mine.zeus
    for bad in (
        ["--rates", "0,10"],
        ["--rates", "fast"],
        ["--databases", "mysql"],
        ["--databases", "sqlite,oracle"],
        ["--workers", "0"],
        ["--duration", "-1"],
    ):
        with pytest.raises(SystemExit):
            bench.build_parser().parse_args(bad)
    with pytest.raises(SystemExit):
        plan("--jobs", "0")


# -- one job's lane against a fake service -------------------------------------------------


class FakeJob:
    """A JobDriver whose reports take ``report_s``; records what it was asked."""

    def __init__(self, report_s: float) -> None:
        self.report_s = report_s
        self.log: list[tuple[str, int]] = []
        self.trials = 0

    def register(self) -> None:
        self.log.append(("register", 0))

    def next_trial(self) -> tuple[int, int]:
        self.trials += 1
        self.log.append(("next_trial", self.trials))
        return self.trials, 128

    def report(self, trial: tuple[int, int], epoch: int) -> bool:
        time.sleep(self.report_s)
        self.log.append(("epoch", epoch))
        return False

    def end(self, trial: tuple[int, int]) -> None:
        self.log.append(("end", trial[0]))

    def close(self) -> None:
        pass


def test_lane_drops_late_reports_and_rolls_trials_over() -> None:
    bench = load_script()
    job = FakeJob(report_s=0.2)
    lane = bench.Lane(job, epochs=2)
    lane.start()
    # The second and third reports fall due while the first takes 0.2 s: with a max lag
    # of 0.1 s they are dropped, not sent late; the fourth finds the job idle again.
    calls, other, errors = lane.run(
        [0.0, 0.01, 0.02, 1.0], time.perf_counter(), 0.1, threading.Event()
    )
    assert [c.outcome for c in calls] == ["ok", "dropped", "dropped", "ok"]
    assert calls[0].idle
    assert calls[3].idle
    assert not calls[1].idle
    assert errors == []
    # Two epochs per trial: after the second report sent, the trial ends and the next starts.
    assert job.log == [
        ("register", 0), ("next_trial", 1), ("epoch", 1), ("epoch", 2),
        ("end", 1), ("next_trial", 2),
    ]  # fmt: skip
    assert sorted(other) == ["end", "next_trial"]


def test_run_step_spreads_the_schedule_over_the_lanes() -> None:
    bench = load_script()
    jobs = [FakeJob(report_s=0.0) for _ in range(4)]
    lanes = [bench.Lane(job, epochs=1000) for job in jobs]
    for lane in lanes:
        lane.start()
    plan = bench.make_plan(
        bench.build_parser().parse_args(["--quick", "--warmup", "0.2", "--duration", "0.5"])
    )
    step = bench.run_step("fake", lanes, 200.0, plan)
    times = bench.poisson_schedule(200.0, 0.7, bench.schedule_rng(plan.seed, 200.0))
    measured = [t for t in times if t >= 0.2]
    assert step.calls == len(measured)
    assert step.offered_per_s == pytest.approx(len(measured) / 0.5)
    assert (step.dropped, step.errors) == (0, 0)
    # Round-robin: every job got its share of the reports, in order.
    sent = [[e for kind, e in job.log if kind == "epoch"] for job in jobs]
    assert [len(s) for s in sent] == [len(times[i::4]) for i in range(4)]
    assert all(s == list(range(1, len(s) + 1)) for s in sent)
